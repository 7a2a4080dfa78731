"""torch.compile (inductor) against eager under every kind of ampkit policy, one interleaved run per model.

Per model (ResNet-18 and the GPT of `ampkit compare`, and the wider GPT of bench_autocast.py), one training
step (forward, backward, AdamW) in ten variants: float32, torch.autocast, ampkit's default policy, an edited
policy (GELU and softmax denied, layer norm allowed) and float32 compute (GEMMs in float32 on bfloat16
values), each eager and compiled (one model and optimizer per mode, shared by its variants). Reported:
ms/step (medians, variants timed in alternation), the ratios to eager float32 and to compiled torch.autocast,
each compiled variant's first-call seconds (the compile) and graph count, saved-for-backward bytes, and the
compiled logits' dtype and greatest difference from eager.

The 16-bit variants other than float32 compute run native bfloat16 kernels: on a CPU without native bf16
arithmetic (AVX2 only) they are many times slower than float32, and each variant leaves the rotation after
``BUDGET_S`` seconds of timed steps (at least 3).

    python benchmarks/bench_compile.py            # writes benchmarks/results/compile.json
    python benchmarks/bench_compile.py --only gpt
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Compile seconds are cold compiles: a fresh inductor cache for this run (graphs it caches, it reuses).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ampkit-bench-compile-")

import torch  # noqa: E402
import torch._dynamo.testing  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402

import ampkit  # noqa: E402
from ampkit.diagnostics.memory import saved_bytes_of_step  # noqa: E402
from ampkit.experiment.models import GPT, ResNet18  # noqa: E402
from common import RESULTS, interleaved_medians, save  # noqa: E402

WARMUP, REPEATS, BUDGET_S = 1, 21, 20.0


def _text(batch: int, context: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def data(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (batch, context + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    return data


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[torch.Generator], Any], str]] = {
    "resnet18": (ResNet18, lambda g: (torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)),
                 "ResNet-18, batch 64 of 28x28"),
    "gpt": (GPT, _text(32, 64), "the GPT of `ampkit compare` (d_model 128, 2 layers), batch 32, context 64"),
    "gpt-wide": (lambda: GPT(context=256, d_model=384, n_layers=4, n_heads=6), _text(2, 256),
                 "the wider GPT (d_model 384, 4 layers), batch 2, context 256"),
}


def regions() -> dict[str, Callable[[], Any]]:
    native = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    edited = native.with_ops(deny=["gelu", "softmax"], allow=["layer_norm"])
    return {
        "float32": contextlib.nullcontext,
        "torch.autocast": lambda: torch.autocast("cpu", torch.bfloat16),
        "ampkit default": lambda: ampkit.autocast(native),
        "ampkit edited": lambda: ampkit.autocast(edited),
        "ampkit float32 compute": lambda: ampkit.autocast(native.with_compute("float32")),
    }


def run_model(name: str, console: Console) -> dict[str, Any]:
    make, data, description = MODELS[name]
    x, y = data(torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    base = make()

    def loss_of(model: Any, region: Callable[[], Any]) -> torch.Tensor:
        with region():
            out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))

    steps: dict[str, Callable[[], None]] = {}
    first_s: dict[str, float] = {}
    graphs: dict[str, int] = {}
    saved: dict[str, int] = {}
    agreement: dict[str, dict[str, Any]] = {}
    torch._dynamo.reset()
    # One model and one optimizer per mode, shared by its policies: with a copy each, two variants that run the same
    # compiled graph (torch.autocast and ampkit's default policy, which is torch.autocast) differed by 8-13% on
    # ResNet-18, the copies' memory layout (measured on one model: 0.98x).
    models = {mode: copy.deepcopy(base) for mode in ("eager", "compiled")}
    optimizers = {mode: torch.optim.AdamW(model.parameters(), lr=1e-4) for mode, model in models.items()}
    for policy, region in regions().items():
        for mode in ("eager", "compiled"):
            label = f"{mode}, {policy}"
            model, optimizer = models[mode], optimizers[mode]
            counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")  # a backend each: graphs of its own
            call = torch.compile(model, backend=counter) if mode == "compiled" else model

            def step(call: Any = call, region: Callable[[], Any] = region, optimizer: Any = optimizer) -> None:
                optimizer.zero_grad(set_to_none=True)
                loss_of(call, region).backward()
                optimizer.step()

            if mode == "compiled":
                with torch.no_grad(), region():  # the compiled forward's values against eager's, same weights
                    got, eager = call(x), model(x)
                agreement[policy] = {"dtype_compiled": str(got.dtype), "dtype_eager": str(eager.dtype),
                                     "max_abs_diff": (got.float() - eager.float()).abs().max().item()}
                start = time.perf_counter()
                step()  # the training graphs' compile
                first_s[label] = time.perf_counter() - start
                graphs[label] = counter.frame_count
                if not graphs[label]:
                    raise RuntimeError(f"{name}, {label}: dynamo compiled no graph (it ran eagerly)")
            _, saved[label] = saved_bytes_of_step(model, lambda call=call, region=region: loss_of(call, region))
            model.zero_grad(set_to_none=True)
            steps[label] = step
            console.print(f"  {name}: {label} ready" + (f" (first step {first_s[label]:.1f} s, "
                                                          f"{graphs[label]} graphs)" if label in first_s else ""))
    seconds = interleaved_medians(steps, warmup=WARMUP, repeats=REPEATS, budget_s=BUDGET_S)
    ms = {label: 1000 * s for label, s in seconds.items()}
    for label, value in ms.items():
        console.print(f"{name:9s} {label:32s} {value:9.1f} ms/step  {value / ms['eager, float32']:6.2f}x float32")
    return {"description": description, "ms": ms, "first_step_s": first_s, "graphs": graphs,
            "saved_for_backward": saved, "agreement": agreement,
            "over_float32_eager": {label: value / ms["eager, float32"] for label, value in ms.items()},
            "over_compiled_torch_autocast": {label: value / ms["compiled, torch.autocast"]
                                             for label, value in ms.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder compile.json goes to")
    args = parser.parse_args()
    # Ten variants compile the same forward code, each under its own guards (policy, grad mode): past dynamo's
    # default limit of 8 graphs per code object the rest would run eagerly, unreported.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    warnings.simplefilter("ignore", ampkit.SlowPrecisionWarning)  # native kernels are the point here
    warnings.simplefilter("ignore", ampkit.ComputeModeWarning)
    console = Console()
    models = {name: run_model(name, console) for name in args.only}
    path = save("compile", {"backend": "inductor", "dtype": "torch.bfloat16", "budget_s": BUDGET_S,
                            "repeats": REPEATS, "models": models}, args.out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
