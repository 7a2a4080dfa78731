"""The Lightning precision plugin against a hand-written ampkit loop, with skips, resume and DDP."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")

import ampkit  # noqa: E402
from ampkit.integrations.lightning import AmpkitFabricPrecision, AmpkitPrecision  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from lightning_digits import Digits, loader  # noqa: E402

STEPS = 5  # one epoch of 5 batches of 32


def _trainer(plugin: AmpkitPrecision, **kwargs: object) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(plugins=[plugin], **{**options, **kwargs})


def _fit(opt_level: str, inf_at_step: int | None = None, **plugin_kwargs: object) -> tuple[Digits, AmpkitPrecision]:
    torch.manual_seed(0)
    model = Digits(inf_at_step=inf_at_step)
    plugin = AmpkitPrecision(opt_level, torch.float16, compute="float32", device="cpu", **plugin_kwargs)
    _trainer(plugin).fit(model, loader(32, 32 * STEPS))
    return model, plugin


def _by_hand(opt_level: str) -> tuple[list[float], Digits]:
    """The loop the README shows for ampkit without Lightning, on the same model and batches."""
    torch.manual_seed(0)
    model = Digits()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    policy = ampkit.Policy.default("cpu", torch.float16, compute="float32")
    if opt_level == "O2":
        model, optimizer = ampkit.initialize(model, optimizer, "O2", torch.float16, compute="float32")
    scaler = ampkit.DynamicLossScaler()
    losses = []
    for x, y in loader(32, 32 * STEPS):
        optimizer.zero_grad(set_to_none=True)
        with ampkit.autocast(policy) if opt_level == "O1" else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        if scaler.step(optimizer):
            scheduler.step()
        scaler.update()
    return losses, model


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_trainer_matches_the_hand_written_loop(opt_level: str) -> None:
    model, plugin = _fit(opt_level)
    expected, by_hand = _by_hand(opt_level)
    assert model.losses == expected and len(expected) == STEPS
    for a, b in zip(model.parameters(), by_hand.parameters()):
        assert a.dtype == (torch.float16 if opt_level == "O2" and a.dim() > 1 else a.dtype) and torch.equal(a, b)
    assert plugin.precision == "16-mixed"


def test_an_overflow_skips_one_step_and_the_scheduler_stays(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Digits(inf_at_step=2)
    plugin = AmpkitPrecision("O2", torch.float16, compute="float32", device="cpu")
    trainer = _trainer(plugin)
    trainer.fit(model, loader(32, 32 * STEPS))
    stats = plugin.scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (STEPS - 1, 1, 2.0**15)  # steps counts those taken
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == STEPS - 1  # StepLR stepped on the 4 steps taken, not on the skipped one
    assert scheduler.get_last_lr()[0] == pytest.approx(2e-3 * 0.9 ** (STEPS - 1))
    assert trainer.callback_metrics["ampkit/skipped_steps"].item() == 1
    assert trainer.callback_metrics["ampkit/loss_scale"].item() == 2.0**15


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_callbacks_and_clipping_see_true_gradients(opt_level: str) -> None:
    class FirstGradNorm(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: object) -> None:
            if not hasattr(self, "norm"):  # what gradient clipping sees, right after it
                params = [p for group in optimizer.param_groups for p in group["params"]]
                self.norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params])).item()

    norms = []
    for precision in ("32-true", AmpkitPrecision(opt_level, torch.float16, compute="float32", device="cpu")):
        torch.manual_seed(0)
        seen = FirstGradNorm()
        options = {"plugins": [precision]} if isinstance(precision, AmpkitPrecision) else {"precision": precision}
        trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
                            gradient_clip_val=1e9, **options)
        trainer.fit(Digits(), loader(32, 32))
        norms.append(seen.norm)
    assert norms[1] == pytest.approx(norms[0], rel=1e-2)  # not 2**16 times the float32 norm


def test_a_resumed_run_is_bit_identical(tmp_path: Path) -> None:
    def run(epochs: int, resume: Path | None = None, save: Path | None = None) -> tuple[Digits, AmpkitPrecision]:
        torch.manual_seed(0 if resume is None else 1)  # the resumed run's weights must come from the checkpoint
        model = Digits(inf_at_step=1)
        plugin = AmpkitPrecision("O2", torch.float16, compute="float32", device="cpu",
                                 scaler=ampkit.DynamicLossScaler(growth_interval=2))
        trainer = _trainer(plugin, max_epochs=epochs)
        trainer.fit(model, loader(32, 32 * STEPS), ckpt_path=resume)
        if save is not None:
            trainer.save_checkpoint(save)
        return model, plugin

    straight, straight_plugin = run(2)
    run(1, save=tmp_path / "epoch1.ckpt")
    resumed, resumed_plugin = run(2, resume=tmp_path / "epoch1.ckpt")
    assert resumed_plugin.scaler.state_dict() == straight_plugin.scaler.state_dict()
    assert resumed_plugin.scaler.stats.skipped >= 1 and resumed_plugin.scaler.get_scale() != 2.0**16
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    masters = [o.master_params for o in (straight.trainer.optimizers[0], resumed.trainer.optimizers[0])]
    assert all(torch.equal(a, b) for a, b in zip(*masters))
    checkpoint = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    assert checkpoint["AmpkitPrecision"]["scaler"]["skipped"] == 1  # the injected overflow at step 1
    assert "master_params" in checkpoint["optimizer_states"][0]


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
@pytest.mark.distributed
def test_ddp_sends_half_the_bytes_with_fp16_compression() -> None:
    example = Path(__file__).parent.parent / "examples" / "lightning_digits.py"
    done = subprocess.run([sys.executable, str(example), "--opt-level", "O1", "--dtype", "bf16", "--compute",
                           "float32", "--max-steps", "3", "--strategy", "ddp", "--devices", "2"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    ratios = re.findall(r"rank (\d): all-reduce bytes \d+ = ([\d.]+)x float32's", done.stdout)
    assert sorted(ratios) == [("0", "0.500"), ("1", "0.500")], done.stdout


def _fabric_losses(opt_level: str, inf_at_step: int | None = None) -> tuple[list[float], list[bool], torch.nn.Module]:
    torch.manual_seed(0)
    model = Digits()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    if opt_level == "O2":  # Fabric has no hook for master weights: initialize first, as the plugin says
        model, optimizer = ampkit.initialize(model, optimizer, "O2", torch.float16, compute="float32")
    fabric = L.Fabric(accelerator="cpu", devices=1,
                      plugins=[AmpkitFabricPrecision(opt_level, torch.float16, compute="float32", device="cpu")])
    model, optimizer = fabric.setup(model, optimizer)
    losses, taken = [], []
    for step, (x, y) in enumerate(loader(32, 32 * STEPS)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        fabric.backward(loss * float("inf") if step == inf_at_step else loss)
        taken.append(optimizer.step())
        if taken[-1]:
            scheduler.step()
    return losses, taken, model


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fabric_matches_the_hand_written_loop(opt_level: str) -> None:
    losses, taken, model = _fabric_losses(opt_level)
    expected, by_hand = _by_hand(opt_level)
    assert losses == expected and all(taken)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_hand.parameters()))


def test_fabric_step_says_when_it_skipped() -> None:
    losses, taken, _ = _fabric_losses("O1", inf_at_step=2)
    assert taken == [True, True, False, True, True]


def test_fabric_o2_without_initialize_is_named() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[AmpkitFabricPrecision("O2", torch.float16, device="cpu")])
    model = Digits()
    with pytest.raises(RuntimeError, match=r"call model, optimizer = ampkit.initialize\(model, optimizer, 'O2', "
                                           r"dtype\) before fabric.setup"):
        fabric.setup(model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"opt_level": "O4"}, r"Unknown opt_level: 'O4'. Choose one of \['O0', 'O1', 'O2', 'O3'\]"),
        ({"opt_level": "O2", "policy": ampkit.Policy.default("cpu")}, r"policy= applies at O1 only"),
        ({"scaler": torch.amp.GradScaler("cpu")}, r"scaler=GradScaler is not an ampkit scaler"),
        ({"compression": torch.float32}, r"compression=torch.float32 is invalid: choose None, torch.float16"),
        ({"compute": "fast"}, r"Unknown compute mode: 'fast'. Choose one of \['auto', 'native', 'float32'\]"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AmpkitPrecision(**{"dtype": torch.bfloat16, "device": "cpu", **kwargs})


def test_importing_ampkit_imports_no_framework() -> None:
    code = "import sys, ampkit, ampkit.integrations; print(sorted({'lightning', 'accelerate'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_fp8_is_a_plugin_argument(tmp_path: Path) -> None:
    class Deeper(Digits):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                           torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    torch.manual_seed(0)
    model = Deeper()
    plugin = AmpkitPrecision("O1", torch.bfloat16, compute="float32", device="cpu", fp8=ampkit.Fp8Recipe())
    trainer = _trainer(plugin)
    trainer.fit(model, loader(32, 32 * STEPS))
    assert plugin.fp8_layers == {"net.1": "kept: the first linear", "net.3": "fp8",
                                 "net.5": "kept: 64x10 is not a multiple of 16"}
    assert all(torch.isfinite(torch.tensor(model.losses))) and model.net[3].amax_history[0, 0] > 0
    trainer.save_checkpoint(tmp_path / "fp8.ckpt")
    state = torch.load(tmp_path / "fp8.ckpt", weights_only=False)["state_dict"]
    assert torch.equal(state["net.3.scale"], model.net[3].scale)  # the amax state travels with the checkpoint


def _nan_loader(step: int) -> torch.utils.data.DataLoader:
    """``loader(32, 32 * STEPS)`` with a NaN in one image of batch ``step``."""
    x, y = loader(32 * STEPS, 32 * STEPS).dataset.tensors
    x = x.clone()
    x[32 * step + 3, 0] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


@pytest.mark.parametrize("plugin", [None, "O1"])
def test_the_guard_callback_skips_a_nan_batch_and_names_it(plugin: str | None, tmp_path: Path) -> None:
    """Issue 43's fault (c) under Lightning: unguarded, one NaN batch makes every weight NaN; with GuardCallback the
    step is refused (its gradients set to None before the optimizer's step), the batch named, the run goes on; the
    timeline and the picture are written at the end of fit."""
    from ampkit.integrations.lightning_guard import GuardCallback

    def fit(callbacks: list) -> Digits:
        torch.manual_seed(0)
        model = Digits()
        plugins = [AmpkitPrecision("O1", torch.bfloat16, compute="float32", device="cpu")] if plugin else []
        options = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
        L.Trainer(plugins=plugins, callbacks=callbacks, **options).fit(model, _nan_loader(2))
        return model

    unguarded = fit([])
    assert all(torch.isnan(p).any() for p in unguarded.parameters())
    callback = GuardCallback(tmp_path / "guard")
    guarded = fit([callback])
    assert all(torch.isfinite(p).all() for p in guarded.parameters())
    [event] = callback.guard.events
    assert (event.step, event.signal, event.action) == (2, "nonfinite-loss", "skipped")
    assert event.where == "the batch: its tensor 0 holds an inf or a NaN"
    assert len(callback.guard.losses) == STEPS and callback.guard.losses[3] is not None
    assert json.loads((tmp_path / "guard.json").read_text())["events"][0]["step"] == 2
    assert (tmp_path / "guard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _NoForward(L.LightningModule):
    """A LightningModule as many are written: no ``forward``, its loss in ``training_step``; a weight of it goes inf
    at ``poison_at`` (a non-finite value outside the batch)."""

    def __init__(self, poison_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))
        self.poison_at = poison_at

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self.trainer.global_step == self.poison_at:
            with torch.no_grad():
                self.net[3].weight[0, 0] = float("inf")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return {"loss": loss}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=2e-3)


def _guarded_fit(model: L.LightningModule, data: torch.utils.data.DataLoader, accumulate: int = 1,
                 **options: object) -> object:
    from ampkit.integrations.lightning_guard import GuardCallback

    callback = GuardCallback(None, **options)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
              accumulate_grad_batches=accumulate).fit(model, data)
    return callback.guard


def test_the_guard_replays_a_module_without_forward_through_its_training_step() -> None:
    """A non-finite value outside the batch in a module with no forward() killed fit with NotImplementedError (the
    replay called the module); it replays the module's training_step now, and names the layer."""
    torch.manual_seed(0)
    model = _NoForward(poison_at=2)
    guard = _guarded_fit(model, loader(32, 32 * STEPS), action="restore", keep_every=1)
    [event] = guard.events
    assert (event.step, event.signal, event.action) == (2, "nonfinite-loss", "restored step 1")
    # the GEMM reading the poisoned weight (the weight's transpose before it is a view: it computes nothing)
    assert event.where == "net.3 (addmm in forward, its inputs already non-finite)", event.where
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_guard_looks_at_every_micro_batch_of_an_accumulated_step() -> None:
    """With accumulate_grad_batches=4 only the last micro-batch was kept: a NaN in the first was "not reproduced".
    Each micro-batch is looked at (and replayed) now."""
    torch.manual_seed(0)
    guard = _guarded_fit(Digits(), _nan_loader(1), accumulate=4)  # batch 1: the second of step 0's four
    [event] = guard.events
    assert (event.step, event.signal, event.action) == (0, "nonfinite-loss", "skipped")
    assert event.where == "micro-batch 1 of 4: its tensor 0 holds an inf or a NaN", event.where


class _FlippedGradient(Digits):
    """Digits whose last linear's gradient gets every exponent bit of one value set after the backward of
    ``flip_at`` (a bit flip), where the plugin's float16 loss scaler takes it for an overflow."""

    flip_at = 2

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.flip_at:
            self.net[4].weight.grad.view(torch.int32)[1, 2] |= 0x7F800000


def test_the_guard_callback_says_a_bit_flip_the_plugins_scaler_skipped_is_transient() -> None:
    """Under AmpkitPrecision's float16 scaler a bit flip in a gradient was a skip of the scaler's, with no word: the
    callback hands the guard the scale the step's backward ran at, and the step re-run from its state at that scale is
    sound: transient."""
    from ampkit.integrations.lightning_guard import GuardCallback

    torch.manual_seed(0)
    callback = GuardCallback(None)
    plugin = AmpkitPrecision("O1", torch.float16, compute="float32", device="cpu")
    _trainer(plugin, callbacks=[callback]).fit(_FlippedGradient(), loader(32, 32 * STEPS))
    [event] = callback.guard.events
    assert (event.step, event.signal, event.action) == (2, "nonfinite-gradient", "skipped")
    assert event.where.startswith("transient: not reproduced by a replay of the batch at loss scale ")
    assert callback.guard.transients == [2] and plugin.scaler.stats.skipped == 1


def test_the_guard_callback_takes_no_scaler_and_one_optimizer() -> None:
    from ampkit.integrations.lightning_guard import GuardCallback

    with pytest.raises(ValueError, match="GuardCallback takes no scaler: the Trainer's precision plugin owns"):
        GuardCallback(scaler=ampkit.DynamicLossScaler())


class _Overflowing(L.LightningModule):
    """A module whose layer "net.2" overflows float16 from ``from_step`` to ``until_step`` (its weight times 1e5, then
    back; the LayerNorm after it holds the run)."""

    def __init__(self, from_step: int, until_step: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.Linear(32, 32),
                                       torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        self.from_step, self.until_step = from_step, until_step

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        with torch.no_grad():
            if self.trainer.global_step == self.from_step and batch_idx == self.from_step:
                self.net[2].weight.mul_(1e5)
            if self.trainer.global_step == self.until_step and batch_idx == self.until_step:
                self.net[2].weight.div_(1e5)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_lightning_run_resumed_from_its_checkpoint_has_the_guards_raised_layers_and_timeline(tmp_path: Path) -> None:
    """It remembers, in Lightning's checkpoints (issue 66's fourth item): the callback's state is the guard's; a fit
    resumed with ckpt_path has the overflowing layer raised again and the timeline it had, and ends where the
    uninterrupted fit ends, loss for loss. Before, the resumed guard started empty, the layer back in float16."""
    from ampkit.integrations.lightning_guard import GuardCallback

    def fit(epochs: int, ckpt: Path | None = None, save: Path | None = None) -> tuple[_Overflowing, GuardCallback]:
        model = _Overflowing(from_step=2, until_step=8)
        callback = GuardCallback(None, action="raise", sample_every=1, quiet_window=None)
        trainer = _trainer(AmpkitPrecision("O1", torch.float16, compute="native", device="cpu"), max_epochs=epochs,
                           callbacks=[callback])
        trainer.fit(model, loader(32, 32 * 10), ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
        return model, callback

    through, whole = fit(epochs=2)
    assert [(e.step, e.layer, e.action) for e in whole.guard.events] == [(2, "net.2", "raised to float32 and skipped")]
    first, half = fit(epochs=1, save=tmp_path / "epoch1.ckpt")
    assert half.guard.raised == {"net.2": "float32"}
    resumed_model, resumed = fit(epochs=2, ckpt=tmp_path / "epoch1.ckpt")
    assert resumed.guard.raised == {"net.2": "float32"} and resumed.guard.events == whole.guard.events
    assert resumed.guard.losses == whole.guard.losses and resumed.guard.step_count == 20
    for mine, theirs in zip(resumed_model.parameters(), through.parameters()):
        assert torch.equal(mine, theirs)


def test_the_guards_training_step_replay_leaves_the_modules_logging_as_it_was() -> None:
    """Over ranks the guard replays on the module itself, not a copy: the replay's quiet ``log`` stayed on it, and
    the run logged nothing more. The module's own ``log`` and ``log_dict`` are back after a replay."""
    from ampkit.integrations.lightning_guard import _training_step_replay

    torch.manual_seed(0)
    module = Digits()
    trainer = _trainer(AmpkitPrecision("O1", torch.bfloat16, compute="native", device="cpu"))
    loss = _training_step_replay(trainer)(module, next(iter(loader(32, 32))))
    assert loss.ndim == 0 and "log" not in module.__dict__ and "log_dict" not in module.__dict__
    assert module.log.__func__ is L.LightningModule.log
