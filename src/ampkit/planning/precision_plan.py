"""A precision plan: each linear's format, with the evidence it was chosen on (``ampkit.tune`` makes one).

A plan is a file: ``save`` writes strict JSON (a version key, atomically), ``load`` reads it back and
refuses another version; ``apply`` converts the chosen linears of the model it was made for (FP8 with
delayed scaling, or a block-scaled format) and refuses a model whose linears differ (names and shapes
are fingerprinted). The linears left in the base format train under the run's 16-bit region as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from ampkit.files import atomic_write, publish_new, strict_json
from ampkit.formats.block_linear import BlockScaledLinear
from ampkit.formats.fp8 import Fp8Linear
from ampkit.formats.recipes import MXFP4_RECIPE, BlockScaledRecipe, Fp8Recipe, features, is_conv1d, refuse_converted

VERSION = 1
BASES = ("bf16", "fp16")  # the 16-bit format the rest of the model trains in
LOWER: dict[str, Fp8Recipe | BlockScaledRecipe] = {  # the formats a linear can be lowered to
    "fp8": Fp8Recipe(),  # delayed scaling, E4M3 forward and E5M2 gradients
    "mxfp8": BlockScaledRecipe("mxfp8", scale_mode="rceil"),  # RCEIL: as ampkit compare's mxfp8
    "mxfp4": BlockScaledRecipe("mxfp4"),
    "mxfp4-recipe": MXFP4_RECIPE,  # a 16-bit forward, the backward in MXFP4 (Tseng et al.)
    "nvfp4": BlockScaledRecipe("nvfp4"),
    "nvfp4-4over6": BlockScaledRecipe("nvfp4", four_over_six=True),  # each block scaled to 4 or 6 (Four Over Six)
}


def block_of(format: str) -> int:
    """The dimension multiple a linear needs for ``format`` (FP8 GEMMs: 16; block formats: their block)."""
    recipe = LOWER[format]
    return recipe.block if isinstance(recipe, BlockScaledRecipe) else 16


def lower_linear(linear: nn.Module, format: str) -> nn.Linear:
    """``linear`` (an ``nn.Linear`` or ``Conv1D``) in ``format``, on its own Parameters (an optimizer built on them
    keeps working)."""
    recipe = LOWER[format]
    if isinstance(recipe, Fp8Recipe):
        return Fp8Linear.from_linear(linear, recipe)
    return BlockScaledLinear.from_linear(linear, recipe)


def fingerprint(model: nn.Module) -> str:
    """A digest of the model's linears (``Conv1D`` too): names and shapes, in order."""
    linears = [f"{name}:{'x'.join(map(str, features(m)))}" for name, m in model.named_modules()
               if isinstance(m, nn.Linear) or is_conv1d(m)]
    return hashlib.sha256("\n".join(linears).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One linear of the plan.

    Attributes:
        name: its module name.
        shape: (in_features, out_features).
        format: the format it trains in: a base (``"bf16"``) or a lowered one (``"fp8"``...).
        why: the reason, in words (not a candidate, too sensitive, chosen, backed off...).
        loss_change: per format tried, the loss's relative change when this layer alone is lowered
            (mean over the tuning batches, against the all-16-bit model).
        gradient_change: per format tried, the relative L2 change of the model's gradients.
        saturation: per format tried, the fraction of the input's nonzero values clamped at the format's
            largest value (None: block formats scale each block to fit).
        underflow: per format tried, the fraction of the input's nonzero values flushed to zero.
        saving: per format tried, what lowering this layer alone saves in the plan's objective: ``saving_ms``
            or ``saving_bytes``; negative where it costs (an emulated format is slower than the 16-bit kernel).
        outlier: the input channel that sets the scale, where one channel's largest magnitude is 100x or
            more the median channel's (as LLM.int8() found): ``"channel 7: 9.8e+03x the median channel"``.
        saving_ms: per format tried, milliseconds per step saved (the layer's own forward and backward,
            measured against the 16-bit layer's).
        saving_bytes: per format tried, saved-for-backward bytes saved (the model's step, measured).
    """

    name: str
    shape: tuple[int, int]
    format: str
    why: str
    loss_change: dict[str, float] = dataclasses.field(default_factory=dict)
    gradient_change: dict[str, float] = dataclasses.field(default_factory=dict)
    saturation: dict[str, float | None] = dataclasses.field(default_factory=dict)
    underflow: dict[str, float] = dataclasses.field(default_factory=dict)
    saving: dict[str, float] = dataclasses.field(default_factory=dict)
    outlier: str | None = None
    saving_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    saving_bytes: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """Each linear's format, chosen from measured sensitivity and cost (``ampkit.tune``).

    Attributes:
        model: the model's class name; ``fingerprint``: its linears' names and shapes, digested.
        base: the 16-bit format of everything not lowered (``"bf16"`` or ``"fp16"``).
        objective: ``"time"`` or ``"memory"``: what ``saving`` counts.
        tolerance: the relative loss change the plan may cost.
        layers: every linear, in model order.
        predicted_loss_change: the sum of the chosen layers' loss changes.
        measured_loss_change: the combined plan's relative loss change on the held-out batches.
        backed_off: layers lowered first and put back, as the combined check asked.
        predicted_saving: the chosen layers' savings in the objective, summed (ms per step, or bytes).
        emulated: whether the lowered formats run emulated on the device tuned on (their cost is
            emulation's there: a slower step, the bytes of the emulation).
        tune_s: how long tuning took.
        predicted_ms: the chosen layers' ``saving_ms`` summed, whatever the objective (what the step should
            gain: negative, what it should lose).
        predicted_bytes: the chosen layers' ``saving_bytes`` summed.
        version: the file format's.
    """

    model: str
    fingerprint: str
    base: str
    objective: str
    tolerance: float
    layers: tuple[LayerChoice, ...]
    predicted_loss_change: float
    measured_loss_change: float
    backed_off: tuple[str, ...]
    predicted_saving: float
    emulated: bool
    tune_s: float
    predicted_ms: float = 0.0
    predicted_bytes: float = 0.0
    version: int = VERSION

    def lowered(self) -> dict[str, str]:
        """The lowered layers and their formats."""
        return {layer.name: layer.format for layer in self.layers if layer.format not in BASES}

    def apply(self, model: nn.Module) -> nn.Module:
        """Convert the plan's lowered linears of ``model`` in place (the model it was made for, before
        ``initialize``); returns it.

        Raises:
            ValueError: the model's linears are not the plan's (another model), or it has lowered layers.
        """
        refuse_converted(model, "PrecisionPlan.apply")  # a sharded model, or one in a narrow format already
        if fingerprint(model) != self.fingerprint:
            names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)]
            raise ValueError(f"This plan was made for another model ({self.model}, linears fingerprint "
                             f"{self.fingerprint}; this {type(model).__name__} has {len(names)} linears, fingerprint "
                             f"{fingerprint(model)}): run ampkit.tune on this model.")
        # all checked before any is converted: a refused plan leaves the model as it was
        for name, format in self.lowered().items():
            if format not in LOWER:
                raise ValueError(f"The plan lowers {name} to {format!r}, which is no format ampkit converts to: "
                                 f"choose one of {list(LOWER)} (or make the plan again with ampkit.tune).")
            try:
                model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"The plan names {name}, which {type(model).__name__} does not have: make the "
                                 "plan again with ampkit.tune on this model.") from None
        lowered = {name: (model.get_submodule(name), format) for name, format in self.lowered().items()}
        for name, (current, _) in lowered.items():
            if type(current) is not nn.Linear and not is_conv1d(current) and isinstance(current, nn.Linear):
                raise ValueError(f"{name} is a {type(current).__name__} already: apply a plan to the model as "
                                 "built, before convert_to_fp8 or convert_to_block_scaled.")
            if type(current) is not nn.Linear and not is_conv1d(current):
                raise ValueError(f"The plan lowers {name}, a {type(current).__name__}: a plan lowers linears only "
                                 "(nn.Linear, transformers' Conv1D). Name a linear, or make the plan again with "
                                 "ampkit.tune.")
        for name, (current, format) in lowered.items():
            model.set_submodule(name, lower_linear(current, format))  # type: ignore[arg-type]  # checked above
        return model

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON values (tuples as lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the plan as strict JSON, atomically; an existing file only with ``overwrite``.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is False (nothing is written).
            ValueError: a figure is NaN or infinite (JSON has none; nothing is written).
        """
        path = Path(path)
        found: list[str] = []
        text = json.dumps(strict_json(self.to_dict(), "", found), indent=2, allow_nan=False) + "\n"
        if found:
            raise ValueError(f"The plan holds figures JSON cannot ({found[:3]}): nothing was written.")
        if overwrite:
            atomic_write(path, lambda tmp: tmp.write_text(text))
        else:
            try:
                publish_new({path: lambda tmp: tmp.write_text(text)})
            except FileExistsError:
                raise FileExistsError(f"{path} exists: pass overwrite=True (ampkit tune --force) to replace it, or "
                                      "another path.") from None
        return path

    @classmethod
    def load(cls, path: str | Path) -> PrecisionPlan:
        """Read a plan ``save`` wrote.

        Raises:
            ValueError: not a plan file, or another version (the path and the version named).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"Cannot read the precision plan {path}: {error}. Write one with ampkit tune --out.") \
                from None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            version = data.get("version") if isinstance(data, dict) else None
            raise ValueError(f"{path} is not a version-{VERSION} precision plan (version {version!r}): make it again "
                             "with this ampkit's `ampkit tune --out`.")
        try:
            layers = tuple(LayerChoice(**{**layer, "shape": tuple(layer["shape"])}) for layer in data["layers"])
            plan = cls(**{**data, "layers": layers, "backed_off": tuple(data["backed_off"])})
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path} is damaged: {error}. Make it again with `ampkit tune --out`.") from None
        for index, layer in enumerate(layers):  # what apply reads: a list where a name was raised TypeError there
            if not (isinstance(layer.name, str) and isinstance(layer.format, str) and len(layer.shape) == 2
                    and all(isinstance(n, int) and not isinstance(n, bool) for n in layer.shape)):
                raise ValueError(f"{path} is damaged: layer {index} has name {layer.name!r}, format {layer.format!r}, "
                                 f"shape {list(layer.shape)!r} (a name, a format and two integers). Make it again "
                                 "with `ampkit tune --out`.")
        _check_edits(plan, path)
        return plan


def _check_edits(plan: PrecisionPlan, path: Path) -> None:
    """Refuse what a hand edit can make of a plan that ``apply`` or ``compare`` would take wrongly (ValueError naming
    the entry and the choices): a layer listed twice (the first was ignored), a base that is no 16-bit format (an
    ``fp32`` base ran mislabelled settings), a format no linear is lowered to, an objective ``tune`` has not."""
    if plan.base not in BASES:
        raise ValueError(f"{path}: base {plan.base!r} is not a 16-bit format: the layers a plan does not lower train "
                         f"in one of {list(BASES)}. Set it back, or make the plan again with `ampkit tune --out`.")
    if plan.objective not in ("time", "memory"):
        raise ValueError(f"{path}: objective {plan.objective!r} is not 'time' or 'memory'. Make the plan again with "
                         "`ampkit tune --out` (its --objective).")
    seen: set[str] = set()
    for layer in plan.layers:
        if layer.name in seen:
            raise ValueError(f"{path}: {layer.name} is listed twice: a plan gives each linear one format. Keep one "
                             "entry, or make the plan again with `ampkit tune --out`.")
        seen.add(layer.name)
        if layer.format not in BASES and layer.format not in LOWER:
            raise ValueError(f"{path}: {layer.name}'s format {layer.format!r} is none a linear is lowered to: choose "
                             f"one of {list(LOWER)}, or the base {plan.base!r} to keep it.")
