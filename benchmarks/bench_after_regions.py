"""What ampkit's regions leave behind in a process (issue 38): plain torch.autocast's step after edited, override and
float32-compute regions ran, against its step where none ran since, in the same process; and while the kernels stay
because a second thread runs.

ampkit's edited policies, module overrides and float32 compute register Python kernels at the Autocast dispatch key
while a region needs them (precision/kernels.py); when the last region closes where every other thread waits they are
released, and torch's own kernels run again, as in a process that never ran a region. Beside a thread that runs
Python they stay (releasing a kernel that thread is about to run crashes it), and plain torch.autocast reaches them
for their ops: the same bits as torch's own kernels (tests/test_autocast.py), in Python.
What each state costs: the GPT of `ampkit compare` (batch 32, forward and backward under plain
``torch.autocast("cpu", torch.bfloat16)``), blocks of 20 steps alternated between three states of one process:
"after" (one step each under an edited, a module-override and a float32-compute ampkit policy, untimed, then the
block: ampkit holds no kernel, checked), "without" (no region since the last block, none held, checked: what a fresh
process has), "kept" (the same regions while a helper thread runs, sleeping 10 ms at a time, and the block while it
still does: the kernels held, checked), 15 rounds, the order rotated every round; medians. Also one op alone: a
64x64 ``torch.mm`` under plain torch.autocast, the same alternation. And what the registration costs a region that
opens alone: the registry's acquire and release of an edited policy's ops and of float32 compute's, medians of 50.

Writes results/after-regions.json.

    python benchmarks/bench_after_regions.py
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ampkit
from ampkit.experiment.models import GPT
from ampkit.precision import kernels
from common import save

ROUNDS, STEPS = 15, 20


def _regions(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One step under each kind of policy that registers kernels (untimed)."""
    default = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    for policy in (default.with_ops(deny=["gelu"], allow=["softmax"]), default.with_modules("lm_head", dtype="fp32"),
                   ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
        with ampkit.autocast(policy, model=model):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
        model.zero_grad(set_to_none=True)


STATES = ("after", "without", "kept")


def _enter(state: str, model: torch.nn.Module, x: torch.Tensor) -> threading.Event | None:
    """Put the process in ``state`` (untimed); returns the event that ends the helper thread of "kept" (one that runs:
    its innermost frame sleeps in its own code, not in a wait of the standard library, so the kernels stay)."""
    if state == "without":
        assert not kernels.registry.registered()
        return None
    release = threading.Event() if state == "kept" else None
    if release is not None:
        threading.Thread(target=lambda: [time.sleep(0.01) for _ in iter(release.is_set, True)]).start()
    _regions(model, x)
    assert bool(kernels.registry.registered()) == (state == "kept"), state
    return release


def _leave(release: threading.Event | None, model: torch.nn.Module, x: torch.Tensor) -> None:
    """End the helper thread, if any, and let one region close alone: ampkit releases the kernels kept meanwhile."""
    if release is not None:
        release.set()
        while threading.active_count() > 1:
            time.sleep(0.001)
        with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="native").with_ops(deny=["gelu"])):
            pass
    assert not kernels.registry.registered()


def _alternate(block: Callable[[], list[float]], model: torch.nn.Module, x: torch.Tensor) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {state: [] for state in STATES}
    for round_ in range(ROUNDS):
        for state in STATES[round_ % 3:] + STATES[:round_ % 3]:
            release = _enter(state, model, x)
            times[state] += block()
            _leave(release, model, x)
    return times


def registration_ms() -> dict[str, dict[str, float]]:
    """Medians of 50 acquire + release of each policy's kernel ops, where no region holds them (a region alone)."""
    default = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    found = {}
    for name, policy in (("an edit", default.with_ops(deny=["gelu"], allow=["softmax"])),
                         ("float32 compute", ampkit.Policy.default("cpu", torch.bfloat16, compute="float32"))):
        region = ampkit.autocast(policy)
        ops = region.resolved.kernel_ops
        times = []
        for _ in range(50):
            assert not kernels.registry.registered()
            start = time.perf_counter()
            kernels.registry.acquire("cpu", ops)
            kernels.registry.release("cpu", ops)
            times.append(time.perf_counter() - start)
        found[name] = {"ops": len(ops), "ms": statistics.median(times) * 1e3}
    return found


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT()
    x = torch.randint(0, 256, (32, 64))

    def gpt_block() -> list[float]:
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16):
                logits = model(x)
            F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
            model.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return times

    a = torch.randn(64, 64)

    def mm_block() -> list[float]:
        with torch.autocast("cpu", torch.bfloat16):
            start = time.perf_counter()
            for _ in range(500):
                torch.mm(a, a)
            return [(time.perf_counter() - start) / 500]

    release = _enter("kept", model, x)
    registered = len(kernels.registry.registered())
    gpt_block()  # warm-up, in each state
    _leave(release, model, x)
    gpt_block()
    gpt = _alternate(gpt_block, model, x)
    mm = _alternate(mm_block, model, x)
    medians = {name: {state: statistics.median(t) for state, t in found.items()}
               for name, found in (("gpt_step", gpt), ("mm", mm))}
    ratios = {name: {state: medians[name][state] / medians[name]["without"] for state in ("after", "kept")}
              for name in medians}
    registration = registration_ms()
    payload = {"rounds": ROUNDS, "steps": STEPS, "registered": registered, "medians": medians, "ratios": ratios,
               "registration": registration}
    path = save("after-regions", payload)
    gpt_ms = {state: medians["gpt_step"][state] * 1e3 for state in STATES}
    mm_us = {state: medians["mm"][state] * 1e6 for state in STATES}
    print(f"plain torch.autocast, GPT step: after regions {gpt_ms['after']:.1f} ms, without {gpt_ms['without']:.1f} ms "
          f"({ratios['gpt_step']['after']:.3f}x), with ampkit's {registered} kernels kept {gpt_ms['kept']:.1f} ms "
          f"({ratios['gpt_step']['kept']:.3f}x); a 64x64 mm: {mm_us['after']:.1f}, {mm_us['without']:.1f}, "
          f"{mm_us['kept']:.1f} us ({ratios['mm']['after']:.2f}x, {ratios['mm']['kept']:.2f}x); registering and "
          "releasing a region's kernels: " + ", ".join(f"{name} ({found['ops']} ops) {found['ms']:.2f} ms"
                                                       for name, found in registration.items()) + f"; {path}")


if __name__ == "__main__":
    main()
