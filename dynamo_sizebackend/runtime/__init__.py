"""Pieces to calls: the per-call runner, padding, CUDA graphs."""
