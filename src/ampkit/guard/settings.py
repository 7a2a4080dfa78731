"""``Guard``'s settings, each checked before the guard changes anything (a refused guard leaves the model, its
hooks and the optimizer as they were)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampkit.formats.torchao import fp8_gathered
from ampkit.modes import check_model_and_optimizer
from ampkit.shards import is_sharded

ACTIONS = ("skip", "restore", "raise")
_LEAST = {"window": 4, "keep_every": 1, "max_skips": 1, "sample_every": 0, "max_refused": 1, "suspect_after": 1,
          "quiet_window": 1}  # each integer setting's least value


def check_settings(model: nn.Module, optimizer: Any, scaler: Any, action: str, checkpoint: str | Path | None,
                   process_group: Any, numbers: dict[str, Any]) -> nn.Parameter | None:
    """Refuse a bad setting with ValueError (see ``Guard``'s Raises); the model's first FSDP2-sharded parameter, or
    None."""
    check_model_and_optimizer(model, optimizer, needed_by="Guard")
    if action not in ACTIONS:
        raise ValueError(f"Unknown action {action!r}. Choose one of {list(ACTIONS)}: 'skip' drops a bad step, "
                         "'restore' puts back the last good state the guard kept, then drops it, 'raise' raises the "
                         "named layer's precision.")
    if isinstance(scaler, torch.amp.GradScaler):
        raise ValueError("scaler=torch.amp.GradScaler does not say whether it skipped a step: pass an ampkit "
                         "loss scaler (ampkit.DynamicLossScaler, whose step returns False on a skip), or None.")
    if scaler is not None and not (callable(getattr(scaler, "step", None)) and callable(getattr(scaler, "update",
                                                                                              None))):
        raise ValueError(f"scaler={type(scaler).__name__} has no step() and update(): pass an ampkit loss scaler "
                         "or None.")
    for name, least in (("spike_sigmas", 0), ("spike_factor", 1)):
        value = numbers[name]
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > least):
            raise ValueError(f"{name}={value!r} is invalid: a number > {least} (math.inf: never a spike).")
    for name, least in _LEAST.items():
        value = numbers[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} is invalid: an integer >= {least}.")
    for name in ("saturation", "underflow", "near_overflow"):
        fraction = numbers[name]
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"{name}={fraction!r} is invalid: a fraction in (0, 1].")
    sharded = next((p for p in model.parameters() if is_sharded(p)), None)
    gathered = fp8_gathered(model) if sharded is not None and action == "raise" else []
    if gathered:
        raise ValueError(f"action='raise' cannot raise the layers of an FSDP2 model whose weights torchao all-gathers "
                         f"in FP8 ({gathered[0]}, ...): the all-gather casts them whatever a raised layer computes. "
                         "Use action='skip' or 'restore', or convert with Fp8Recipe(fsdp_all_gather=False).")
    if checkpoint is not None and action != "restore":
        raise ValueError(f"checkpoint={str(checkpoint)!r} is where action='restore' reads the state it puts back; "
                         f"the action is {action!r}: pass action='restore', or drop checkpoint.")
    if checkpoint is not None and (Path(checkpoint).is_dir() or not Path(checkpoint).parent.is_dir()):
        what = "a folder" if Path(checkpoint).is_dir() else "in a folder that does not exist"
        raise ValueError(f"checkpoint={str(checkpoint)!r} is {what}: pass the file the loop writes with "
                         "ampkit.save_checkpoint(path, model=..., optimizer=...), e.g. "
                         f"{str(Path(checkpoint) / 'last.pt')!r} (in an existing folder).")
    if process_group is not None and not dist.is_initialized():
        raise ValueError("process_group is given but torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group first, or pass process_group=None.")
    return sharded
