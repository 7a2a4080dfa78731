"""Adapters for training frameworks (Lightning, Accelerate), imported only on demand."""
