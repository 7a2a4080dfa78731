"""The recompute planner: saved-for-backward within the budget (measured equal to the prediction), losses
and gradients bit-identical to the unplanned step, batch-norm statistics untouched, the baselines, the
refusals, and composition with ampkit regions, float32 compute and FP8."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.diagnostics.memory import saved_bytes_of_step
from ampkit.experiment.models import GPT, ResNet18
from ampkit.planning.recompute import parse_budget, plan_recompute


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = ampkit.initialize(GPT(d_model=32, n_layers=4, n_heads=2, context=16), None, "O1",
                                     torch.bfloat16, compute="native")
    return model, torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
    loss, saved = saved_bytes_of_step(model, lambda: _loss(model(x)))
    loss.backward()
    return loss.detach(), saved, [p.grad for p in model.parameters()]


def _planned_and_plain(model: nn.Module, x: torch.Tensor, budget: float, strategy: str = "auto") -> tuple:
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    plan = plan_recompute(planned, x, budget, _loss, strategy=strategy)
    plan.apply(planned)
    return plan, _step(planned, x), _step(plain, x), planned, plain


@pytest.mark.parametrize("strategy", ["auto", "blocks", "sqrt"])
def test_a_plan_fits_its_budget_and_changes_no_loss_or_gradient(strategy: str) -> None:
    model, x = _gpt()
    plan, (loss, saved, grads), (loss0, saved0, grads0), _, _ = _planned_and_plain(model, x, 0.5, strategy)
    assert saved0 == plan.unplanned_bytes and plan.budget_bytes == int(0.5 * saved0)
    assert saved == plan.planned_bytes <= plan.budget_bytes  # the prediction is the measurement
    assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
    assert plan.segments and plan.extra_ms > 0


def test_the_baselines_are_every_block_and_sqrt_n_segments() -> None:
    model, x = _gpt()
    blocks = plan_recompute(model, x, 1.0, _loss, strategy="blocks")
    assert blocks.segments == (("blocks.0",), ("blocks.1",), ("blocks.2",), ("blocks.3",))
    sqrt = plan_recompute(model, x, 1.0, _loss, strategy="sqrt")
    assert sqrt.segments == (("blocks.0", "blocks.1"), ("blocks.2", "blocks.3"))  # sqrt(4) = 2 runs of 2
    assert sqrt.planned_bytes < blocks.planned_bytes  # a segment keeps only its first input
    auto = plan_recompute(model, x, 1.0, _loss)
    assert auto.segments == () and auto.planned_bytes == auto.unplanned_bytes  # nothing to do at the full budget


def test_the_planner_recomputes_no_more_than_the_sqrt_baseline_where_both_fit() -> None:
    model, x = _gpt()
    sqrt = plan_recompute(model, x, 0.6, _loss, strategy="sqrt")
    auto = plan_recompute(model, x, 0.6, _loss)
    recomputed = {name for segment in auto.segments for name in segment}
    assert recomputed <= {name for segment in sqrt.segments for name in segment}
    assert auto.planned_bytes <= auto.budget_bytes and sqrt.planned_bytes <= sqrt.budget_bytes


def test_resnet_batch_norm_statistics_are_the_unplanned_ones() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the planner is the subject, not the compute mode: native bf16 convolutions are emulated (slow) on AVX2
        model, _ = ampkit.initialize(ResNet18(), None, "O1", torch.bfloat16, compute="auto")
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    plan, (loss, saved, grads), (loss0, _, grads0), planned, plain = _planned_and_plain(model, x, 0.5)
    assert saved <= plan.budget_bytes and any(len(s) > 1 for s in plan.segments)  # merged segments were needed
    assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
    for (name, a), (_, b) in zip(planned.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), name  # measured three times and recomputed once: still one update


@pytest.mark.parametrize("name, budget", [("gpt", 0.2), ("resnet18", 0.25)])
def test_below_the_blocks_reach_the_whole_model_is_one_segment(name: str, budget: float) -> None:
    """Below what any plan of blocks reaches (the stem and head outside the blocks save the rest: ResNet-18's
    block floor was 0.42x), the whole model recomputed as one segment keeps only its inputs."""
    if name == "gpt":
        model, x = _gpt()
    else:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = ampkit.initialize(ResNet18(), None, "O1", torch.bfloat16, compute="auto")  # as above
        x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    for strategy in ("blocks", "sqrt"):
        with pytest.raises(ValueError, match="smallest feasible budget"):
            plan_recompute(model, x, budget, _loss, strategy=strategy)
    plan, (loss, saved, grads), (loss0, saved0, grads0), planned, plain = _planned_and_plain(model, x, budget)
    assert plan.segments == (("",),) and saved == plan.planned_bytes <= plan.budget_bytes
    assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
    for (buffer, a), (_, b) in zip(planned.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), buffer


@pytest.mark.parametrize("budget, message", [
    (0, "budget=0 is invalid"), (-5, "budget=-5 is invalid"), (math.nan, "budget=nan is invalid"),
    (1.5, "budget=1.5 is a fraction above 1"), (True, "budget=True is invalid"), ("lots", "budget='lots' is unreadable"),
])
def test_bad_budgets_are_refused_in_one_line(budget: object, message: str) -> None:
    model, x = _gpt()
    with pytest.raises(ValueError, match=message):
        plan_recompute(model, x, budget, _loss)  # type: ignore[arg-type]


def test_budget_strings_and_an_unreachable_budget_that_names_the_smallest_feasible_one() -> None:
    assert parse_budget("64MiB", 10) == 64 * 2**20 and parse_budget("0.5", 1000) == 500 and parse_budget(2048, 1) == 2048
    model, x = _gpt()
    with pytest.raises(ValueError, match=r"the smallest feasible budget is (\d+) bytes") as error:
        plan_recompute(model, x, 1, _loss)
    floor = int(error.value.args[0].split("smallest feasible budget is ")[1].split(" ")[0])
    assert plan_recompute(model, x, floor, _loss).planned_bytes == floor  # it is feasible, exactly


def test_sqrt_needs_sequential_blocks_and_a_plan_applies_once() -> None:
    class Looped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    with pytest.raises(ValueError, match="strategy='sqrt' recomputes runs of consecutive blocks of an nn.Sequential"):
        plan_recompute(Looped(), torch.randn(2, 8), 0.5, _loss, strategy="sqrt")
    with pytest.raises(ValueError, match="strategy='fast' is invalid"):
        plan_recompute(Looped(), torch.randn(2, 8), 0.5, _loss, strategy="fast")
    model = Looped()
    plan = plan_recompute(model, torch.randn(2, 8), 1.0, _loss, strategy="blocks")
    plan.apply(model)
    with pytest.raises(RuntimeError, match="A recompute plan is installed on this model already"):
        plan.apply(model)


@pytest.mark.parametrize("selective", [False, True], ids=["whole blocks", "selective"])
@pytest.mark.parametrize("setting", ["edited policy", "float32 compute", "fp8"])
def test_a_plan_recomputes_in_the_forwards_dtypes_and_gives_the_unplanned_gradients(setting: str,
                                                                                   selective: bool) -> None:
    torch.manual_seed(0)
    model = GPT(d_model=32, n_layers=2, n_heads=2, context=16)
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    if setting == "edited policy":
        policy = policy.with_ops(deny=["gelu"])
    elif setting == "float32 compute":
        policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")
    else:
        ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(), emulate=True)
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampkit.autocast(policy):
            plan = plan_recompute(planned, x, 0.6, _loss, strategy="blocks")
        if selective:  # every block but for its GEMMs and attention (the GELU is recomputed either way)
            plan = dataclasses.replace(plan, selective=tuple(s[0] for s in plan.segments))
        plan.apply(planned)
        seen: dict[str, list[torch.dtype]] = {"planned": [], "plain": []}
        for key, m in (("planned", planned), ("plain", plain)):
            m.blocks[0].mlp[1].register_forward_hook(lambda mod, a, out, key=key: seen[key].append(out.dtype))
            with ampkit.autocast(policy):
                loss = _loss(m(x))
            loss.backward()
    assert len(seen["planned"]) == 2 and len(seen["plain"]) == 1  # the GELU ran again in backward
    assert seen["planned"][0] == seen["planned"][1] == seen["plain"][0]  # in the forward's dtype
    if setting == "edited policy":
        assert seen["plain"][0] == torch.float32  # gelu denied: float32, in the recompute too
    for a, b in zip(planned.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_estimate_memory_takes_a_plan_for_its_activations() -> None:
    model, x = _gpt()
    plan = plan_recompute(model, x, 0.5, _loss)
    torch.manual_seed(0)
    plain = GPT(d_model=32, n_layers=4, n_heads=2, context=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        without = ampkit.estimate_memory(plain, x, "O1", loss_fn=_loss)
        with_plan = ampkit.estimate_memory(plain, x, "O1", loss_fn=_loss, plan=plan)
    assert with_plan.mixed.activations == plan.planned_bytes < without.mixed.activations
    assert with_plan.mixed.weights == without.mixed.weights and with_plan.mixed.label.endswith("recompute")
    with pytest.raises(ValueError, match="plan=dict is not a RecomputePlan"):
        ampkit.estimate_memory(plain, x, "O1", plan={})


def test_compare_runs_each_mixed_setting_with_and_without_a_plan_and_the_losses_agree() -> None:
    from ampkit.experiment.config import RunConfig
    from ampkit.experiment.settings import plan
    from ampkit.experiment.training import execute

    configs = plan(model="gpt", precisions=["bf16"], opt_levels=["O1"], steps=3, activation_budgets=["0.5"],
                   probe=False)
    assert [c.label.endswith("recompute-0.5") for c in configs] == [False, False, True]
    with pytest.raises(ValueError, match=r"activation_budgets=\['1.5'\]: budget=1.5 is a fraction above 1"):
        plan(model="gpt", precisions=["bf16"], activation_budgets=["1.5"])
    with pytest.raises(ValueError, match="plan the mixed runs: add a 16-bit precision"):
        plan(model="gpt", precisions=["fp32"], activation_budgets=["0.5"])
    common = dict(model="gpt", data="text", precision="bf16", opt_level="O1", steps=3, batch_size=4, compute="native")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = execute(RunConfig(**common))
        planned = execute(RunConfig(**common, activation_budget="0.5"))
    assert planned.losses == plain.losses  # bit-identical training
    assert planned.saved_for_backward_bytes <= 0.5 * plain.saved_for_backward_bytes


def test_the_compare_table_gives_each_planned_run_against_the_same_setting_without_its_plan() -> None:
    from rich.console import Console

    from ampkit.experiment import comparison, report
    from ampkit.experiment.config import RunResult
    from ampkit.experiment.settings import plan
    from ampkit.hardware.advice import machine_summary

    configs = plan(model="gpt", precisions=["bf16"], opt_levels=["O1"], steps=2, activation_budgets=["0.5"],
                   computes=["native"], probe=False)
    figures = {"fp32": (100.0, 400, 80), "bf16 O1": (50.0, 200, 40), "bf16 O1 recompute-0.5": (60.0, 150, 20)}
    runs = [RunResult(label=c.label, precision=c.precision, opt_level=c.opt_level, float32_compute=[], probe=False,
                      ms_per_step=figures[c.label][0], samples_per_s=1.0, peak_memory_bytes=figures[c.label][1],
                      saved_for_backward_bytes=figures[c.label][2], final_train_loss=1.0, test_accuracy=0.5,
                      skipped_steps=0, final_loss_scale=None, steps=2, losses=[1.0, 1.0], wall_s=0.1)
            for c in configs]
    result = comparison.Comparison(runs, comparison._shared_config(configs), machine_summary("cpu"), "2026-12-01")
    record = {run["label"]: run for run in result.to_dict()["runs"]}
    assert record["bf16 O1 recompute-0.5"]["ratio_to_unplanned"] == {
        "ms_per_step": 1.2, "peak_memory_bytes": 0.75, "saved_for_backward_bytes": 0.5}
    assert "ratio_to_unplanned" not in record["bf16 O1"]
    console = Console(width=100, record=True)
    console.print(report.table(result))
    text = console.export_text()
    assert "(1.20x)" in text and "(0.75x)" in text and "(0.50x)" in text and "without its plan" in text


def test_a_planned_run_plans_inside_its_first_step_while_the_other_runs_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare steps its runs in turn; a run with an activation budget planned at start-up, beside the others'
    start-ups and planners, which oversubscribed the cores. Now it plans after the host's first ``step``, inside
    that step's turn."""
    from ampkit.experiment import training
    from ampkit.experiment.config import RunConfig

    events: list[str] = []
    real = training.plan_recompute

    def planning(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("plan")
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "plan_recompute", planning)
    config = RunConfig(model="gpt", data="text", precision="bf16", opt_level="O1", steps=2, batch_size=4,
                       compute="native", probe=False, activation_budget="0.5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = training.execute(config, wait=events.append)
    assert events == ["step", "plan", "step", "finish"]
    assert result.steps == 2
