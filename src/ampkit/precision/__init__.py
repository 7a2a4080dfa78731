"""Casting: which op runs in which dtype (policies, autocast regions and their kernels)."""
