"""Diagnostics: numerics (ranges per module), the first inf/NaN, memory estimates, tensor-core alignment."""
