"""Checkpoint conversions (WeightConverter / ConversionOps), each with an exact reverse."""
