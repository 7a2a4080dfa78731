"""Optimizers for mixed precision: float32 master weights, the opt levels, pure 16-bit updates."""
