"""The training loop's contract (``test_training_contract.py``) where a framework runs the loop: transformers'
Trainer (with ``install_scaler``), Accelerate (``ampkit.integrations.accelerate.prepare``), Lightning
(``AmpkitPrecision``) and Fabric (``AmpkitFabricPrecision``), each clipping as its users ask it to
(``max_grad_norm``, ``accelerator.clip_grad_norm_``, ``gradient_clip_val``, ``fabric.clip_gradients``). Each runs
one clipped step beside the same framework in float32: the norm it reports (where it reports one) and the update
must be float32's within the format's rounding. Issue 64 found at O2: the Trainer logged 9.2e4 (fp16) and clipped
nothing the step used, Accelerate reported 4.6e4 and updated 0.70 for 0.01, Lightning and Fabric updated 0.70.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from test_training_contract import DTYPES, TOLERANCE, X, Y, _distance, _model, _weights

CLIP, LR = 0.05, 20.0  # the float32 gradients' norm is about 0.32: the clip bites, the update is 1.0
FRAMEWORK_LEVELS = ["O1", "O2", "O3"]
CASES = [pytest.param(level, dtype, id=f"{level}-{dtype}") for level in FRAMEWORK_LEVELS for dtype in DTYPES]


def _check(level: str | None, dtype: str, run: Any) -> None:
    """``run(level, dtype)`` returns (the model after one clipped step, the norm reported or None)."""
    before = _weights(_model())
    reference, true_norm = run(None, dtype)
    mixed, reported = run(level, dtype)
    if true_norm is not None:
        assert reported == pytest.approx(true_norm, rel=TOLERANCE[dtype])
    float32_update = _distance(_weights(reference), before)
    assert float32_update == pytest.approx(LR * CLIP, rel=1e-3)
    assert _distance(_weights(mixed), _weights(reference)) < TOLERANCE[dtype] * float32_update


class _Net(nn.Module):
    """The contract's MLP as transformers' Trainer wants a model: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


class _Batch(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(Y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": X[i], "labels": Y[i]}


def _trainer(level: str | None, dtype: str, tmp_path: Any) -> tuple[nn.Module, float]:
    transformers = pytest.importorskip("transformers")
    from ampkit.integrations.accelerate import install_scaler

    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if level is not None:
            model, optimizer = ampkit.initialize(model, optimizer, level, DTYPES[dtype], compute="native")
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=64,
                                              max_grad_norm=CLIP, learning_rate=LR, use_cpu=True, report_to=[],
                                              logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Batch(), optimizers=(optimizer, None))
        if level is not None and dtype == "fp16":
            install_scaler(trainer.accelerator, ampkit.DynamicLossScaler())
        trainer.train()
    logged = next(entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry)
    return model.net, float(logged)


@pytest.mark.parametrize("level, dtype", CASES)
def test_the_trainers_max_grad_norm_clips_what_the_step_uses(level: str, dtype: str, tmp_path: Any) -> None:
    _check(level, dtype, lambda lv, dt: _trainer(lv, dt, tmp_path / str(lv)))


def _accelerate(level: str | None, dtype: str) -> tuple[nn.Module, float]:
    accelerate = pytest.importorskip("accelerate")
    from ampkit.integrations.accelerate import prepare

    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if level is None:
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            model, optimizer = prepare(accelerator, model, optimizer, opt_level=level, dtype=DTYPES[dtype],
                                       compute="native")
    accelerator.backward(F.cross_entropy(model(X).float(), Y))
    norm = float(accelerator.clip_grad_norm_(model.parameters(), CLIP))
    optimizer.step()
    return model, norm


@pytest.mark.parametrize("level, dtype", CASES)
def test_accelerates_clip_grad_norm_clips_what_the_step_uses(level: str, dtype: str) -> None:
    _check(level, dtype, _accelerate)


def _lightning_fit(level: str | None, dtype: str, configure: Any, load: Any = None, **options: Any) -> tuple[Any, Any]:
    """A LightningModule around the contract's MLP, fitted by a Trainer with ``options`` at ``level`` (None:
    float32), its optimizers from ``configure(module)``; the module and the Trainer."""
    L = pytest.importorskip("lightning")
    from ampkit.integrations.lightning import AmpkitPrecision

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x).float(), y)

        def configure_optimizers(self) -> Any:
            return configure(self)

    module = Module()
    precision: dict[str, Any] = (
        {"precision": "32-true"} if level is None
        else {"plugins": [AmpkitPrecision(level, DTYPES[dtype], compute="native", device="cpu")]})
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **precision, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=64),
                    ckpt_path=str(load) if load is not None else None)
    return module, trainer


def _lightning(level: str | None, dtype: str) -> tuple[nn.Module, None]:
    module, _ = _lightning_fit(level, dtype, lambda m: torch.optim.SGD(m.parameters(), lr=LR), max_steps=1,
                               gradient_clip_val=CLIP)
    return module.net, None  # Lightning reports no norm


@pytest.mark.parametrize("level, dtype", CASES)
def test_lightnings_gradient_clip_val_clips_what_the_step_uses(level: str, dtype: str) -> None:
    _check(level, dtype, _lightning)


def _fabric_setup(level: str | None, dtype: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """A Fabric at ``level`` (None: float32) and ``model`` and ``optimizer`` set up by it (at O2 initialized first,
    the plugin's documented order: Fabric gives it no hook to make the masters): (fabric, model, optimizer)."""
    L = pytest.importorskip("lightning")
    from ampkit.integrations.lightning import AmpkitFabricPrecision

    if level is None:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    else:
        fabric = L.Fabric(accelerator="cpu", devices=1,
                          plugins=[AmpkitFabricPrecision(level, DTYPES[dtype], compute="native", device="cpu")])
        if level == "O2":
            model, optimizer = ampkit.initialize(model, optimizer, "O2", DTYPES[dtype], compute="native")
    return (fabric, *fabric.setup(model, optimizer))


def _fabric(level: str | None, dtype: str) -> tuple[nn.Module, float]:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric, wrapped, optimizer = _fabric_setup(level, dtype, model, torch.optim.SGD(model.parameters(), lr=LR))
        fabric.backward(F.cross_entropy(wrapped(X).float(), Y))
        norm = float(fabric.clip_gradients(wrapped, optimizer, max_norm=CLIP))
        optimizer.step()
    return model, norm


@pytest.mark.parametrize("level, dtype", CASES)
def test_fabrics_clip_gradients_clips_what_the_step_uses(level: str, dtype: str) -> None:
    _check(level, dtype, _fabric)


# ---------------------------------------------------------------------------
# A scheduler built first, a float32 run resumed at O2, a save and load at O2: in each framework, beside float32.
# O2 is the level with a second copy of the weights (the masters): O1 and O3 step the model's own parameters.

STEPS = 3


def _scheduled(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (eps above the gradients' size: see test_training_contract._adamw) and a halving LambdaLR on it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, eps=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)


def _fresh_accelerate() -> None:
    """Accelerate keeps process-wide states (the Trainer's runs through it too): reset as its own tests do, so
    that a run does not inherit the last one's gradient-sync settings."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerate_run(level: str | None, dtype: str, steps: int, save: Any = None, load: Any = None
                    ) -> tuple[dict[str, torch.Tensor], float]:
    accelerate = pytest.importorskip("accelerate")
    from ampkit.integrations.accelerate import prepare

    _fresh_accelerate()
    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    optimizer, scheduler = _scheduled(model)  # built before prepare (and the initialize inside it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if level is None:
            model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        else:
            model, optimizer, scheduler = prepare(accelerator, model, optimizer, scheduler, opt_level=level,
                                                  dtype=DTYPES[dtype], compute="native")
        if load is not None:
            accelerator.load_state(load)
        for _ in range(steps):
            accelerator.backward(F.cross_entropy(model(X).float(), Y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if save is not None:
            accelerator.save_state(save)
    return _weights(model), scheduler.get_last_lr()[0]


def _trainer_run(level: str | None, dtype: str, steps: int, folder: Any,
                 resume: Any = None) -> tuple[dict[str, torch.Tensor], float]:
    transformers = pytest.importorskip("transformers")
    from ampkit.integrations.accelerate import install_scaler

    _fresh_accelerate()
    model = _Net()
    optimizer, scheduler = _scheduled(model)  # built before initialize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if level is not None:
            model, optimizer = ampkit.initialize(model, optimizer, level, DTYPES[dtype], compute="native")
        args = transformers.TrainingArguments(output_dir=str(folder), max_steps=steps, per_device_train_batch_size=64,
                                              use_cpu=True, report_to=[], save_strategy="steps", save_steps=2,
                                              disable_tqdm=True, seed=0, data_seed=0, max_grad_norm=1e9)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Batch(),
                                       optimizers=(optimizer, scheduler))
        if level is not None and dtype == "fp16":
            install_scaler(trainer.accelerator, ampkit.DynamicLossScaler())
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return _weights(model.net), scheduler.get_last_lr()[0]


def _fabric_run(level: str | None, dtype: str, steps: int, save: Any = None, load: Any = None
                ) -> tuple[dict[str, torch.Tensor], float]:
    model = _model()
    optimizer, scheduler = _scheduled(model)  # built before initialize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric, wrapped, optimizer = _fabric_setup(level, dtype, model, optimizer)
        if load is not None:
            fabric.load(load, {"model": wrapped, "optimizer": optimizer, "scheduler": scheduler})
        for _ in range(steps):
            fabric.backward(F.cross_entropy(wrapped(X).float(), Y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if save is not None:
            fabric.save(save, {"model": wrapped, "optimizer": optimizer, "scheduler": scheduler})
    return _weights(model), scheduler.get_last_lr()[0]


def _lightning_run(level: str | None, dtype: str, steps: int, save: Any = None, load: Any = None
                   ) -> tuple[dict[str, torch.Tensor], float]:
    def configure(module: nn.Module) -> Any:
        optimizer, scheduler = _scheduled(module)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module, trainer = _lightning_fit(level, dtype, configure, load=load, max_steps=steps)
    if save is not None:
        trainer.save_checkpoint(save)
    return _weights(module.net), trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]


def _close(mixed: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], dtype: str) -> None:
    moved = _distance(reference, _weights(_model()))
    assert _distance(mixed, reference) < 2 * TOLERANCE[dtype] * moved


FRAMEWORK_RUNS = ["accelerate", "trainer", "lightning", "fabric"]


def _after(framework: str, saved_at: int) -> int:
    """The ``steps`` a run resumed at step ``saved_at`` takes to end at ``STEPS``: the Trainer and Lightning count
    their steps from the start, a loop of Accelerate's or Fabric's from the resume."""
    return STEPS - saved_at if framework in ("accelerate", "fabric") else STEPS


def _run(framework: str, level: str | None, dtype: str, steps: int, tmp_path: Any, save: bool = False,
         load: Any = None) -> tuple[dict[str, torch.Tensor], float, Any]:
    """``framework``'s run of ``steps`` steps (after resuming from ``load``): the model's state dict as the run
    ends (at O2 the masters: taken while its optimizer lives, which holds them), the learning rate, and where it
    saved, when ``save``."""
    where = tmp_path / f"{framework}-{level}-{dtype}-{steps}-{'load' if load else 'fresh'}"
    if framework == "trainer":  # saves every 2 steps by itself; resumes from its checkpoint folder
        model, lr = _trainer_run(level, dtype, steps, where, load)
        return model, lr, where / "checkpoint-2"
    target = where if framework == "accelerate" else where.with_suffix(".ckpt")
    run = {"accelerate": _accelerate_run, "lightning": _lightning_run, "fabric": _fabric_run}[framework]
    model, lr = run(level, dtype, steps, save=target if save else None, load=load)
    return model, lr, target


@pytest.mark.parametrize("framework", FRAMEWORK_RUNS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_scheduler_built_first_drives_the_o2_step_in_each_framework(framework: str, dtype: str,
                                                                      tmp_path: Any) -> None:
    reference, reference_lr, _ = _run(framework, None, dtype, STEPS, tmp_path)
    mixed, lr, _ = _run(framework, "O2", dtype, STEPS, tmp_path)
    assert lr == reference_lr == 0.5 * 0.5**STEPS
    _close(mixed, reference, dtype)


@pytest.mark.parametrize("framework", FRAMEWORK_RUNS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_float32_runs_checkpoint_resumes_at_o2_from_its_trained_weights_in_each_framework(
        framework: str, dtype: str, tmp_path: Any) -> None:
    _, _, saved = _run(framework, None, dtype, 2, tmp_path, save=True)
    resumed, _, _ = _run(framework, "O2", dtype, _after(framework, 2), tmp_path, load=saved)
    reference, _, _ = _run(framework, None, dtype, STEPS, tmp_path / "reference")
    _close(resumed, reference, dtype)  # the masters were the fresh model's: the trained weights were lost


@pytest.mark.parametrize("framework", FRAMEWORK_RUNS)
def test_an_o2_run_saved_and_loaded_continues_bit_for_bit_in_each_framework(framework: str, tmp_path: Any) -> None:
    uninterrupted, _, _ = _run(framework, "O2", "bf16", STEPS, tmp_path / "whole")
    _, _, saved = _run(framework, "O2", "bf16", 2, tmp_path, save=True)
    resumed, _, _ = _run(framework, "O2", "bf16", _after(framework, 2), tmp_path, load=saved)
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
