"""Optimizer states in fewer bits: AdamW's two moments in bfloat16, 8 bits, 4 bits or FP8.

float32 AdamW keeps two float32 moments per parameter, 8 bytes: half of float32 training's 16 and, at O2,
more than the 16-bit weights, their gradients and the masters' gradient together. The moments tolerate
coarse storage (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022; Li et al.,
"Memory Efficient Optimizers with 4-bit States", 2023) as long as the arithmetic of each step is float32:

- ``"fp32"``: the optimizer as given (float32 moments; at O3 the weights' dtype, as torch keeps them).
- ``"bf16"``: 2 bytes per moment, ampkit's own (``StochasticRoundingOptimizer`` with
  ``state_dtype=torch.bfloat16``): each step reads the moments into float32 and writes them back, the
  second moment stochastically rounded. Rounded to nearest, it never decays: ``0.999 * v`` is within half
  of bfloat16's spacing of ``v`` (2**-9 relative and more) and rounds back to ``v``, so one large gradient
  keeps that weight's steps small for good. The first moment changes by a tenth a step and is rounded to
  nearest: in pure bf16 training, stochastic rounding's noise there cost loss on the GPT
  (``benchmarks/bench_bf16_moments.py``).
  torchao has no bfloat16 moments.
- ``"8bit"``, ``"4bit"``, ``"fp8"``: torchao's ``AdamW8bit`` (dynamic-tree codes, a float32 scale per
  block of 256), ``AdamW4bit`` (blocks of 128) and ``AdamWFp8`` (float8_e4m3fn, blocks of 256). As
  bitsandbytes does, a tensor of fewer than 4096 values, or not a multiple of the block, keeps its
  moments in the parameter's dtype. torchao compiles its step function per parameter shape with
  torch.compile: the first step takes seconds to a minute on a CPU.

Adam and AdamW only: the formats are AdamW's (torch.optim.Adam converts where its weight decay is 0,
which is AdamW's with 0). ``initialize(..., states=...)`` applies the choice at any opt level
(at O2 to the optimizer of the float32 masters); ``ampkit.distributed.prepare_optimizer`` on FSDP2
shards; ``estimate_memory(..., states=...)`` counts each exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from ampkit.modes import OptLevel, opt_level as level_named
from ampkit.optim.pure16 import StochasticRoundingOptimizer, pure16_optimizer, refuse_options
from ampkit.shards import local_shard

STATES = ("fp32", "bf16", "8bit", "4bit", "fp8")
# torchao's optimizer, its block size, and the bytes of one quantized value, per format
LOW_BIT = {"8bit": ("AdamW8bit", 256, 1.0), "4bit": ("AdamW4bit", 128, 0.5), "fp8": ("AdamWFp8", 256, 1.0)}
QUANTIZED_MIN_NUMEL = 4096  # torchao (after bitsandbytes) quantizes tensors of at least this many values
# Lookup tables torchao keeps per quantized moment (float32 values): 8-bit dynamic tree 256, 4-bit 16, FP8 none.
QMAP_ENTRIES = {"8bit": 256, "4bit": 16, "fp8": 0}
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "differentiable": False, "capturable": False}


def check_states(states: str | None, optimizer: torch.optim.Optimizer | None, opt_level: str | OptLevel,
                 dtype: torch.dtype, update: str = "plain") -> None:
    """Refuse a ``states`` choice that cannot apply, changing nothing (``initialize`` calls it first).

    Raises:
        ValueError: what ``check_format`` refuses; an optimizer other than torch.optim.AdamW (or Adam without
            weight decay), one with an option the formats lack (amsgrad, maximize...), or one that has stepped.
        ImportError: a low-bit format without torchao.
    """
    check_format(states, opt_level, dtype, update)
    if states is None and level_named(opt_level).pure16 and dtype == torch.float16 and update != "stochastic":
        _check_float16_eps(optimizer)
    if states is None or states == "fp32" and not level_named(opt_level).pure16:
        return
    if optimizer is None:
        raise ValueError(f"states={states!r} needs the optimizer: pass initialize the model's optimizer.")
    _adamw_groups(optimizer, states)
    if states in LOW_BIT:
        try:
            import torchao.optim  # noqa: F401  (the `fp8` extra installs torchao)
        except ImportError as error:
            raise ImportError(f"states={states!r} uses torchao's low-bit optimizers, which are not installed: "
                              "pip install 'ampkit[fp8]' (or torchao), or use states='bf16'.") from error


def check_format(states: str | None, opt_level: str | OptLevel, dtype: torch.dtype, update: str = "plain") -> None:
    """Refuse an unknown format, and at O3 the formats its updates cannot keep (ValueError): float32 moments
    without ``update="stochastic"``, bfloat16 moments of float16 weights, low-bit moments with
    ``update="kahan"``, and stochastic rounding of float16 weights with low-bit moments."""
    if states is not None and states not in STATES:
        raise ValueError(f"Unknown states {states!r}. Choose one of {list(STATES)}: the format AdamW's moments are "
                         "kept in (fp32: the optimizer as given), or None.")
    if states is not None and level_named(opt_level).pure16:
        _check_o3(states, dtype, update)


def _check_o3(states: str, dtype: torch.dtype, update: str) -> None:
    """At O3 the optimizer steps the 16-bit weights themselves: what each format can do there."""
    if states == "fp32" and update != "stochastic":
        raise ValueError(f"states='fp32' at O3 with update={update!r}: torch's and torch-optimi's optimizers keep "
                         "the moments in the weights' dtype. Use update='stochastic' (ampkit's optimizer keeps them "
                         "in float32), or O2, or drop states.")
    if states == "bf16" and dtype != torch.bfloat16:
        raise ValueError(f"states='bf16' at O3 with {dtype} weights: the moments of pure 16-bit training are the "
                         "weights' dtype or float32; use dtype=torch.bfloat16, or states='fp32' with "
                         "update='stochastic'.")
    if states in LOW_BIT and update == "kahan":
        raise ValueError(f"states={states!r} with update='kahan': torchao's low-bit optimizers have no Kahan "
                         "summation. Use update='stochastic' (or 'plain'), or states='bf16' with Kahan's "
                         "16-bit moments.")
    if states in LOW_BIT and update == "stochastic" and dtype != torch.bfloat16:
        raise ValueError(f"states={states!r} with update='stochastic' on {dtype} weights: torchao rounds "
                         "stochastically into bfloat16 only. Use dtype=torch.bfloat16, or update='plain'.")


def _check_float16_eps(optimizer: torch.optim.Optimizer | None) -> None:
    """At O3 on float16 weights torch's Adam and AdamW (and torch-optimi's, ``update="kahan"``) keep the moments in
    float16 and divide by their root plus ``eps`` there: an ``eps`` float16 rounds to 0 (the default, 1e-8) makes a
    zero gradient 0 / 0, and the first step left NaN weights (measured: with no warning). ValueError, changing
    nothing."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        if float(torch.tensor(group["eps"], dtype=torch.float16)) == 0:
            raise ValueError(f"opt_level='O3' with float16 weights keeps {type(optimizer).__name__}'s moments in "
                             f"float16, where eps={group['eps']!r} rounds to 0: a zero gradient makes the first step "
                             "0 / 0 and the weights NaN. Build the optimizer with an eps float16 holds (eps=1e-4 is "
                             "the usual choice in pure float16), or use update='stochastic' (float32 arithmetic), "
                             "dtype=torch.bfloat16, or O2.")


def _adamw_groups(optimizer: torch.optim.Optimizer, states: str) -> list[dict[str, Any]]:
    """``optimizer``'s groups as AdamW hyperparameters, or ValueError where it is not an AdamW."""
    adam = type(optimizer) is torch.optim.Adam
    if type(optimizer) is not torch.optim.AdamW and not adam:
        raise ValueError(f"states={states!r} keeps AdamW's moments in fewer bits; the optimizer is "
                         f"{type(optimizer).__name__}. Build a torch.optim.AdamW (torchao's low-bit optimizers "
                         "cover Adam and AdamW), or drop states.")
    if optimizer.state:
        raise ValueError(f"states={states!r}: the optimizer has already stepped, and its float32 moments would be "
                         "lost. Convert it before training.")
    refuse_options(optimizer, _UNSUPPORTED, f"with states={states!r}", "states='fp32'")
    groups = []
    for group in optimizer.param_groups:
        if adam and group["weight_decay"] and not group.get("decoupled_weight_decay", False):
            raise ValueError(f"states={states!r} on torch.optim.Adam with weight_decay={group['weight_decay']}: "
                             "Adam's weight decay is an L2 term in the gradient, which the formats' AdamW has not. "
                             "Use torch.optim.AdamW (decoupled decay), or weight_decay=0.")
        # Every key but AdamW's own options stays (a group's name, a scheduler's initial_lr, the user's own).
        kept = {key: value for key, value in group.items() if key not in optimizer.defaults}
        groups.append({**kept, "params": list(group["params"]), "lr": float(group["lr"]),
                       "betas": tuple(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"]})
    return groups


def with_states(optimizer: torch.optim.Optimizer, states: str | None, update: str = "plain",
                float32_weights: bool = True) -> torch.optim.Optimizer:
    """The same AdamW (groups and hyperparameters) keeping its moments in ``states``.

    Args:
        optimizer: a torch.optim.AdamW (or Adam with weight_decay=0) that has not stepped; ``check_states``
            has accepted it.
        states: one of STATES; None or ``"fp32"`` over float32 weights returns ``optimizer``.
        update: O3's update rule: ``"stochastic"`` rounds 16-bit weights stochastically (ampkit's optimizer,
            or torchao's ``bf16_stochastic_round``).
        float32_weights: whether the optimizer steps float32 weights (O0-O2) or the 16-bit ones (O3).

    Returns:
        The optimizer that keeps the moments in ``states`` (``optimizer`` itself where nothing changes).
    """
    if states is None or (float32_weights and states == "fp32") or (states == "bf16" and not float32_weights
                                                                    and update != "stochastic"):
        return optimizer  # float32 moments as given; or 16-bit weights whose optimizer keeps their dtype
    groups = _adamw_groups(optimizer, states)
    converted: torch.optim.Optimizer
    if states in ("fp32", "bf16"):
        state_dtype = torch.float32 if states == "fp32" else torch.bfloat16
        converted = StochasticRoundingOptimizer(groups, "adamw", lr=groups[0]["lr"], state_dtype=state_dtype)
    else:
        import torchao.optim

        name, block_size, _ = LOW_BIT[states]
        converted = getattr(torchao.optim, name)(
            groups, lr=groups[0]["lr"], block_size=block_size, bf16_stochastic_round=update == "stochastic")
    # The user's optimizer and this one share their groups: a scheduler built on it before initialize (as
    # examples/train.py does) sets the learning rate this one steps with. (torch's scheduler then warns once that
    # it stepped before the optimizer: it watches the user's optimizer's step, which is no longer called.)
    optimizer.param_groups = converted.param_groups
    converted.register_load_state_dict_pre_hook(loaded_in_format)
    converted.register_load_state_dict_post_hook(_requantize)
    return converted


def for_level(optimizer: torch.optim.Optimizer, states: str | None, update: str = "plain",
              float32_weights: bool = True) -> torch.optim.Optimizer:
    """The optimizer a level steps with: its moments in ``states`` (``with_states``) and, where those are the
    16-bit weights' own, its O3 ``update`` (``pure16_optimizer``); ``check_states`` has accepted the choice."""
    converted = with_states(optimizer, states, update, float32_weights)
    if converted is optimizer and update != "plain":  # the moments are the weights' dtype: the update decides
        converted = pure16_optimizer(optimizer, update)
    return converted


def states_format(optimizer: torch.optim.Optimizer) -> str:
    """The format ``optimizer`` keeps AdamW's moments in, as ``with_states`` names it: ``"8bit"``, ``"4bit"``,
    ``"fp8"`` (torchao's), ``"bf16"`` or ``"fp32"`` (ampkit's stochastically rounding optimizer), or ``"as given"``
    (any other optimizer: moments in its parameters' dtype)."""
    if hasattr(optimizer, "master_params"):  # a MasterWeightOptimizer: its inner optimizer keeps the moments
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    name = type(optimizer).__name__
    for states, (torchao_name, _, _) in LOW_BIT.items():
        if name == torchao_name and type(optimizer).__module__.startswith("torchao."):
            return states
    if isinstance(optimizer, StochasticRoundingOptimizer) and optimizer.state_dtype is not None:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(optimizer.state_dtype, str(optimizer.state_dtype))
    return "as given"


def check_same_format(saved: str, optimizer: torch.optim.Optimizer, what: str) -> None:
    """Refuse to load moments kept as ``saved`` (``states_format``'s name) into ``optimizer`` where it keeps another
    format (RuntimeError naming both and the fix): its state and group keys differ, and torch would take 8-bit
    tensors as float32 moments."""
    current = states_format(optimizer)
    if saved != current:
        raise RuntimeError(f"{what} kept AdamW's moments as {saved!r}, this one keeps them as {current!r}: its moments "
                           f"cannot be read. Pass ampkit.initialize (or prepare_optimizer) states={saved!r} to resume "
                           "it ('as given': no states=).")


def _moments_format(state_dict: dict[str, Any]) -> str | None:
    """The format an optimizer state dict's AdamW moments are in, as ``states_format`` names it (``"fp32"`` for
    plain float32 moments, ``"bf16"`` for bfloat16 ones); None where it holds no moment (nothing stepped). A
    low-bit optimizer leaves small tensors' moments unquantized: any quantized moment names the format."""
    quantized = {"OptimState8bit": "8bit", "OptimState4bit": "4bit", "OptimStateFp8": "fp8"}
    moments = [per_param["exp_avg_sq"] for per_param in state_dict.get("state", {}).values()
               if isinstance(per_param, dict) and isinstance(per_param.get("exp_avg_sq"), torch.Tensor)]
    for moment in moments:
        if is_quantized(moment) and type(local_shard(moment)).__name__ in quantized:
            return quantized[type(local_shard(moment)).__name__]
    if not moments:
        return None
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(moments[0].dtype, str(moments[0].dtype))


def loaded_in_format(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Refuse, naming both formats, a state dict whose AdamW moments ``optimizer`` cannot take (RuntimeError):
    torch would read a low-bit optimizer's codes as moments, or a low-bit optimizer keep float32 moments and save
    them under its own name. float32 and bfloat16 moments are taken by ampkit's optimizer (cast to its
    ``state_dtype``), by torch's (cast to the parameters' dtype) and by a low-bit optimizer whose quantized states
    exist for every moment (they are quantized into them: ``_requantize``, as a sharded checkpoint's values are).
    A ``load_state_dict`` pre-hook of the optimizers ``with_states`` builds, and the check of a
    MasterWeightOptimizer's plain state dicts."""
    saved, current = _moments_format(state_dict), states_format(optimizer)
    if saved is None or saved == current or saved in ("fp32", "bf16") and current not in LOW_BIT:
        return
    if saved in ("fp32", "bf16") and current in LOW_BIT:
        held = {(id(p), key): value for p, per_param in optimizer.state.items() for key, value in per_param.items()
                if is_quantized(value)}
        wanted = sum(1 for per_param in state_dict["state"].values() for key, value in per_param.items()
                     if key in ("exp_avg", "exp_avg_sq") and isinstance(value, torch.Tensor) and value.numel()
                     >= QUANTIZED_MIN_NUMEL)
        if len(held) >= wanted:
            optimizer._ampkit_quantized = held  # type: ignore[attr-defined]  # for _requantize, after the load
            return
    raise RuntimeError(f"The state dict keeps AdamW's moments as {saved!r}, this optimizer as {current!r}: they cannot "
                       f"be converted. Build the optimizer with states={saved!r} (ampkit.initialize) to resume it, "
                       "or start this format's moments afresh.")


def _requantize(optimizer: torch.optim.Optimizer) -> None:
    """After a low-bit optimizer loaded float moments (``loaded_in_format`` let them in): each goes back into the
    quantized state it replaced (torchao's ``copy_`` quantizes)."""
    held = getattr(optimizer, "_ampkit_quantized", None)
    if not held:
        return
    del optimizer._ampkit_quantized  # type: ignore[attr-defined]
    for param, per_param in optimizer.state.items():
        for key, value in list(per_param.items()):
            quantized = held.get((id(param), key))
            if quantized is not None and not is_quantized(value):
                quantized.copy_(value)
                per_param[key] = quantized


def state_bytes(numels: Iterable[int], states: str, param_bytes: int) -> int:
    """Bytes of AdamW's two moments of tensors of ``numels`` values each (see ``moment_bytes``)."""
    return sum(2 * moment_bytes(numel, states, param_bytes) for numel in numels)


def moment_bytes(numel: int, states: str, param_bytes: int) -> int:
    """Bytes of one AdamW moment of a tensor of ``numel`` values, exactly as ``with_states`` keeps it.

    Args:
        numel: the values of the (local) tensor the optimizer steps.
        states: one of STATES.
        param_bytes: the bytes of one value of that tensor (4 for float32, 2 for 16-bit): torchao keeps an
            unquantized moment in the parameter's dtype.
    """
    if states in ("fp32", "bf16"):
        return (4 if states == "fp32" else 2) * numel
    _, block_size, value_bytes = LOW_BIT[states]
    if numel < QUANTIZED_MIN_NUMEL or numel % block_size:
        return param_bytes * numel
    return int(numel * value_bytes) + 4 * (numel // block_size) + 4 * QMAP_ENTRIES[states]


def is_quantized(value: object) -> bool:
    """Whether ``value`` (or an FSDP2 DTensor's local shard of it) is one of torchao's low-bit optimizer states."""
    return isinstance(value, torch.Tensor) and type(local_shard(value)).__module__.startswith("torchao.optim.")


def dequantized(value: torch.Tensor) -> torch.Tensor:
    """A torchao low-bit state's values in float32, sharded as it is (an FSDP2 DTensor stays one).

    torch.distributed.checkpoint cannot copy torchao's state subclasses (pytorch/ao#1189): a sharded checkpoint
    carries these values (which reshard to any world size), and loading quantizes them again into the
    optimizer's own states. That round trip is not always exact: a block whose largest value is negative has no
    code of -1.0 in torchao's signed 8-bit and 4-bit maps, so quantizing it again finds a smaller scale. The
    checkpoint also carries each rank's codes and scales, which come back exactly on the same world size.
    """
    local = local_shard(value).dequantize().float()
    if local is value or not hasattr(value, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, value.device_mesh, value.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=value.shape, stride=value.stride())


def snapshot(state: Any) -> Any:
    """A copy of ``state`` (a state dict: nested dicts and lists of tensors and plain values) whose tensors are new
    copies, torchao's low-bit states too: they implement no ``clone`` (nor ``copy.deepcopy``), so a copy is made
    of their inner tensors and the subclass rebuilt from them (the tensor-subclass protocol's
    ``__tensor_flatten__`` / ``__tensor_unflatten__``, which DTensor follows too)."""
    if isinstance(state, dict):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    if not isinstance(state, torch.Tensor):
        return copy.deepcopy(state)
    if type(state) is torch.Tensor or type(state) is torch.nn.Parameter or not hasattr(state, "__tensor_flatten__"):
        return state.detach().clone()
    names, context = state.__tensor_flatten__()
    inner = {name: snapshot(getattr(state, name)) for name in names}
    return type(state).__tensor_unflatten__(inner, context, state.size(), state.stride())  # type: ignore[attr-defined]
