"""Loss scaling: the pure rules (rules.py), the scalers (scaler.py), per-layer scales (adaptive.py)."""
