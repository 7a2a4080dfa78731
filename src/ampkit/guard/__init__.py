"""``ampkit.Guard``: a training run that watches its own numerics (``core.py``) and its narrow layers
(``layers.py``), and acts before a run is lost."""

from ampkit.guard.core import Guard
from ampkit.guard.events import GuardEvent, GuardStopped
from ampkit.guard.settings import ACTIONS

__all__ = ["ACTIONS", "Guard", "GuardEvent", "GuardStopped"]
