"""autocast(policy): run a region in mixed precision as a Policy says.

``autocast`` enters torch.autocast with the policy's dtype and pushes a region on the
calling thread's stack (``state.py``); the ops the policy handles unlike torch.autocast
get dispatcher kernels (``kernels.py``), the model's modules that per-module overrides match
get forward wrappers (``overrides.py``); a checkpointed segment recomputes under the region through
``checkpointing.checkpoint_context_fn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ampkit.precision import compiling, overrides
from ampkit.precision.decide import resolve
from ampkit.precision.kernels import registry
from ampkit.precision.policy import Policy
from ampkit.precision.state import Region, state, warn_once

F = TypeVar("F", bound=Callable[..., Any])


_SCRIPT_UNSUPPORTED = (
    "torch.jit.script cannot compile an ampkit.autocast region or a function decorated with one (TorchScript "
    "would keep none of the policy). Script the code inside the region and call it under ampkit.autocast from "
    "Python, or use torch.autocast in scripted code, as torch.jit.script supports it."
)


class autocast:  # noqa: N801 - named like torch.autocast, which it extends
    """Run a region (or a function) in mixed precision as ``policy`` says.

    Args:
        policy: the Policy; defaults to ``Policy.default()`` for the CPU.
        enabled: False (or a disabled policy) turns autocasting off inside the
            region, also inside an enclosing enabled region. Default True.
        model: the module whose modules the policy's per-module overrides match (names relative to it).
            Needed by a ``with`` region whose policy has overrides; a decorated ``forward`` takes its own module.

    Nestable, re-entrant and thread-safe: one instance can decorate a
    ``forward`` that runs in several threads at once. Casts of float32 weights
    are cached for the outermost region and dropped when it exits.

    Examples:
        >>> policy = ampkit.Policy.default("cpu", torch.bfloat16)
        >>> with ampkit.autocast(policy):
        ...     loss = loss_fn(model(x), y)
        >>> loss.backward()  # outside the region, as with torch.autocast

    Note:
        An edited policy, or float32 compute, registers process-wide dispatcher
        kernels on entry of the first region that needs them (under a millisecond),
        released when the last open region closes (kept while another thread runs
        rather than waits, doing there what torch.autocast does: ``precision/kernels.py``).
        ``"auto"`` compute reads ``ampkit.measure()``, which times this machine's
        kernels for about a second the first time it ever runs here (then it is
        cached on disk). Compiled code called inside a region traces the policy
        into its graph and runs only under that policy (docs/compile.md).
    """

    @torch.compiler.disable  # built eagerly too, inside compiled code: it reads measurements and may warn
    def __init__(self, policy: Policy | None = None, *, enabled: bool = True, model: nn.Module | None = None) -> None:
        policy = policy if policy is not None else Policy.default("cpu")
        if not isinstance(policy, Policy):
            raise ValueError(
                f"ampkit.autocast takes an ampkit.Policy, got {type(policy).__name__}: "
                "build one with ampkit.Policy.default(device_type, dtype)."
            )
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled={enabled!r} is not a bool: pass True or False (as torch.autocast).")
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model={type(model).__name__} is not an nn.Module: pass the model whose modules the "
                             "policy's overrides name, or leave it out.")
        self.model = model
        if policy.enabled and policy.device_type == "cuda" and not torch.cuda.is_available():
            # torch.autocast warns and disables itself here; so does ampkit (a decorated function must not
            # break the import of its module on a machine without CUDA).
            warn_once("no-cuda", "ampkit.autocast: a CUDA policy on a machine where CUDA is not available (torch "
                      f"{torch.__version__}): the region is disabled, as torch.autocast disables itself.")
            enabled = False
        self.policy = policy if enabled else policy.disabled()
        self.resolved = resolve(self.policy)  # the compute mode decided here once (and said once a process)
        self._kernel_ops = self.resolved.kernel_ops
        self._overrides = bool(self.policy.enabled and self.policy.overrides)  # wrap the model's matching modules
        # torch.compile guards on torch.autocast's state: a policy that differs carries a guard of its own
        self._guard = compiling.guard_for(self.resolved) if compiling.needs_guard(self.resolved) else None

    @torch.compiler.disable  # the region opens and closes eagerly; what runs inside it compiles
    def __enter__(self) -> autocast:
        self._enter(self.model, root=True)
        return self

    @torch.compiler.disable
    def _enter(self, model: nn.Module | None, root: bool) -> None:
        """Open the region; with overrides, wrap ``model``'s matching modules (``model`` itself with ``root``)."""
        policy = self.policy
        modules = None
        if self._overrides:
            if model is None:
                raise ValueError(
                    f"This policy's per-module overrides ({', '.join(map(overrides.pattern_name, policy.overrides))}) "
                    "name modules of a model the region does not know: pass it, ampkit.autocast(policy, "
                    "model=model), or decorate the model's forward with ampkit.autocast(policy).")
            modules = overrides.matches(model, policy, root=root)
        if policy.enabled:
            ctx = torch.autocast(policy.device_type, dtype=policy.dtype)
        else:
            ctx = torch.autocast(policy.device_type, enabled=False)
        if self._kernel_ops:
            registry.acquire(policy.device_type, self._kernel_ops)
        if modules:
            overrides.install(modules)
        ctx.__enter__()
        guard_type = self._guard
        if guard_type is None and any(region.guard is not None for region in state.stack):
            # inside a guarded region, a region torch.autocast alone would serve is guarded too: else a graph
            # traced under both would pass the outer region's guard alone, and run there
            guard_type = compiling.guard_for(self.resolved)
        guard = compiling.enter(guard_type) if guard_type is not None else None
        state.stack.append(Region(policy.device_type, self.resolved, ctx, guard, model, modules))

    @torch.compiler.disable
    def __exit__(self, *exc: object) -> None:
        if not state.stack:
            raise RuntimeError("ampkit.autocast.__exit__() without __enter__(): use `with ampkit.autocast(policy):`.")
        region = state.stack.pop()
        if region.guard is not None:
            region.guard.__exit__(*exc)
        region.ctx.__exit__(*exc)
        if region.modules:
            overrides.uninstall(region.modules)
        if self._kernel_ops:
            registry.release(self.policy.device_type, self._kernel_ops)
        if not state.stack:
            state.weight_cache.clear()

    def __call__(self, fn: F) -> F:
        # torch.compile opens the region eagerly (this frame only, not recursive) and compiles `fn` inside it,
        # guarded by the region's policy (precision/compiling.py): in a compiled module whose forward is decorated,
        # the graph starts at the forward, as it would under torch.autocast (with fullgraph=True too). The function
        # dynamo skips must be the one the caller holds.
        # torch.jit.script meeting `with ampkit.autocast(...)` fails here, showing these lines:
        @functools.partial(torch.compiler.disable, recursive=False)
        @functools.wraps(fn)  # torch.jit.script cannot compile an ampkit region: use torch.autocast in scripted code
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # a decorated forward: overrides name its own module's modules (it runs already: not itself)
            own = args[0] if self._overrides and args and isinstance(args[0], nn.Module) else None
            self._enter(own if own is not None else self.model, root=own is None)
            try:
                return fn(*args, **kwargs)
            finally:
                self.__exit__(None, None, None)

        # torch.jit.script would compile the undecorated function (it follows __wrapped__) and
        # silently drop the policy; this attribute makes it refuse instead.
        setattr(wrapper, "__script_unsupported", _SCRIPT_UNSUPPORTED)
        return wrapper  # type: ignore[return-value]

