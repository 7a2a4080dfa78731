"""``ampkit.Guard``: a training run that watches its own numerics (``core.py``) and its narrow layers
(``layers.py``), and acts before a run is lost."""

from ampkit.guard.core import ACTIONS, Guard
from ampkit.guard.events import GuardEvent, GuardStopped

__all__ = ["ACTIONS", "Guard", "GuardEvent", "GuardStopped"]
