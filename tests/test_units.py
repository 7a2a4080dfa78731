"""Which modules fully_shard makes FSDP2 units, the shared weights it refuses, and what it refuses first (no process
group needed, or one of this process alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampkit.distributed.units import check_units, kept_units, shard_blocks
from ampkit.experiment.models import GPT, MLP, ResNet18
from ampkit.modes import OPT_LEVELS

O1, O2 = OPT_LEVELS["O1"], OPT_LEVELS["O2"]


def test_the_default_blocks_are_the_children_of_containers_outermost_first() -> None:
    assert [n for n, _ in shard_blocks(GPT(n_layers=3), None)] == ["blocks.0", "blocks.1", "blocks.2"]
    resnet = shard_blocks(ResNet18(), None)  # the shortcut Sequentials inside the blocks are not chosen again
    assert [(n, type(m).__name__) for n, m in resnet] == [(f"layers.{i}", "BasicBlock") for i in range(8)]
    sequential = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert [n for n, _ in shard_blocks(sequential, None)] == ["0", "2"]  # the ReLU holds nothing to shard
    assert [n for n, _ in shard_blocks(MLP(), [nn.Linear])] == [n for n, m in MLP().named_modules()
                                                               if isinstance(m, nn.Linear)]


def test_o2_keeps_every_norm_and_the_kept_types_as_units_of_their_own() -> None:
    model = GPT(n_layers=2)
    assert [n for n, _ in kept_units(model, O2, ())] == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1",
                                                         "blocks.1.ln2", "ln_f"]
    assert kept_units(model, O1, ()) == []
    assert [n for n, _ in kept_units(model, O2, (nn.Embedding,))][:2] == ["tok", "pos"]


def test_a_weight_shared_across_units_is_refused_by_name() -> None:
    model = GPT(n_layers=2)  # its head is tied to the token embedding: both at the root, fine
    check_units(model, shard_blocks(model, None), kept_units(model, O2, ()))
    with pytest.raises(ValueError, match="'lm_head.weight' is shared between 'tok' and 'the root'"):
        check_units(model, shard_blocks(model, None), kept_units(model, O2, (nn.Embedding,)))
    model.blocks[1].mlp[0].weight = model.blocks[0].mlp[0].weight  # tied across two blocks
    with pytest.raises(ValueError, match="'blocks.1.mlp.0.weight' is shared between 'blocks.0' and 'blocks.1'"):
        check_units(model, shard_blocks(model, None), [])


def test_blocks_that_match_nothing_or_are_not_module_types_are_refused() -> None:
    with pytest.raises(ValueError, match=r"blocks=\['Conv2d'\] matches no module"):
        shard_blocks(GPT(), [nn.Conv2d])
    with pytest.raises(ValueError, match="must list nn.Module subclasses"):
        shard_blocks(GPT(), ["Block"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must list nn.Module subclasses"):
        shard_blocks(GPT(), [])


class _WithScale(nn.Module):  # a logit scale, as CLIP's: a 0-d parameter
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.tensor(2.0))


@pytest.mark.parametrize("arguments, message", [
    ({"opt_level": "O3", "dtype": torch.bfloat16}, r"0-d parameters \(scale\), which FSDP2 cannot shard.*1-d"),
    ({"blocks": nn.Linear}, r"blocks=Linear is one type: pass a list of block types, blocks=\[Linear\]"),
    ({"reshard_after_forward": "yes"}, r"reshard_after_forward='yes' is not a bool"),
    ({"opt_level": "O2", "keep_float32": nn.Embedding}, r"keep_float32=Embedding is one type: pass a list"),
])
def test_what_torchs_fully_shard_refuses_part_way_is_refused_first_and_nothing_changes(
        arguments: dict, message: str) -> None:
    """On main, torch refused a 0-d parameter (and a bad reshard_after_forward) after the blocks before it were
    sharded, and at O3 cast: the model was left half-applied. blocks=nn.Linear gave a TypeError traceback."""
    from ampkit.distributed import fully_shard

    model = _WithScale() if "dtype" in arguments else nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        fully_shard(model, **arguments)  # refused before it asks for a process group
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: d for n, (d, _) in before.items()}
    assert all(torch.equal(p, before[n][1]) for n, p in model.named_parameters())
    assert getattr(model, "_ampkit_opt_level", None) is None


@pytest.mark.parametrize("then, message", [
    ("fp8", r"convert_to_fp8 takes the model before FSDP2 shards it, and this one is sharded .* first, then "
            r"ampkit.distributed.fully_shard"),
    ("block_scaled", r"convert_to_block_scaled takes the model before FSDP2 shards it"),
    ("plan", r"PrecisionPlan.apply takes the model before FSDP2 shards it"),
    ("initialize", r"sharded by ampkit.distributed.fully_shard at O1, which applied that opt level: initialize is "
                   r"not called on it. For another level, shard the float32 model with fully_shard\(model, "
                   r"opt_level='O2'\)"),
])
def test_what_takes_the_model_before_sharding_says_so_on_a_sharded_one(one_rank: object, then: str,
                                                                      message: str) -> None:
    """On main: "No linear of FSDPSequential can take mxfp8-floor: {}", FP8 layers swapped into FSDP2's units
    silently, a plan's "This plan was made for another model", and "initialized at O1 already" for a model
    fully_shard had sharded."""
    import warnings

    import ampkit
    from ampkit.distributed import fully_shard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fully_shard(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)))
    plan = ampkit.PrecisionPlan("model", "any", "bf16", "time", 0.01, (), 0.0, 0.0, (), 0.0, False, 0.0)
    act = {"fp8": lambda: ampkit.convert_to_fp8(model), "block_scaled": lambda: ampkit.convert_to_block_scaled(model),
           "plan": lambda: plan.apply(model), "initialize": lambda: ampkit.initialize(model, None, "O2")}[then]
    layers = [type(m).__name__ for m in model.modules()]
    with pytest.raises(ValueError, match=message):
        act()
    assert [type(m).__name__ for m in model.modules()] == layers


def test_a_recipe_given_as_a_string_is_refused_naming_the_class() -> None:
    """On main, convert_to_block_scaled(model, "mxfp8") raised AttributeError: 'str' object has no attribute."""
    import ampkit

    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"recipe='mxfp8' is a str, not a BlockScaledRecipe: pass one, e.g. "
                                         r"BlockScaledRecipe\(format='mxfp8'\)"):
        ampkit.convert_to_block_scaled(model, "mxfp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"recipe='e4m3' is a str, not a Fp8Recipe"):
        ampkit.convert_to_fp8(model, "e4m3")  # type: ignore[arg-type]
