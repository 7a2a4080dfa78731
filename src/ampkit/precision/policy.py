"""Policy: how a forward pass runs in mixed precision.

A policy is a low-precision ``dtype``, three op lists (allow / deny / infer) and
per-module overrides. It is immutable: every edit returns a new policy, so a
policy can be shared between threads and stored in a config. ``Resolved`` is a policy
as a region reads it on this machine: with the ops it computes in float32 (``decide.py``
decides them) and the ops that need ampkit's kernels.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Iterable

import torch
from torch import nn

from ampkit.modes import check_compute, resolve_dtype
from ampkit.precision import op_lists
from ampkit.precision.op_lists import ALLOW, DENY, INFER

ModulePattern = str | type[nn.Module]


def check_device_type(device_type: str) -> str:
    """Return ``device_type`` if ampkit has op lists for it, else raise ValueError."""
    if device_type not in op_lists.DEVICE_TYPES:
        raise ValueError(
            f"Unknown device_type: {device_type!r}. Choose one of {list(op_lists.DEVICE_TYPES)} "
            "(the type of torch.device, without an index)."
        )
    return device_type


def known_op(op: str) -> bool:
    """Whether the running torch defines the ATen operator ``op`` (without overload): ``torch.ops.aten``
    resolves every registered operator by name, loaded yet or not."""
    return hasattr(getattr(torch.ops.aten, op, None), "overloads")


def _ops_like(op: str) -> list[str]:
    """Up to three ATen operator names close to ``op``: among the table's and those torch has loaded."""
    names = set(dir(torch.ops.aten)).union(*(ops for table in op_lists.TABLE.values() for ops in table.values()))
    return difflib.get_close_matches(op, sorted(n for n in names if known_op(n)), n=3)


@functools.cache
def autocast_ops(device_type: str) -> frozenset[str]:
    """The ops of ampkit's table that the running torch autocasts on ``device_type``, read once.

    An op is autocast where one of its overloads has a kernel at the device's Autocast key
    (the public ``OpOverload.has_kernel_for_dispatch_key``), asked before ampkit registers
    kernels of its own there (``kernels.py`` reads this first). The table holds every op
    torch autocasts in the releases CI tests (``tests/test_op_lists.py`` checks each
    against its dispatcher); an op a newer torch adds is not read here and is left to
    torch.autocast, as every op no policy edit names is.
    """
    key = op_lists.autocast_key(device_type)
    candidates = frozenset().union(*op_lists.TABLE[device_type].values(), op_lists.BANNED[device_type])
    return frozenset(op for op in candidates if known_op(op) and _has_kernel(op, key))


@torch.compiler.disable
def _read_eagerly(device_type: str) -> frozenset[str]:
    """``autocast_ops`` for ``Policy.default``, which may be built inside compiled code: dynamo would trace past the
    cache, reading the dispatcher again at each trace, and warn."""
    return autocast_ops(device_type)


def _has_kernel(op: str, key: str) -> bool:
    """Whether an overload of the ATen operator ``op`` has a kernel at the dispatch key ``key``. (TorchScript-only
    overloads, which raise when asked, are none of the table's ops: tests/test_op_lists.py reads them all.)"""
    packet = getattr(torch.ops.aten, op)
    return any(getattr(packet, name).has_kernel_for_dispatch_key(key) for name in packet.overloads())


def torch_lists(device_type: str) -> dict[str, frozenset[str]]:
    """torch.autocast's allow / deny / infer lists on the running torch (banned ops absent)."""
    return op_lists.torch_lists(device_type, autocast_ops(device_type))


def torch_category(device_type: str, op: str) -> str | None:
    """What the running torch's autocast does with ``op``: a list, ``"banned"``, or None."""
    return op_lists.torch_category(device_type, op, autocast_ops(device_type))


def _check_ops(ops: Iterable[str], argument: str) -> frozenset[str]:
    if isinstance(ops, str):
        raise ValueError(f"{argument}= takes a list of op names, got the string {ops!r}; write [{ops!r}].")
    ops = frozenset(ops)
    for op in ops:
        if not isinstance(op, str):
            raise ValueError(f"{argument}= takes op names (strings), got {op!r}; `ampkit ops` lists them.")
    for op in sorted(ops):
        if not known_op(op):
            close = _ops_like(op)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"Unknown op {op!r} in {argument}=: it is no ATen operator of torch "
                f"{torch.__version__}.{hint} `ampkit ops` lists the ops of the default policy."
            )
    return ops


@dataclasses.dataclass(frozen=True)
class ModuleOverride:
    """Run every module matching ``pattern`` in ``dtype``.

    ``pattern`` is an ``nn.Module`` subclass (matches instances) or an fnmatch
    pattern over qualified names from ``named_modules()`` (``"lm_head"``,
    ``"*.attn.*"``); names are taken relative to the outermost module called in
    the autocast region. Built by ``Policy.with_modules``.

    Attributes:
        pattern: an ``nn.Module`` subclass or a name pattern.
        dtype: torch.float32, or the policy's 16-bit dtype.
    """

    pattern: ModulePattern
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Policy:
    """An immutable mixed precision policy.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: the low-precision compute dtype, torch.float16 or torch.bfloat16.
        allow: ops that run in ``dtype`` (convolutions, linear, matmul...).
        deny: ops that run in float32 (reductions, softmax, exp/log, norms, losses).
        infer: ops that run in the widest floating dtype among their inputs.
        overrides: per-module dtypes, applied in order (the last match wins).
        enabled: False makes ``ampkit.autocast`` a pass-through.
        compute: how GEMMs and convolutions on 16-bit values compute: ``"native"``
            (16-bit kernels, as torch.autocast), ``"float32"`` (float32 arithmetic on
            the 16-bit values, output rounded to 16 bits; see ``ampkit.float32_compute``) or
            ``"auto"`` (default: per op class, native where this machine's measured
            16-bit kernels beat float32, else float32).

    Ops in no list run in the dtype of their inputs. Build one with
    ``Policy.default()`` and edit it with ``with_ops`` / ``with_modules`` /
    ``with_compute``.

    Examples:
        >>> policy = Policy.default("cpu", torch.bfloat16).with_ops(deny=["gelu"])
        >>> policy.category("gelu")
        'deny'
    """

    device_type: str
    dtype: torch.dtype
    allow: frozenset[str]
    deny: frozenset[str]
    infer: frozenset[str]
    overrides: tuple[ModuleOverride, ...] = ()
    enabled: bool = True
    compute: str = "auto"
    # op -> category for every listed op; derived, so not compared or shown.
    _table: dict[str, str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_device_type(self.device_type)
        check_compute(self.compute)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        table: dict[str, str] = {}
        for category in (ALLOW, DENY, INFER):
            ops = getattr(self, category)
            object.__setattr__(self, category, _check_ops(ops, category))
            for op in ops:
                if op in table:
                    raise ValueError(
                        f"Op {op!r} is in both {table[op]} and {category}; an op belongs to one list. "
                        "Use with_ops(), which moves ops instead of copying them."
                    )
                table[op] = category
        object.__setattr__(self, "_table", table)

    @classmethod
    def default(
        cls, device_type: str = "cpu", dtype: torch.dtype | str | None = None, compute: str = "auto"
    ) -> Policy:
        """The default policy: torch.autocast's decisions for ``device_type``.

        Args:
            device_type: ``"cpu"`` (default) or ``"cuda"``.
            dtype: defaults to bfloat16 on CPU and float16 on CUDA, as torch.autocast.
            compute: ``"auto"`` (default), ``"native"`` or ``"float32"``; see the class.

        Two differences from torch.autocast: ops torch refuses under autocast
        (``binary_cross_entropy`` on CUDA) run in float32 with a one-time warning;
        and where this machine computes 16-bit GEMMs slower than float32 (measured),
        ``"auto"`` computes them in float32 on the 16-bit values.
        """
        lists = op_lists.default_lists(check_device_type(device_type), _read_eagerly(device_type))
        if dtype is None:
            dtype = torch.bfloat16 if device_type == "cpu" else torch.float16
        return cls(device_type, resolve_dtype(dtype), lists[ALLOW], lists[DENY], lists[INFER], compute=compute)

    @classmethod
    def for_16bit_model(cls, device_type: str, dtype: torch.dtype | str, compute: str = "auto") -> Policy:
        """A policy that casts nothing (every op follows its inputs) and only decides how
        GEMMs and convolutions compute: for models already in 16 bits (O2, O3)."""
        empty: frozenset[str] = frozenset()
        return cls(check_device_type(device_type), resolve_dtype(dtype), empty, empty, empty, compute=compute)

    @property
    def lists(self) -> dict[str, frozenset[str]]:
        """The three op lists by name: ``{"allow": ..., "deny": ..., "infer": ...}``."""
        return {ALLOW: self.allow, DENY: self.deny, INFER: self.infer}

    def category(self, op: str) -> str | None:
        """``"allow"``, ``"deny"``, ``"infer"`` or None (the op follows its inputs)."""
        return self._table.get(op)

    def with_ops(
        self,
        *,
        allow: Iterable[str] = (),
        deny: Iterable[str] = (),
        infer: Iterable[str] = (),
        none: Iterable[str] = (),
    ) -> Policy:
        """Return a policy with the named ops moved into the given lists.

        Args:
            allow: ops to move into the allow list (from wherever they are).
            deny: ops to move into the deny list.
            infer: ops to move into the infer list.
            none: ops to take out of every list, so they follow their inputs.

        Raises:
            ValueError: an unknown op name (with close matches), or one op named twice.
        """
        moves = {ALLOW: allow, DENY: deny, INFER: infer, "none": none}
        target: dict[str, str] = {}
        for category, ops in moves.items():
            for op in _check_ops(ops, category):
                if op in target:
                    raise ValueError(f"Op {op!r} is named in both {target[op]}= and {category}=; name it once.")
                target[op] = category
        lists = {c: set(getattr(self, c)) - set(target) for c in (ALLOW, DENY, INFER)}
        for op, category in target.items():
            if category != "none":
                lists[category].add(op)
        return dataclasses.replace(
            self, allow=frozenset(lists[ALLOW]), deny=frozenset(lists[DENY]), infer=frozenset(lists[INFER])
        )

    def with_modules(self, *patterns: ModulePattern, dtype: torch.dtype | str) -> Policy:
        """Return a policy that runs the matching modules wholly in ``dtype``.

        Args:
            patterns: ``nn.Module`` subclasses or fnmatch patterns of qualified names.
            dtype: torch.float32 (keep them out of mixed precision) or the policy's dtype
                (every listed op, deny ops too, runs in 16 bits).

        Examples:
            >>> policy = Policy.default("cpu").with_modules(nn.LayerNorm, "lm_head", dtype=torch.float32)
        """
        dtype = torch.float32 if dtype in (torch.float32, "fp32", "float32") else resolve_dtype(dtype)
        if dtype not in (torch.float32, self.dtype):
            raise ValueError(
                f"Module override dtype {dtype} is neither torch.float32 nor this policy's dtype "
                f"{self.dtype}. Build the policy with dtype={dtype} first, or keep the modules in float32."
            )
        for pattern in patterns:
            if not isinstance(pattern, str) and not (isinstance(pattern, type) and issubclass(pattern, nn.Module)):
                raise ValueError(
                    f"Module pattern {pattern!r} is neither an nn.Module subclass nor a name pattern "
                    "such as 'lm_head' or '*.attn.*'."
                )
        added = tuple(ModuleOverride(p, dtype) for p in patterns)
        return dataclasses.replace(self, overrides=self.overrides + added)

    @functools.cached_property
    def ops_only(self) -> Policy:
        """This policy without its module overrides (for code that calls no module of the model: a backward)."""
        return dataclasses.replace(self, overrides=()) if self.overrides else self

    def with_compute(self, compute: str) -> Policy:
        """This policy with another compute mode (``"auto"``, ``"native"``, ``"float32"``)."""
        return dataclasses.replace(self, compute=check_compute(compute))

    def disabled(self) -> Policy:
        """This policy with ``enabled=False``: autocast becomes a pass-through."""
        return dataclasses.replace(self, enabled=False)

    @functools.cached_property
    def edits(self) -> frozenset[str]:
        """Ops whose handling differs from torch.autocast's on this device."""
        ops = self._table.keys() | op_lists.BANNED[self.device_type].keys()
        ops |= frozenset().union(*torch_lists(self.device_type).values())
        return frozenset(op for op in ops if self.category(op) != torch_category(self.device_type, op))

    @functools.cached_property
    def all_low(self) -> Policy:
        """This policy with every deny op moved to allow (for modules overridden to ``dtype``)."""
        return dataclasses.replace(self, allow=self.allow | self.deny, deny=frozenset(), overrides=())


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A policy resolved on this machine into plain data: what its regions, their kernels, their compile guards
    and their checkpointed recomputes read (``decide.resolve`` makes it, once a region)."""

    policy: Policy
    float32_ops: frozenset[str]  # the autocast-level ops computed in float32 on 16-bit values

    @functools.cached_property
    def kernel_ops(self) -> frozenset[str]:
        """The ops that need ampkit's Autocast-key kernels (``kernels.py``): the policy's edits, its float32-computed
        ops, and the edits of the 16-bit policy its module overrides push; none where the policy is disabled."""
        policy = self.policy
        if not policy.enabled:
            return frozenset()
        ops = policy.edits | self.float32_ops
        if "linear" in self.float32_ops:  # a linear reading a GELU's output recomputes it (gelu_recompute.py)
            ops |= {"gelu"}
        if any(o.dtype != torch.float32 for o in policy.overrides):
            ops |= policy.all_low.edits
        return ops

    @functools.cached_property
    def all_low(self) -> Resolved:
        """What a 16-bit module override of this policy pushes: every op in the policy's dtype, the same float32
        compute."""
        return Resolved(self.policy.all_low, self.float32_ops)
