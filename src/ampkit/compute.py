"""How allow-list ops compute: natively in 16 bits, or in float32 on 16-bit values.

A mixed precision policy decides two things that torch.autocast ties together:
the 16-bit format values are *rounded to and stored in*, and the arithmetic
its GEMMs and convolutions *compute* in. Tensor cores and CPUs with AVX-512
BF16 compute 16-bit GEMMs natively and fast. A CPU without them (AVX2 only)
emulates them in software, many times slower than float32 (as
``ampkit.hardware.measure`` finds; never assumed). There ampkit computes those
ops in float32 on the 16-bit values and rounds the result back to 16 bits,
forward and backward:

- memory is a native run's: autograd saves the 16-bit tensors (less where a linear
  reads a GELU's output: it recomputes that instead of saving it, see ``_Linear``);
- the numerics are a tensor core's (16-bit inputs, float32 accumulation,
  output rounded once), so the same mode emulates GPU numerics on any CPU,
  float16 overflow to inf and subnormals included;
- elementwise ops stay in 16 bits, where halving the bytes makes them faster.

How. An allow-list op with ``float32`` compute runs inside
``_Float32Compute`` (an autograd Function) under ``_UpcastGemms`` (a
TorchDispatchMode below autograd): the op's own decomposition is recorded in
a nested graph whose GEMM/convolution kernels (``BACKEND_OPS``) receive the
16-bit tensors, compute on float32 copies and round their outputs to the
dtype the native kernel would return. The Function's backward replays that
graph under the same mode, so backward GEMMs compute in float32 too, although
``loss.backward()`` runs outside the autocast region.

This module imports nothing of ampkit but ``hardware``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ampkit import hardware

if TYPE_CHECKING:
    from ampkit.policy import Policy

COMPUTE_MODES = ("auto", "native", "float32")

# The op classes a measurement distinguishes, and the autocast-level (ATen) ops of
# each whose work is GEMMs or convolutions: with float32 compute for a class,
# these ops run through _Float32Compute. Other allow-list ops (prelu) are
# elementwise and stay native.
GEMM_OPS: dict[str, frozenset[str]] = {
    "conv": frozenset(
        """
        conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
        _convolution convolution cudnn_convolution cudnn_convolution_transpose
        """.split()
    ),
    "matmul": frozenset(
        """
        mm bmm addmm baddbmm addbmm _addmm_activation addmv addr mv matmul linear einsum
        chain_matmul linalg_multi_dot linalg_vecdot mkldnn_rnn_layer _thnn_fused_lstm_cell
        _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        scaled_dot_product_attention _scaled_dot_product_flash_attention _native_multi_head_attention
        """.split()
    ),
}

# Kernels below autograd that do the arithmetic of those ops, forward and backward
# (names as TorchDispatchMode sees them: torch.ops.aten.<name>). CUDA's flash and
# cuDNN attention kernels take no float32 inputs, so they are not here: attention that
# torch routes to them stays native (fast where they exist: on tensor-core GPUs).
BACKEND_OPS = frozenset(
    """
    mm bmm addmm baddbmm addbmm _addmm_activation addmv addr mv dot vdot
    convolution convolution_backward _convolution mkldnn_rnn_layer mkldnn_rnn_layer_backward
    _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
    _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
    _native_multi_head_attention _thnn_fused_lstm_cell _thnn_fused_gru_cell
    """.split()
)
# Of those, the ones whose floating inputs must share one dtype (torch refuses a
# bfloat16 x float32 GEMM); attention's backward also takes a float32 logsumexp.
ONE_DTYPE_OPS = frozenset(
    "mm bmm addmm baddbmm addbmm _addmm_activation addmv addr mv dot vdot convolution convolution_backward "
    "_convolution".split()
)
_LOW = (torch.float16, torch.bfloat16)


class ComputeModeWarning(UserWarning):
    """Says, once per device, dtype and mode, that GEMMs compute in float32 on 16-bit values."""


def check_compute(compute: str) -> str:
    """Return ``compute`` if it is a compute mode, else raise ValueError."""
    if compute not in COMPUTE_MODES:
        raise ValueError(
            f"Unknown compute mode: {compute!r}. Choose one of {list(COMPUTE_MODES)}: 'native' runs 16-bit "
            "kernels, 'float32' computes GEMMs and convolutions in float32 on the 16-bit values, 'auto' "
            "picks per op class what the measured hardware runs faster."
        )
    return compute


def float32_classes(device_type: str, dtype: torch.dtype, compute: str) -> frozenset[str]:
    """The op classes (``"conv"``, ``"matmul"``) that compute in float32 under ``compute``.

    ``"auto"`` reads ``hardware.measure(device_type)`` (measured once per machine,
    then cached): float32 for each class whose native ``dtype`` kernel is slower
    than float32 here.
    """
    check_compute(compute)
    if compute == "native":
        return frozenset()
    if compute == "float32":
        return frozenset(GEMM_OPS)
    measured = hardware.measure(device_type)
    return frozenset(c for c in GEMM_OPS if not measured.native_is_faster(c, dtype))


@functools.cache
def _existing(ops: frozenset[str]) -> frozenset[str]:
    names = {n[len("aten::") :].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    return ops & names


def float32_ops(policy: Policy) -> frozenset[str]:
    """The autocast-level ops that ``policy`` runs through ``run_in_float32``."""
    classes = float32_classes(policy.device_type, policy.dtype, policy.compute)
    return _existing(frozenset().union(*(GEMM_OPS[c] for c in classes)))


def label(policy: Policy) -> str:
    """How ``policy`` computes here, in a few words: ``"native"`` or ``"float32 (conv, matmul)"``."""
    classes = float32_classes(policy.device_type, policy.dtype, policy.compute)
    return f"float32 ({', '.join(sorted(classes))})" if classes else "native"


def describe(policy: Policy) -> str:
    """One sentence on how ``policy``'s GEMMs and convolutions compute here, with the
    measured figures behind an ``"auto"`` decision."""
    dtype = str(policy.dtype).removeprefix("torch.")
    classes = float32_classes(policy.device_type, policy.dtype, policy.compute)
    if not classes:
        return f"{dtype} GEMMs and convolutions on {policy.device_type} run natively in {dtype}."
    names = " and ".join(sorted(classes))
    text = f"ampkit computes {names} in float32 on {dtype} values on {policy.device_type}"
    if policy.compute == "auto":
        measured = hardware.measure(policy.device_type)
        speeds = ", ".join(f"{c} {measured.speedup(c, policy.dtype):.3g}x" for c in sorted(classes))
        text += (
            f": measured on {measured.device_name}, native {dtype} kernels run at {speeds} float32's speed. "
            f"Tensors stay {dtype} (memory as a native run's, or less) and results are rounded as a tensor core rounds "
            "them; Policy(compute='native') forces the 16-bit kernels."
        )
    else:
        text += f" (compute='float32': emulating a tensor core's {dtype} numerics at float32 speed)."
    return text


# ---------------------------------------------------------------------------
# The dispatch mode: GEMM kernels on 16-bit tensors compute in float32


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``fn`` over the tensors of an op's argument (a tensor, or a list/tuple of them);
    a lighter pytree.tree_map for the arguments ATen kernels take."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


def _float_dtypes(value: Any, found: set[torch.dtype]) -> set[torch.dtype]:
    """The floating dtypes among an op's argument's tensors, added to ``found``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.add(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _float_dtypes(v, found)
    return found


_handled: dict[torch._ops.OpOverload, bool] = {}
_out_dtypes: dict[tuple, tuple[torch.dtype | None, ...]] = {}


def _is_backend_op(func: torch._ops.OpOverload) -> bool:
    found = _handled.get(func)
    if found is None:
        found = _handled[func] = func.overloadpacket.__name__ in BACKEND_OPS and not func._schema.is_mutable
    return found


def _native_out_dtypes(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[torch.dtype | None, ...]:
    """The dtypes of ``func``'s outputs when run natively, found once per input-dtype
    signature on meta tensors (no arithmetic)."""
    leaves = pytree.tree_leaves((args, kwargs))
    key = (func, tuple(t.dtype if isinstance(t, torch.Tensor) else type(t) for t in leaves))
    found = _out_dtypes.get(key)
    if found is None:
        def to_meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        meta_args = _map_tensors(to_meta, args)
        meta_kwargs = {k: _map_tensors(to_meta, v) for k, v in kwargs.items()}
        with _disable_current_modes():  # modes below ours need not see this dry run
            out = func(*meta_args, **meta_kwargs)
        found = tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(out))
        _out_dtypes[key] = found
    return found


_PLAIN = (torch.Tensor, nn.Parameter)


class _Upcasts:
    """float32 copies of 16-bit tensors, memoized per storage: a weight or gradient that
    several GEMMs read (a linear's backward reads its output gradient twice; attention's
    q, k and v are views of one projection's output) is converted once. One instance
    serves one forward or backward; float32 tensors pass through."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in _LOW:
            return t
        storage = t.untyped_storage()
        if storage.nbytes() > 4 * max(t.numel() * t.element_size(), 1) or storage.nbytes() % t.element_size():
            return t.float()  # a small view of a big storage: convert just the view
        key = (storage.data_ptr(), t._version, t.dtype)
        whole = self._memo.get(key)
        if whole is None:
            whole = self._memo[key] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage).float()
        return whole.as_strided(t.shape, t.stride(), t.storage_offset())


class _UpcastGemms(TorchDispatchMode):
    """Run BACKEND_OPS that receive 16-bit tensors on float32 copies (``_Upcasts``) and
    round their outputs to the dtypes the native kernel returns; every other op runs
    untouched. One instance serves one nested forward or backward."""

    def __init__(self) -> None:
        super().__init__()
        self._upcast = _Upcasts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not _is_backend_op(func) or any(
                isinstance(t, torch.Tensor) and type(t) not in _PLAIN for t in pytree.tree_leaves((args, kwargs))):
            # A tensor subclass (torchao's FP8 tensors, for one) computes by its own rules: leave it alone.
            return func(*args, **kwargs)
        dtypes = _float_dtypes((args, list(kwargs.values())), set())
        low = dtypes & set(_LOW)
        # Mixed dtypes that torch refuses run natively, so the error is torch's own.
        mixed = len(dtypes) > 1 and (len(low) > 1 or func.overloadpacket.__name__ in ONE_DTYPE_OPS)
        if not low or mixed:
            return func(*args, **kwargs)
        out_dtypes = _native_out_dtypes(func, args, kwargs)
        with _disable_current_modes():  # the conversions are ours: modes below see the float32 kernel
            args = _map_tensors(self._upcast, args)
            kwargs = {k: _map_tensors(self._upcast, v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        flat, spec = pytree.tree_flatten(out)
        rounded = [
            t.to(dtype) if isinstance(t, torch.Tensor) and dtype is not None and t.dtype != dtype else t
            for t, dtype in zip(flat, out_dtypes)
        ]
        return pytree.tree_unflatten(rounded, spec)


# ---------------------------------------------------------------------------
# The autograd Function: a nested graph, replayed under the mode in backward

# The nested graph's aliases of weights (parameters, and 16-bit copies of them made by
# autocast): memory accounting counts what the nested graph saves of these storages as
# weights, as it does for a native op, which saves the weight copy itself.
_weight_aliases: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()


def is_weight(t: torch.Tensor) -> bool:
    """A parameter (a leaf that requires grad) or a copy of one (``is_weight_copy``)."""
    return t.requires_grad if t.is_leaf else is_weight_copy(t)


def is_weight_copy(t: torch.Tensor) -> bool:
    """A copy of a parameter cast by autocast, or a view of one (a linear saves the
    transposed weight): its only autograd input is a leaf's gradient accumulator."""
    fn = (t._base if t._base is not None else t).grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    inputs = [next_fn for next_fn, _ in fn.next_functions if next_fn is not None]
    return bool(inputs) and all(next_fn.name().endswith("AccumulateGrad") for next_fn in inputs)


def weight_storages() -> set[int]:
    """Storage addresses of the weights that live float32-compute ops hold (see ``is_weight``)."""
    return {t.untyped_storage().data_ptr() for t in list(_weight_aliases)}



class _Float32Compute(torch.autograd.Function):
    """``fn`` on float32-computing kernels; its backward replays the nested graph
    under the same mode. Inputs are the flattened call (tensors and constants)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[list[Any]], Any], *flat: Any) -> Any:  # type: ignore[override]
        inputs = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in flat]
        for outer, inner in zip(flat, inputs):
            if isinstance(outer, torch.Tensor) and is_weight(outer):
                _weight_aliases.add(inner)
        with torch.enable_grad(), _UpcastGemms():
            outs = fn(inputs)
        ctx.inputs, ctx.outputs = inputs, outs
        ctx.set_materialize_grads(False)  # outputs nobody used get None, not zeros to multiply
        detached = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in outs)
        ctx.mark_non_differentiable(
            *(d for t, d in zip(outs, detached) if isinstance(t, torch.Tensor) and t.grad_fn is None)
        )
        return detached

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:
        if ctx.outputs is None:
            raise RuntimeError(
                "Trying to backward through a float32-compute op a second time: these ops support one "
                "backward per forward (their nested graph is freed by the first, as a native op's saved "
                "tensors are). For retain_graph=True or double backward, use Policy(compute='native')."
            )
        pairs = [
            (o, g) for o, g in zip(ctx.outputs, grads)
            if g is not None and isinstance(o, torch.Tensor) and o.grad_fn is not None
        ]
        wanted = [i for i, t in enumerate(ctx.inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        found: dict[int, torch.Tensor | None] = {}
        if pairs and wanted:
            with _UpcastGemms():
                grads_in = torch.autograd.grad(
                    [o for o, _ in pairs], [ctx.inputs[i] for i in wanted], [g for _, g in pairs], allow_unused=True
                )
            found = dict(zip(wanted, grads_in))
        count = len(ctx.inputs)
        ctx.inputs = ctx.outputs = None  # the nested graph and its saved tensors go now
        return (None, *(found.get(i) for i in range(count)))


# ---------------------------------------------------------------------------
# Fast paths: the ops that carry most of a network's arithmetic, as explicit autograd
# Functions. The generic path above costs a millisecond or more of Python per op and
# step (a dispatch mode, a nested graph, its replay); these compute the same kernels
# on the same values for a fraction of that.


def passthrough(pack_hook: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """Mark a ``saved_tensors_hooks`` pack hook that returns its tensor as it is (one that
    only looks, as ``memory.saved_bytes_of_step`` does): under it, ``_Linear`` still
    recomputes a GELU output instead of saving it (see ``_gelu_input``)."""
    pack_hook._ampkit_passthrough = True  # type: ignore[attr-defined]
    return pack_hook


def identity_forward(cls: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Mark an autograd Function whose forward returns its first input unchanged, whole (a
    view, as a gradient rescaling does; ``AdaptiveLossScaler``'s brackets): ``_Linear`` looks
    through it for a GELU output (see ``_gelu_input``)."""
    cls._ampkit_identity_forward = True  # type: ignore[attr-defined]
    return cls


def _gelu_input(x: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """When ``x`` is the output of a GELU (a transformer MLP's hidden layer), possibly behind
    ``identity_forward`` Functions, the GELU's input and mode: autograd keeps that input for
    the GELU's own backward, so a linear reading ``x`` can save nothing more and recompute
    ``x`` in its backward (the same kernel on the same 16-bit values: bit for bit). None
    otherwise, or when saved-tensor hooks other than a ``passthrough`` one are active
    (offloading, checkpointing), whose unpacking during forward is theirs to decide."""
    fn = x.grad_fn
    while fn is not None and getattr(getattr(fn, "_forward_cls", None), "_ampkit_identity_forward", False):
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "GeluBackward0":
        return None
    base = x._base  # x must be the whole output (a view through identity Functions is), not a part of it
    if base is not None and (x.shape, x.stride(), x.storage_offset()) != (base.shape, base.stride(),
                                                                         base.storage_offset()):
        return None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and not getattr(hooks[0], "_ampkit_passthrough", False):
        return None
    source = fn._saved_self  # type: ignore[attr-defined]
    if source.dtype != x.dtype or source.shape != x.shape:
        return None
    return source, fn._saved_approximate  # type: ignore[attr-defined]


def _rounded(grads: Sequence[torch.Tensor], dtype: torch.dtype, wanted: Sequence[bool]) -> list[torch.Tensor | None]:
    """A float32 kernel's input gradients rounded to the inputs' 16-bit ``dtype``; None where not wanted."""
    return [g.to(dtype) if want else None for g, want in zip(grads, wanted)]


class _Linear(torch.autograd.Function):
    """``F.linear`` in float32 on 16-bit ``x``, ``w`` (and ``b``), each GEMM's result rounded
    once, as torch's own linear (addmm) and its backward (two mm, a sum) are.

    A GELU output ``x`` is not saved: its backward recomputes it from the GELU's input,
    which autograd keeps anyway (a transformer MLP then saves one hidden-size tensor, not two)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        gelu = _gelu_input(x)
        ctx.gelu = None if gelu is None else gelu[1]
        ctx.save_for_backward(x if gelu is None else gelu[0], w)
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        if ctx.gelu is not None:
            x = F.gelu(x, approximate=ctx.gelu)
        grad32 = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad32, w.float()).to(x.dtype)
        flat = grad32.reshape(-1, grad32.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = (flat.t() @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = flat.sum(0).to(w.dtype)
        return grad_x, grad_w, grad_b


class _Convolution(torch.autograd.Function):
    """``aten.convolution`` in float32 on 16-bit tensors; backward through
    ``aten.convolution_backward``, each result rounded once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *params: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.params, ctx.bias_sizes = params, None if b is None else list(b.shape)
        out = torch.ops.aten.convolution(x.float(), w.float(), None if b is None else b.float(), *params)
        return out.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        mask = list(ctx.needs_input_grad[:3])
        grads = torch.ops.aten.convolution_backward(
            grad.float(), x.float(), w.float(), ctx.bias_sizes, *ctx.params, mask
        )
        return (*_rounded(grads, x.dtype, mask), *(None for _ in ctx.params))


class _Attention(torch.autograd.Function):
    """``scaled_dot_product_attention`` through CPU's flash kernel in float32 on 16-bit q, k,
    v: what the generic path runs (the same kernel on the same float32 copies, its output
    rounded, backward reading that rounded output), without a dispatch mode and a nested
    graph. Saves what the native kernel saves: q, k, v, the 16-bit output and the float32
    log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,  # type: ignore[override]
                scale: float | None) -> torch.Tensor:
        up = _Upcasts()  # q, k and v are often views of one tensor: one conversion
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            up(q), up(k), up(v), 0.0, is_causal, scale=scale
        )
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v, out, logsumexp = ctx.saved_tensors
        up = _Upcasts()
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.float(), up(q), up(k), up(v), out.float(), logsumexp, 0.0, ctx.is_causal, scale=ctx.scale
        )
        return (*_rounded(grads, q.dtype, ctx.needs_input_grad[:3]), None, None)


def _same_low_dtype(*tensors: torch.Tensor | None) -> bool:
    dtypes = {t.dtype for t in tensors if t is not None}
    return len(dtypes) == 1 and dtypes.pop() in _LOW


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> Any:
    if not _same_low_dtype(x, w, b):
        return NotImplemented
    return _Linear.apply(x, w, b)


def _convnd(dims: int) -> Callable[..., Any]:
    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, stride: Any = 1, padding: Any = 0,
             dilation: Any = 1, groups: int = 1) -> Any:
        if not _same_low_dtype(x, w, b) or isinstance(padding, str) or x.dim() != dims + 2:
            return NotImplemented  # unbatched input, padding="same": the generic path

        def expand(v: Any) -> list[int]:
            return [v] * dims if isinstance(v, int) else list(v)

        params = (expand(stride), expand(padding), expand(dilation), False, [0] * dims, groups)
        return _Convolution.apply(x, w, b, *params)

    return conv


def _convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *params: Any) -> Any:
    if not _same_low_dtype(x, w, b):
        return NotImplemented
    return _Convolution.apply(x, w, b, *params)


_FLASH = SDPBackend.FLASH_ATTENTION.value


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Any:
    # The case the flash kernel serves on the CPU, as torch itself would pick it for these 16-bit
    # inputs; masks (converted by torch before the kernel), dropout (its random draws) and
    # grouped-query attention take the generic path.
    if (attn_mask is not None or dropout_p or enable_gqa or not q.is_cpu or not _same_low_dtype(q, k, v)
            or torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale) != _FLASH):
        return NotImplemented
    return _Attention.apply(q, k, v, is_causal, scale)


_FAST: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.scaled_dot_product_attention.default: _attention,
    torch.ops.aten.linear.default: _linear,
    torch.ops.aten.conv1d.default: _convnd(1),
    torch.ops.aten.conv2d.default: _convnd(2),
    torch.ops.aten.conv3d.default: _convnd(3),
    torch.ops.aten.convolution.default: _convolution,
}


def run_in_float32(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` with its GEMMs and convolutions computed in float32.

    16-bit inputs stay 16-bit (autograd saves them as they are); each GEMM
    kernel, forward and backward, computes on float32 copies and rounds its
    output to the dtype the native kernel would return.
    """
    fast = _FAST.get(fn)
    if fast is not None:
        result = fast(*args, **kwargs)
        if result is not NotImplemented:
            return result
    flat, spec = pytree.tree_flatten((args, kwargs))
    if not any(isinstance(t, torch.Tensor) and t.dtype in _LOW for t in flat):
        return fn(*args, **kwargs)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
    if not grad:
        with _UpcastGemms():
            return fn(*args, **kwargs)
    out_spec: list[pytree.TreeSpec] = []

    def call(inputs: list[Any]) -> list[torch.Tensor]:
        call_args, call_kwargs = pytree.tree_unflatten(inputs, spec)
        leaves, tree = pytree.tree_flatten(fn(*call_args, **call_kwargs))
        out_spec.append(tree)
        return leaves

    outs = _Float32Compute.apply(call, *flat)
    return pytree.tree_unflatten(list(outs), out_spec[0])
