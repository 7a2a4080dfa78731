"""ampkit on models its authors did not write: transformers' Llama and BERT, built from small configs with random
weights (nothing downloaded), and the norm classes of transformers' T5 and ConvNeXt.

O2 against what the model is for: a rotary embedding's frequencies, custom RMSNorms and the ``ModelOutput`` a
model returns (issue 39's defects: each test fails on the main that cast them to bfloat16).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput
from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

import ampkit
from ampkit.optim.kept import is_normalization, to_float32

POSITIONS = 4096


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS)
    return LlamaForCausalLM(config)


def _o2(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-kernel advice on CPUs without native bfloat16
        return ampkit.initialize(model, optimizer, "O2", dtype=torch.bfloat16, compute="native")


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_o2_keeps_the_llama_rotary_frequencies_and_rms_norms_in_float32_and_returns_float32_logits() -> None:
    """On main, O2 cast ``inv_freq`` to bfloat16 (each rotary angle then off by the position times that
    frequency's rounding), every ``LlamaRMSNorm`` to bfloat16 (not torch's class), and returned bfloat16 logits
    inside the ``CausalLMOutputWithPast``. Now the angles are float32's to the last bit at every position."""
    reference = _llama()
    model, optimizer = _o2(copy.deepcopy(reference))
    rotary, rotary32 = model.model.rotary_emb, reference.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, rotary32.inv_freq)
    positions = torch.arange(POSITIONS)[None]
    x = torch.zeros(1, POSITIONS, 64, dtype=torch.bfloat16)
    cos, sin = rotary(x, positions)
    cos32, sin32 = rotary32(x.float(), positions)
    assert torch.equal(cos, cos32.bfloat16()) and torch.equal(sin, sin32.bfloat16())
    # what a bfloat16 inv_freq does at the last position (the figure in the closing note)
    turned = (POSITIONS - 1) * (rotary32.inv_freq.bfloat16().float() - rotary32.inv_freq).abs().max().item()
    assert turned > 0.1

    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 5 and all(p.dtype == torch.float32 for m in norms for p in m.parameters())
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16

    idx = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    out, out32 = model(idx, labels=idx), reference(idx, labels=idx)
    assert isinstance(out, CausalLMOutputWithPast) and out.logits.dtype == torch.float32
    assert _rel_l2(out.logits, out32.logits) < 0.02
    out.loss.backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_o2_bert_returns_its_masked_lm_output_in_float32() -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    reference = BertForMaskedLM(config).eval()
    model, _ = _o2(copy.deepcopy(reference))
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    out, out32 = model(idx), reference(idx)
    assert isinstance(out, MaskedLMOutput) and out.logits.dtype == torch.float32
    assert _rel_l2(out.logits, out32.logits) < 0.03



def test_o2_a_custom_norm_returns_its_input_dtype_so_qwen3s_attention_runs() -> None:
    """Qwen3 normalizes each head's queries and keys (``q_norm``, ``k_norm``: RMSNorms found by behaviour, kept
    float32). On main their float32 weight promoted the bfloat16 heads to float32 and attention refused them
    beside bfloat16 values (``Expected query, key, and value to have the same dtype``). Now a kept custom norm
    returns its input's dtype, as torch's own norms do, and O2 trains as float32 does."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    reference = Qwen3ForCausalLM(config)
    model, optimizer = _o2(copy.deepcopy(reference))
    attention = model.model.layers[0].self_attn
    assert attention.q_norm.weight.dtype == torch.float32 and attention.q_proj.weight.dtype == torch.bfloat16
    seen = {}
    for name in ("q_norm", "k_norm"):
        getattr(attention, name).register_forward_hook(
            lambda module, args, out, name=name: seen.__setitem__(name, out.dtype))
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    out, out32 = model(idx, labels=idx), reference(idx, labels=idx)
    assert seen == {"q_norm": torch.bfloat16, "k_norm": torch.bfloat16}
    assert out.logits.dtype == torch.float32 and _rel_l2(out.logits, out32.logits) < 0.02
    out.loss.backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_o2_the_projections_after_a_custom_norm_share_one_16_bit_input() -> None:
    """A Llama attention's q, k and v projections read the input norm's output: one bfloat16 tensor (on main each
    cast the norm's float32 output for itself, and each saved its own copy for backward)."""
    model, _ = _o2(_llama())
    attention = model.model.layers[0].self_attn
    inputs = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(attention, name).register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0]))
    model(torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)))
    q, k, v = inputs["q_proj"], inputs["k_proj"], inputs["v_proj"]
    assert q.dtype == torch.bfloat16 and q is k and k is v


@pytest.mark.parametrize("compute", ["native", "float32"])
def test_the_recompute_planner_plans_a_qwen3_at_o2_and_keeps_its_gradients(compute: str) -> None:
    """Qwen3's grouped-query attention runs on float32 compute's generic path (a nested graph). On the tree
    before this test the planner's measurement raised there (its selective recompute context entered twice:
    torch recomputed each checkpointed block once more per generic op's backward). Now the plan fits its budget
    and the planned model's gradients are the unplanned ones, to the bit."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ampkit.diagnostics.memory import saved_bytes_of_step

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         use_cache=False)
    reference = Qwen3ForCausalLM(config)
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))

    def loss_fn(out: Any) -> torch.Tensor:
        return out.logits.float().pow(2).mean()

    grads = []
    for planned in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = ampkit.initialize(copy.deepcopy(reference), None, "O2", torch.bfloat16, compute=compute)
            if planned:
                plan = ampkit.plan_recompute(model, (idx,), 0.5, loss_fn=loss_fn, repeats=1)
                plan.apply(model)
                _, saved = saved_bytes_of_step(model, lambda: loss_fn(model(idx)))
                assert plan.segments and saved <= plan.budget_bytes
            loss_fn(model(idx)).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))

def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
                      dropout_rate=0.0)
    return T5ForConditionalGeneration(config)


def _bert() -> nn.Module:
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


@pytest.mark.parametrize("build", [_bert, _t5], ids=["bert", "t5"])
def test_o2_computes_the_loss_a_model_computes_itself_in_float32(build) -> None:  # type: ignore[no-untyped-def]
    """BERT and T5 compute their loss inside ``forward``: on main, from bfloat16 logits in bfloat16 (O2's float32
    boundary is the model's output, after the loss). Now the loss is float32's cross entropy of the logits the
    model returns, to the last bit, as under torch.autocast."""
    model, optimizer = _o2(build())
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model(idx, labels=idx)
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.float32
    assert torch.equal(out.loss, torch.nn.functional.cross_entropy(out.logits.view(-1, 128), idx.view(-1)))
    out.loss.backward()
    optimizer.step()


def test_a_compiled_o2_model_returns_its_model_output() -> None:
    """On main, compiled, O2's output boundary returned transformers' ``ModelOutput`` as a plain ``OrderedDict``
    (``out.logits`` an AttributeError): dynamo traced its ``copy()`` as a dict's."""
    model, _ = _o2(_bert())
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    out = torch.compile(model, backend="eager")(idx)
    assert type(out) is MaskedLMOutput and out.logits.dtype == torch.float32


class _Scale(nn.Module):
    """A learned per-feature scale (LayerScale): vectors of one length, yet no normalization."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((features,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class _CountingNorm(nn.Module):
    """A batch-norm-like layer that updates a buffer at every forward: the probe must put it back."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).sqrt()


def test_normalization_layers_are_found_by_behaviour_not_by_torch_class() -> None:
    found = {name: is_normalization(module) for name, module in {
        "LlamaRMSNorm": LlamaRMSNorm(16), "T5LayerNorm": T5LayerNorm(16),
        "ConvNextLayerNorm channels first": ConvNextLayerNorm(16, data_format="channels_first"),
        "nn.LayerNorm": nn.LayerNorm(16), "nn.BatchNorm2d": nn.BatchNorm2d(16), "counting": _CountingNorm(16),
        "nn.PReLU": nn.PReLU(16), "LayerScale": _Scale(16), "nn.Linear": nn.Linear(16, 16),
        "nn.Embedding": nn.Embedding(16, 16), "nn.Sequential": nn.Sequential(LlamaRMSNorm(16)),
    }.items()}
    assert found == {"LlamaRMSNorm": True, "T5LayerNorm": True, "ConvNextLayerNorm channels first": True,
                     "nn.LayerNorm": True, "nn.BatchNorm2d": True, "counting": True, "nn.PReLU": False,
                     "LayerScale": False, "nn.Linear": False, "nn.Embedding": False, "nn.Sequential": False}


def test_the_probe_runs_no_hook_and_leaves_every_buffer_as_it_was() -> None:
    norm = _CountingNorm(16)
    calls: list[object] = []
    norm.register_forward_hook(lambda *args: calls.append(args))
    assert is_normalization(norm)
    assert calls == [] and norm.seen.item() == 0


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extras: dict
    step: int = 0


def test_the_boundary_casts_16_bit_tensors_to_float32_through_any_container() -> None:
    low = torch.ones(2, dtype=torch.bfloat16)
    pair = collections.namedtuple("pair", "a b")
    value = {"out": _Output(low, {"hidden": [low, (low, 3)]}, 7), "pair": pair(low, torch.ones(2, dtype=torch.int64)),
             "model": CausalLMOutputWithPast(logits=low)}
    cast = to_float32(value)
    assert cast["out"].logits.dtype == torch.float32 and cast["out"].step == 7
    assert [t.dtype for t in (cast["out"].extras["hidden"][0], cast["out"].extras["hidden"][1][0])] == [torch.float32] * 2
    assert cast["out"].extras["hidden"][1][1] == 3
    assert type(cast["pair"]) is pair and cast["pair"].a.dtype == torch.float32 and cast["pair"].b.dtype == torch.int64
    model_out = cast["model"]
    assert type(model_out) is CausalLMOutputWithPast and model_out.logits.dtype == torch.float32
    assert model_out["logits"].dtype == model_out.to_tuple()[0].dtype == torch.float32
    assert value["model"].logits.dtype == torch.bfloat16  # the model's own output is left as it was


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_buffers_stay_float32_at_o2_only(level: str) -> None:
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ampkit.initialize(model, None, level, dtype=torch.bfloat16, compute="native")
    expected = torch.float32 if level == "O2" else torch.bfloat16
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {expected}


def _loss(out: CausalLMOutputWithPast) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


def _planned_inputs(architecture: str) -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(1)
    if architecture == "t5":
        return _t5(), (torch.randint(0, 128, (2, 16), generator=g), None, torch.randint(0, 128, (2, 8), generator=g))
    return (_llama() if architecture == "llama" else _gpt2()), (torch.randint(0, 128, (2, 32), generator=g),)


@pytest.mark.parametrize("architecture", ["llama", "t5"])
def test_the_planner_refuses_a_block_that_takes_a_key_value_cache_naming_it_and_the_fix(architecture: str) -> None:
    """A cache appends at every call: a block replayed on it attends over the first run's keys too (on main,
    'Trying to backward through the graph a second time' on GPT-2, whose config keeps a cache by default, and a
    ``CheckpointError`` on T5). T5's decoder keeps its own copy of the config: the fix names it."""
    model, inputs = _planned_inputs(architecture)
    model.config.use_cache = architecture == "llama"  # T5: off in the model's config, on in its decoder's copy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    block, cache = ("model.layers.0", "DynamicCache") if architecture == "llama" else ("decoder.block.0",
                                                                                       "EncoderDecoderCache")
    with pytest.raises(ValueError, match=rf"Block '{block}' takes a {cache} .*model\.config\.use_cache = False.*"
                                         r"model\.decoder\.config\.use_cache = False"):
        ampkit.plan_recompute(model, inputs, 0.5, loss_fn=_loss, repeats=1)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def _with_linears(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each ``Conv1D`` swapped for the ``nn.Linear`` it computes (the weight's transpose):
    the reference a converted ``Conv1D`` must match."""
    from transformers.pytorch_utils import Conv1D

    reference = copy.deepcopy(model)
    for name, module in list(reference.named_modules()):
        if isinstance(module, Conv1D):
            linear = nn.Linear(*module.weight.shape)
            with torch.no_grad():
                linear.weight.copy_(module.weight.t())
                linear.bias.copy_(module.bias)
            reference.set_submodule(name, linear)
    return reference


@pytest.mark.parametrize("convert", ["fp8", "block-scaled"])
def test_conversions_convert_gpt2s_conv1d_projections_as_the_linears_they_are(convert: str) -> None:
    """On main, ``convert_to_fp8`` converted none of GPT-2's 8 ``Conv1D`` projections and
    ``convert_to_block_scaled`` only the tied head. Now each is converted on its own Parameter, in its own
    (transposed) layout, and computes what the same format gives the ``nn.Linear`` it stands for."""
    model = _gpt2()
    reference = _with_linears(model)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    parameters = list(model.parameters())

    def converted(m: nn.Module) -> dict[str, str]:
        if convert == "fp8":
            return ampkit.convert_to_fp8(m, include=["lm_head"])
        return ampkit.convert_to_block_scaled(m, ampkit.BlockScaledRecipe("mxfp8", keep_first_last=False))

    decisions, expected = converted(model), converted(reference)
    assert decisions == expected
    projections = [n for n, m in _gpt2().named_modules() if type(m).__name__ == "Conv1D"]
    chosen = "fp8" if convert == "fp8" else "block-scaled"
    assert len(projections) == 8 and sum(decisions[n] == chosen for n in projections) >= 7
    assert all(getattr(model.get_submodule(n), "transposed", False) for n in projections if decisions[n] == chosen)
    assert list(model.parameters()) == parameters  # the same Parameter objects: an optimizer keeps working
    assert all(v.shape == shapes[k] for k, v in model.state_dict().items() if k in shapes)  # GPT-2's layout

    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    out, out_reference = (torch.manual_seed(2) and m(idx, labels=idx) for m in (model, reference))  # one dropout
    out.loss.backward()
    out_reference.loss.backward()
    torch.testing.assert_close(out.logits, out_reference.logits, rtol=1e-5, atol=1e-5)
    for name in projections:
        grad, grad_reference = model.get_submodule(name).weight.grad, reference.get_submodule(name).weight.grad
        torch.testing.assert_close(grad, grad_reference.t(), rtol=1e-4, atol=1e-6)


class _Bilinear(nn.Module):
    """A linear-like leaf (a 2-D weight) that no format converts."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_tune_chooses_for_conv1d_layers_and_names_the_linear_like_layers_it_leaves() -> None:
    """On main, tune on a model with transformers' ``Conv1D`` projections returned a plan of its nn.Linear layers
    alone and said nothing of the rest."""
    from transformers.pytorch_utils import Conv1D

    from ampkit.experiment.models import GPT

    torch.manual_seed(0)
    model = GPT(d_model=32, n_layers=2, n_heads=2, context=16)
    model.blocks[0].mlp[0] = Conv1D(model.blocks[0].mlp[0].out_features, 32)  # GPT-2's layout of one projection
    model.blocks[1].mlp.insert(0, _Bilinear())
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 256, (8, 17), generator=g) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"leaves 1 other linear-like layer.*_Bilinear.*\['blocks\.1\.mlp\.0'\]"):
        plan = ampkit.tune(model, [(w[:, :-1], w[:, 1:]) for w in windows], formats=("fp8", "bf16"),
                           objective="memory")
    layer = next(layer for layer in plan.layers if layer.name == "blocks.0.mlp.0")
    assert layer.shape == (32, model.blocks[0].mlp[0].nf) and "fp8" in layer.loss_change


def test_find_nonfinite_skips_the_infinity_t5_discards_and_finds_an_overflow_in_its_decoder() -> None:
    """T5's relative position buckets take ``log(0)`` and a ``torch.where`` drops it: on main, find_nonfinite
    always named that ``log``, so an overflow planted in a decoder layer under float16 was never reported."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 128, (2, 16), generator=g), None, torch.randint(0, 128, (2, 8), generator=g))
    policy = ampkit.Policy.default("cpu", torch.float16, compute="native")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ampkit.find_nonfinite(model, inputs, policy=policy) is None
        with torch.no_grad():
            model.decoder.block[0].layer[-1].DenseReluDense.wo.weight.mul_(1e6)  # beyond float16's range
        finding = ampkit.find_nonfinite(model, inputs, policy=policy, backward=False)
    assert finding is not None and finding.module == "decoder.block.0.layer.2.DenseReluDense.wo"
    assert finding.phase == "forward" and finding.finite_inputs


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gpt2", "bert"])
def test_compare_trains_a_transformers_architecture_named_on_the_command_line(architecture: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``ampkit compare --model hf:<architecture>``: a small model of that family from its config, random weights,
    on the text data, float32 beside bf16 O2 (3 steps here; 200 by default)."""
    import json

    from ampkit.cli.main import main

    out = tmp_path / "run"
    argv = ["compare", "--model", f"hf:{architecture}", "--precision", "bf16", "--opt-level", "O2", "--steps", "3",
            "--batch-size", "4", "--quiet", "--no-probe", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    runs = {run["label"]: run for run in results["runs"]}
    assert len(runs) == 2 and all(len(run["losses"]) == 3 for run in runs.values())
    assert results["config"]["data"] == "text"


def test_an_unknown_transformers_architecture_is_refused_naming_the_choices(capsys) -> None:  # type: ignore[no-untyped-def]
    from ampkit.cli.main import main

    assert main(["compare", "--model", "hf:mamba", "--quiet"]) == 2
    assert "Unknown transformers architecture 'hf:mamba'. Choose one of ['hf:llama'" in capsys.readouterr().err


def test_sizes_are_set_in_the_name_and_travel_with_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--model hf:<architecture>,d_model=N,n_layers=N,n_heads=N``: the sizes travel in the name, so the run's
    record says what was trained and the defaults (text data, steps) still apply."""
    import json

    from ampkit.cli.main import main
    from ampkit.experiment.models import build

    model = build("hf:llama,d_model=32,n_layers=3,n_heads=2", vocab_size=96, context=16).model
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.num_attention_heads) == (32, 3, 2)
    assert len(model.model.layers) == 3 and model.lm_head.weight.shape == (96, 32)
    gpt2 = build("hf:gpt2,n_layers=1", vocab_size=96, context=16).model
    assert (gpt2.config.n_embd, gpt2.config.n_layer, gpt2.config.n_head) == (64, 1, 4)

    out = tmp_path / "run"
    spec = "hf:qwen2,d_model=32,n_layers=1,n_heads=2"
    assert main(["compare", "--model", spec, "--precision", "bf16", "--opt-level", "O1", "--steps", "2",
                 "--batch-size", "4", "--quiet", "--no-probe", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["model"] == spec and results["config"]["data"] == "text"


@pytest.mark.parametrize(("spec", "message"), [
    ("hf:llama,width=32", r"Unknown size 'width' in 'hf:llama,width=32'. Choose from \['d_model', 'n_layers', "
                          r"'n_heads'\], e\.g\. hf:llama,d_model=128"),
    ("hf:llama,n_layers=0", r"n_layers='0' in 'hf:llama,n_layers=0' is invalid: a positive integer"),
    ("hf:llama,d_model=30,n_heads=4", r"d_model=30 in .* is not a multiple of n_heads=4"),
    ("hf:llama,d_model=64,d_model=32", r"d_model is given twice in 'hf:llama,d_model=64,d_model=32': give each size "
                                       r"once"),  # the last one won
    ("hf:llama,d_model=12,n_heads=4", r"give heads of 3 features: llama's rotary embeddings turn pairs of them, so a "
                                      r"head needs an even width"),  # failed deep inside the model
    ("hf:mamba,d_model=32", r"Unknown transformers architecture 'hf:mamba'. Choose one of \['hf:llama'"),
])
def test_a_wrong_size_is_refused_naming_the_choices(spec: str, message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    from ampkit.cli.main import main
    from ampkit.experiment.hf_models import parse

    with pytest.raises(ValueError, match=message):
        parse(spec)
    assert main(["compare", "--model", spec, "--quiet"]) == 2
    assert re.search(message, capsys.readouterr().err)

