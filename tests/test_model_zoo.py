"""Every ampkit feature on a small zoo of models its authors did not write (issue 39): transformers' Llama, GPT-2,
BERT, T5, ViT and ConvNeXt, each built from a small config with random weights (nothing downloaded), each feature
against its own reference: torch.autocast, the float32 run, the unplanned step, the unconverted model.

(timm is not in the zoo: it imports torchvision, whose registry build does not load beside the CPU torch wheel.)
The defects the zoo found have their own tests in ``test_real_models.py``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.formats.recipes import linear_layers

transformers = pytest.importorskip("transformers")
BF16 = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
VOCAB, CLASSES = 128, 10


class Case(NamedTuple):
    model: nn.Module
    inputs: tuple
    loss: Callable[[Any], torch.Tensor]  # the model's output -> a float32 loss


def _ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _next_tokens(idx: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda out: F.cross_entropy(out.logits[:, :-1].float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def _classes(out: Any) -> torch.Tensor:
    return F.cross_entropy(out.logits.float(), torch.arange(2) % CLASSES)


def _llama() -> Case:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    idx = _ids(2, 32)
    return Case(transformers.LlamaForCausalLM(config), (idx,), _next_tokens(idx))


def _gpt2() -> Case:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    idx = _ids(2, 32)
    return Case(transformers.GPT2LMHeadModel(config), (idx,), _next_tokens(idx))


def _bert() -> Case:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    idx = _ids(2, 32)
    return Case(transformers.BertForMaskedLM(config),
                (idx,), lambda out: F.cross_entropy(out.logits.float().reshape(-1, VOCAB), idx.reshape(-1)))


def _t5() -> Case:
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, dropout_rate=0.0, use_cache=False)
    model = transformers.T5ForConditionalGeneration(config)
    model.decoder.config.use_cache = False  # the decoder keeps its own copy of the config
    source, target = _ids(2, 16), _ids(2, 16, seed=2)
    return Case(model, (source, None, target), _next_tokens(target))


def _vit() -> Case:
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, num_labels=CLASSES,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Case(transformers.ViTForImageClassification(config), (_images(),), _classes)


def _convnext() -> Case:
    config = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[32, 64], depths=[1, 1],
                                         num_labels=CLASSES, image_size=32)
    return Case(transformers.ConvNextForImageClassification(config), (_images(),), _classes)


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


ZOO: dict[str, Callable[[], Case]] = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "t5": _t5, "vit": _vit,
                                      "convnext": _convnext}


@pytest.fixture(params=list(ZOO))
def case(request: pytest.FixtureRequest) -> Case:
    torch.manual_seed(0)
    return ZOO[request.param]()


def _step(case: Case, model: nn.Module | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One forward and backward: the loss and the gradients (cleared after)."""
    model = case.model if model is None else model
    loss = case.loss(model(*case.inputs))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_the_default_policy_gives_torch_autocasts_loss_and_gradients_bit_for_bit(case: Case) -> None:
    with ampkit.autocast(BF16):
        loss, grads = _step(case)
    with torch.autocast("cpu", torch.bfloat16):
        reference, reference_grads = _step(case)
    assert torch.equal(loss, reference)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, reference_grads))


def _train(case: Case, level: str | None, dtype: torch.dtype = torch.bfloat16, steps: int = 4) -> list[float]:
    """The loss after each number of optimizer steps taken, 0 to ``steps`` - 1: a float16 step that the loss
    scaler skips (its first scales overflow) trains nothing, so its loss is not counted twice."""
    model = copy.deepcopy(case.model)
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ampkit.DynamicLossScaler(enabled=dtype == torch.float16)
    if level is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the slow-kernel advice on CPUs without native 16-bit GEMMs
            model, optimizer = ampkit.initialize(model, optimizer, level, dtype=dtype, compute="native")
    losses: dict[int, float] = {}
    for _ in range(4 * steps):
        loss = case.loss(model(*case.inputs))
        losses.setdefault(len(losses), loss.item())
        scaler.scale(loss).backward()
        if not scaler.step(optimizer):
            del losses[len(losses) - 1]
        scaler.update()
        optimizer.zero_grad()
        if len(losses) == steps:
            break
    return list(losses.values())


@pytest.mark.parametrize(("level", "dtype"), [("O1", torch.bfloat16), ("O2", torch.bfloat16),
                                              ("O2", torch.float16)], ids=["bf16-O1", "bf16-O2", "fp16-O2"])
def test_opt_levels_train_as_float32_does(case: Case, level: str, dtype: torch.dtype) -> None:
    """Four steps at the same learning rate: the loss goes down as float32's does and ends within 5% of it."""
    reference = _train(case, None)
    losses = _train(case, level, dtype)
    assert len(losses) == len(reference) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] and reference[-1] < reference[0]
    assert abs(losses[-1] - reference[-1]) <= 0.05 * reference[-1]


def test_the_recompute_planner_predicts_the_measured_bytes_and_keeps_the_gradients(case: Case) -> None:
    """On main, ``plan_recompute`` replayed each block with its positional inputs only: a Llama decoder layer,
    which takes its rotary ``position_embeddings`` by keyword, failed (``cannot unpack non-iterable NoneType``),
    and T5's decoder blocks, replayed on their cache, with checkpoint's ``CheckpointError``. Now the blocks
    transformers' own gradient checkpointing wraps are planned, their bytes predicted exactly, the gradients the
    unplanned step's bit for bit."""
    from ampkit.diagnostics.memory import saved_bytes_of_step

    plan = ampkit.plan_recompute(case.model, case.inputs, 0.5, loss_fn=case.loss, repeats=1)
    assert plan.segments and plan.planned_bytes <= plan.budget_bytes
    planned = copy.deepcopy(case.model)
    plan.apply(planned)
    loss, measured = saved_bytes_of_step(planned, lambda: case.loss(planned(*case.inputs)))
    assert measured == plan.planned_bytes
    loss.backward()
    reference, grads = _step(case)
    assert torch.equal(loss, reference)
    assert all(g is None or torch.equal(g, p.grad) for g, p in zip(grads, planned.parameters()))


@pytest.mark.parametrize("convert", ["fp8", "mxfp8"])
def test_narrow_formats_convert_the_linears_and_stay_near_the_16_bit_model(case: Case, convert: str) -> None:
    """Every nn.Linear and Conv1D that fits is converted (none is left unnamed) and the loss stays within 5% of
    the bfloat16 model's."""
    with ampkit.autocast(BF16):
        reference = case.loss(case.model(*case.inputs)).item()
    model = copy.deepcopy(case.model)
    if convert == "fp8":
        decisions = ampkit.convert_to_fp8(model)
    else:
        decisions = ampkit.convert_to_block_scaled(model, ampkit.BlockScaledRecipe("mxfp8"))
    chosen = "fp8" if convert == "fp8" else "block-scaled"
    assert sum(d == chosen for d in decisions.values()) >= 3
    assert all(d == chosen or d.startswith("kept: ") for d in decisions.values())
    with ampkit.autocast(BF16):
        loss = case.loss(model(*case.inputs))
    loss.backward()
    assert abs(loss.item() - reference) <= 0.05 * reference
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_find_nonfinite_finds_nothing_in_the_healthy_model(case: Case) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ampkit.find_nonfinite(case.model, case.inputs, policy=BF16, backward=False) is None


@pytest.mark.slow
def test_a_module_override_compiles_once_and_gives_eagers_result(case: Case) -> None:
    """The model compiled under a policy that runs its last linear in float32: one set of graphs over 3 steps,
    the eager override's loss to the last bit."""
    from torch._dynamo.testing import CompileCounter

    last = [name for name, m in case.model.named_modules() if isinstance(m, nn.Linear)][-1]
    policy = BF16.with_modules(last, dtype=torch.float32)
    with ampkit.autocast(policy, model=case.model):
        eager, _ = _step(case)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(case.model, backend=counter)
    graphs = []
    for _ in range(3):
        with ampkit.autocast(policy, model=case.model):
            loss, _ = _step(case, compiled)
        graphs.append(counter.frame_count)
    assert graphs == [graphs[0]] * 3
    assert torch.equal(loss, eager)


class _Positional(nn.Module):
    """``model`` called on a tuple of positional inputs (tune gives a model one input per batch)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: tuple) -> Any:
        return self.model(*inputs)


def test_tune_makes_a_plan_that_applies(case: Case) -> None:
    model = _Positional(case.model)
    linears = [name for name, _ in linear_layers(model)]  # nn.Linear and GPT-2's Conv1D
    batches = [(case.inputs, None)] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ampkit.tune(model, batches, formats=("fp8", "bf16"), loss_fn=lambda out, _: case.loss(out),
                           objective="memory")
    assert [layer.name for layer in plan.layers] == linears
    lowered = plan.apply(copy.deepcopy(model))
    assert sum(type(m).__name__ == "Fp8Linear" for m in lowered.modules()) == len(plan.lowered())
