"""Planning: what to recompute under a memory budget (recompute.py)."""
