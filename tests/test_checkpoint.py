"""Checkpoints: a resume is bit-identical, damaged files are named, a failed load changes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, ampkit.DynamicLossScaler, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = ampkit.initialize(model, optimizer, "O2", torch.float16, compute="float32")
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scaler, scheduler


def _train(model, optimizer, scaler, scheduler, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        if step == 3:
            loss = loss * float("inf")  # one skipped step inside the resumed part
        scaler.scale(loss).backward()
        if scaler.step(optimizer):
            scheduler.step()
        scaler.update()
        losses.append(loss.item())
    return losses


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = _setup()
    expected = _train(*straight, range(6))

    first = _setup()
    _train(*first, range(2))
    model, optimizer, scaler, scheduler = first
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scaler=scaler,
                           scheduler=scheduler, extra={"step": 2})

    resumed = _setup(seed=1)  # other initial weights: everything must come from the file
    model, optimizer, scaler, scheduler = resumed
    extra = ampkit.load_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scaler=scaler,
                                   scheduler=scheduler)
    assert extra == {"step": 2}
    assert _train(*resumed, range(2, 6)) == expected[2:]
    assert scaler.get_scale() == straight[2].get_scale() and scaler.stats.skipped == straight[2].stats.skipped == 1
    for a, b in zip(straight[1].master_params, optimizer.master_params):
        assert torch.equal(a, b)
    for a, b in zip(straight[0].parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert oct(os.stat(tmp_path / "ck.pt").st_mode & 0o777) != "0o600"  # readable as results are


@pytest.mark.parametrize(
    "damage, error, message",
    [
        ("missing", FileNotFoundError, r"ck.pt does not exist: pass the file save_checkpoint wrote"),
        ("empty", RuntimeError, r"ck.pt is empty \(0 bytes\): it was not written completely"),
        ("truncated", RuntimeError, r"ck.pt \(\d+ bytes\) cannot be read: .* truncated or not a torch checkpoint"),
        ("text", RuntimeError, r"ck.pt \(\d+ bytes\) cannot be read"),
        ("foreign", RuntimeError, r"ck.pt is not an ampkit checkpoint \(keys \['scale', 'version'\]\)"),
        ("version", RuntimeError, r"ck.pt has version 99; this ampkit reads version 1"),
    ],
)
def test_damaged_checkpoints_are_named(damage: str, error: type, message: str, tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    model = nn.Linear(2, 2)
    if damage != "missing":
        ampkit.save_checkpoint(path, model=model)
        whole = path.read_bytes()
        content = {"empty": b"", "truncated": whole[: len(whole) // 2], "text": b"not a checkpoint\n"}
        if damage in content:
            path.write_bytes(content[damage])
        elif damage == "foreign":
            torch.save({"scale": 2.0, "version": 1}, path)  # a bare scaler state dict
        else:
            torch.save({"ampkit_checkpoint": 99, "states": {}, "extra": {}}, path)
    before = model.weight.detach().clone()
    with pytest.raises(error, match=message):
        ampkit.load_checkpoint(path, model=model)
    assert torch.equal(model.weight, before)


def test_a_failed_load_changes_nothing(tmp_path: Path) -> None:
    model, optimizer, scaler, scheduler = _setup()
    _train(model, optimizer, scaler, scheduler, range(2))
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=optimizer, scaler=scaler)

    other, other_opt, other_scaler, _ = _setup(seed=1)
    wrong = nn.Linear(3, 3)  # restored first, then the scaler refuses: the model must be put back
    weights, scale = [p.detach().clone() for p in other.parameters()], other_scaler.get_scale()
    wrong_before = wrong.weight.detach().clone()
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    state["states"]["scaler"]["scale"] = float("nan")
    state["states"]["wrong"] = nn.Linear(3, 3).state_dict()
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(RuntimeError, match=r"bad.pt: loading 'scaler' failed, nothing was changed: .*scale=nan"):
        ampkit.load_checkpoint(tmp_path / "bad.pt", wrong=wrong, model=other, optimizer=other_opt,
                               scaler=other_scaler)
    assert torch.equal(wrong.weight, wrong_before)
    assert all(torch.equal(a, b) for a, b in zip(weights, other.parameters()))
    assert other_scaler.get_scale() == scale and other_opt.optimizer.state == {}

    with pytest.raises(RuntimeError, match=r"has no state for \['schedule'\]; it holds \['model', 'optimizer', "
                                           r"'scaler'\]"):
        ampkit.load_checkpoint(tmp_path / "ck.pt", model=other, schedule=scheduler)


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    ampkit.save_checkpoint(path, model=nn.Linear(2, 2), extra={"epoch": 1})
    before = path.read_bytes()
    with pytest.raises(Exception):
        ampkit.save_checkpoint(path, model=nn.Linear(2, 2), extra={"epoch": 2, "bad": lambda: 0})  # unpicklable
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    with pytest.raises(TypeError, match=r"epoch=int has no state_dict\(\): .* plain values in extra="):
        ampkit.save_checkpoint(path, epoch=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs at least one object"):
        ampkit.save_checkpoint(path)


def test_extra_values_that_would_not_load_back_are_refused_at_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    model = nn.Linear(2, 2)
    for value, kind in ((np.float64(0.97), "numpy.float64"), (tmp_path, "pathlib")):
        with pytest.raises(ValueError, match=rf"extra\['best'\] is a {kind}"):
            ampkit.save_checkpoint(tmp_path / "c.pt", extra={"best": value}, model=model)
    assert not (tmp_path / "c.pt").exists()  # was: saved, then "truncated or not a torch checkpoint" at load
    ampkit.save_checkpoint(tmp_path / "c.pt", extra={"best": 0.97, "path": str(tmp_path)}, model=model)
    assert ampkit.load_checkpoint(tmp_path / "c.pt", model=model)["best"] == 0.97


def test_a_path_without_an_extension_saves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = nn.Linear(2, 2)
    ampkit.save_checkpoint(tmp_path / "run" / "last", model=model)  # was: "invalid file name: run/.last-xxx"
    ampkit.load_checkpoint(tmp_path / "run" / "last", model=model)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["last"]  # no temporary file left behind


def _trained_o2() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), "O2", torch.bfloat16,
                                         compute="native")
    model(torch.randn(4, 8)).float().pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


class _Figures:
    """A stateful object whose state is one float (a scaler's scale, a metric)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"scale": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["scale"]


def test_a_nan_in_an_o2_weights_16_bit_copy_is_not_in_the_checkpoint_which_holds_the_masters(
        tmp_path: Path) -> None:
    model, optimizer = _trained_o2()
    masters = {name: value.clone() for name, value in model.state_dict().items()}
    model[0].weight.data.view(-1)[3] = float("nan")  # the working copy only: the next step writes the master back
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer)
    ampkit.load_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in masters.items())
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.parametrize("poison, named", [
    (lambda m, o: o.state[o.master_params[2]]["exp_avg_sq"].view(-1).__setitem__(5, float("nan")),
     r"optimizer: exp_avg_sq of 2.weight"),
    # at O2 the model's state dict holds each weight's master: a poisoned master is named in both
    (lambda m, o: o.master_params[1].data.__setitem__(0, float("inf")),
     r"model\['0.bias'\], optimizer: the float32 master of 0.bias"),
    (lambda m, o: None, r"figures\['scale'\]"),
])
def test_a_state_holding_an_inf_or_a_nan_is_not_saved_and_the_previous_checkpoint_stays(
        poison, named: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 43's fault (d): a NaN-poisoned checkpoint, once saved and resumed from, loses the run. The save is
    refused naming the place (a moment by its parameter's name), nothing is written; allow_nonfinite=True saves it."""
    model, optimizer = _trained_o2()
    figures = _Figures(1.0)
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer, figures=figures)
    before = (tmp_path / "last.pt").read_bytes()
    poison(model, optimizer)
    if "figures" in named:
        figures.value = float("inf")
    with pytest.raises(ValueError, match=rf"Not saving .*last.pt: the state holds an inf or a NaN \({named}.*"
                                         r"The previous checkpoint is as it was.*allow_nonfinite=True"):
        ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer, figures=figures)
    assert (tmp_path / "last.pt").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    ampkit.save_checkpoint(tmp_path / "debug.pt", allow_nonfinite=True, model=model, optimizer=optimizer,
                           figures=figures)
    assert (tmp_path / "debug.pt").exists()


def test_a_buffer_holding_minus_inf_is_its_value_and_saves(tmp_path: Path) -> None:
    """An attention mask's -inf is a value, not a fault: buffers are not checked."""
    model = nn.Linear(4, 4)
    model.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model)
    loaded = nn.Linear(4, 4)
    loaded.register_buffer("mask", torch.zeros(4, 4))
    ampkit.load_checkpoint(tmp_path / "last.pt", model=loaded)
    assert torch.equal(loaded.mask, model.mask)


def test_a_nan_in_torchao_s_8bit_moments_is_found_in_their_scales(tmp_path: Path) -> None:
    pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128))
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), "O1", torch.bfloat16,
                                         compute="native", states="8bit")
    with torch.compiler.set_stance("force_eager"):
        model(torch.randn(4, 64)).float().pow(2).mean().backward()
        optimizer.step()
    optimizer.state[model[0].weight]["exp_avg"].scale[0] = float("nan")
    with pytest.raises(ValueError, match=r"optimizer: exp_avg of 0.weight"):
        ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer)
    assert not (tmp_path / "last.pt").exists()


def _nan_on_rank_1(rank: int, world: int, path: str) -> dict:
    from ampkit.distributed import fully_shard, load_sharded_checkpoint, save_sharded_checkpoint

    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), opt_level="O2",
                        dtype=torch.bfloat16, compute="native")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).float().pow(2).mean().backward()
    optimizer.step()
    save_sharded_checkpoint(path, model, optimizer, extra={"step": 1})
    if rank == 1:
        optimizer.state[model[2].weight]["exp_avg"].to_local().view(-1)[0] = float("nan")
    try:
        save_sharded_checkpoint(path, model, optimizer, extra={"step": 2})
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {"refused": refused, "extra": load_sharded_checkpoint(path, model, None)}


@pytest.mark.distributed
def test_a_sharded_save_is_refused_on_every_rank_when_one_rank_holds_a_nan(tmp_path: Path) -> None:
    """Every rank refuses together (one refusing alone would leave the others waiting in DCP); the one holding the
    NaN names it, the previous checkpoint loads."""
    import warnings

    from multiprocess import run_ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_nan_on_rank_1, 2, str(tmp_path / "run"), timeout_s=120)
    assert "on another rank" in ranks[0]["refused"]
    assert "optimizer: exp_avg of 2.weight" in ranks[1]["refused"]
    assert ranks[0]["extra"] == ranks[1]["extra"] == {"step": 1}
