"""16-bit gradient compression on torch.distributed, with a pre-divide factor.

Sending gradients in 16 bits halves the bytes of every all-reduce (Horovod's
``Compression.fp16``). Summing float16 gradients over many ranks can pass
65504, so the sum is taken of pre-divided values: divide by ``f`` before the
reduction and by ``world_size / f`` after (Horovod PR #1949, issue #1699).
``f = world_size`` never overflows but pushes small values into float16's
subnormals; ``f = 1`` keeps them and overflows first; the default
``sqrt(world_size)`` splits the difference.

Works with gloo (CPU) and NCCL (GPU), under torchrun.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 * 2**20
STATE_VERSION = 1


class ReductionOverflowWarning(RuntimeWarning):
    """A compressed all-reduce produced inf/NaN."""


@dataclasses.dataclass(frozen=True)
class Compressor:
    """Cast floating tensors to ``dtype`` for the wire (None: leave them alone)."""

    dtype: torch.dtype | None

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Returns the tensor to send and the context ``decompress`` needs (its dtype)."""
        if self.dtype is None or not tensor.is_floating_point():
            return tensor, tensor.dtype
        return tensor.to(self.dtype), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """The compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = Compressor(None)
    fp16 = Compressor(torch.float16)
    bf16 = Compressor(torch.bfloat16)


def check_compression(dtype: object) -> None:
    """Refuse a gradient compression dtype other than None, float16 and bfloat16 (ValueError)."""
    if dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"compression={dtype!r} is invalid: choose None, torch.float16 or torch.bfloat16.")


def _require_process_group(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed has no initialized process group. Start the script with "
            "`torchrun --nproc-per-node N script.py` and call torch.distributed.init_process_group('nccl' or 'gloo') "
            "before building DDP models, compression hooks or a DistributedOptimizer."
        )
    return dist.get_world_size(group)


def predivide(world_size: int, factor: float | None) -> float:
    """The pre-divide factor in use: ``factor``, or sqrt(world_size) when None."""
    factor = math.sqrt(world_size) if factor is None else float(factor)
    if not 1.0 <= factor <= world_size:
        raise ValueError(
            f"predivide factor {factor} is outside [1, world_size={world_size}]: 1 sums then divides, "
            f"{world_size} divides first."
        )
    return factor


def _overflow_message(dtype: torch.dtype, factor: float, world_size: int) -> str:
    return (
        f"The {dtype} all-reduce of gradients overflowed (predivide factor {factor:g}, world size {world_size}): "
        f"the sum of pre-divided values passed {torch.finfo(dtype).max:g}. The step is skipped. Raise the factor "
        f"(up to {world_size}), lower the loss scale, or compress with bfloat16."
    )


def _to_wire(tensor: torch.Tensor, compressor: Compressor, factor: float) -> tuple[torch.Tensor, torch.dtype]:
    """Pre-divide by ``factor`` and compress: what goes into the sum."""
    return compressor.compress(tensor.div(factor) if factor != 1.0 else tensor)


def _from_wire(wire: torch.Tensor, ctx: torch.dtype, compressor: Compressor, factor: float,
               world_size: int) -> torch.Tensor:
    """Decompress the sum and divide by ``world_size / factor``: the average."""
    return compressor.decompress(wire, ctx).mul_(factor / world_size)


def reduce_(tensor: torch.Tensor, compressor: Compressor, factor: float, group: Any = None) -> tuple[torch.Tensor, int]:
    """Average ``tensor`` over the group in place, through ``compressor``.

    Returns:
        The averaged tensor and the bytes this rank handed to the collective.
    """
    wire, ctx = _to_wire(tensor, compressor, factor)
    dist.all_reduce(wire, group=group)
    result = _from_wire(wire, ctx, compressor, factor, dist.get_world_size(group))
    if result is not tensor:  # no compression and no pre-division: reduced in place already
        tensor.copy_(result)
    return tensor, wire.numel() * wire.element_size()


@dataclasses.dataclass
class HookState:
    """State of ``compression_hook``: what it sent and whether a reduction overflowed."""

    process_group: Any = None
    bytes_sent: int = 0
    overflows: int = 0


def compression_hook(dtype: torch.dtype | None = torch.float16, predivide_factor: float | None = None):  # type: ignore[no-untyped-def]
    """A DDP communication hook that all-reduces gradient buckets in ``dtype``.

    Args:
        dtype: torch.float16, torch.bfloat16, or None (no compression).
        predivide_factor: None picks sqrt(world_size); 1.0 sums then divides;
            world_size divides first.

    Returns:
        ``hook(state, bucket)``; register it with
        ``ddp_model.register_comm_hook(ampkit.distributed.HookState(), hook)``. The
        result is the average gradient in the gradient's own dtype. A non-finite
        result warns (ReductionOverflowWarning) and is left for the loss scaler to
        skip; ``state.overflows`` counts them.

    Note:
        The overflow check reads one scalar per bucket from the device.
    """
    compressor = Compressor(dtype)

    def hook(state: HookState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state.process_group if state is not None else None
        world_size = _require_process_group(group)
        factor = predivide(world_size, predivide_factor)
        wire, ctx = _to_wire(bucket.buffer(), compressor, factor)
        if state is not None:
            state.bytes_sent += wire.numel() * wire.element_size()
        future = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            result = _from_wire(fut.value()[0], ctx, compressor, factor, world_size)
            if not bool(torch.isfinite(result).all()):
                if state is not None:
                    state.overflows += 1
                warnings.warn(_overflow_message(wire.dtype, factor, world_size), ReductionOverflowWarning, stacklevel=2)
            return result

        return future.then(finish)

    # DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


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
        self.world_size = _require_process_group(process_group)
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
                flat = _flatten_dense_tensors(bucket)
                flat, sent = reduce_(flat, self.compression, self.factor, self.process_group)
                self.bytes_sent += sent
                finite.append(torch.isfinite(flat).all())
                torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))
            self._reduced = True
            device = finite[0].device if finite else torch.device("cpu")
            # One read from the device per step, however many buckets.
            self.overflowed = bool(finite) and not bool(torch.stack([f.to(device) for f in finite]).all())
            if self.overflowed:
                dtype = self.compression.dtype or torch.float32
                warnings.warn(_overflow_message(dtype, self.factor, self.world_size), ReductionOverflowWarning,
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


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment.

    Returns:
        (rank, world_size). The backend defaults to NCCL with CUDA, gloo otherwise.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
