"""`ampkit tune`'s run: the model and batches `ampkit compare` would train on, tuned (``ampkit.tune``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ampkit.experiment import data as data_mod
from ampkit.experiment.config import CONTEXT
from ampkit.experiment.models import build
from ampkit.experiment.settings import check_positive_int, model_defaults
from ampkit.planning.precision_plan import PrecisionPlan
from ampkit.planning.tune import tune


def tuning_batches(dataset: data_mod.Dataset, batch_size: int, count: int, seed: int,
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` training batches as (input, target) pairs, drawn as `ampkit compare` draws them."""
    pairs = (data_mod.pair(dataset, index, CONTEXT) for index in data_mod.batches(dataset, batch_size, count, seed,
                                                                                   CONTEXT))
    return [(x.to(device), y.to(device)) for x, y in pairs]


def run_tune(model: str, data: str | None, formats: list[str], tolerance: float, objective: str, batches: int,
             batch_size: int | None, include: list[str], seed: int, device: str,
             progress: Callable[[str], None] | None = None) -> tuple[PrecisionPlan, nn.Module]:
    """Build ``model`` on ``data`` (compare's defaults), seeded as compare seeds its runs, and tune it."""
    defaults = model_defaults(model) or {"data": "digits", "batch_size": 64}
    dataset = data_mod.load(data or defaults["data"])
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 2:
        raise ValueError(f"batches={batches!r} is invalid: tune needs at least 2 batches (one is held out).")
    check_positive_int(batch_size, "batch_size")  # 0 once tuned at the default batch, silently
    torch.manual_seed(seed)
    built = build(model, **dataset.model_kwargs(CONTEXT)).to(device)
    pairs = tuning_batches(dataset, batch_size if batch_size is not None else defaults["batch_size"], batches, seed,
                           torch.device(device))
    return tune(built, pairs, formats=formats, tolerance=tolerance, objective=objective, include=include,
                progress=progress), built
