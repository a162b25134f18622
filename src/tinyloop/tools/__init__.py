"""Offline procedures that run a model: evaluation, quantization."""
