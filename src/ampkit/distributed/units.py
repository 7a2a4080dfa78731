"""Which modules FSDP2 shards as units under ``ampkit.distributed.fully_shard``, and the weights they may
not share.

FSDP2 gathers each unit's parameters before its forward and frees them after, so a unit is the
granularity of memory and of communication: one per transformer block is the usual choice
(torchtitan's), found here as the children of the model's containers; at O2 each normalization layer
is a unit of its own, gathered in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ampkit.modes import OptLevel
from ampkit.optim.kept import kept_modules

CONTAINERS = (nn.Sequential, nn.ModuleList)


def shard_blocks(model: nn.Module, types: Sequence[type[nn.Module]] | None) -> list[tuple[str, nn.Module]]:
    """The units sharded before the root: modules of ``types``, or the children of every container,
    outermost first (nothing inside a chosen block is chosen again)."""
    if types is not None:
        bad = [t for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
        if bad or not types:
            raise ValueError(f"blocks={list(types)!r} must list nn.Module subclasses, e.g. [Block]; or pass None "
                             "for the children of the model's nn.Sequential / nn.ModuleList containers.")
    chosen: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if types is not None:
                picked = isinstance(child, tuple(types))
            else:
                picked = isinstance(module, CONTAINERS) and next(child.parameters(), None) is not None
            if picked:
                chosen.append((prefix + name, child))
            else:
                visit(prefix + name + ".", child)

    visit("", model)
    if types is not None and not chosen:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"blocks={[t.__name__ for t in types]} matches no module of the model; its types: {present}.")
    return chosen


def kept_units(model: nn.Module, level: OptLevel, keep_float32: tuple[type[nn.Module], ...]) -> list[tuple[str, nn.Module]]:
    if not level.keeps_float32:
        return []
    kept = {id(m) for m in kept_modules(model, keep_float32)}
    return [(n, m) for n, m in model.named_modules()
            if id(m) in kept and m is not model and next(m.parameters(), None) is not None]


def check_units(model: nn.Module, chosen: list[tuple[str, nn.Module]], kept: list[tuple[str, nn.Module]]) -> None:
    """Refuse a weight shared across the units FSDP2 gathers separately: a unit frees its gathered
    weights after its forward, and another unit's module using them would see shards."""
    units = [m for _, m in kept] + [m for _, m in chosen]  # the order they are sharded in: innermost first
    unit_of: dict[int, nn.Module] = {}
    for unit in [*units, model]:
        for p in unit.parameters():
            unit_of.setdefault(id(p), unit)  # FSDP2 gives a parameter to the first unit sharded over it
    names = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        enclosing = next((u for u in units if _within(module, u)), model)
        for pname, p in module.named_parameters(recurse=False):
            if unit_of[id(p)] is not enclosing:
                raise ValueError(
                    f"{name + '.' + pname if name else pname!r} is shared between {names[id(unit_of[id(p)])] or 'the root'!r} "
                    f"and {names[id(enclosing)] or 'the root'!r}, which FSDP2 would gather separately (a block, or a norm "
                    "kept in float32 at O2): tie weights within one block or at the root, pass blocks= so both "
                    "owners are in one unit, or use opt_level='O1'.")


def group_segments(chosen: list[tuple[str, nn.Module]],
                   segments: Sequence[tuple[str, ...]]) -> list[list[tuple[str, nn.Module]]]:
    """The blocks as FSDP2 units, in order: each alone, but the blocks of a recompute plan's segment of several
    (``plan.apply`` before sharding) in one unit. FSDP2 gathers a unit's weights at its first module's forward, and
    such a segment runs its blocks' forwards from its first block's, past the others' own gathers. ValueError for
    a segment whose blocks are not all units (the plan was made with other ``blocks=``)."""
    units = dict(chosen)
    several = [segment for segment in segments if len(segment) > 1]
    stray = [name for segment in several for name in segment if name not in units]
    if stray:
        shown = list(units) if len(units) <= 4 else [*list(units)[:4], "..."]
        raise ValueError(f"The model's recompute plan runs {stray[:3]} in a segment of several blocks, but they are "
                         f"not the blocks fully_shard shards ({shown}): pass plan_recompute and fully_shard the same "
                         "blocks=.")
    segment_of = {name: segment for segment in several for name in segment}
    groups: list[list[tuple[str, nn.Module]]] = []
    for name, module in chosen:
        if name not in segment_of:
            groups.append([(name, module)])
        elif name == segment_of[name][0]:
            groups.append([(block, units[block]) for block in segment_of[name]])
    return groups


def _within(inner: nn.Module, outer: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def plan_units(model: nn.Module, level: OptLevel, keep_float32: tuple[type[nn.Module], ...],
               blocks: Sequence[type[nn.Module]] | None) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """(the float32 units O2 keeps, the blocks), in the order they are sharded; a kept module is not a
    block as well (a LayerNorm in an nn.Sequential). Raises ValueError as ``shard_blocks`` and ``check_units``."""
    kept = kept_units(model, level, keep_float32)
    kept_ids = {id(m) for _, m in kept}
    chosen = [(name, m) for name, m in shard_blocks(model, blocks) if id(m) not in kept_ids]
    check_units(model, chosen, kept)
    return kept, chosen
