"""Per-step cost of ampkit's Lightning plugin and Accelerate helper against each framework's own mixed precision.

The digits MLP of the examples, batch 64, on the CPU. Each setting trains in turn, round after
round (order reversed every other round), and the median step time over all rounds is kept: the
frameworks' own ``bf16-mixed`` / ``16-mixed`` (torch.autocast, torch's GradScaler) against ampkit
O1 with the same native kernels (``compute="native"``: the integration's own overhead).

On a CPU neither framework has a float16 reference: Lightning's ``16-mixed`` switches to bfloat16
without a scaler, Accelerate's ``fp16`` trains in float32; both are timed, as what their users get,
but ampkit's float16 rows have no ratio. ampkit's float32-compute mode is left out: its kernels, once
registered, stay for the process and would route the frameworks' own torch.autocast through them
too (its speed is in bench_autocast.py).

    python benchmarks/bench_integrations.py   # writes benchmarks/results/integrations.json
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console

from common import save

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

ROUNDS, STEPS, WARMUP = 4, 20, 4


def lightning_settings() -> dict[str, Callable[[], list[float]]]:
    import lightning as L

    from ampkit.integrations.lightning import AmpkitPrecision
    from lightning_digits import Digits, loader

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    def fit(**options: Any) -> list[float]:
        torch.manual_seed(0)
        timer = StepTimer()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[timer], **options)
        trainer.fit(Digits(), loader(64))
        return timer.times[WARMUP:]

    return {
        "lightning bf16-mixed": lambda: fit(precision="bf16-mixed"),
        "ampkit O1 bf16 native": lambda: fit(plugins=[AmpkitPrecision("O1", torch.bfloat16, compute="native")]),
        "lightning 16-mixed (bf16 on a CPU)": lambda: fit(precision="16-mixed"),
        "ampkit O1 fp16 native": lambda: fit(plugins=[AmpkitPrecision("O1", torch.float16, compute="native")]),
    }


def accelerate_settings() -> dict[str, Callable[[], list[float]]]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from accelerate_digits import build, loader
    from ampkit.integrations.accelerate import prepare

    def fit(mixed_precision: str = "no", **ampkit_options: Any) -> list[float]:
        AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate keeps one setting per process
        accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
        model, optimizer, scheduler = build()
        objects = (model, optimizer, loader(64), scheduler)
        if ampkit_options:
            model, optimizer, batches, scheduler = prepare(accelerator, *objects, **ampkit_options)
        else:
            model, optimizer, batches, scheduler = accelerator.prepare(*objects)
        times = []
        for step, (x, y) in enumerate(batches):
            if step == STEPS:
                break
            start = time.perf_counter()
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return times[WARMUP:]

    return {
        "accelerate bf16": lambda: fit("bf16"),
        "ampkit O1 bf16 native": lambda: fit(opt_level="O1", dtype=torch.bfloat16, compute="native"),
        "accelerate fp16 (float32 on a CPU)": lambda: fit("fp16"),
        "ampkit O1 fp16 native": lambda: fit(opt_level="O1", dtype=torch.float16, compute="native"),
    }


def interleaved_step_medians(settings: dict[str, Callable[[], list[float]]]) -> dict[str, float]:
    """Median ms per step of each setting over ROUNDS rounds, the order reversed every other round."""
    times: dict[str, list[float]] = {name: [] for name in settings}
    names = list(settings)
    for round_ in range(ROUNDS):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name] += settings[name]()
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    warnings.simplefilter("ignore")  # the frameworks' tips and ampkit's compute-mode notes, once per fit
    console = Console()
    payload: dict[str, Any] = {"rounds": ROUNDS, "steps_timed": STEPS - WARMUP, "batch": 64, "ms": {}, "ratio": {}}
    for framework, settings, references in (
        ("lightning", lightning_settings(), {"bf16": "lightning bf16-mixed"}),
        ("accelerate", accelerate_settings(), {"bf16": "accelerate bf16"}),
    ):
        ms = interleaved_step_medians(settings)
        payload["ms"][framework] = ms
        payload["ratio"][framework] = {
            name: ms[name] / ms[references[dtype]]
            for name in ms if name.startswith("ampkit") and (dtype := "fp16" if "fp16" in name else "bf16") in references
        }
        for name, value in ms.items():
            ratio = payload["ratio"][framework].get(name)
            console.print(f"{framework:10s} {name:24s} {value:8.2f} ms" + (f"  {ratio:.2f}x" if ratio else ""))
    console.print(f"wrote {save('integrations', payload)}")


if __name__ == "__main__":
    main()
