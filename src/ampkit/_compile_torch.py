"""The torch.compile privates ampkit uses (dynamo, inductor, AOTAutograd), one wrapper each, as in ``_torch.py``.

Each says the torch versions it was checked on and what ampkit does where it is missing; ``_torch.missing()``
checks every one of them, so a torch release that moves one fails ``tests/test_torch_shim.py``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit._torch import _module, at_least, fallback_once, is_compiling

# inductor's custom pass base (``torch._inductor.custom_graph_pass.CustomGraphPass``, 2.6-2.14.1): its ``uuid()``
# enters inductor's and AOTAutograd's cache keys, which is how compiled graphs are keyed by policy.
CustomGraphPass: Any = getattr(_module("torch._inductor.custom_graph_pass"), "CustomGraphPass", object)


class _Passes(CustomGraphPass):  # type: ignore[misc, valid-type]
    """Several custom passes as one, for a torch whose inductor calls a single one (2.11: a list is not callable)."""

    def __init__(self, *passes: Any) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Any:
        ids = [getattr(p, "uuid", lambda: None)() for p in self.passes]
        return None if None in ids else repr(ids)  # None: inductor caches nothing (a pass without an id)


def add_inductor_key_pass(key_pass: Any) -> None:
    """Add ``key_pass`` to ``torch._inductor.config.post_grad_custom_pre_pass`` beside any pass the user set, once:
    alone where none is set, in a list where inductor takes one (``custom_graph_pass.get_custom_graph_passes``,
    2.13-2.14.1), else with the user's as one pass. Missing: AOTAutograd's and inductor's on-disk graph caches are
    turned off instead (said once)."""
    config: Any = _module("torch._inductor.config")
    if CustomGraphPass is object or not hasattr(config, "post_grad_custom_pre_pass"):
        fallback_once("torch._inductor.custom_graph_pass.CustomGraphPass", "the on-disk caches of compiled graphs are "
                      "turned off (they could not tell two ampkit policies apart)")
        for name, flag in (("torch._functorch.config", "enable_autograd_cache"),
                           ("torch._inductor.config", "fx_graph_cache")):
            setattr(_module(name) or types.SimpleNamespace(), flag, False)
        return
    current = config.post_grad_custom_pre_pass
    passes = list(current) if isinstance(current, (list, tuple)) else [] if current is None else [current]
    passes = [p for q in passes for p in (q.passes if isinstance(q, _Passes) else (q,))]
    if key_pass in passes:
        return
    if not passes:
        config.post_grad_custom_pre_pass = key_pass
    elif hasattr(_module("torch._inductor.custom_graph_pass"), "get_custom_graph_passes"):
        config.post_grad_custom_pre_pass = [*passes, key_pass]
    else:
        config.post_grad_custom_pre_pass = _Passes(*passes, key_pass)


def compiled_original(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper holds (``OptimizedModule._orig_mod``, 2.0-2.14.1), else
    ``module`` itself: module names are the model's own."""
    wrapper = getattr(_module("torch._dynamo.eval_frame"), "OptimizedModule", ())
    return module._orig_mod if isinstance(module, wrapper) else module  # type: ignore[return-value]


def skip_as_frame(fn: Callable[..., Any]) -> None:
    """Never compile ``fn`` as a frame of its own, yet inline it where dynamo traces a caller (``torch._dynamo.
    eval_frame.skip_code``, 2.4-2.14.1; ``torch._dynamo.skip`` would make callers break). Missing: dynamo may
    compile it alone (recompiles to its limit, then eager: slower, never wrong)."""
    skip_code = getattr(_module("torch._dynamo.eval_frame"), "skip_code", None)
    if skip_code is None:
        fallback_once("torch._dynamo.eval_frame.skip_code", "dynamo may compile ampkit's policy guard on its own")
    else:
        skip_code(fn.__code__)


def _translator() -> Any:
    """dynamo's translator of the frame it compiles in this thread, else None (``InstructionTranslator.current_tx``,
    2.1-2.14.1)."""
    translator = getattr(_module("torch._dynamo.symbolic_convert"), "InstructionTranslator", None)
    return translator.current_tx() if translator is not None and is_compiling() else None


def _tracer() -> Any:
    """The output graph dynamo is building in this thread, else None."""
    return getattr(_translator(), "output", None)


# Named in ampkit's error messages: the setting under which a graph can end inside a module, and the tool that
# shows graph breaks.
NESTED_GRAPH_BREAKS = "torch._dynamo.config.nested_graph_breaks"
EXPLAIN = "torch._dynamo.explain"


def trace_ends_in_a_graph() -> bool:
    """Whether dynamo's cleanup hooks run because its graph is complete (``OutputGraph.compile_and_call_fx_graph``
    calls them, 2.1-2.14.1), not because the trace stopped part-way."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "compile_and_call_fx_graph":
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None


def on_trace_end(fn: Callable[[], None]) -> None:
    """Call ``fn`` when dynamo's trace in progress ends, finished or stopped part-way (``OutputGraph.
    add_cleanup_hook``, 2.1-2.14.1, dynamo's own way to close its context managers); outside a trace, never."""
    if (tracer := _tracer()) is not None:
        tracer.add_cleanup_hook(fn)


def graph_op_with_side_effects(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` as a node of dynamo's graph, kept though nothing uses its result (``torch.fx.node.has_side_effect``,
    2.1-2.14.1). Missing: ``can_trace_module_regions()`` says False, and the function is never traced."""
    mark = getattr(torch.fx.node, "has_side_effect", None)
    if mark is not None:
        mark(fn)
    return torch.compiler.allow_in_graph(fn)


def trace_backward_without_autocast() -> None:
    """AOTAutograd traces the backward of the graph dynamo is building with autocast off, until the trace ends
    (``torch._functorch.config.backward_pass_autocast``, 2.5-2.14.1; its default traces it under the forward's)."""
    config: Any = _module("torch._functorch.config")
    if _tracer() is None or not hasattr(config, "backward_pass_autocast"):
        return
    before, config.backward_pass_autocast = config.backward_pass_autocast, "off"
    on_trace_end(lambda: setattr(config, "backward_pass_autocast", before))


def can_trace_module_regions() -> bool:
    """Whether this torch has what per-module overrides need to be traced into a graph (above). Missing:
    their hooks run eagerly, a graph break at every module call while such a policy is open (said once)."""
    # and a dynamo that takes a module as a constant argument of ``assume_constant_result`` (2.13 on; 2.11 raises
    # AsPythonConstantNotImplementedError at the first overridden module it traces)
    found = (at_least(2, 13)
             and getattr(getattr(_module("torch._dynamo.symbolic_convert"), "InstructionTranslator", None),
                         "current_tx", None) is not None
             and hasattr(getattr(_module("torch._dynamo.output_graph"), "OutputGraph", None), "add_cleanup_hook")
             and hasattr(_module("torch._functorch.config"), "backward_pass_autocast")
             and hasattr(torch.fx.node, "has_side_effect"))
    if not found:
        fallback_once("dynamo's InstructionTranslator.current_tx / OutputGraph.add_cleanup_hook / AOTAutograd's "
                      "backward_pass_autocast / modules as constants (2.13 on)", "per-module overrides break compiled "
                      "graphs at every module call")
    return found


# Looked up once: dynamo cannot trace an import where the traced code calls the wrapper.
_funcol: Any = _module("torch.distributed._functional_collectives")


def all_reduce_max(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The maximum of ``tensor`` over ``group``'s ranks, as a new tensor: torch's functional collective
    (``torch.distributed._functional_collectives.all_reduce``, 2.2-2.14.1), which torch.compile traces into its
    graph. Missing: ``torch.distributed.all_reduce`` in place (eager code only; dynamo breaks its graph there)."""
    if _funcol is None or not hasattr(_funcol, "all_reduce"):
        fallback_once("torch.distributed._functional_collectives.all_reduce", "amaxes are reduced in place, and "
                      "compiled code breaks its graph at each reduction")
        out = tensor.clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=group)
        return out
    return _funcol.wait_tensor(_funcol.all_reduce(tensor, "max", group))
