"""Issue 71's first rule, measured: an edited policy through a TorchFunctionMode against the Autocast-key kernels.

ampkit carries an edited policy (ops moved between torch.autocast's lists) by registering Python kernels at the
dispatcher's Autocast key for the ops the edit moves, while a region is open. Issue 71 lets edited lists act at the
torch-function level instead, through a ``TorchFunctionMode`` (which dynamo traces and guards natively), if the
mode costs no more in eager: it runs Python at every torch call, where the kernels run Python only at the moved
ops. This script times both on the GPT of ``bench_autocast.py`` (its edit: ``add`` inferred, ``layer_norm`` and
``gelu`` denied), in eager, against torch.autocast's step, in one interleaved run: torch.autocast bf16, ampkit's
default and edited policies (today's kernels), torch.autocast with a prototype mode that carries the same edit
(``EditMode`` below, a few lines: the moved functions looked up by name in ``torch``, ``torch.nn.functional`` and
``torch.Tensor``), the same mode with nothing to move (its bare cost per torch call), and the edit written by hand
under torch.autocast (a copy of the model whose GELUs compute in float32: the cost of the edit's numerics alone, no
mechanism; its layer norms read float32 already, the residual stream being float32). It checks that the prototype's
and the hand-written edited steps give the kernels' losses (equal dtypes; the values within rounding). Then the cost per
call, over 10,000 small linears without grad: a moved linear (denied) through a kernel and through the mode, a
linear the mode passes through, against torch.autocast's.

Writes results/policy-mechanism.json.

    python benchmarks/bench_policy_mechanism.py
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import ampkit
from bench_autocast import EDITS, step_fn, workload
from common import interleaved_medians, save, timed_against


def _functions(name: str) -> list[Callable[..., Any]]:
    """The torch-level callables a user's code reaches an op through: ``torch.add``, ``Tensor.add``, ``a + b``."""
    found = [getattr(namespace, attr) for namespace in (torch, F, torch.Tensor)
             for attr in (name, f"__{name}__", f"__r{name}__") if hasattr(namespace, attr)]
    return list(dict.fromkeys(found))


class Float32GELU(torch.nn.Module):
    """GELU in float32 under torch.autocast: the edit ``deny=["gelu"]`` as a user writes it without ampkit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return F.gelu(x.float())


def by_hand(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (the same weights) whose ``nn.GELU`` modules compute in float32."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.GELU):
                setattr(module, child_name, Float32GELU())
    return model


class EditMode(TorchFunctionMode):
    """torch.autocast's lists edited at the torch-function level: a denied function's floating tensors in float32,
    an inferred one's in the widest floating dtype among them; every other call passes through."""

    def __init__(self, deny: list[str], infer: list[str]) -> None:
        super().__init__()
        self.rules = {fn: "deny" for name in deny for fn in _functions(name)}
        self.rules |= {fn: "infer" for name in infer for fn in _functions(name)}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        rule = self.rules.get(func)
        if rule is None:
            return func(*args, **kwargs)
        floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if rule == "deny":
            dtype = torch.float32
        else:
            dtype = max((a.dtype for a in floating), key=lambda d: torch.finfo(d).bits, default=None)
        if dtype is not None:
            args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        if rule == "infer":
            return func(*args, **kwargs)
        torch.set_autocast_enabled("cpu", False)  # a denied op torch.autocast lists (linear) must not be cast back
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled("cpu", True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    model, x, y = workload("gpt", "cpu")
    default = ampkit.Policy.default("cpu", torch.bfloat16)
    edits = EDITS["gpt"]
    edited = default.with_ops(**edits)

    @contextlib.contextmanager
    def with_mode(mode: TorchFunctionMode) -> Any:
        with torch.autocast("cpu", torch.bfloat16), mode:
            yield

    regions: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "torch.autocast bf16": lambda: torch.autocast("cpu", torch.bfloat16),
        "ampkit default (kernels)": lambda: ampkit.autocast(default),
        "ampkit edited (kernels)": lambda: ampkit.autocast(edited),
        "torch.autocast + mode, edited": lambda: with_mode(EditMode(edits["deny"], edits["infer"])),
        "torch.autocast + mode, nothing moved": lambda: with_mode(EditMode([], [])),
    }
    hand_model = by_hand(model)
    models = dict.fromkeys(regions, model) | {"torch.autocast, the edit by hand": hand_model}
    regions["torch.autocast, the edit by hand"] = regions["torch.autocast bf16"]
    losses = {}
    for label, region in regions.items():
        torch.manual_seed(0)
        with region():
            logits = models[label](x)
            losses[label] = (logits.dtype, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                            y.reshape(-1)).item())
    kernels, mode = losses["ampkit edited (kernels)"], losses["torch.autocast + mode, edited"]
    hand = losses["torch.autocast, the edit by hand"]
    for other in (mode, hand):
        assert kernels[0] == other[0] and abs(kernels[1] - other[1]) < 1e-2 * abs(kernels[1]), (kernels, other)

    steps = {label: step_fn(models[label], x, y, region) for label, region in regions.items()}
    rows = timed_against(steps, "torch.autocast bf16", args.repeats)
    print(f"losses: kernels {kernels[1]:.5f}, mode {mode[1]:.5f}, by hand {hand[1]:.5f}")
    calls = _count_calls(steps["torch.autocast + mode, nothing moved"])
    print(f"torch-function calls a step: {calls}")
    per_call = _per_call_us(default)
    for label, us in per_call.items():
        print(f"{label:40s} {us:6.2f} us a linear")
    payload = {"repeats": args.repeats, "edits": edits, "variants": rows, "torch_calls_per_step": calls,
               "losses": {"kernels": kernels[1], "mode": mode[1], "by_hand": hand[1]}, "us_per_linear": per_call}
    print(f"wrote {save('policy-mechanism', payload)}")


def _per_call_us(default: ampkit.Policy, n: int = 10_000) -> dict[str, float]:
    x, w = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    native = ampkit.Policy.default("cpu", torch.bfloat16, compute="native").with_ops(deny=["linear"])

    def loop(region: Callable[[], contextlib.AbstractContextManager[Any]]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), region():
                for _ in range(n):
                    F.linear(x, w)
        return run

    def autocast_with(mode: TorchFunctionMode) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cpu", torch.bfloat16))
        stack.enter_context(mode)
        return stack

    medians = interleaved_medians({
        "torch.autocast": loop(lambda: torch.autocast("cpu", torch.bfloat16)),
        "linear moved, kernel": loop(lambda: ampkit.autocast(native)),
        "linear moved, mode": loop(lambda: autocast_with(EditMode(["linear"], []))),
        "linear passed through, mode": loop(lambda: autocast_with(EditMode([], []))),
    }, warmup=1, repeats=9)
    return {label: s / n * 1e6 for label, s in medians.items()}


def _count_calls(step: Callable[[], Any]) -> int:
    """How many torch-function calls a mode sees in one step (forward, backward and the optimizer)."""
    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        step()
    return Counting.calls


if __name__ == "__main__":
    main()
