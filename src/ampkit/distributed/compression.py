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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 2**20
STATE_VERSION = 1


class ReductionOverflowWarning(RuntimeWarning):
    """A compressed all-reduce produced inf/NaN."""


@dataclasses.dataclass(frozen=True)
class Compressor:
    """Cast floating tensors to ``dtype`` for the wire (None: leave them alone).

    Attributes:
        dtype: the wire dtype (torch.float16, torch.bfloat16) or None (no compression).
    """

    dtype: torch.dtype | None

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Returns the tensor to send and the context ``decompress`` needs (its dtype)."""
        if self.dtype is None or not tensor.is_floating_point():
            return tensor, tensor.dtype
        return tensor.to(self.dtype), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        """The received tensor back in ``ctx``, the dtype ``compress`` returned."""
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """The compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = Compressor(None)
    fp16 = Compressor(torch.float16)
    bf16 = Compressor(torch.bfloat16)


def check_compression(dtype: object) -> None:
    """Refuse a gradient compression dtype other than None, float16 and bfloat16 (ValueError).

    Args:
        dtype: the compression dtype to check.
    """
    if dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"compression={dtype!r} is invalid: choose None, torch.float16 or torch.bfloat16.")


def require_process_group(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed has no initialized process group. Start the script with "
            "`torchrun --nproc-per-node N script.py` and call torch.distributed.init_process_group('nccl' or 'gloo') "
            "before building DDP models, compression hooks or a DistributedOptimizer."
        )
    return dist.get_world_size(group)


def predivide(world_size: int, factor: float | None) -> float:
    """The pre-divide factor in use: ``factor``, or sqrt(world_size) when None.

    Args:
        world_size: ranks in the reduction.
        factor: a factor in [1, world_size], or None.

    Returns:
        The factor, a float.

    Raises:
        ValueError: a factor outside [1, world_size].
    """
    factor = math.sqrt(world_size) if factor is None else float(factor)
    if not 1.0 <= factor <= world_size:
        raise ValueError(
            f"predivide factor {factor} is outside [1, world_size={world_size}]: 1 sums then divides, "
            f"{world_size} divides first."
        )
    return factor


def overflow_message(dtype: torch.dtype, factor: float, world_size: int) -> str:
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

    Args:
        tensor: this rank's values (overwritten with the average).
        compressor: ``Compression.none``, ``.fp16`` or ``.bf16``.
        factor: the pre-divide factor (``predivide``).
        group: the process group (default: every rank).

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
    """State of ``compression_hook``: what it sent and whether a reduction overflowed.

    Attributes:
        process_group: the group reduced over (None: every rank).
        bytes_sent: bytes this rank handed to all-reduces.
        overflows: reductions whose result held inf/NaN.
    """

    process_group: Any = None
    bytes_sent: int = 0
    overflows: int = 0


def compression_hook(dtype: torch.dtype | None = torch.float16,
                     predivide_factor: float | None = None) -> Callable[..., Any]:
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
        world_size = require_process_group(group)
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
                warnings.warn(overflow_message(wire.dtype, factor, world_size), ReductionOverflowWarning, stacklevel=2)
            return result

        return future.then(finish)

    # DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


class PredividedReduceScatter:
    """FSDP2's gradient reduce-scatter, summed with ampkit's pre-divide (set with
    ``FSDPModule.set_custom_reduce_scatter``; FSDP2 is told to sum and divide by 1)."""

    def __init__(self, factor: float, counts: Any) -> None:
        self.factor, self.counts = factor, counts  # counts: anything with bytes_sent and overflows

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        world_size = dist.get_world_size(group)
        if self.factor != 1.0:
            input_tensor.div_(self.factor)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None)  # torch >= 2.13's name
        if reduce_scatter is None:
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
        else:
            reduce_scatter(output=output_tensor, input=input_tensor, op=dist.ReduceOp.SUM, group=group)
        output_tensor.mul_(self.factor / world_size)
        self.counts.bytes_sent += input_tensor.numel() * input_tensor.element_size()
        if not bool(torch.isfinite(output_tensor).all()):  # left for the loss scaler to skip
            self.counts.overflows += 1
            warnings.warn(overflow_message(input_tensor.dtype, self.factor, world_size), ReductionOverflowWarning,
                          stacklevel=2)


class BytesAllGather:
    """FSDP2's all-gather, a buffer of 1-byte floats sent as bytes (set with ``FSDPModule.set_custom_all_gather``
    on a model whose weights torchao all-gathers in FP8): gloo has no float8 types, and FSDP2 hands it a float8
    buffer where every weight of a unit is FP8 (a block whose norms are units of their own, as at O2). An
    all-gather moves bits, so the bytes arrive as the floats were."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        if output_tensor.dtype.is_floating_point and output_tensor.element_size() == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        all_gather = getattr(dist, "all_gather_single", None)  # torch >= 2.13's name
        if all_gather is None:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
