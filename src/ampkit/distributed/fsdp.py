"""ampkit's opt levels on FSDP2: ``fully_shard`` with the mixed precision policies each level means.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a float32 shard and casts at
the all-gather (``MixedPrecisionPolicy.param_dtype``), so its shards are the master weights and O2
needs no second copy. ampkit maps its levels onto it rather than re-implementing sharding:

- O0: float32 shards, float32 all-gathers (the baseline);
- O1: float32 shards and all-gathers, ampkit's autocast policy around the forward;
- O2: float32 shards, 16-bit all-gathers and compute, normalization layers (and ``keep_float32``
  types) sharded on their own with float32 all-gathers, inputs cast at the root, outputs float32;
- O3: 16-bit shards (the model is cast first), with ``update="kahan"`` / ``"stochastic"`` through
  ``prepare_optimizer``.

Gradients reduce-scatter in ``reduce_dtype`` (ampkit's gradient compression on this engine) with
ampkit's pre-divide: FSDP2 is told to sum (``set_force_sum_reduction_for_comms``, divide factor 1)
and a reduce-scatter of ours divides by ``f`` before the sum and by ``world_size / f`` after, as the
DDP hook does (FSDP2's own rule pre-divides float16 by a power of two near sqrt(world_size) and
averages bfloat16 and float32 in the collective; ours names the factor, counts the bytes and warns on
an overflowed sum).

An optimizer built before sharding holds parameters FSDP2 has replaced and would train nothing: the
replaced ones are remembered, and any optimizer step over one raises.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampkit.distributed.compression import BytesAllGather, PredividedReduceScatter, predivide, require_process_group
from ampkit.distributed.units import group_segments, plan_units
from ampkit.formats.torchao import check_fp8_gathers, fp8_gathered
from ampkit.hardware.advice import recommend_dtype
from ampkit.modes import OptLevel, opt_level as level_named, resolve_dtype
from ampkit.optim import pure16
from ampkit.optim.kept import add_input_casts, add_norm_casts, needs_input_casts
from ampkit.optim.levels import cast_model_, check_keep_float32, check_settings, forward_wrappers, wrap_forward
from ampkit.optim.states import check_states, for_level
from ampkit.precision.policy import Policy

REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class Sharding:
    """How ``fully_shard`` sharded a model (``sharding(model)``), and what its reduce-scatters sent.

    Attributes:
        opt_level: ``"O0"`` to ``"O3"``.
        dtype: the 16-bit dtype (float32 at O0).
        reduce_dtype: the gradients' dtype on the wire.
        predivide: the pre-divide factor of the reduce-scatters.
        world_size: ranks the parameters are sharded over.
        blocks: names of the modules sharded as blocks (the root is sharded too, with the rest).
        float32: at O2, names of the modules sharded with float32 all-gathers (norms, ``keep_float32``).
        bytes_sent: bytes this rank handed to gradient reduce-scatters so far.
        overflows: reduce-scatters whose result held inf/NaN (each warned).
    """

    opt_level: str
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    predivide: float
    world_size: int
    blocks: tuple[str, ...]
    float32: tuple[str, ...]
    bytes_sent: int = 0
    overflows: int = 0

    @property
    def level(self) -> OptLevel:
        """What ``opt_level`` does (``ampkit.modes.OptLevel``)."""
        return level_named(self.opt_level)


def fully_shard(
    model: nn.Module,
    *,
    mesh: Any = None,
    opt_level: str = "O1",
    dtype: torch.dtype | str | None = None,
    reduce_dtype: torch.dtype | str = torch.float32,
    blocks: Sequence[type[nn.Module]] | None = None,
    keep_float32: Sequence[type[nn.Module]] = (),
    compute: str = "auto",
    policy: Policy | None = None,
    predivide_factor: float | None = None,
    reshard_after_forward: bool | int = True,
    optimizer: Any = None,
) -> nn.Module:
    """Shard a float32 model with FSDP2 at an ampkit opt level (the FSDP2 counterpart of ``initialize``).

    Each block, then the root, is sharded with ``torch.distributed.fsdp.fully_shard`` and the
    ``MixedPrecisionPolicy`` of ``opt_level`` (see the module docstring). Build the optimizer
    afterwards, on ``model.parameters()`` (FSDP2 replaces them with DTensor shards), and pass it
    through ``prepare_optimizer``.

    Args:
        model: a float32 model on the mesh's device type, not yet sharded nor initialized.
        mesh: a 1-D ``DeviceMesh`` (default: every rank of the default process group).
        opt_level: ``"O0"``, ``"O1"`` (default), ``"O2"`` or ``"O3"`` (as ``initialize``'s).
        dtype: torch.float16 or torch.bfloat16 (None: ``recommend_dtype``).
        reduce_dtype: the gradients' dtype in the reduce-scatter: torch.float32 (default),
            torch.bfloat16 or torch.float16 (half the bytes on the wire).
        blocks: module types to shard as blocks (default: the children of every nn.Sequential
            or nn.ModuleList, outermost first, e.g. a transformer's layers).
        keep_float32: at O2, module types kept in float32 besides the normalization layers.
        compute: how GEMMs compute (``Policy.compute``): ``"auto"``, ``"native"`` or ``"float32"``.
        policy: the O1 policy (default ``Policy.default(device, dtype, compute=compute)``).
        predivide_factor: divide gradients by it before the sum (default sqrt(world_size); 1 sums
            then divides; world_size divides first).
        reshard_after_forward: FSDP2's (default True: free the gathered weights after each forward).
        optimizer: leave None: an optimizer can only be built after sharding (passing one raises).

    Returns:
        The model, sharded in place; ``sharding(model)`` says how.

    Raises:
        RuntimeError: no process group; an optimizer was given (built before sharding).
        ValueError: a bad mesh, opt level, dtype, reduce dtype, predivide factor, block type,
            ``keep_float32`` or ``reshard_after_forward``; a model already sharded or initialized, not
            float32, with a 0-d parameter, or whose weights are shared across the units FSDP2 would shard
            them in; a recompute plan whose segment of several blocks is not of the blocks sharded (a segment of
            blocks is one unit); O3 on weights torchao all-gathers in FP8. Nothing is changed when it raises.

    Example:
        >>> model = ampkit.distributed.fully_shard(model, opt_level="O2", dtype=torch.bfloat16)
        >>> optimizer = ampkit.distributed.prepare_optimizer(model, torch.optim.AdamW(model.parameters()))
    """
    # Every check before any change: a refused call leaves the model as it was.
    if optimizer is not None:
        raise RuntimeError("fully_shard(optimizer=...): build the optimizer after sharding, on model.parameters(): "
                           "FSDP2 replaces every parameter with a DTensor shard, and an optimizer built before "
                           "would step the old tensors and train nothing.")
    level = check_settings(opt_level, compute, policy)
    check_keep_float32(level, keep_float32)
    device = _check_model(model)
    check_fp8_gathers(model, level.name, level.pure16)
    _check_sharding_arguments(blocks, reshard_after_forward)
    world_size = require_process_group(None)
    mesh = _mesh(mesh, device.type, world_size)
    _check_reshard_size(reshard_after_forward, mesh.size())
    dtype = (torch.float32 if not level.mixed else resolve_dtype(dtype) if dtype is not None
             else recommend_dtype(device))
    reduce_dtype = _reduce_dtype(reduce_dtype)
    factor = predivide(mesh.size(), predivide_factor)
    kept, chosen = plan_units(model, level, tuple(keep_float32), blocks)
    plan = getattr(model, "_ampkit_recompute", None)  # a recompute plan applied before sharding
    units = group_segments(chosen, plan.segments if plan is not None else ())
    before = list(model.parameters())
    gathers_fp8 = bool(fp8_gathered(model))

    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    layout = Sharding(level.name, dtype, reduce_dtype, factor, mesh.size(), tuple(n for n, _ in chosen),
                      tuple(n for n, _ in kept))
    if level.pure16:
        cast_model_(model, level, dtype)  # uniform 16-bit shards; inputs cast in, outputs float32 out
    gathered = dtype if level.masters else None  # O2: float32 shards (the masters), gathered in 16 bits
    add_norm_casts([m for _, m in kept])  # a custom norm's float32 output takes its 16-bit input's dtype
    if level.keeps_float32 and needs_input_casts(model, [m for _, m in kept], keep_float32):
        # float32 activations (a float32 embedding's, a custom norm's) can reach 16-bit modules: each casts its inputs.
        add_input_casts(model, dtype, {id(p) for _, m in kept for p in m.parameters()})
    for _, module in kept:
        torch_fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                          mp_policy=MixedPrecisionPolicy(None, reduce_dtype, cast_forward_inputs=False))
    for unit in units:
        modules = [module for _, module in unit]
        torch_fully_shard(modules if len(modules) > 1 else modules[0],  # type: ignore[arg-type]
                          mesh=mesh, reshard_after_forward=reshard_after_forward,
                          mp_policy=MixedPrecisionPolicy(gathered, reduce_dtype))
    torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy(
        gathered, reduce_dtype, output_dtype=torch.float32 if level.masters else None))
    comm = PredividedReduceScatter(factor, layout)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            module.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
            if gathers_fp8:
                module.set_custom_all_gather(BytesAllGather())  # type: ignore[arg-type]
    wrap_forward(model, *forward_wrappers(level, device.type, dtype, compute, policy))
    model._ampkit_opt_level = level.name  # type: ignore[assignment]
    model._ampkit_sharding = layout  # type: ignore[assignment]
    _remember_replaced(model, before)
    return model


def sharding(model: nn.Module) -> Sharding:
    """How ``fully_shard`` sharded ``model``.

    Args:
        model: the model ``fully_shard`` returned.

    Returns:
        Its ``Sharding`` (live: ``bytes_sent`` and ``overflows`` grow as it trains).

    Raises:
        ValueError: the model was not sharded by ``ampkit.distributed.fully_shard``.
    """
    layout = getattr(model, "_ampkit_sharding", None)
    if layout is None:
        raise ValueError(f"{type(model).__name__} was not sharded by ampkit.distributed.fully_shard: call it first.")
    return layout


def prepare_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, update: str = "plain",
                      states: str | None = None) -> torch.optim.Optimizer:
    """Check an optimizer built on a sharded model, and give O3 its update rule and AdamW its states' format.

    Args:
        model: the model ``fully_shard`` returned.
        optimizer: a torch.optim optimizer built after sharding, on ``model.parameters()``.
        update: at O3, ``"plain"`` (default), ``"kahan"`` or ``"stochastic"`` (``ampkit.optim.pure16``);
            either applies to each rank's shards, elementwise.
        states: the format of AdamW's moments, as ``initialize``'s (``ampkit.optim.states``): None (default: as
            the optimizer keeps them), ``"fp32"``, ``"bf16"``, ``"8bit"``, ``"4bit"`` or ``"fp8"``, kept per shard
            (torchao's low-bit optimizers quantize each rank's local shard).

    Returns:
        The optimizer (``update`` other than plain, or ``states``: the one that replaces it).

    Raises:
        ValueError: the model is not sharded by ampkit, an unknown update or one below O3, ``states`` the
            optimizer or the level cannot take, or an optimizer over tensors that are not the sharded model's
            parameters.
        RuntimeError: the optimizer was built before sharding.
    """
    layout = sharding(model)
    pure16.check_update(update)
    if update != "plain" and not layout.level.pure16:
        raise ValueError(f"update={update!r} applies at O3 only (this model is sharded at {layout.opt_level}, whose "
                         "float32 shards take small updates as they are): drop update=, or shard at opt_level='O3'.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={optimizer!r} is a {type(optimizer).__name__}, not a torch.optim.Optimizer.")
    _refuse_replaced(optimizer)
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        raise ValueError(f"The optimizer steps {len(foreign)} tensor(s) that are not this sharded model's parameters "
                         f"(shapes {[tuple(p.shape) for p in foreign[:3]]}): build it on model.parameters().")
    if update != "plain":
        pure16.pure16_groups(optimizer, update)  # refuses before anything is replaced
    check_states(states, optimizer, layout.opt_level, layout.dtype, update)
    return for_level(optimizer, states, update, float32_weights=not layout.level.pure16)


def precompute_fp8_scales(model: nn.Module) -> None:
    """After each optimizer step, with ``Fp8Recipe(scaling="current", fsdp_all_gather=True)``: compute every
    FP8 weight's scale in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) instead
    of one per weight at its all-gather. Does nothing for a model without FP8 all-gathers.

    Args:
        model: the sharded model.
    """
    from ampkit.formats.torchao import precompute_fsdp_scales

    precompute_fsdp_scales(model)


# -- checks ---------------------------------------------------------------------


def _check_model(model: object) -> torch.device:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not an nn.Module: pass the model itself.")
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} is sharded already (FSDP2 modules inside): pass the float32 model "
                         "before any fully_shard call, once.")
    if getattr(model, "_ampkit_opt_level", None) is not None:
        raise ValueError(f"The model was initialized at {model._ampkit_opt_level} already: on FSDP2, call "
                         "ampkit.distributed.fully_shard instead of ampkit.initialize (not both).")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: FSDP2 has nothing to shard.")
    dtypes = sorted({str(p.dtype) for p in params})
    if dtypes != ["torch.float32"]:
        raise ValueError(f"The model's parameters are {dtypes}: pass the float32 model (fully_shard casts what the "
                         "opt level asks for), e.g. model.float().")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"The model's parameters are on {devices}: move it to one device first.")
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:  # torch's fully_shard refuses them on its own only after the blocks before them were sharded
        raise ValueError(f"The model has 0-d parameters ({', '.join(scalars[:3])}), which FSDP2 cannot shard (it "
                         "splits each parameter's first dimension): make each one 1-d, e.g. nn.Parameter(torch.tensor"
                         "([value])), and index it where it is used.")
    return params[0].device


def _check_sharding_arguments(blocks: object, reshard_after_forward: object) -> None:
    """Refuse what torch's fully_shard would refuse only after sharding the blocks before the one it fails on."""
    if isinstance(blocks, type):
        raise ValueError(f"blocks={blocks.__name__} is one type: pass a list of block types, blocks=[{blocks.__name__}].")
    if not isinstance(reshard_after_forward, bool) and not (isinstance(reshard_after_forward, int)
                                                            and reshard_after_forward > 0):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} is not a bool: pass True (free the gathered "
                         "weights after each forward, the default), False (keep them until the backward) or, as "
                         "torch's fully_shard takes, a world size to reshard to.")


def _check_reshard_size(reshard_after_forward: bool | int, shards: int) -> None:
    """An int ``reshard_after_forward`` is a group size to reshard to, a factor of the ``shards`` the mesh shards over
    (torch's rule, which it applies only after sharding the modules before the first one it fails on, and at O3
    after the cast: refused here first, so that a refused call leaves the model as it was)."""
    factors = [n for n in range(1, shards + 1) if shards % n == 0]
    if not isinstance(reshard_after_forward, bool) and reshard_after_forward not in factors:
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} is no group size to reshard to: a factor "
                         f"of the {shards} shards, one of {factors} (or True, False).")


def _mesh(mesh: Any, device_type: str, world_size: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if mesh is None:
        return init_device_mesh(device_type, (world_size,))
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh={mesh!r} is a {type(mesh).__name__}, not a DeviceMesh: pass "
                         f"init_device_mesh({device_type!r}, ({world_size},)), or None for every rank.")
    if mesh.ndim != 1:
        raise ValueError(f"mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}: ampkit shards over a 1-D mesh "
                         "(HSDP's 2-D meshes: call torch.distributed.fsdp.fully_shard with your own policies).")
    if mesh.device_type != device_type:
        raise ValueError(f"mesh is on {mesh.device_type!r} but the model is on {device_type!r}: build the mesh with "
                         f"init_device_mesh({device_type!r}, ...) or move the model.")
    return mesh


def _reduce_dtype(value: object) -> torch.dtype:
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    dtype = names.get(value) if isinstance(value, str) else value
    if dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype={value!r} is invalid: choose torch.float32, torch.bfloat16 or torch.float16.")
    return dtype  # type: ignore[return-value]


# -- optimizers built before sharding -------------------------------------------

_REPLACED: dict[int, weakref.ref] = {}  # id -> the parameter FSDP2 replaced (a Tensor's == is elementwise)


def _remember_replaced(model: nn.Module, before: Sequence[torch.Tensor]) -> None:
    """The parameters FSDP2 replaced with shards, and every optimizer alive that holds one: each refuses its next
    step (a step pre-hook of its own, ``Optimizer.register_step_pre_hook``; no global optimizer hook). The optimizers
    are found once, among the objects Python's garbage collector tracks (a walk over them all: once, not a step)."""
    now = {id(p) for p in model.parameters()}
    replaced = [p for p in before if id(p) not in now]
    for p in replaced:
        _REPLACED[id(p)] = weakref.ref(p, _forget(id(p)))
    ids = {id(p) for p in replaced}
    for obj in gc.get_objects():  # type(), not isinstance: a dead weak proxy among them raises at its __class__
        if issubclass(type(obj), torch.optim.Optimizer) and any(id(p) in ids for g in obj.param_groups
                                                                for p in g["params"]):
            obj.register_step_pre_hook(lambda optimizer, args, kwargs: _refuse_replaced(optimizer))


def _forget(pid: int) -> Any:
    """The weakref callback that drops a replaced parameter's entry when it is freed."""
    return lambda _: _REPLACED.pop(pid, None)


def _refuse_replaced(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _REPLACED.get(id(p))
            if ref is not None and ref() is p:
                raise RuntimeError(
                    f"{type(optimizer).__name__} was built before ampkit.distributed.fully_shard: it holds parameters "
                    "FSDP2 has replaced with DTensor shards, and would train nothing. Build the optimizer after "
                    "sharding, on model.parameters().")
