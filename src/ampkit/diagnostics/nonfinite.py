"""find_nonfinite: run under a policy and name the first module and op whose output is inf/NaN.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit import _trees
from ampkit._torch import TorchDispatchMode
from ampkit.diagnostics.numerics import default_loss, first_tensor, output_tensor, policy_region, probing
from ampkit.precision.policy import Policy
from ampkit.shards import local_shard


@dataclasses.dataclass(frozen=True)
class NonFiniteFinding:
    """Where the first inf/NaN appeared."""

    module: str  # innermost module running at the time
    op: str  # the ATen op whose output was non-finite
    phase: str  # "forward" or "backward"
    input_ranges: list[tuple[float, float] | None]  # (min, max) of each tensor input
    finite_inputs: bool  # False: a weight, buffer or model input was already inf/NaN


# Ops whose output is allocated but not yet written (autograd's gradient buffers):
# whatever bits they hold are not a finding.
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# The namespaces of torch.distributed's collectives (FSDP2's all-gathers and reduce-scatters)
_COLLECTIVES = frozenset({"c10d", "_c10d_functional"})


class _FirstNonFinite(TorchDispatchMode):
    """Sees every op's output. In backward the first non-finite one is the finding; in forward it is a candidate
    until a module's output (or the loss) is non-finite too: an op whose inf a later op discards (T5's relative
    position buckets take ``log(0)`` and drop it in a ``torch.where``) is no finding."""

    def __init__(self, current_module: Callable[[], str], phase: Callable[[], str]) -> None:
        super().__init__()
        self.current_module, self.phase = current_module, phase
        self.finding: NonFiniteFinding | None = None
        self.pending: list[NonFiniteFinding] = []  # forward candidates, in execution order
        # The previous op: (name, tensor inputs, first output).
        self._previous: tuple[str, list[torch.Tensor], torch.Tensor | None] | None = None
        self.paused = False  # while the check's own ops run: they are not the model's

    def settle(self, since: int, output: Any) -> None:
        """A module (or the loss) is done: where its output is non-finite, the first candidate still pending is
        the finding; where finite, the candidates recorded since ``since`` did not reach it and are dropped."""
        self.paused = True
        try:
            reached = not _finite(output)
        finally:
            self.paused = False
        if self.finding is None and reached and self.pending:
            self.finding = self.pending[0]
        if not reached:
            del self.pending[since:]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        # a collective's output is another rank's values: that rank's replay names their op
        moved = str(func).split(".")[0] in _COLLECTIVES
        if self.finding is None and not self.paused and name not in _UNINITIALIZED and not moved:
            # this rank's values only: a sharded tensor's check would be a collective, run by the ranks whose
            # replay has found nothing yet
            tensor = first_tensor(out)
            tensor = local_shard(tensor) if tensor is not None else None
            inputs = [local_shard(a) for a in _trees.leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if tensor is not None and not _all_finite(tensor) and not _view(tensor, inputs):
                previous = self._previous
                if name in ("to", "_to_copy") and previous is not None and args and args[0] is previous[2]:
                    # float32 compute (ampkit.float32_compute): a GEMM's float32 result overflowed when rounded
                    # to 16 bits, where a native 16-bit kernel overflows in the GEMM itself.
                    name, inputs = previous[0], previous[1]
                ranges = [
                    (t.float().min().item(), t.float().max().item()) if t.is_floating_point() and t.numel() else None
                    for t in inputs
                ]
                finite_inputs = all(_all_finite(t) for t in inputs if t.is_floating_point())
                found = NonFiniteFinding(self.current_module(), name, self.phase(), ranges, finite_inputs)
                if found.phase == "forward":
                    self.pending.append(found)
                else:
                    self.finding = found
            self._previous = (name, inputs, tensor)
        return out


def find_nonfinite(
    model: nn.Module,
    inputs: Any,
    policy: Policy | torch.autocast | None = None,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    backward: bool = True,
    run: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    collective: bool = False,
) -> NonFiniteFinding | None:
    """Run the forward (and backward) under ``policy``; name the first op that makes inf/NaN.

    The first op in execution order whose output is non-finite is where the trouble
    starts: either it overflowed on finite inputs (``finite_inputs``), or it read a
    weight, buffer or model input that already held inf/NaN. A backward op is named
    with the innermost module whose output's gradient was the last one computed
    before it (the module whose backward was running).

    Args:
        model: the model, float32 or 16-bit.
        inputs: a tensor or tuple of positional inputs.
        policy: the ampkit policy to run under, or a ``torch.autocast`` (the region the training loop opened;
            ``Guard`` replays under it); default None: float32, autocast off.
        target: the loss target, for the backward (default None).
        loss_fn: ``loss_fn(output, target) -> loss`` (default: cross-entropy for integer targets, mean
            square error for floating ones, the output's mean square without a target).
        backward: also run the backward and look there (default True).
        run: ``run(model, inputs) -> loss`` in place of ``loss_fn(model(*inputs), target)``: a training step's own
            code (a LightningModule's ``training_step``, which may not call ``forward``).
        collective: the backward runs whatever the forward found (``backward`` True), and each op's values are
            checked on this rank only: every rank of a sharded model, called alike, runs the same collectives.

    Returns:
        A NonFiniteFinding, or None when everything stayed finite.

    Note:
        Checks every op's output on the device: slow, for debugging only.
    """
    loss_fn = loss_fn or default_loss
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    names = {module: name or "(model)" for name, module in model.named_modules()}
    stack: list[tuple[str, int]] = []  # the modules running: name, and how many candidates were pending at entry
    phase = ["forward"]
    in_backward = ["(model)"]  # the module whose output's gradient autograd computed last
    # Outputs marked by the innermost module that returned them, by id, each with a reference that tells the tensor from
    # a later one given a freed tensor's id (which lost a module its mark, and named its parent, in a long test run).
    marked: dict[int, weakref.ref[torch.Tensor]] = {}

    def enter(module: nn.Module, _: Any) -> None:
        stack.append((names[module], len(mode.pending)))

    def leave(module: nn.Module, _: Any, output: Any) -> None:
        name, since = stack.pop()
        mode.settle(since, output)
        tensor = first_tensor(output)
        earlier = marked.get(id(tensor)) if tensor is not None else None
        if tensor is not None and tensor.requires_grad and (earlier is None or earlier() is not tensor):
            marked[id(tensor)] = weakref.ref(tensor)
            tensor.register_hook(lambda grad: in_backward.__setitem__(0, name))

    pre = [m.register_forward_pre_hook(enter) for m in model.modules()]
    post = [m.register_forward_hook(leave, always_call=True) for m in model.modules()]
    mode = _FirstNonFinite(lambda: (stack[-1][0] if stack else "(model)") if phase[0] == "forward" else in_backward[0],
                           lambda: phase[0])
    with probing(model, pre + post), mode:
        with policy_region(model, policy):
            loss = run(model, inputs) if run is not None else loss_fn(output_tensor(model(*args)), target)
        mode.settle(0, loss)
        if backward and (mode.finding is None or collective) and loss.requires_grad:
            phase[0] = "backward"
            loss.backward()
    return mode.finding


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a floating ``tensor`` is finite; an FP8 one (an FP8 linear's casts) read in float32, as
    torch has no ``isfinite`` of its own for them (a replay of an FP8 model raised NotImplementedError)."""
    return bool(torch.isfinite(tensor.float() if tensor.element_size() == 1 else tensor).all())


def _view(tensor: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``tensor`` is a view of one of ``inputs`` (a new tensor on its storage; an in-place op's output is the
    input itself). A view computes nothing: its values are its base's, non-finite where an earlier op made them so,
    or where the base is a buffer not yet written (FSDP2 views its all-gather and reduce-scatter buffers before
    the collective fills them)."""
    storage = tensor.untyped_storage().data_ptr()
    return any(t is not tensor and t.untyped_storage().data_ptr() == storage for t in inputs)


def _finite(value: Any) -> bool:
    """Whether every floating tensor in ``value`` (through containers) is finite."""
    return all(_all_finite(t) for t in _trees.leaves(value)
               if isinstance(t, torch.Tensor) and t.is_floating_point())
