"""Replacement nn.Modules, generic across model families."""
