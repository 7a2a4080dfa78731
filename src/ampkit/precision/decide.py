"""Which GEMMs and convolutions compute in float32 on 16-bit values: the decision.

``"native"`` runs 16-bit kernels, ``"float32"`` runs every GEMM class in float32,
``"auto"`` decides per op class from ``ampkit.measure()`` (measured once per
machine, then cached; never assumed). ``decision`` is the one place a compute mode is
resolved; regions, ``initialize``, ``ampkit compare`` and ``inspect`` read its ``Decision``,
and a region reads its policy as ``resolve`` makes it: one ``Resolved``, plain data.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ampkit.hardware import throughput
from ampkit.hardware.advice import slow_native_message
from ampkit.hardware.flags import SlowPrecisionWarning
from ampkit.modes import ComputeModeWarning, check_compute
from ampkit.precision.policy import Policy, Resolved, known_op
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


class Decision(NamedTuple):
    """How one setting's GEMMs and convolutions compute on this machine (``decision`` makes it; nothing else turns
    a compute mode and the measurement behind it into ops)."""

    device_type: str
    dtype: torch.dtype
    compute: str
    classes: frozenset[str]  # the op classes ("conv", "matmul") computed in float32 on 16-bit values
    measured: throughput.Throughput | None  # what an "auto" decision read

    @property
    def ops(self) -> frozenset[str]:
        """The autocast-level ops computed in float32: the classes' ops this torch has."""
        return _existing(frozenset().union(*(GEMM_OPS[c] for c in self.classes)))

    @property
    def label(self) -> str:
        """In a few words: ``"native"`` or ``"float32 (conv, matmul)"``."""
        return f"float32 ({', '.join(sorted(self.classes))})" if self.classes else "native"

    def describe(self) -> str:
        """One sentence on how the GEMMs and convolutions compute here, with the measured figures behind an
        ``"auto"`` decision."""
        dtype, device_type = str(self.dtype).removeprefix("torch."), self.device_type
        if not self.classes:
            return f"{dtype} GEMMs and convolutions on {device_type} run natively in {dtype}."
        text = f"ampkit computes {' and '.join(sorted(self.classes))} in float32 on {dtype} values on {device_type}"
        if self.measured is None:
            return text + f" (compute='float32': emulating a tensor core's {dtype} numerics at float32 speed)."
        speeds = ", ".join(f"{c} {self.measured.speedup(c, self.dtype):.3g}x" for c in sorted(self.classes))
        return text + (
            f": measured on {self.measured.device_name}, native {dtype} kernels run at {speeds} float32's speed. "
            f"Tensors stay {dtype} (memory as a native run's, or less) and results are rounded as a tensor core rounds "
            "them; Policy(compute='native') forces the 16-bit kernels."
        )


def decision(device_type: str, dtype: torch.dtype, compute: str) -> Decision:
    """How ``dtype`` GEMMs and convolutions compute on ``device_type`` under ``compute``: ``"auto"`` reads
    ``throughput.measure(device_type)`` (measured once per machine, then cached) and computes in float32 each class
    whose native ``dtype`` kernel is slower than float32 here."""
    if compute == "native":
        return Decision(device_type, dtype, compute, frozenset(), None)
    if compute == "float32":
        return Decision(device_type, dtype, compute, frozenset(GEMM_OPS), None)
    check_compute(compute)  # a compute mode not given through a Policy (which checks its own)
    measured = throughput.measure(device_type)
    return Decision(device_type, dtype, compute,
                    frozenset(c for c in GEMM_OPS if not measured.native_is_faster(c, dtype)), measured)


def decision_of(policy: Policy) -> Decision:
    return decision(policy.device_type, policy.dtype, policy.compute)


@functools.cache
def _existing(ops: frozenset[str]) -> frozenset[str]:
    return frozenset(op for op in ops if known_op(op))


def resolve(policy: Policy) -> Resolved:
    """``policy`` resolved here: its compute mode decided, once a region. Says once a process what it chose for the
    setting: a ``ComputeModeWarning`` with the measured figures where GEMMs compute in float32, a
    ``SlowPrecisionWarning`` where ``"native"`` runs 16-bit kernels this machine runs slower than float32."""
    if not policy.enabled:
        return Resolved(policy, frozenset())
    chosen = decision_of(policy)
    device_type, dtype = policy.device_type, policy.dtype
    if chosen.classes:
        warn_once(f"compute:{device_type}:{dtype}:{policy.compute}", chosen.describe, ComputeModeWarning)
    elif policy.compute == "native":
        warn_once(f"slow:{device_type}:{dtype}", lambda: slow_native_message(device_type, dtype), SlowPrecisionWarning)
    return Resolved(policy, chosen.ops)
