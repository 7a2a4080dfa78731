"""ampkit: mixed precision training for PyTorch."""

from __future__ import annotations

# Casting
from ampkit.autocast import autocast, custom_bwd, custom_fwd
from ampkit.hardware import SlowPrecisionWarning
from ampkit.policy import ModuleOverride, Policy

__version__ = "0.1.0"

__all__ = [
    # Casting
    "Policy",
    "ModuleOverride",
    "autocast",
    "custom_fwd",
    "custom_bwd",
    "SlowPrecisionWarning",
]
