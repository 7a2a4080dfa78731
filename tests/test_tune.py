"""ampkit.tune: a planted outlier layer kept in bf16 with the channel named, ordinary layers lowered; the
back-off; the plan as a file (round trip, another model, another version, no silent overwrite); the
refusals; `ampkit tune` and `ampkit compare --plan`."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.experiment.models import GPT, gpt_with_outlier
from ampkit.formats.fp8 import Fp8Linear
from ampkit.planning.precision_plan import PrecisionPlan
from ampkit.planning.tune import _back_off

PLANTED = "blocks.0.mlp.3"  # the linear whose input channel 7 is 10^6x the others


def _gpt(planted: bool = True, **kwargs: int) -> nn.Module:
    torch.manual_seed(0)
    shape = dict(d_model=32, n_layers=2, n_heads=2, context=16) | kwargs
    return gpt_with_outlier(**shape) if planted else GPT(**shape)


def _batches(count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 256, (8, 17), generator=g) for _ in range(count)]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


@pytest.fixture(scope="module")
def planted_plan() -> PrecisionPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ampkit.tune(_gpt(), _batches(), formats=("fp8", "bf16"), tolerance=0.05, objective="memory")


def test_the_planted_outlier_layer_stays_in_bf16_and_its_evidence_names_the_channel(planted_plan) -> None:  # type: ignore[no-untyped-def]
    layers = {layer.name: layer for layer in planted_plan.layers}
    planted = layers[PLANTED]
    assert planted.format == "bf16" and "too sensitive" in planted.why
    assert planted.outlier is not None and planted.outlier.startswith("channel 7: ")
    assert planted.underflow["fp8"] > 0.5  # the one channel's scale flushes the others
    assert "channel 7" in planted.why and "flushes to zero in fp8" in planted.why
    assert planted.gradient_change["fp8"] > planted_plan.layers[1].gradient_change["fp8"] * 10
    ordinary = [layer for name, layer in layers.items() if "fp8" in layer.loss_change and name != PLANTED]
    assert planted.loss_change["fp8"] > 10 * max(layer.loss_change["fp8"] for layer in ordinary)
    lowered = planted_plan.lowered()
    assert lowered and set(lowered.values()) == {"fp8"} and PLANTED not in lowered
    assert layers["blocks.0.attn.qkv"].why.startswith("not a candidate: the first linear")
    assert layers["lm_head"].why.startswith("not a candidate: the last linear")
    assert planted_plan.measured_loss_change <= planted_plan.tolerance
    assert all(layers[name].saving["fp8"] > 0 for name in lowered)  # memory: measured saved-for-backward bytes
    assert planted_plan.predicted_bytes == planted_plan.predicted_saving == sum(
        layers[name].saving_bytes["fp8"] for name in lowered)
    assert planted_plan.predicted_ms == sum(layers[name].saving_ms["fp8"] for name in lowered)  # timed as well


def test_a_plan_is_a_file_for_its_own_model(planted_plan, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = planted_plan.save(tmp_path / "plan.json")
    assert PrecisionPlan.load(path) == planted_plan
    with pytest.raises(FileExistsError, match="plan.json exists: pass overwrite=True"):
        planted_plan.save(path)
    planted_plan.save(path, overwrite=True)
    model = planted_plan.apply(_gpt())
    for name, module in model.named_modules():
        if name in planted_plan.lowered():
            assert isinstance(module, Fp8Linear)
        elif isinstance(module, nn.Linear):
            assert type(module) is nn.Linear, name
    converted = len(planted_plan.lowered())  # which layers a plan lowers is measured: it differs between CPUs
    with pytest.raises(ValueError, match=rf"PrecisionPlan.apply takes a model as built, and {converted} of this "
                                         r"model's linears are converted already: .* \(Fp8Linear\)"):
        planted_plan.apply(model)
    # every candidate lowered, the last already converted: refused before any other is converted
    every = dataclasses.replace(planted_plan, layers=tuple(
        dataclasses.replace(layer, format="fp8") if "fp8" in layer.loss_change else layer
        for layer in planted_plan.layers))
    *first, last = every.lowered()
    partly = _gpt()
    ampkit.convert_to_fp8(partly, ampkit.Fp8Recipe(), include=(last,), keep=tuple(first))
    with pytest.raises(ValueError, match=f"converted already: {last} \\(Fp8Linear\\)"):
        every.apply(partly)
    assert first and all(type(partly.get_submodule(name)) is nn.Linear for name in first)
    with pytest.raises(ValueError, match="This plan was made for another model"):
        planted_plan.apply(_gpt(d_model=64))
    data = json.loads(path.read_text())
    (tmp_path / "v2.json").write_text(json.dumps({**data, "version": 2}))
    with pytest.raises(ValueError, match="is not a version-1 precision plan"):
        PrecisionPlan.load(tmp_path / "v2.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="Cannot read the precision plan"):
        PrecisionPlan.load(tmp_path / "bad.json")


@pytest.mark.parametrize("kwargs, message", [
    (dict(formats=("fp9", "bf16")), r"formats=\['fp9', 'bf16'\]: fp9 is not a format"),
    (dict(formats=("fp8",)), "needs exactly one 16-bit base"),
    (dict(formats=("bf16",)), "needs exactly one 16-bit base"),
    (dict(tolerance=0), "tolerance=0 is invalid"),
    (dict(tolerance=-0.1), "tolerance=-0.1 is invalid"),
    (dict(tolerance=float("nan")), "tolerance=nan is invalid"),
    (dict(gradient_tolerance=0), "gradient_tolerance=0 is invalid"),
    (dict(objective="speed"), "objective='speed' is invalid"),
    (dict(include=["head"]), "include=\\['head'\\]: 'head' is not a linear"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ampkit.tune(_gpt(), _batches(), **kwargs)
    with pytest.raises(ValueError, match="tune needs at least 2"):
        ampkit.tune(_gpt(), _batches(1))


def test_the_combined_check_backs_off_the_last_layers_until_it_fits() -> None:
    changes = {("a", "b", "c"): 0.05, ("a", "b"): 0.02, ("a",): 0.004}
    measured, backed = _back_off(["a", "b", "c"], lambda names: changes[tuple(names)], 0.01)
    assert measured == 0.004 and backed == [("c", 0.05), ("b", 0.02)]
    assert _back_off(["a"], lambda names: 0.5, 0.01) == (0.0, [("a", 0.5)])
    assert _back_off([], lambda names: pytest.fail("nothing to check"), 0.01) == (0.0, [])


def test_ampkit_tune_refuses_a_directory_as_out_before_measuring(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On main, --force --out DIR ran the whole measurement, then raised IsADirectoryError."""
    from ampkit.cli import tune as tune_cmd
    from ampkit.cli.main import main

    monkeypatch.setattr(tune_cmd, "run_tune", lambda *a, **k: pytest.fail("measured before refusing --out"))
    assert main(["tune", "--model", "mlp", "--force", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory; the plan is one file" in capsys.readouterr().err


def test_ampkit_tune_writes_a_plan_that_compare_runs_beside_its_references(tmp_path, capsys,  # type: ignore[no-untyped-def]
                                                                          monkeypatch) -> None:
    from ampkit.cli.main import main
    from ampkit.experiment.settings import plan

    monkeypatch.setenv("COLUMNS", "240")  # the table unwrapped

    out = tmp_path / "plan.json"
    args = ["tune", "--model", "gpt-outlier", "--batches", "4", "--batch-size", "8", "--objective", "memory",
            "--tolerance", "0.05", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert PLANTED in printed and "channel 7" in printed and f"wrote {out}" in printed
    # each layer as it is measured (on main, minutes of silence): one line per candidate and format
    assert re.search(rf"ampkit tune: {re.escape(PLANTED)} in fp8: loss [+-]\d", captured.err)
    assert main(args) == 2 and "exists: pass --force" in capsys.readouterr().err  # never overwritten silently
    configs = plan(model="gpt-outlier", steps=2, precision_plan=str(out), probe=False, computes=["native"])
    assert [c.label for c in configs] == ["fp32", "bf16 O1", "fp8-delayed-hybrid O1", "bf16 O1 tuned"]
    with pytest.raises(ValueError, match="was made for another model"):
        plan(model="gpt", steps=2, precision_plan=str(out))
    from ampkit.experiment import data as data_mod
    from ampkit.experiment.training import prepare

    model, _ = prepare(configs[-1], data_mod.load("text"), torch.device("cpu"))  # the tuned run's model
    lowered = PrecisionPlan.load(out).lowered()
    assert lowered and all(isinstance(model.get_submodule(name), Fp8Linear) for name in lowered)
    assert type(model.get_submodule(PLANTED)) is nn.Linear
    assert main(["tune", "--model", "gpt", "--tolerance", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "tolerance=0.0 is invalid" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_a_user_factory_is_tuned_as_compare_builds_it() -> None:
    from ampkit.experiment.tuning import run_tune

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned, model = run_tune("ampkit.experiment.models:MLP", "digits", ["fp8", "bf16"], 0.05, "memory", 4, 16, [],
                                0, "cpu")
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert [layer.name for layer in tuned.layers] == names and tuned.model == "MLP"
    assert all(layer.why for layer in tuned.layers)
    with pytest.raises(ValueError, match="batches=1 is invalid"):
        run_tune("mlp", "digits", ["fp8", "bf16"], 0.05, "memory", 1, 16, [], 0, "cpu")


def test_the_cli_table_is_readable_at_80_columns() -> None:
    """On main, at 80 columns every header and layer name was cut ("satura...", "blocks...") and the reason wrapped
    a word a line; now the names are whole and the figures and reason share one wrapped column."""
    from rich.console import Console

    from ampkit.cli.tune import table

    _, plan = _small_plan()
    console = Console(width=80)
    with console.capture() as captured:
        console.print(table(plan, console.width))
    text = captured.get()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert all(f" {layer.name} " in text for layer in plan.layers)
    assert "fp8: loss" in text and "saturation / underflow" in text


def _small_plan() -> tuple[nn.Module, PrecisionPlan]:
    torch.manual_seed(0)
    model = GPT(d_model=32, n_layers=2, n_heads=2, context=16)
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 256, (8, 17), generator=g) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ampkit.tune(model, [(w[:, :-1], w[:, 1:]) for w in windows], formats=("fp8", "bf16"),
                           objective="memory", tolerance=0.5)
    return model, plan


@pytest.mark.parametrize("broken", ["format", "layer"])
def test_a_plan_with_an_unknown_format_or_layer_changes_nothing(broken: str) -> None:
    """Issue 40: a format that does not exist on a later layer converted the earlier layers, then KeyError; a
    layer the model lacks was a traceback."""
    model, plan = _small_plan()
    # every candidate lowered (what a plan lowers is measured, and differs between CPUs): the last one is broken
    plan = dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(layer, format="fp8") if "fp8" in layer.loss_change else layer for layer in plan.layers))
    lowered = list(plan.lowered())
    assert len(lowered) >= 2
    last = next(i for i, layer in enumerate(plan.layers) if layer.name == lowered[-1])
    edited = plan.layers[last]
    edited = (dataclasses.replace(edited, format="fp7") if broken == "format"
              else dataclasses.replace(edited, name="blocks.9.mlp.0"))
    bad = dataclasses.replace(plan, layers=(*plan.layers[:last], edited, *plan.layers[last + 1:]))
    message = r"lowers blocks\.\S+ to 'fp7', which is no format" if broken == "format" else "does not have"
    with pytest.raises(ValueError, match=message):
        bad.apply(model)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())  # nothing converted before the refusal


@pytest.mark.parametrize("first", ["fp8", "block-scaled"])
def test_a_model_in_one_narrow_format_is_refused_by_the_next_and_by_tune(first: str) -> None:
    """Issue 40: convert_to_fp8 after convert_to_block_scaled replaced the MXFP8 layers silently, and tune on a
    converted model left its converted linears out of the plan."""
    torch.manual_seed(0)
    model = GPT(d_model=32, n_layers=2, n_heads=2, context=16)
    if first == "fp8":
        ampkit.convert_to_fp8(model)
    else:
        ampkit.convert_to_block_scaled(model, ampkit.BlockScaledRecipe("mxfp8"))
    before = {name: type(m) for name, m in model.named_modules()}
    for convert, what in ((lambda: ampkit.convert_to_block_scaled(model), "convert_to_block_scaled"),
                          (lambda: ampkit.convert_to_fp8(model), "convert_to_fp8"),
                          (lambda: ampkit.tune(model, [(torch.zeros(2, 16, dtype=torch.long),) * 2] * 2), "tune")):
        expected = "trains in FP8 already" if first == "fp8" and what == "convert_to_fp8" else (
            rf"{what} takes a model as built, and \d+ of this model's linears are converted already: blocks\.0\.")
        with pytest.raises(ValueError, match=expected):
            convert()
        assert {name: type(m) for name, m in model.named_modules()} == before


def test_ampkit_tune_refuses_a_batch_size_of_0(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 40: `ampkit tune --batch-size 0` exited 0, having tuned at batch 64 (-3 was refused)."""
    from ampkit.cli.main import main

    assert main(["tune", "--model", "gpt", "--batch-size", "0", "--out", str(tmp_path / "plan.json")]) == 2
    assert "--batch-size 0 is invalid: use an integer >= 1" in capsys.readouterr().err


def test_batches_from_a_generator_tune_as_the_same_list() -> None:
    """On main, a generator of batches raised TypeError: object of type 'generator' has no len()."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))

    batches = [(torch.randn(8, 32), torch.randint(0, 10, (8,))) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        listed = ampkit.tune(model(), batches, include=["0", "4"])
        generated = ampkit.tune(model(), (b for b in batches), include=["0", "4"])
    assert [(l.name, l.format) for l in generated.layers] == [(l.name, l.format) for l in listed.layers]
    with pytest.raises(ValueError, match=r"batches=int is not a sequence of \(input, target\) pairs: pass a list"):
        ampkit.tune(model(), 8)  # type: ignore[arg-type]


def test_tune_measures_the_mxfp4_recipe_as_compare_runs_it() -> None:
    """Issue 68: ``tune`` and ``compare`` know MXFP4's recipe (a 16-bit forward, an MXFP4 backward: Tseng et al.),
    the same recipe in both. ``tune`` measures each candidate linear in it; emulated here, it saves no time, so
    each is kept with that reason; a linear lowered to it is a block-scaled one in the recipe."""
    from ampkit.experiment.config import BLOCK_RECIPES
    from ampkit.formats.block_linear import BlockScaledLinear
    from ampkit.formats.recipes import MXFP4_RECIPE
    from ampkit.planning.precision_plan import LOWER, lower_linear

    assert BLOCK_RECIPES["mxfp4-recipe"] == LOWER["mxfp4-recipe"] == MXFP4_RECIPE
    assert MXFP4_RECIPE.label == "mxfp4-floor-sr-hadamard-fwd16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ampkit.tune(_gpt(planted=False), _batches(), formats=("mxfp4-recipe", "bf16"), tolerance=0.05)
    measured = [layer for layer in plan.layers if "mxfp4-recipe" in layer.loss_change]
    assert len(measured) >= 4 and all("mxfp4-recipe" in layer.why for layer in measured), plan.layers
    lowered = lower_linear(nn.Linear(64, 64), "mxfp4-recipe")
    assert isinstance(lowered, BlockScaledLinear) and lowered.recipe == MXFP4_RECIPE
