"""The machine: what it supports (flags), how fast its 16-bit kernels run (throughput), and what to use (advice)."""
