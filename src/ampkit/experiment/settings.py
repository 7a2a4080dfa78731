"""plan(): the runs of a comparison from its settings, every setting checked before anything runs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ampkit.experiment import data as data_mod
from ampkit.experiment.config import (
    COMPILE_MODES,
    BLOCK_RECIPES,
    FP8_RECIPES,
    GRAD_ACCUMS,
    LOSS_SCALES,
    PRECISIONS,
    RunConfig,
    low_dtype,
)
from ampkit.experiment import sizing
from ampkit.experiment.hf_models import ARCHITECTURES, PREFIX, family
from ampkit.experiment.format_checks import check_block_scaled, check_fp8, check_plan, lowest
from ampkit.experiment.models import load_factory
from ampkit.experiment.sizing import check_size
from ampkit.hardware.advice import recommend_dtype, slow_native_message
from ampkit.hardware.flags import SlowPrecisionWarning
from ampkit.modes import COMPUTE_MODES, MIXED_LEVELS, OPT_LEVELS, SHORT_NAMES
from ampkit.optim.pure16 import UPDATES
from ampkit.optim.states import LOW_BIT, STATES, check_format
from ampkit.planning.recompute import parse_budget

MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt": {"data": "text", "batch_size": 32, "steps": 400, "lr": 6e-3},
    "gpt-outlier": {"data": "text", "batch_size": 32, "steps": 400, "lr": 6e-3},
    "gpt-overflow": {"data": "text", "batch_size": 32, "steps": 400, "lr": 6e-3},
    **{PREFIX + name: {"data": "text", "batch_size": 32, "steps": 200, "lr": 3e-3} for name in ARCHITECTURES},
}
IMAGE_DEFAULTS: dict[str, Any] = {"data": "digits", "batch_size": 64, "epochs": 2, "lr": 2e-3}


def model_defaults(model: str) -> dict[str, Any] | None:
    """A built-in text model's defaults (``hf:`` names with or without their sizes); None for any other model."""
    return MODEL_DEFAULTS.get(family(model))


# The loss divided by at most this: gradients as a batch 65536 times larger's (1e20 was accepted, and float32 trained
# to a loss of 1e16 with exit 0).
MAX_LOSS_DIVISOR = 2**16
PROBE_STEPS = 2  # one warm-up step, then one timed: native 16-bit steps can take tens of seconds


def _check_choice(value: str, choices: Sequence[str], what: str) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {what} {value!r}. Choose from {list(choices)}.")


def default_levels(precision: str) -> tuple[str, ...]:
    """The opt levels a precision runs at where none are given: O1 and O2; a block-scaled format O1 alone. Its
    emulated steps cost two to three times bf16's, the format changes only the linears, and what O2 does to the
    rest of the model the 16-bit precisions' own O2 runs show: with O2 too, ``compare --precision bf16 mxfp8
    nvfp4`` took 272 s on a 2-core machine, its own issue's bound 240 (``--opt-level O1 O2`` runs both)."""
    return ("O1",) if precision in BLOCK_RECIPES else ("O1", "O2")


def default_settings(device: torch.device) -> list[tuple[str, str]]:
    """The mixed settings the hardware supports: (precision, opt level) pairs."""
    if device.type == "cuda":
        settings = [("fp16", "O1"), ("fp16", "O2")]
        if recommend_dtype(device) == torch.bfloat16:  # bf16 tensor cores: compute capability >= 8.0
            settings += [("bf16", "O1"), ("bf16", "O2")]
        return settings
    return [("bf16", "O1"), ("bf16", "O2")]


def check_device(device: str) -> torch.device:
    """Parse ``device``. Raises ValueError for unknown devices and CUDA without CUDA."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"Unknown device {device!r}: choose 'cpu' or 'cuda' (or 'cuda:N').") from error
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"Unknown device {device!r}: choose 'cpu' or 'cuda' (or 'cuda:N').")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: CUDA is not available here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'no'}). Use device='cpu'."
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
    computes: Sequence[str] | None = None,
    probe: bool | None = None,
    loss_scales: Sequence[str] | None = None,
    updates: Sequence[str] | None = None,
    loss_divisor: float = 1.0,
    activation_budgets: Sequence[str] | None = None,
    compile: str = "off",
    precision_plan: str | None = None,
    grad_accums: Sequence[str] | None = None,
    micro_batches: int = 1,
    states: Sequence[str] | None = None,
    guard: bool = False,
    size: str = "small",
) -> list[RunConfig]:
    """The runs of a comparison: float32 first, then the mixed settings, then a probe.

    Unset options take the model's defaults (ResNet-18 and MLP: digits, batch 64,
    2 epochs, lr 2e-3; GPT: text, batch 32, 400 steps, lr 6e-3). ``precisions`` and
    ``opt_levels`` default to what the hardware supports (on a CPU: bf16 with O1
    and O2; on CUDA: fp16 with O1 and O2, and bf16 too from compute capability 8.0);
    a block-scaled format given without ``opt_levels`` runs at O1 alone (``default_levels``).
    ``computes`` (default ``["auto"]``: native where the measured 16-bit kernels
    beat float32, else float32 GEMMs on 16-bit values) multiplies the settings.

    ``loss_scales`` (default ``["auto"]``: dynamic for fp16, none for the others; or
    ``none``, ``static``, ``dynamic``, ``adaptive``) multiply the fp16 settings; bf16 and
    fp8 settings, whose 16-bit parts have float32's exponent range, run once without
    scaling. For O3 settings, ``updates`` (``plain``, ``kahan``, ``stochastic``; default
    ``["plain"]``) multiply the settings too.

    ``loss_divisor`` (default 1) divides every run's training loss, float32's too, and
    AdamW's eps with it, so float32 trains as without it. Each gradient value then sits
    where a ``loss_divisor``-times larger batch's mean puts it, as gradient accumulation
    over that many micro-batches divides each one's loss: the regime of large-batch
    training (GPT-2's ~2**19 tokens a step against the GPT workload's 2**11), where float16
    without loss scaling flushes gradients to zero. Reported losses are undivided.

    ``grad_accums`` (``fp32``, or the run's 16-bit dtype, ``bf16`` or ``fp16``) multiply the O2 and O3 settings:
    what their 16-bit weights' gradients accumulate in (``initialize``'s ``grad_dtype``; without them, its default:
    float32 at O2, the weights' dtype at O3).
    ``micro_batches`` (default 1) splits every step's batch into that many micro-batches, a backward each, their
    gradients accumulated into one step (it must divide the batch size).
    ``states`` (``fp32``: the default, ``bf16``, ``8bit``, ``4bit``, ``fp8``) multiply the mixed settings: the
    format of AdamW's moments (``initialize``'s ``states``; at O3 ``fp32`` needs the ``stochastic`` update).

    ``activation_budgets`` (fractions of a run's own saved-for-backward, ``"0.5"``, or bytes,
    ``"64MiB"``) add, for every mixed setting, a run per budget that trains with a recompute plan for
    it (``ampkit.plan_recompute`` on its first batch), beside the same setting without one.

    ``compile``: ``"off"`` (default) trains eagerly; ``"on"`` compiles every run's training forward with
    torch.compile (inductor; its first step, the compile, is reported apart as ``compile_s``); ``"both"``
    runs every setting eagerly and compiled, side by side; ``"reduce-overhead"`` compiles every run with torch.compile's
    ``mode="reduce-overhead"`` (on a GPU each step replays as a CUDA graph: the host's per-op launches leave the
    step). The probe stays eager.

    ``precision_plan`` (a file ``ampkit tune`` wrote for this model) adds a run at O1 that converts the
    plan's linears and trains the rest in its base; without ``precisions`` and ``opt_levels`` it runs beside
    float32, the base alone and the lowest format the plan uses for every linear, each at O1.

    ``size`` (``small``: the model's defaults; ``medium``, ``large``: a built-in model wider, with a larger batch,
    ``experiment/sizing.py``; ``auto``: the smallest of them whose float32 step is arithmetic-bound here, measured)
    sets the model's width and the default batch; images keep the small size's number of steps.

    ``probe`` (default: where an ``auto`` setting computes in float32) adds a short
    run of the first mixed precision at O1 with native 16-bit kernels,
    ``PROBE_STEPS`` steps with no evaluation, so the table also says how fast
    native 16-bit compute is here.

    Raises:
        ValueError: unknown choices (listed in the message), or CUDA without CUDA.
    """
    arguments = dict(locals())  # the call as made: ``auto`` plans again at the size it measures
    parsed_device = check_device(device)
    load_factory(model)  # fail fast on an unknown model
    check_size(size, model)
    defaults = model_defaults(model) or IMAGE_DEFAULTS
    data = data or defaults["data"]
    data_mod.check_spec(data)
    if model_defaults(model) and data != "text" or model in ("resnet18", "mlp") and data == "text":
        raise ValueError(f"model={model!r} and data={data!r} do not fit: text goes with gpt (or your own text "
                         "model), images with resnet18, mlp or your own image model.")
    for precision in precisions or ():
        _check_choice(precision, PRECISIONS, "precision")
    for level in opt_levels or ():
        _check_choice(level, MIXED_LEVELS, "opt level for a mixed run:")
    for compute in computes or ():
        _check_choice(compute, COMPUTE_MODES, "compute mode")
    for scaling in loss_scales or ():
        _check_choice(scaling, LOSS_SCALES, "loss scaling")
    for update in updates or ():
        _check_choice(update, UPDATES, "update")
    for accumulate in grad_accums or ():
        _check_choice(accumulate, GRAD_ACCUMS, "gradient accumulation")
    for state in states or ():
        _check_choice(state, STATES, "optimizer state format")
    _check_choice(compile, COMPILE_MODES, "compile mode")
    # Options that the chosen settings would ignore are refused, never dropped: a run must be what was asked.
    if precisions is not None and set(precisions) == {"fp32"}:
        ignored = [f"{name}={list(value)!r}" for name, value in (("opt_levels", opt_levels), ("computes", computes),
                                                                 ("loss_scales", loss_scales), ("updates", updates),
                                                                 ("grad_accums", grad_accums),
                                                                 ("states", states)) if value]
        if ignored:
            raise ValueError(f"precisions=['fp32'] runs float32 alone, which ignores {', '.join(ignored)}: add a "
                             "16-bit precision, e.g. precisions=['fp32', 'bf16'], or drop them.")
    if epochs is not None and data == "text":
        raise ValueError(f"epochs={epochs} applies to image data; text runs (model={model!r}) train for a number "
                         "of steps: use steps=N instead.")
    if epochs is not None and steps is not None:
        raise ValueError(f"epochs={epochs} and steps={steps} both set the run's length: give one of them.")
    if updates and not any(OPT_LEVELS[level].pure16 for level in opt_levels or ()):
        raise ValueError(f"updates={list(updates)!r} applies to O3 runs only: add opt_levels=['O3'] (pure 16-bit "
                         "weights; O1 and O2 keep float32 weights or masters, which take small updates as they are).")
    float16_moments = sorted(set(updates or ("plain",)) - {"stochastic"})
    if "fp16" in (precisions or ()) and "O3" in (opt_levels or ()) and float16_moments:
        raise ValueError(f"precisions={list(precisions or ())!r} with opt_levels={list(opt_levels or ())!r} and "
                         f"updates={float16_moments!r}: fp16 at O3 keeps the runs' AdamW moments in float16, where "
                         "its eps (1e-8) rounds to 0 and the first step makes the weights NaN. Use "
                         "updates=['stochastic'] (float32 arithmetic) for fp16 at O3, or bf16.")
    for name, values in (("precisions", precisions), ("opt_levels", opt_levels), ("computes", computes),
                         ("loss_scales", loss_scales), ("updates", updates), ("grad_accums", grad_accums),
                         ("states", states)):
        repeated = sorted({v for v in values or () if list(values or ()).count(v) > 1})
        if repeated:
            raise ValueError(f"{name}={list(values or ())!r}: {', '.join(repeated)} named more than once; name each "
                             "setting once.")
    for budget in activation_budgets or ():
        try:
            parse_budget(str(budget), 1)  # a bad budget fails before anything runs
        except ValueError as error:
            raise ValueError(f"activation_budgets={list(activation_budgets or ())!r}: {error}") from None
    if activation_budgets and precisions is not None and set(precisions) == {"fp32"}:
        raise ValueError(f"activation_budgets={list(activation_budgets)!r} plan the mixed runs: add a 16-bit "
                         "precision, e.g. precisions=['bf16'].")
    check_positive_int(batch_size, "batch_size")
    check_positive_int(epochs, "epochs")
    check_positive_int(steps, "steps")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr={lr} is invalid: use a finite learning rate > 0, e.g. lr=0.002.")
    if not (isinstance(loss_divisor, (int, float)) and 1 <= loss_divisor <= MAX_LOSS_DIVISOR):
        raise ValueError(f"loss_divisor={loss_divisor} is invalid: use a number from 1 to {MAX_LOSS_DIVISOR} (a batch "
                         "up to that many times larger), e.g. loss_divisor=16 (gradients as a 16-times larger "
                         "batch's), or 1 to train on the loss as it is.")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed} is out of range: use an integer in [0, 2**63).")
    if precision_plan is not None:
        tuned = check_plan(model, data, size, precision_plan, opt_levels)
        if precisions is None and opt_levels is None:
            precisions, opt_levels = ["fp32", tuned.base, lowest(tuned)], ["O1"]
    if any(p in FP8_RECIPES for p in precisions or ()):
        check_fp8(model, data, size, [p for p in precisions or () if p in FP8_RECIPES])
    for precision in precisions or ():
        if precision in BLOCK_RECIPES:
            check_block_scaled(model, data, size, precision)
    if precisions is None and opt_levels is None:
        settings = default_settings(parsed_device)
    else:
        mixed = [p for p in (precisions or ("bf16" if parsed_device.type == "cpu" else "fp16",)) if p != "fp32"]
        settings = [(p, level) for p in mixed for level in (opt_levels or default_levels(p))]
    if grad_accums and not any(OPT_LEVELS[level].weights_16bit for _, level in settings):
        raise ValueError(f"grad_accums={list(grad_accums)!r} applies to O2 and O3 runs only: add opt_levels=['O2'] "
                         "(16-bit weights; O1's weights and gradients are float32 already).")
    if loss_scales and not any(p == "fp16" for p, _ in settings):
        raise ValueError(f"loss_scales={list(loss_scales)!r} applies to fp16 runs only: add precisions=['fp16'] "
                         "(bf16 and fp8 keep float32's exponent range, so their runs take no loss scaling).")
    small_batch = defaults["batch_size"]  # images keep the small size's steps at a larger size's batch
    batch_size = batch_size or sizing.batch_size(model, size) or small_batch
    if data != "text":
        train_size = training_set_size(data)
        if batch_size > train_size:
            raise ValueError(
                f"batch_size={batch_size} is larger than the {data} training set ({train_size} samples): "
                f"use at most {train_size}."
            )
    check_positive_int(micro_batches, "micro_batches")
    if batch_size % micro_batches:
        divisors = [str(d) for d in range(1, batch_size + 1) if batch_size % d == 0][1:5] or ["1"]
        raise ValueError(f"micro_batches={micro_batches} does not divide batch_size={batch_size}: choose a divisor "
                         f"(e.g. {', '.join(divisors)}), or change the batch size.")
    if steps is None:
        if data == "text":
            steps = defaults.get("steps", 30)
        else:
            epochs_given = defaults.get("epochs", 2) if epochs is None else epochs
            steps = (train_size // (batch_size if epochs is not None or size == "small" else small_batch)
                     * epochs_given)
    common: dict[str, Any] = dict(
        model=model,
        data=data,
        batch_size=batch_size,
        steps=steps,
        lr=defaults["lr"] if lr is None else lr,
        device=device,
        seed=seed,
        loss_divisor=float(loss_divisor),
        micro_batches=micro_batches,
        guard=guard,
        size=size,
    )
    configs = [RunConfig(precision="fp32", opt_level="O0", **common)]
    configs += [
        RunConfig(precision=p, opt_level=level, compute=c, loss_scale=scaling, update=update,
                  grad_accum=_grad_accum(accumulate, p, parsed_device),
                  states=_states(state, p, level, update, parsed_device), **common)
        for p, level in settings
        for c in (computes or ("auto",))
        for scaling in ((loss_scales or ("auto",)) if p == "fp16" else ("auto",))
        for update in ((updates or ("plain",)) if OPT_LEVELS[level].pure16 else ("plain",))
        for accumulate in ((grad_accums or (None,)) if OPT_LEVELS[level].weights_16bit else (None,))
        for state in (states or (None,))
    ]
    if precision_plan is not None:
        configs.append(RunConfig(precision=tuned.base, opt_level="O1", compute=(computes or ["auto"])[0],
                                 precision_plan=str(Path(precision_plan).resolve()),  # as the run's process reads it
                                 **common))
    configs += [dataclasses.replace(c, activation_budget=str(budget)) for c in configs[1:]
                for budget in activation_budgets or ()]
    if compile != "off":
        ways = {"on": (True,), "both": (False, True), "reduce-overhead": (True,)}[compile]
        mode = "reduce-overhead" if compile == "reduce-overhead" else "default"
        configs = [dataclasses.replace(c, compiled=way, compile_mode=mode if way else "default") for c in configs
                   for way in ways]
    for precision in sorted({c.precision for c in configs if c.compute == "native"}):
        slow = slow_native_message(parsed_device, low_dtype(precision, parsed_device))
        if slow:
            warnings.warn(slow, SlowPrecisionWarning, stacklevel=2)
    auto_in_float32 = [c for c in configs[1:] if c.compute == "auto" and c.float32_compute]
    if probe or (probe is None and auto_in_float32):
        first = (auto_in_float32 or configs[1:])[0] if len(configs) > 1 else None
        if first is not None:
            # the probe times native kernels at O1: O3's update and fp16's scaling choice do not apply to it
            configs.append(dataclasses.replace(first, opt_level="O1", compute="native", steps=PROBE_STEPS, probe=True,
                                               update="plain", compiled=False, compile_mode="default", guard=False))
    if size == "auto":  # the size needs the runs' count (they hold memory together): the rest is planned again
        chosen = sizing.auto(model, data, parsed_device, len(configs), configs[0].steps).name
        return plan(**{**arguments, "size": chosen})
    return configs


def _grad_accum(accumulate: str | None, precision: str, device: torch.device) -> str | None:
    """A run's ``grad_accum``: ``"fp32"``, the weights' own 16-bit name (refused if it is another), or None
    (``initialize``'s default: float32 at O2, the weights' dtype at O3)."""
    if accumulate in (None, "fp32"):
        return accumulate
    own = SHORT_NAMES[low_dtype(precision, device)]
    if accumulate != own:
        raise ValueError(f"grad_accums=[{accumulate!r}] with precision {precision!r}, whose 16-bit weights are {own}: "
                         f"gradients accumulate in fp32 or in the weights' dtype ({own}).")
    return accumulate


def _states(state: str | None, precision: str, level: str, update: str, device: torch.device) -> str | None:
    """A run's ``states``: None for the optimizer as given (float32 moments below O3), else the format, checked
    against the run's level and update (``ampkit.optim.states.check_format``)."""
    if state is None or state == "fp32" and not OPT_LEVELS[level].pure16:
        return None
    try:
        check_format(state, level, low_dtype(precision, device), update)
    except ValueError as error:
        raise ValueError(f"states=[{state!r}] with the {precision} {level} {update} setting: {error}") from None
    if state in LOW_BIT:
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            raise ValueError(f"states=[{state!r}] uses torchao's low-bit optimizers, which are not installed: pip "
                             "install 'ampkit[fp8]', or use states=['bf16'].") from None
    return state


def check_positive_int(value: int | None, name: str) -> None:
    """A count the user may leave out (None) must be an integer >= 1 (ValueError naming it otherwise)."""
    if value is not None and value < 1:
        raise ValueError(f"{name}={value} is invalid: use an integer >= 1 (or leave it out for the default).")


def training_set_size(data: str) -> int:
    """How many samples the training split of ``data`` has."""
    return len(data_mod.load(data).train_y)
