"""One run's settings and its result: RunConfig, RunResult and the setting names.

Plain dataclasses (they travel as JSON between a comparison and its run processes).
"""

from __future__ import annotations

import dataclasses

import torch

from ampkit.formats.recipes import MXFP4_RECIPE, BlockScaledRecipe, Fp8Recipe
from ampkit.hardware.advice import recommend_dtype
from ampkit.modes import resolve_dtype
from ampkit.precision.decide import GEMM_OPS, decision

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8-current", "mxfp8", "mxfp8-floor", "mxfp4", "mxfp4-rceil",
              "mxfp4-recipe", "nvfp4", "nvfp4-no-tiles", "nvfp4-no-sr", "nvfp4-no-hadamard", "nvfp4-no-kept",
              "nvfp4-plain", "nvfp4-4over6")
LOSS_SCALES = ("auto", "none", "static", "dynamic", "adaptive")
GRAD_ACCUMS = ("fp32", "bf16", "fp16")  # compare --grad-accum: what O2/O3 gradients accumulate in
# compare --compile: eager runs, compiled runs, each setting both ways, or compiled runs whose steps replay as CUDA
# graphs (torch.compile's mode="reduce-overhead": one launch a step, where a GPU's per-op launches set a short step)
COMPILE_MODES = ("off", "on", "both", "reduce-overhead")
STATIC_SCALE = 2.0**10  # the static setting's loss scale (Micikevicius et al. used 8 to 32768 per task)
# FP8 recipes of the fp8 settings: delayed scaling (ampkit's own) and current scaling (torchao), both
# E4M3 forward and E5M2 gradients; everything else runs at the 16-bit dtype the hardware recommends.
FP8_RECIPES = {"fp8": Fp8Recipe(), "fp8-current": Fp8Recipe(scaling="current")}
# Block-scaled recipes (emulated). mxfp8 scales with RCEIL (rounded up: no element saturates), which trained
# the GPT within 2% of bf16 on two seeds where the OCP spec's FLOOR was 7% above it on one (BENCHMARKS.md,
# "MXFP8's two scale modes"); mxfp8-floor is the spec's. MXFP4 as the spec scales it, and with RCEIL; NVFP4
# with its full recipe, with each of its four parts removed (the ablation of the NVFP4 pretraining report) and with
# none of them (nvfp4-plain: the format alone); nvfp4-4over6: the full recipe, each block scaled to 4 or 6 (Four Over
# Six, arXiv 2512.02010).
BLOCK_RECIPES = {name: BlockScaledRecipe(name) for name in ("mxfp4", "nvfp4")} | {
    "mxfp8": BlockScaledRecipe("mxfp8", scale_mode="rceil"),
    "mxfp8-floor": BlockScaledRecipe("mxfp8"),
    "mxfp4-rceil": BlockScaledRecipe("mxfp4", scale_mode="rceil"),
    "mxfp4-recipe": MXFP4_RECIPE,
    "nvfp4-no-tiles": BlockScaledRecipe("nvfp4", weight_tiles=False),
    "nvfp4-no-sr": BlockScaledRecipe("nvfp4", stochastic_gradients=False),
    "nvfp4-no-hadamard": BlockScaledRecipe("nvfp4", hadamard=False),
    "nvfp4-no-kept": BlockScaledRecipe("nvfp4", keep_first_last=False),
    "nvfp4-plain": BlockScaledRecipe("nvfp4", weight_tiles=False, stochastic_gradients=False, hadamard=False,
                                     keep_first_last=False),
    "nvfp4-4over6": BlockScaledRecipe("nvfp4", four_over_six=True),
}


def low_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """The 16-bit dtype of a mixed setting; for the fp8 settings, the one the rest of the model runs in."""
    if precision in FP8_RECIPES or precision in BLOCK_RECIPES:
        return recommend_dtype(device)
    return resolve_dtype(precision)
CONTEXT = 64  # bytes per text window (the GPT's context)
WARMUP_STEPS = 2
PROBE_WARMUP_STEPS = 1
PRECISE_BN_BATCHES = 8
ZERO_GRAD_EVERY = 10  # steps between counts of zero gradient values


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run: a model on data in one precision setting."""

    model: str = "resnet18"
    data: str = "digits"
    precision: str = "fp32"  # one of PRECISIONS
    opt_level: str = "O0"  # O0 for fp32; O1/O2/O3 for 16-bit
    batch_size: int = 64
    steps: int = 44
    lr: float = 2e-3
    device: str = "cpu"
    seed: int = 0
    compute: str = "auto"  # how 16-bit GEMMs compute: auto, native or float32 (Policy.compute)
    probe: bool = False  # a few timed steps only: no evaluation, no accuracy
    loss_scale: str = "auto"  # one of LOSS_SCALES; auto: dynamic for float16, none otherwise
    update: str = "plain"  # O3's update rule (ampkit.optim.pure16): plain, kahan or stochastic
    # The training loss is divided by this (and AdamW's eps with it, so float32 trains as with 1): each gradient
    # value then sits where a loss_divisor-times larger batch's mean puts it (see ``plan``).
    loss_divisor: float = 1.0
    # Each step's batch is split into this many micro-batches, a backward each, their gradients accumulated into
    # one optimizer step (the loss of each weighted by its share of the batch).
    micro_batches: int = 1
    grad_accum: str | None = None  # O2/O3: "fp32", or the weights' "bf16" / "fp16"; None: initialize's default
    states: str | None = None  # AdamW's moments (ampkit.optim.states): bf16, 8bit, 4bit, fp8; None: as torch keeps them
    # A saved-for-backward budget ("0.5" of the run's own, or bytes: "64MiB"): the run trains with a recompute
    # plan for it (ampkit.plan_recompute, made on its first batch); None: no plan.
    activation_budget: str | None = None
    compiled: bool = False  # the training forward through torch.compile (inductor); evaluation stays eager
    compile_mode: str = "default"  # torch.compile's mode for a compiled run: default, or reduce-overhead (CUDA graphs)
    # A precision plan file (ampkit tune): the run converts the plan's linears first, the rest train in
    # ``precision`` (its base); None: no plan.
    precision_plan: str | None = None
    # The run's steps go through an ampkit.Guard (action "raise" where the run's weights are float32, O1; else
    # "skip"), its timeline in RunResult.guard.
    guard: bool = False
    # The model's width and batch (experiment/sizing.py): small (its defaults), medium or large
    size: str = "small"

    @property
    def scaling(self) -> str:
        """The loss scaling this run uses (``auto`` resolved): none, static, dynamic or adaptive."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "dynamic" if self.precision == "fp16" else "none"

    @property
    def float32_compute(self) -> list[str]:
        """The op classes this run computes in float32 on 16-bit values (resolved here)."""
        if self.precision == "fp32":
            return []
        device_type = torch.device(self.device).type
        return sorted(decision(device_type, low_dtype(self.precision, self.device), self.compute).classes)

    @property
    def label(self) -> str:
        """``fp32``, ``bf16 O1``; ``bf16 O1 fp32-compute`` where GEMMs compute in float32;
        ``bf16 O1 native probe`` for a probe; the fp8 settings name their recipe
        (``fp8-delayed-hybrid O1``); ``... fp32-grads`` where gradients accumulate in float32; ``... 8bit-states``
        where AdamW's moments are kept in 8 bits; ``... compiled``
        for a run through torch.compile. (``guard`` is not in it: every run of a comparison has it or none.)"""
        if self.precision == "fp32":
            return "fp32" + (" compiled" if self.compiled else "")
        recipe = FP8_RECIPES.get(self.precision)
        name = f"fp8-{recipe.scaling}-{recipe.format}" if recipe is not None else self.precision
        if self.precision in BLOCK_RECIPES:
            name = BLOCK_RECIPES[self.precision].label
        label = f"{name} {self.opt_level}"
        classes = self.float32_compute
        if classes:
            label += " fp32-compute" if len(classes) == len(GEMM_OPS) else f" fp32-{classes[0]}"
        elif self.compute == "native" and self.probe:
            label += " native"
        if self.loss_scale != "auto":
            label += f" {self.loss_scale}-scaling" if self.loss_scale != "none" else " no-scaling"
        if self.update != "plain":
            label += f" {self.update}"
        if self.grad_accum is not None:
            label += f" {self.grad_accum}-grads"
        if self.states is not None:
            label += f" {self.states}-states"
        if self.precision_plan is not None:
            label += " tuned"
        if self.activation_budget is not None:
            label += f" recompute-{self.activation_budget}"
        return label + (" probe" if self.probe else "") + (" compiled" if self.compiled else "")


@dataclasses.dataclass
class RunResult:
    """What one run measured. Times in ms, memory in bytes."""

    label: str
    precision: str
    opt_level: str
    float32_compute: list[str]  # op classes computed in float32 on 16-bit values ([] = native)
    probe: bool  # a speed probe: no accuracy, loss or evaluation
    ms_per_step: float  # median over the steps after warm-up
    samples_per_s: float
    # What training added to memory. CUDA: max_memory_allocated; CPU: peak resident
    # memory during training minus the resident memory before the model was built.
    peak_memory_bytes: int
    saved_for_backward_bytes: int  # activation memory of one step, exact on any device
    final_train_loss: float | None  # mean of the last final_steps(steps) steps (None for a probe)
    test_accuracy: float | None  # images: class accuracy; text: next-byte accuracy (None for a probe)
    skipped_steps: int
    final_loss_scale: float | None  # None without loss scaling (adaptive: the global scale)
    steps: int
    losses: list[float]
    wall_s: float
    diverged: str | None = None  # why training stopped early (a non-finite loss), else None
    state_bytes: int = 0  # weights, gradients, masters and optimizer states after training (measured)
    parameters: int = 0  # the model's parameters (a tied weight once)
    zero_grad_fraction: float | None = None  # of gradient values exactly zero, mean over sampled steps
    compile_s: float | None = None  # compiled runs: the first step's seconds (tracing and compiling), not in ms_per_step
    guard: dict | None = None  # guarded runs: the guard's timeline (Guard.timeline(): events, losses, samples, raised)
    # state_bytes by part (diagnostics.memory.STATE_PARTS: weights, gradients, masters, optimizer states); older
    # records have none
    state_parts: dict[str, int] = dataclasses.field(default_factory=dict)
