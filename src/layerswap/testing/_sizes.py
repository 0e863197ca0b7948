"""Sizes every tiny test model shares, in one module both config builders import."""

VOCAB = 128
