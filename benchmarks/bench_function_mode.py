"""Issue 38's first direction, measured before it is built: a policy's edited lists as a ``TorchFunctionMode`` that
casts in ``__torch_function__``, traced by dynamo.

A stand-in for the mode (not ampkit's code): a deny list runs its ops on float32 inputs with autocast off, an allow
list on the region's 16-bit dtype; every other call passes through, and a torch.autocast opened inside with another
dtype (or off) gets torch's own behaviour (what dynamo guards). On one small model, eagerly and compiled (a counting
backend: graphs run as dynamo traced them), under: deny ``linear``; allow ``gelu``; plain torch.autocast; a
torch.autocast of float16 and one of bfloat16 opened inside the deny region; no region; all twice (the second pass
must compile nothing). Then the eager cost of the mode with no op of its lists hit, against torch.autocast alone,
on an 8-layer MLP step (400 steps each, alternated, medians).

Writes results/function-mode.json.

    python benchmarks/bench_function_mode.py
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from common import save

NAMES = {"__matmul__": "matmul"}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class PolicyMode(TorchFunctionMode):
    """The stand-in: ``deny`` ops on float32 inputs, ``allow`` ops on ``dtype``, both with autocast off."""

    def __init__(self, dtype: torch.dtype, deny: frozenset[str] = frozenset(),
                 allow: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.dtype, self.deny, self.allow = dtype, deny, allow

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        name = NAMES.get(name, name)
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == self.dtype:
            to = torch.float32 if name in self.deny else self.dtype if name in self.allow else None
            if to is not None:
                with torch.autocast("cpu", enabled=False):
                    return func(*_cast(args, to), **kwargs)
        return func(*args, **kwargs)


class Region:
    """torch.autocast with the mode inside it, as an ampkit region would enter them."""

    def __init__(self, dtype: torch.dtype, **lists: frozenset[str]) -> None:
        self.mode, self.ctx = PolicyMode(dtype, **lists), torch.autocast("cpu", dtype)

    def __enter__(self) -> None:
        self.ctx.__enter__()
        self.mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)
        self.ctx.__exit__(*exc)


def dtypes() -> list[dict[str, Any]]:
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)), torch.randn(8, 16)
    compiled = torch.compile(model, backend=counting)

    def deny() -> Region:
        return Region(torch.bfloat16, deny=frozenset({"linear"}))

    cases: list[tuple[str, Callable[[], Any], torch.dtype | None]] = [
        ("deny linear", deny, None), ("allow gelu", lambda: Region(torch.bfloat16, allow=frozenset({"gelu"})), None),
        ("plain torch.autocast", lambda: torch.autocast("cpu", torch.bfloat16), None),
        ("deny, then torch.autocast float16 inside", deny, torch.float16),
        ("deny, then torch.autocast bfloat16 inside", deny, torch.bfloat16),
        ("no region", lambda: torch.autocast("cpu", enabled=False), None)]
    rows = []
    for passing in (1, 2):
        for name, region, inner in cases:
            with region():
                with torch.autocast("cpu", inner) if inner is not None else contextlib.nullcontext():
                    eager, traced = model(x).dtype, compiled(x).dtype
            rows.append({"pass": passing, "case": name, "eager": str(eager), "compiled": str(traced),
                         "graphs so far": len(graphs)})
    return rows


def eager_cost(repeats: int = 400) -> float:
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)]), torch.randn(64, 256)
    regions = {"plain": lambda: torch.autocast("cpu", torch.bfloat16),
               "mode": lambda: Region(torch.bfloat16, deny=frozenset({"softmax"}))}
    times: dict[str, list[float]] = {name: [] for name in regions}
    for round_ in range(repeats + 5):
        for name in regions if round_ % 2 == 0 else reversed(list(regions)):
            start = time.perf_counter()
            with regions[name]():
                model(x).float().sum().backward()
            if round_ >= 5:
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["mode"]) / statistics.median(times["plain"])


def main() -> None:
    warnings.simplefilter("ignore")
    rows = dtypes()
    for row in rows:
        print(row)
    ratio = eager_cost()
    print(f"eager step with the mode (no op of its lists hit) over torch.autocast's: {ratio:.3f}x")
    path = save("function-mode", {"rows": rows, "eager_ratio": ratio,
                                  "same_dtypes": all(r["eager"] == r["compiled"] for r in rows),
                                  "second_pass_compiles": rows[-1]["graphs so far"] - rows[len(rows) // 2 - 1][
                                      "graphs so far"]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
