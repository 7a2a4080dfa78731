"""The default allow / deny / infer op lists, per device, as data.

Names are ATen operator names without overload (``"softmax"`` covers
``aten::softmax.int`` and ``aten::softmax.Dimname``). The table holds torch.autocast's
own category for every op it has listed in a release ampkit is tested on
(``aten/src/ATen/autocast_mode.{h,cpp}``, 2.11 to 2.14.1): the union over releases,
since releases add and drop ops (2.14 removed ``cholesky`` and ``qr``, added
``linalg_matrix_sqrth``; ``rms_norm`` joined CUDA's list in 2.13). Which of them the
running torch autocasts is read from its dispatcher, not from here (``torch_lists``
takes that set): a default policy never names an op the running torch lacks.
``tests/test_op_lists.py`` checks the table against the installed torch's dispatcher and
runs every CPU op under torch.autocast, so a release that changes its lists fails a test
on the CI matrix instead of drifting silently.

This module imports nothing of ampkit.
"""

from __future__ import annotations

ALLOW = "allow"
DENY = "deny"
INFER = "infer"
CATEGORIES = (ALLOW, DENY, INFER)

_CPU_ALLOW = frozenset(
    """
    conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    _convolution bmm mm baddbmm addmm addbmm _addmm_activation linalg_vecdot linear
    matmul prelu mkldnn_rnn_layer scaled_dot_product_attention _native_multi_head_attention
    """.split()
)
_CPU_DENY = frozenset(
    """
    avg_pool3d max_pool3d adaptive_avg_pool3d adaptive_max_pool3d fractional_max_pool2d
    fractional_max_pool3d max_unpool2d max_unpool3d reflection_pad1d reflection_pad2d
    replication_pad1d replication_pad2d replication_pad3d grid_sampler grid_sampler_2d
    grid_sampler_3d _grid_sampler_2d_cpu_fallback polar prod quantile nanquantile stft
    cdist trace view_as_complex fake_quantize_per_tensor_affine
    cholesky cholesky_inverse cholesky_solve inverse lu_solve _lu_with_info orgqr ormqr
    pinverse geqrf qr svd triangular_solve
    linalg_cholesky linalg_cholesky_ex linalg_cond linalg_eig linalg_eigh linalg_eigvals
    linalg_eigvalsh linalg_householder_product linalg_inv linalg_inv_ex linalg_lstsq
    linalg_matrix_rank linalg_matrix_sqrth linalg_qr linalg_solve linalg_svd linalg_svdvals
    linalg_tensorinv linalg_tensorsolve
    fft_fft fft_fft2 fft_fftn fft_hfft fft_ifft fft_ifft2 fft_ifftn fft_ihfft fft_irfft
    fft_irfft2 fft_irfftn fft_rfft fft_rfft2 fft_rfftn
    binary_cross_entropy binary_cross_entropy_with_logits cross_entropy_loss nll_loss
    nll_loss2d mse_loss l1_loss smooth_l1_loss huber_loss kl_div ctc_loss poisson_nll_loss
    cosine_embedding_loss hinge_embedding_loss margin_ranking_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss multilabel_margin_loss
    multilabel_margin_loss_forward
    """.split()
)
_CPU_INFER = frozenset("cat stack index_copy".split())

_CUDA_ALLOW = frozenset(
    """
    _convolution convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
    conv_transpose3d cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr
    matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul
    linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
    rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
    scaled_dot_product_attention _cudnn_rnn
    """.split()
)
_CUDA_DENY_TORCH = frozenset(
    """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
    softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm
    cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
    margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
    upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
    upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
    _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
    prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm
    linalg_matrix_sqrth
    """.split()
)
_CUDA_INFER = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
)

# Ops torch.autocast refuses to run (it raises) and the message ampkit warns with,
# once, when it runs them in float32 instead.
BANNED: dict[str, dict[str, str]] = {
    "cuda": {
        "binary_cross_entropy": (
            "binary_cross_entropy / nn.BCELoss is unsafe in float16 (log of a probability "
            "that rounded to 0 or 1); torch.autocast raises here, ampkit runs it in float32. "
            "binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss is faster and exact "
            "under autocast: prefer it."
        ),
    },
    "cpu": {},
}

# What torch.autocast does, per device, in any release it lists the op in: category -> op names.
# Banned ops are absent. ``_cudnn_rnn`` (cudnn/AutocastRNN.cpp) casts to the 16-bit dtype like the allow list.
TABLE: dict[str, dict[str, frozenset[str]]] = {
    "cpu": {ALLOW: _CPU_ALLOW, DENY: _CPU_DENY, INFER: _CPU_INFER},
    "cuda": {ALLOW: _CUDA_ALLOW, DENY: _CUDA_DENY_TORCH, INFER: _CUDA_INFER},
}

DEVICE_TYPES = tuple(TABLE)


def autocast_key(device_type: str) -> str:
    """The dispatcher's Autocast key for ``device_type``, by the name ``torch.library`` takes: where torch's autocast
    kernels are, and where edited policies register theirs."""
    return {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device_type]


def torch_lists(device_type: str, autocast_ops: frozenset[str]) -> dict[str, frozenset[str]]:
    """torch.autocast's lists on a torch that has autocast kernels for ``autocast_ops``:
    the table less the ops that torch does not autocast (or lacks)."""
    return {category: ops & autocast_ops for category, ops in TABLE[device_type].items()}


def default_lists(device_type: str, autocast_ops: frozenset[str]) -> dict[str, frozenset[str]]:
    """ampkit's defaults on that torch: its decisions, with the banned ops it has run in float32."""
    lists = torch_lists(device_type, autocast_ops)
    return {**lists, DENY: lists[DENY] | (frozenset(BANNED[device_type]) & autocast_ops)}


def torch_category(device_type: str, op: str, autocast_ops: frozenset[str]) -> str | None:
    """What torch.autocast does with ``op`` on ``device_type``, on a torch that autocasts ``autocast_ops``.

    Returns:
        ``"allow"``, ``"deny"``, ``"infer"``, ``"banned"``, or None when torch
        leaves the op alone (it runs in its inputs' dtype).
    """
    if op not in autocast_ops:
        return None
    if op in BANNED[device_type]:
        return "banned"
    for category, ops in TABLE[device_type].items():
        if op in ops:
            return category
    return None
