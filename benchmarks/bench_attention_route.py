"""Float32 compute's attention: ampkit's public route against CPU's private flash kernels it called before.

Issue 71 takes public ops only for float32 compute, and asks for the figure where a custom op costs more than
10% of the private path's time. ampkit's attention (``float32_compute/single_ops.py``) runs the public
``F.scaled_dot_product_attention`` on float32 copies of 16-bit q, k, v and saves the 16-bit tensors only; its
backward runs that forward again under autograd (torch's attention backward kernels are private). Until issue 71
it called ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward directly (kept here, as the
reference, in this script only), saving the 16-bit output and the log-sum-exp as well. A third route keeps
autograd's float32 graph (saving float32 copies of q, k, v and the output). Each route, forward and backward of
one causal attention in bf16, timed in alternation (medians of ``--repeats`` rounds), and the bytes each saves for
backward, at two sizes: the ``ampkit compare`` GPT's attention, and a larger one.

Writes results/attention-route.json.

    python benchmarks/bench_attention_route.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ampkit.float32_compute import fast_paths
from common import interleaved_medians, save

SHAPES = {"compare GPT (8, 4, 64, 16)": (8, 4, 64, 16), "larger (4, 8, 512, 64)": (4, 8, 512, 64)}
DTYPE = torch.bfloat16


class _PrivateKernels(torch.autograd.Function):
    """What ampkit ran before issue 71: CPU's flash kernel and its backward, by their private names, on float32
    copies; saves the 16-bit q, k, v and output and the float32 log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), 0.0, True)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v, out, logsumexp = ctx.saved_tensors
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.float(), q.float(), k.float(), v.float(), out.float(), logsumexp, 0.0, True)
        return tuple(g.to(q.dtype) for g in grads[:3])


PRIVATE = "private kernels (before issue 71)"
ROUTES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    PRIVATE: _PrivateKernels.apply,
    "public, forward recomputed (ampkit)": lambda q, k, v: fast_paths.FAST[
        torch.ops.aten.scaled_dot_product_attention.default](q, k, v, is_causal=True),
    "public, float32 graph kept": lambda q, k, v: F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True).to(q.dtype),
}


def _saved_bytes(route: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        route(*inputs)
    inputs_storage = {t.untyped_storage().data_ptr() for t in inputs}
    return sum(n for ptr, n in seen.items() if ptr not in inputs_storage)  # q, k, v are the caller's anyway


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    for label, shape in SHAPES.items():
        inputs = [torch.randn(shape).to(DTYPE).requires_grad_() for _ in range(3)]
        grad = torch.randn(shape).to(DTYPE)

        def step(route: Callable[..., torch.Tensor]) -> Callable[[], None]:
            return lambda: torch.autograd.grad(route(*inputs), inputs, grad)

        seconds = interleaved_medians({name: step(route) for name, route in ROUTES.items()}, warmup=2,
                                      repeats=args.repeats)
        reference = seconds[PRIVATE]
        results[label] = {name: {"ms": s * 1e3, "ratio_to_private": s / reference,
                                 "saved_bytes": _saved_bytes(ROUTES[name], inputs)}
                          for name, s in seconds.items()}
        for name, row in results[label].items():
            print(f"{label:28s} {name:28s} {row['ms']:8.2f} ms {row['ratio_to_private']:6.3f}x "
                  f"saved {row['saved_bytes'] / 2**20:7.2f} MiB")
    print(f"wrote {save('attention-route', {'repeats': args.repeats, 'dtype': str(DTYPE), 'routes': results})}")


if __name__ == "__main__":
    main()
