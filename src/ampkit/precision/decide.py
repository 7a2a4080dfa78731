"""Which GEMMs and convolutions compute in float32 on 16-bit values: the decision.

``"native"`` runs 16-bit kernels, ``"float32"`` runs every GEMM class in float32,
``"auto"`` decides per op class from ``ampkit.measure()`` (measured once per
machine, then cached; never assumed).
"""

from __future__ import annotations

import functools

import torch

from ampkit.hardware import throughput
from ampkit.hardware.advice import slow_native_message
from ampkit.hardware.flags import SlowPrecisionWarning
from ampkit.modes import ComputeModeWarning, check_compute
from ampkit.precision.policy import Policy, known_op
from ampkit.precision.state import warn_once

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


def float32_classes(device_type: str, dtype: torch.dtype, compute: str) -> frozenset[str]:
    """The op classes (``"conv"``, ``"matmul"``) that compute in float32 under ``compute``.

    ``"auto"`` reads ``throughput.measure(device_type)`` (measured once per machine,
    then cached): float32 for each class whose native ``dtype`` kernel is slower
    than float32 here.
    """
    check_compute(compute)
    if compute == "native":
        return frozenset()
    if compute == "float32":
        return frozenset(GEMM_OPS)
    measured = throughput.measure(device_type)
    return frozenset(c for c in GEMM_OPS if not measured.native_is_faster(c, dtype))


@functools.cache
def _existing(ops: frozenset[str]) -> frozenset[str]:
    return frozenset(op for op in ops if known_op(op))


def float32_ops(policy: Policy) -> frozenset[str]:
    """The autocast-level ops that ``policy`` runs through ``run_in_float32``."""
    classes = float32_classes(policy.device_type, policy.dtype, policy.compute)
    return _existing(frozenset().union(*(GEMM_OPS[c] for c in classes)))


def resolve(policy: Policy) -> frozenset[str]:
    """The ops a region of ``policy`` computes in float32 here: its compute mode resolved, once a region (regions
    read the result, ``Region.float32_ops``). Says once a process what it chose for the setting: a
    ``ComputeModeWarning`` with the measured figures where GEMMs compute in float32, a ``SlowPrecisionWarning``
    where ``"native"`` runs 16-bit kernels this machine runs slower than float32."""
    if not policy.enabled:
        return frozenset()
    ops = float32_ops(policy)
    device_type, dtype = policy.device_type, policy.dtype
    if ops:
        warn_once(f"compute:{device_type}:{dtype}:{policy.compute}", lambda: describe(policy), ComputeModeWarning)
    elif policy.compute == "native":
        warn_once(f"slow:{device_type}:{dtype}", lambda: slow_native_message(device_type, dtype), SlowPrecisionWarning)
    return ops


def compute_label(policy: Policy) -> str:
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
        measured = throughput.measure(policy.device_type)
        speeds = ", ".join(f"{c} {measured.speedup(c, policy.dtype):.3g}x" for c in sorted(classes))
        text += (
            f": measured on {measured.device_name}, native {dtype} kernels run at {speeds} float32's speed. "
            f"Tensors stay {dtype} (memory as a native run's, or less) and results are rounded as a tensor core rounds "
            "them; Policy(compute='native') forces the 16-bit kernels."
        )
    else:
        text += f" (compute='float32': emulating a tensor core's {dtype} numerics at float32 speed)."
    return text
