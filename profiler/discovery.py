"""Pass 0 of :mod:`.profile` (units).

Default unit discovery, measured: the repeated blocks of the whole model, at the
level that holds its activation memory, joined by the modules that make them a chain.

From the blocks of the module tree (:mod:`.blocks`) and one recorded forward pass
(:mod:`.saves`):

1. **blocks**: every block that ran exactly once and ran ops, outermost first
   (every stage, encoder and decoder: all of them, not the longest list);
2. **level**: a block that holds inner blocks (a stage of blocks) is replaced by
   its *pieces* (its inner blocks and the modules between them, such as a
   stage's downsample layer) when those hold at least :data:`REFINE_SHARE` of
   what the block holds: finer units give the solver more choices and, on a chain,
   segments still span them;
3. **chain**: where code runs between two consecutive units and that code is only
   module calls, each taking the previous one's output (a ConvNeXt downsample
   layer, a final layer norm), those modules become units, so the units stay one
   chain and segments can span the stage boundary. Only done when it makes *all*
   of the units a chain (a profile is a chain or not, as a whole);
4. **coverage**: while the units hold less than :data:`TARGET_COVERAGE` of the
   activation memory, the uncovered module that adds the most is added (on a
   chain, only modules that extend it at either end: a stem, a final norm),
   skipping any that would add less than :data:`MIN_GAIN` of it.

"Holds" is measured: the bytes of the storages every save of which happened
inside the units (:meth:`~remat.profiler.saves.SaveRecord.held_bytes`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from remat.profiler.blocks import block_names, outermost
from remat.profiler.saves import ModuleCall, SaveRecord

__all__ = ["MIN_GAIN", "REFINE_SHARE", "TARGET_COVERAGE", "Discovery", "chain_breaks",
           "choose_units"]

log = logging.getLogger("remat")

REFINE_SHARE = 0.9  # pieces must hold this share of their block's bytes to replace it
TARGET_COVERAGE = 0.9  # add modules while the units hold less than this share
MIN_GAIN = 0.005  # ... and each adds at least this share of the activation bytes


@dataclass(frozen=True)
class Discovery:
    """The measured choice of units.

    Attributes:
        units: their names, in execution order.
        blocks: the blocks among them (the rest joined for the chain or coverage).
        joined: modules added to link the chain (``"chain"``) or for coverage.
        is_chain: the recorded pass says the units form a chain (the capture pass
            checks it again).
    """

    units: tuple[str, ...]
    blocks: tuple[str, ...]
    joined: dict[str, str]
    is_chain: bool


class _Tree:
    """The recorded calls, with what contains what."""

    def __init__(self, record: SaveRecord, model: nn.Module) -> None:
        self.record = record
        self.model = model
        self.calls = record.calls
        self.children: dict[int, list[int]] = {c.index: [] for c in self.calls}
        for c in self.calls:
            if c.parent is not None:
                self.children[c.parent].append(c.index)
        self.last: dict[int, int] = {}  # call -> the last call started inside it (or itself)
        for c in reversed(self.calls):
            self.last[c.index] = max([c.index] + [self.last[k] for k in self.children[c.index]])

    def usable(self, name: str) -> ModuleCall | None:
        """The call of ``name`` when it can be a unit: it ran exactly once, ran ops."""
        call = self.record.call(name)
        if call is None or call.calls != 1 or call.ops == 0 or call.index == 0:
            return None
        return call

    def inside(self, index: int, outer: int) -> bool:
        return outer < index <= self.last[outer]


def chain_breaks(record: SaveRecord, units: Sequence[int]) -> list[tuple[int, int]]:
    """The consecutive pairs of ``units`` (call indices, in execution order) that are
    not linked: the second's boundary input is not the first's boundary output, or
    ops run between them."""
    calls = record.calls
    return [(a, b) for a, b in zip(units, units[1:])
            if a not in calls[b].input_from or calls[b].enter_op != calls[a].exit_op]


def _pieces(tree: _Tree, module: nn.Module, prefix: str, blocks: set[str]) -> list[str] | None:
    """The inner blocks of ``module`` and the called modules around them (see step 2),
    or ``None`` when a module with ops ran more than once (it cannot be a unit)."""
    out: list[str] = []
    for child_name, child in module.named_children():
        name = f"{prefix}.{child_name}"
        if name in blocks:
            out.append(name)
            continue
        if any(b.startswith(name + ".") for b in blocks):
            inner = _pieces(tree, child, name, blocks)
            if inner is None:
                return None
            out += inner
            continue
        call = tree.record.call(name)
        if call is None or call.ops == 0:
            continue  # never called, or runs nothing: nothing to plan
        if call.calls != 1:
            return None
        out.append(name)
    return out


def _level(tree: _Tree, blocks: list[str]) -> list[str]:
    """Step 2: outermost blocks, each replaced by its pieces where those hold enough."""
    usable = {b for b in blocks if tree.usable(b) is not None}
    reused = [b for b in blocks if (c := tree.record.call(b)) is not None and c.calls > 1]
    for b in outermost(reused):
        log.warning("block %r runs %d times in one forward pass: a unit must run exactly once "
                    "(recurrent reuse is unsupported), so it is left out of the units and its "
                    "activations are not planned", b, tree.record.call(b).calls)
    chosen: list[str] = []
    for name in outermost(sorted(usable, key=lambda b: tree.usable(b).index)):
        chosen += _refine(tree, name, usable)
    return chosen


def _refine(tree: _Tree, name: str, blocks: set[str]) -> list[str]:
    inner = {b for b in blocks if b.startswith(name + ".")}
    if not inner:
        return [name]
    pieces = _pieces(tree, tree.model.get_submodule(name), name, inner)
    if not pieces:
        return [name]
    record = tree.record
    whole = record.saved_inside(tree.usable(name).index)
    held = record.held_bytes(record.by_name[p].index for p in pieces)
    if held < REFINE_SHARE * whole:
        log.debug("discovery: keeping %r whole: its pieces hold %d of its %d B", name, held,
                  whole)
        return [name]
    out: list[str] = []
    for p in pieces:
        out += _refine(tree, p, blocks) if p in blocks else [p]
    return out


def _gap_calls(tree: _Tree, a: int, b: int) -> list[int]:
    """The outermost calls that ran after call ``a`` ended and before call ``b`` started."""
    out: list[int] = []
    for k in range(tree.last[a] + 1, b):
        if tree.inside(b, k) or any(tree.inside(k, g) for g in out):
            continue
        out.append(k)
    return out


def _link(tree: _Tree, a: int, b: int) -> list[int] | None:
    """Calls that, made units, link unit ``a`` to unit ``b`` (``None``: they cannot)."""
    calls = tree.calls
    gap = _gap_calls(tree, a, b)
    loose = calls[b].enter_op - calls[a].exit_op - sum(calls[g].ops for g in gap)
    if loose or any(calls[g].calls != 1 for g in gap):
        return None  # code outside any module runs there, or a module is reused
    added = [g for g in gap if calls[g].ops > 0]
    chain = [a, *added, b]
    if any(x not in calls[y].input_from for x, y in zip(chain, chain[1:])):
        return None
    return added


def _link_chain(tree: _Tree, units: list[int]) -> list[int]:
    """Step 3: the calls that make ``units`` one chain, or none when some link cannot be made."""
    record = tree.record
    added: list[int] = []
    for a, b in chain_breaks(record, units):
        link = _link(tree, a, b)
        if link is None:
            log.debug("discovery: %r -> %r cannot be linked into a chain",
                      record.calls[a].name, record.calls[b].name)
            return []
        added += link
    return added


def _outside(tree: _Tree, units: list[int]) -> list[int]:
    """The outermost usable calls that neither contain a unit nor lie inside one."""
    containing = {p for u in units for p in tree.record.ancestors(u)}
    inside = set(units)
    out = []
    for c in tree.calls[1:]:
        if c.index in containing or c.index in inside:
            continue
        if c.parent is not None and c.parent not in containing:
            continue  # inside a unit or inside an outer candidate
        if tree.usable(c.name) is not None:
            out.append(c.index)
    return out


def _extensions(tree: _Tree, units: list[int], is_chain: bool) -> list[tuple[list[int], bool]]:
    """Additions that step 4 may make, each with whether it starts a recomputation
    region of its own (then its first call's input stays held): any one outside
    call off a chain; on a chain the runs of calls that extend it at its start or
    its end, nearest first."""
    outside = _outside(tree, units)
    if not is_chain:
        return [([c], True) for c in outside]
    record = tree.record
    options: list[tuple[list[int], bool]] = []
    before = sorted((c for c in outside if c < units[0]), reverse=True)
    run: list[int] = []
    for c in before:
        if chain_breaks(record, sorted([c, *run, units[0]])):
            break
        run = [c, *run]
        options.append((list(run), True))
    after = sorted(c for c in outside if c > tree.last[units[-1]])
    run = []
    for c in after:
        if chain_breaks(record, [units[-1], *run, c]):
            break
        run = [*run, c]
        options.append((list(run), False))  # a segment from an earlier unit spans it
    return options


def _gain(record: SaveRecord, current: list[int], option: list[int], starts: bool) -> int:
    """Bytes a plan could drop once ``option`` joins ``current``: what they newly hold,
    less, when it starts a recomputation region, its first call's input (checkpointing
    holds that) unless code outside ``option`` holds it anyway."""
    held_before = record.held_bytes(current)
    gain = record.held_bytes(current + option) - held_before
    call = record.calls[option[0]]
    if starts and call.input_saved is not None:
        s = record.saved[call.input_saved]
        if s.held_by(set(current + option)):  # only units save it: no one else holds it
            gain -= s.nbytes
    elif starts:
        gain -= call.input_fresh_bytes  # saved by no one: checkpointing would hold it
    return gain




def _cover(tree: _Tree, units: list[int], is_chain: bool) -> list[int]:
    """Step 4: calls added for coverage."""
    record = tree.record
    total = record.activation_bytes
    added: list[int] = []
    current = list(units)
    while total and record.held_bytes(current) < TARGET_COVERAGE * total:
        best, best_rate = None, 0.0
        for option, starts in _extensions(tree, current, is_chain):
            gain = _gain(record, current, option, starts)
            rate = gain / len(option)
            if gain >= MIN_GAIN * total and rate > best_rate:
                best, best_rate = option, rate
        if best is None:
            break
        current = sorted(current + best)
        added += best
    return added


def choose_units(record: SaveRecord, model: nn.Module) -> Discovery | None:
    """The units of ``model`` chosen on ``record`` (see the module docstring), or ``None``
    when it has no usable block."""
    tree = _Tree(record, model)
    blocks = _level(tree, block_names(model))
    if not blocks:
        return None
    units = sorted(record.by_name[b].index for b in blocks)
    joined: dict[str, str] = {}
    links = _link_chain(tree, units)
    for c in links:
        joined[record.calls[c].name] = "chain"
    units = sorted(units + links)
    is_chain = not chain_breaks(record, units)
    for c in _cover(tree, units, is_chain):
        joined[record.calls[c].name] = "coverage"
        units.append(c)
    units.sort()
    names = tuple(record.calls[u].name for u in units)
    log.debug("discovery: %d blocks, joined %s", len(blocks), joined)
    return Discovery(names, tuple(sorted(blocks, key=lambda b: record.by_name[b].index)), joined,
                     not chain_breaks(record, units))
