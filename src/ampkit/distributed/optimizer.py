"""DistributedOptimizer: compressed, bucketed gradient all-reduce for models not wrapped in DDP (the Horovod way).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ampkit import _torch
from ampkit.distributed.compression import (
    BUCKET_BYTES,
    STATE_VERSION,
    Compression,
    Compressor,
    ReductionOverflowWarning,
    overflow_message,
    predivide,
    reduce_,
    require_process_group,
)


class DistributedOptimizer:
    """All-reduce gradients (compressed, bucketed) before stepping, for models not wrapped in DDP.

    Args:
        optimizer: the optimizer to step (may be a MasterWeightOptimizer).
        named_parameters: ``model.named_parameters()``; checked to be the same on every
            rank (names, shapes, dtypes) so a mismatch is an error, not a hang.
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``.
        gradient_predivide_factor: as ``compression_hook``'s ``predivide_factor``
            (default 1.0, Horovod's default; None picks sqrt(world_size)).
        process_group: the group to average over (default: the world).
        bucket_bytes: gradients are flattened into buckets of about this size.

    With a loss scaler, ``scaler.step(dist_opt)`` reduces first, then unscales and
    checks the averaged gradients, which are identical on every rank, so every rank
    skips the same steps. Without one, a reduction that overflowed warns and skips
    the step (``step`` returns False).

    Raises:
        RuntimeError: no initialized process group.
        ValueError: ranks whose parameters differ; the first mismatch is named.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        compression: Compressor = Compression.fp16,
        gradient_predivide_factor: float | None = 1.0,
        process_group: Any = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.world_size = require_process_group(process_group)
        self.optimizer = optimizer
        self.compression = compression
        self.process_group = process_group
        self.factor = predivide(self.world_size, gradient_predivide_factor)
        self.named_parameters = [(name, p) for name, p in named_parameters if p.requires_grad]
        self.bucket_bytes = bucket_bytes
        self.bytes_sent = 0
        self.overflowed = False  # whether the last reduction produced inf/NaN
        self._reduced = False
        self._check_same_parameters()

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    def _check_same_parameters(self) -> None:
        mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in self.named_parameters]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        for rank, theirs in enumerate(everyone):
            if theirs == mine:
                continue
            for index in range(max(len(mine), len(theirs))):
                a = mine[index] if index < len(mine) else None
                b = theirs[index] if index < len(theirs) else None
                if a != b:
                    raise ValueError(
                        f"Ranks hold different parameters: parameter #{index} is {a} on rank "
                        f"{dist.get_rank(self.process_group)} but {b} on rank {rank}. Build the same model on every rank."
                    )

    def _buckets(self) -> list[list[torch.Tensor]]:
        groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
        filled: dict[tuple[torch.device, torch.dtype], int] = {}  # bytes in each group's last bucket
        for _, p in self.named_parameters:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = grad  # every rank reduces the same tensors, even where one had no gradient
            key = (grad.device, grad.dtype)
            buckets = groups.setdefault(key, [[]])
            if filled.get(key, 0) >= self.bucket_bytes:
                buckets.append([])
                filled[key] = 0
            buckets[-1].append(grad)
            filled[key] = filled.get(key, 0) + grad.numel() * grad.element_size()
        return [bucket for buckets in groups.values() for bucket in buckets]

    @torch.no_grad()
    def prepare_grads_(self) -> None:
        """Average the gradients over the ranks (once per step), then the inner optimizer's preparation."""
        if not self._reduced:
            finite: list[torch.Tensor] = []
            for bucket in self._buckets():
                flat = torch.cat([grad.reshape(-1) for grad in bucket])  # one message per bucket
                flat, sent = reduce_(flat, self.compression, self.factor, self.process_group)
                self.bytes_sent += sent
                finite.append(torch.isfinite(flat).all())
                parts = flat.split([grad.numel() for grad in bucket])
                _torch.foreach_copy_(bucket, [part.view_as(grad) for part, grad in zip(parts, bucket)])
            self._reduced = True
            device = finite[0].device if finite else torch.device("cpu")
            # One read from the device per step, however many buckets.
            self.overflowed = bool(finite) and not bool(torch.stack([f.to(device) for f in finite]).all())
            if self.overflowed:
                dtype = self.compression.dtype or torch.float32
                warnings.warn(overflow_message(dtype, self.factor, self.world_size), ReductionOverflowWarning,
                              stacklevel=3)
        prepare = getattr(self.optimizer, "prepare_grads_", None)
        if prepare is not None:
            prepare()

    def step(self, closure: Any = None) -> bool:
        """Reduce, then step the inner optimizer; False (and a warning) when the reduction overflowed."""
        self.prepare_grads_()
        self._reduced = False
        if self.overflowed:
            return False
        self.optimizer.step() if closure is None else self.optimizer.step(closure)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; the next step reduces afresh."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._reduced = False

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``version``, ``optimizer`` (the wrapped optimizer's state dict), ``bytes_sent``."""
        return {"version": STATE_VERSION, "optimizer": self.optimizer.state_dict(), "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()``.

        Raises:
            RuntimeError: the dict misses ``version`` or ``optimizer``.
        """
        missing = sorted({"version", "optimizer"} - set(state_dict))
        if missing:
            raise RuntimeError(
                f"Cannot load DistributedOptimizer state: missing keys {missing}. Pass the dict from "
                "DistributedOptimizer.state_dict(), or load the wrapped optimizer's own dict into .optimizer."
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.bytes_sent = int(state_dict.get("bytes_sent", 0))
