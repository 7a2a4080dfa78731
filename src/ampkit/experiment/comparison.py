"""The float32-vs-mixed-precision comparison behind `ampkit compare`."""

from __future__ import annotations

import dataclasses
import datetime
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ampkit import hardware
from ampkit.experiment import data as data_mod
from ampkit.experiment.models import load_factory
from ampkit.experiment.run import PRECISIONS, RunConfig, RunResult, run_in_subprocess
from ampkit.master import OPT_LEVELS

RESULT_FILES = ("results.json", "curves.png", "summary.png")
# Figures compared against float32, and whether lower is better.
RATIO_FIELDS = {
    "ms_per_step": True,
    "samples_per_s": False,
    "peak_memory_bytes": True,
    "saved_for_backward_bytes": True,
    "final_train_loss": True,
    "test_accuracy": False,
}
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt": {"data": "text", "batch_size": 16, "steps": 30, "lr": 1e-3},
}
IMAGE_DEFAULTS = {"data": "digits", "batch_size": 64, "epochs": 2, "lr": 2e-3}

Progress = Callable[[str, int, int, float], None]


@dataclasses.dataclass
class Comparison:
    """Results of one comparison: float32 first, then each mixed setting."""

    runs: list[RunResult]
    config: dict[str, Any]
    machine: dict[str, Any]
    created: str

    @property
    def baseline(self) -> RunResult:
        return self.runs[0]

    def ratio(self, run: RunResult, field: str) -> float:
        """``run``'s figure divided by float32's (nan where float32's is 0)."""
        base = getattr(self.baseline, field)
        return getattr(run, field) / base if base else math.nan

    def to_dict(self) -> dict[str, Any]:
        runs = []
        for run in self.runs:
            entry = dataclasses.asdict(run)
            entry["ratio_to_fp32"] = {field: self.ratio(run, field) for field in RATIO_FIELDS}
            runs.append(entry)
        return {"version": 1, "created": self.created, "machine": self.machine, "config": self.config, "runs": runs}


def default_settings(device: torch.device) -> list[tuple[str, str]]:
    """The mixed settings the hardware supports: (precision, opt level) pairs."""
    if device.type == "cuda":
        settings = [("fp16", "O1"), ("fp16", "O2")]
        if hardware.recommend_dtype(device) == torch.bfloat16:  # bf16 tensor cores: compute capability >= 8.0
            settings += [("bf16", "O1"), ("bf16", "O2")]
        return settings
    return [("bf16", "O1"), ("bf16", "O2")]


def check_device(device: str) -> torch.device:
    """Parse ``--device``. Raises ValueError for unknown devices and CUDA without CUDA."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"Unknown device {device!r}: choose 'cpu' or 'cuda' (or 'cuda:N').") from error
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"Unknown device {device!r}: choose 'cpu' or 'cuda' (or 'cuda:N').")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'no'}). Use --device cpu."
        )
    return parsed


def plan(
    model: str = "resnet18",
    data: str | None = None,
    precisions: Sequence[str] | None = None,
    opt_levels: Sequence[str] | None = None,
    batch_size: int | None = None,
    epochs: int | None = None,
    steps: int | None = None,
    lr: float | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> list[RunConfig]:
    """The runs of a comparison: float32 first, then the mixed settings.

    Unset options take the model's defaults (ResNet-18 and MLP: digits, batch 64,
    2 epochs, lr 2e-3; GPT: text, batch 16, 30 steps, lr 1e-3). ``precisions`` and
    ``opt_levels`` default to what the hardware supports (on a CPU: bf16 with O1
    and O2; on CUDA: fp16 with O1 and O2, and bf16 too from compute capability 8.0).

    Raises:
        ValueError: unknown choices (listed in the message), or CUDA without CUDA.
    """
    parsed_device = check_device(device)
    load_factory(model)  # fail fast on an unknown model
    defaults = MODEL_DEFAULTS.get(model, IMAGE_DEFAULTS)
    data = data or defaults["data"]
    data_mod.check_spec(data)
    for precision in precisions or ():
        if precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {precision!r}. Choose from {list(PRECISIONS)}.")
    for level in opt_levels or ():
        if level not in OPT_LEVELS[1:]:
            raise ValueError(f"Unknown opt level {level!r} for a mixed run. Choose from {list(OPT_LEVELS[1:])}.")
    if precisions is None and opt_levels is None:
        settings = default_settings(parsed_device)
    else:
        mixed = [p for p in (precisions or ("bf16" if parsed_device.type == "cpu" else "fp16",)) if p != "fp32"]
        settings = [(p, level) for p in mixed for level in (opt_levels or ("O1", "O2"))]
    if parsed_device.type == "cpu" and any(p == "fp16" for p, _ in settings) and not hardware.cpu_has_native_fp16():
        warnings.warn(hardware.slow_fp16_message(), hardware.SlowPrecisionWarning, stacklevel=2)
    if steps is None:
        if data == "text":
            steps = defaults.get("steps", 30)
        else:
            per_epoch = _train_size(data) // (batch_size or defaults["batch_size"])
            steps = per_epoch * (epochs or defaults.get("epochs", 2))
    common = dict(
        model=model,
        data=data,
        batch_size=batch_size or defaults["batch_size"],
        steps=steps,
        lr=lr or defaults["lr"],
        device=device,
        seed=seed,
    )
    return [RunConfig(precision="fp32", opt_level="O0", **common)] + [  # type: ignore[arg-type]
        RunConfig(precision=p, opt_level=level, **common) for p, level in settings  # type: ignore[arg-type]
    ]


def _train_size(data: str) -> int:
    return len(data_mod.load(data).train_y)


def compare(configs: list[RunConfig], progress: Progress | None = None) -> Comparison:
    """Run every configuration in its own subprocess and collect the results.

    Args:
        configs: from ``plan()``; the first is the float32 baseline.
        progress: called as ``progress(label, step, total_steps, loss)`` after each step.
    """
    runs = []
    for config in configs:

        def report(step: int, loss: float, config: RunConfig = config) -> None:
            if progress is not None:
                progress(config.label, step, config.steps, loss)

        runs.append(run_in_subprocess(config, report))
    first = dataclasses.asdict(configs[0])
    shared = {k: v for k, v in first.items() if k not in ("precision", "opt_level")}
    shared["settings"] = [c.label for c in configs]
    return Comparison(
        runs=runs,
        config=shared,
        machine=hardware.machine_summary(configs[0].device),
        created=datetime.datetime.now().isoformat(timespec="seconds"),
    )


def default_out_dir() -> Path:
    return Path("ampkit-runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def check_out_dir(out: Path) -> None:
    """Refuse an output directory that already holds results (never overwrite silently)."""
    clashes = [name for name in RESULT_FILES if (out / name).exists()]
    if clashes:
        raise ValueError(
            f"{out} already holds {', '.join(clashes)}; ampkit never overwrites results. "
            "Pass another --out, or move those files away."
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory.")
