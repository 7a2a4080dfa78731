"""What O2 keeps in float32, by what a tensor is for, and the casts at a 16-bit model's boundary.

- **Normalization layers, by behaviour.** torch's norm classes, and any module that normalizes: a leaf whose
  parameters are vectors of one length ``d`` and whose forward, on a probe of ``d`` features (last dimension, or
  channels first), gives the same output for ``x`` and ``8 * x``. transformers' ``LlamaRMSNorm``,
  ``T5LayerNorm`` and ConvNeXt's channels-first LayerNorm pass; a learned scale or a PReLU (``f(8x) = 8 f(x)``)
  does not. The probe calls ``forward`` itself (no hooks run) without grad, and puts back any buffer it changed.
- **Buffers: never cast at O2.** A buffer is not trained: a rotary embedding's ``inv_freq``, FP8 amax histories,
  running statistics. Cast to bfloat16, transformers' rotary angles drift from float32's in proportion to the
  position (``tests/test_real_models.py`` measures it at position 4095).
- **A kept norm returns its input's dtype**, as torch's own norms do on float32 weights on the CPU (``layer_norm``
  and ``rms_norm`` take mixed dtypes there): a norm found by behaviour gets a forward hook casting its float32
  output to its 16-bit input's dtype (``add_norm_casts``). Its weight times a 16-bit input would otherwise promote
  to float32, and code beside the modules then mixes dtypes: Qwen3's per-head ``q_norm`` and ``k_norm`` gave
  attention float32 queries and keys beside bfloat16 values (``scaled_dot_product_attention`` refuses them), and
  each projection after a norm cast the same float32 output for itself (three bfloat16 copies of one activation
  saved for a Llama attention's q, k and v projections; one now). Off the CPU, torch's layer, group and RMS norms
  run on a float32 copy of a 16-bit input and return its dtype: CUDA's ``layer_norm`` refuses a bfloat16 input
  beside float32 weights ("expected scalar type BFloat16 but found Float", an H200 with torch 2.11). Batch and
  instance norms take mixed dtypes on CUDA as on the CPU (cuDNN's batch norm wants float32 weights).
- Where anything else stays float32, float32 activations can reach 16-bit layers (a ``keep_float32`` embedding's
  output, a sum with a float32 buffer): each module with 16-bit weights of its own then casts its floating
  inputs to the 16-bit dtype (``cast_inputs``).
- The model's outputs become float32 through any container: tensors, tuples, lists, dicts, dataclasses and
  transformers' ``ModelOutput`` (a dict and a dataclass at once).
- **Losses computed inside the model** (transformers' BERT and T5 compute theirs in ``forward``) take float32
  inputs, as under torch.autocast: the loss functions of ``torch.nn.functional`` whose ops torch.autocast runs in
  float32 on some device, read from the running torch (``Float32Losses``, a ``TorchFunctionMode`` entered around
  the forward; it sees the outermost call of each function, which is the loss itself).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ampkit.modes import LOW_DTYPES
from ampkit.precision.op_lists import DEVICE_TYPES
from ampkit.precision.policy import Policy

# torch's normalization layers, by public name: batch and instance norms (running statistics; in eval mode no probe
# below finds them), lazy and synchronized ones included, and the layer, group and RMS norms.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
               nn.LazyBatchNorm3d, nn.SyncBatchNorm)
NORM_TYPES = (*BATCH_NORMS, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyInstanceNorm1d,
              nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def is_normalization(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer: one of torch's, or one that behaves as one (above)."""
    return isinstance(module, NORM_TYPES) or _normalizes(module)


def _normalizes(module: nn.Module) -> bool:
    if next(module.children(), None) is not None:
        return False
    params = list(module.parameters(recurse=False))
    if not params or any(p.dim() != 1 or not p.is_floating_point() or p.is_meta for p in params):
        return False
    features = params[0].numel()
    if any(p.numel() != features for p in params):
        return False
    buffers = {name: b.clone() for name, b in module.named_buffers(recurse=False)}
    generator = torch.Generator().manual_seed(0)
    try:
        for shape in ((2, 3, features), (2, features, 3, 3)):  # features last, then channels first
            x = torch.randn(shape, generator=generator).to(device=params[0].device, dtype=params[0].dtype)
            try:
                with torch.no_grad():
                    out, scaled = module.forward(x), module.forward(8 * x)
            except Exception:  # noqa: BLE001 - a forward that takes other inputs is no normalization layer
                continue
            if (isinstance(out, torch.Tensor) and isinstance(scaled, torch.Tensor) and out.shape == x.shape
                    and torch.allclose(out, scaled, rtol=1e-3, atol=1e-4)):
                return True
        return False
    finally:
        for name, value in buffers.items():
            getattr(module, name).copy_(value)


def kept_modules(model: nn.Module, keep_float32: Sequence[type[nn.Module]] = ()) -> list[nn.Module]:
    """The modules whose own parameters O2 keeps in float32: normalization layers and ``keep_float32`` types."""
    types = tuple(keep_float32)
    return [m for m in model.modules() if (types and isinstance(m, types)) or is_normalization(m)]


def needs_input_casts(model: nn.Module, kept: Sequence[nn.Module], keep_float32: Sequence[type[nn.Module]]) -> bool:
    """Whether float32 activations can reach O2's 16-bit layers: something besides torch's norms stays float32
    (their outputs take the input's dtype), a kept type or a floating buffer outside them."""
    kept_ids = {id(m) for m in kept}
    return (bool(keep_float32) or any(not isinstance(m, NORM_TYPES) for m in kept)
            or any(b.is_floating_point() for m in model.modules() if id(m) not in kept_ids
                   for b in m.buffers(recurse=False)))


def cast_inputs(dtype: torch.dtype) -> Any:
    """A forward pre-hook (with kwargs) that casts floating tensor inputs to ``dtype``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def cast(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.to(dtype)
            return v

        return tuple([cast(a) for a in args]), {k: cast(v) for k, v in kwargs.items()}  # no generator: dynamo

    return hook


def add_input_casts(model: nn.Module, dtype: torch.dtype, kept_params: set[int]) -> None:
    """Give each module below ``model`` with weights of its own, none of them kept (``kept_params``: ids), a
    pre-hook casting its floating inputs to ``dtype`` while its weights are 16-bit: where float32 activations can
    reach O2's 16-bit layers (``needs_input_casts``). A module whose weights are float32 at the call, inside a layer
    the guard raised to float32 from its masters, takes its inputs as they are (cast, they met float32 weights)."""
    cast = cast_inputs(dtype)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return None if next(module.parameters(recurse=False)).dtype == torch.float32 else cast(module, args, kwargs)

    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if module is not model and own and not any(id(p) in kept_params for p in own):
            module.register_forward_pre_hook(hook, with_kwargs=True)


def cast_output_to_input_dtype(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """A forward hook (with kwargs): a float32 tensor output takes the dtype of the first floating tensor input
    where that is 16-bit (a kept norm's output, as a 16-bit model's norm would give it); else the output as it is."""
    given = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    if (given is not None and given.dtype in LOW_DTYPES and isinstance(output, torch.Tensor)
            and output.dtype == torch.float32):
        return output.to(given.dtype)
    return None


# torch's norms whose kernels take a 16-bit input beside float32 weights on the CPU only
FLOAT32_OFF_CPU = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def add_norm_casts(kept: Sequence[nn.Module]) -> None:
    """Give each norm of ``kept`` found by behaviour the ``cast_output_to_input_dtype`` hook, and each of torch's
    ``FLOAT32_OFF_CPU`` norms with float32 weights the ``float32_off_cpu`` forward (torch's own return their input's
    dtype already; one without weights takes a 16-bit input on any device)."""
    for module in kept:
        if isinstance(module, FLOAT32_OFF_CPU) and any(p.dtype == torch.float32 for p in module.parameters()):
            # a bound method, so copy.deepcopy of the model binds it to the copy
            forward = float32_off_cpu(type(module).forward)
            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        elif not isinstance(module, NORM_TYPES) and _normalizes(module):
            module.register_forward_hook(cast_output_to_input_dtype, with_kwargs=True)


def float32_off_cpu(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A norm's ``forward`` that, off the CPU, runs on a float32 copy of a 16-bit input and returns the input's
    dtype; on the CPU, where the kernels take mixed dtypes, it is ``forward`` as it is (bit for bit)."""

    @functools.wraps(forward)
    def wrapped(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if x.device.type != "cpu" and x.dtype in LOW_DTYPES:
            return forward(self, x.float(), *args, **kwargs).to(x.dtype)
        return forward(self, x, *args, **kwargs)

    return wrapped


def to_float32(value: Any) -> Any:
    """``value`` with every 16-bit tensor in it float32: through tuples (named too), lists, dicts (transformers'
    ``ModelOutput`` among them, which keeps its type) and dataclasses; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in LOW_DTYPES else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # before dict: a ModelOutput is both
        return dataclasses.replace(value, **{f.name: to_float32(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, dict):
        cast = {k: to_float32(v) for k, v in value.items()}
        if type(value) is dict:
            return cast
        out = value.copy()  # the same dict type; ModelOutput's copy keeps its attributes in step with its items
        for k, v in cast.items():
            out[k] = v
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*[to_float32(v) for v in value])
    if isinstance(value, (tuple, list)):
        return type(value)(to_float32(v) for v in value)
    return value


def cast_output_to_float32(module: nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook: 16-bit tensors in the output become float32 (the O2/O3 model boundary)."""
    return to_float32(output)


@functools.cache
def loss_functions() -> frozenset[Callable[..., Any]]:
    """The ``torch.nn.functional`` losses whose op torch.autocast runs in float32 on some device (``cross_entropy``
    for ``cross_entropy_loss``, ``nll_loss``, ``kl_div``, ``mse_loss`` ...), read from the running torch's lists."""
    ops = {op for device in DEVICE_TYPES for op in Policy.default(device, torch.bfloat16).deny
           if "loss" in op or "entropy" in op or op == "kl_div"}
    found = (getattr(F, name, None) for op in ops for name in (op, op.removesuffix("_loss")))
    return frozenset(fn for fn in found if callable(fn))


class Float32Losses(TorchFunctionMode):
    """While entered, a loss function of ``loss_functions()`` takes its 16-bit tensors as float32 (O2's model
    keeps a loss it computes itself in float32, as torch.autocast would)."""

    def __init__(self, losses: frozenset[Callable[..., Any]] | None = None) -> None:
        super().__init__()
        self.losses = loss_functions() if losses is None else losses

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.losses:
            args, kwargs = to_float32(args), to_float32(kwargs)
        return func(*args, **kwargs)


def losses_in_float32(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under ``Float32Losses`` (for ``levels.wrap_forward``)."""
    losses = loss_functions()  # read here: torch.compile traces the forward, not a cached call

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with Float32Losses(losses):
            return forward(*args, **kwargs)

    return wrapped
