"""Pass 0 of :mod:`.profile` (units).

Which modules a profile measures as units, and what they cover: one call for
``profile()``, ``check_chain()`` and users (:func:`find_units`).

With ``units=None`` the units are discovered on a recorded forward pass
(:mod:`.saves`, :mod:`.discovery`); with ``units=`` they are the ones given. Either
way their coverage is measured on the same record (:mod:`.coverage`).

Granularity: ``"blocks"`` (the default) plans the blocks; ``"children"`` plans
each block's children instead (descending through a block that wraps a single
child), which can beat whole blocks where blocks are few and large;
``"auto"`` lets ``profile()`` measure both and keep the better
(:mod:`.granularity`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.core.errors import ProfileError
from remat.profiler.coverage import Coverage, measure_coverage
from remat.profiler.discovery import Discovery, choose_units
from remat.profiler.saves import SaveRecord, record_saves
from remat.profiler.units import UnitsSpec, discover_units, no_units_error

__all__ = ["GRANULARITIES", "UnitChoice", "children_level", "choose", "few_and_large",
           "find_units"]

log = logging.getLogger("remat")

GRANULARITIES = ("blocks", "children", "auto")
FEW_BLOCKS = 8  # fewer blocks than this are "few"
LARGE_SHARE = 0.5  # a block holding this share of what the units hold is "large"


@dataclass(frozen=True)
class UnitChoice:
    """The units a profile measures and what they cover.

    Attributes:
        units: ``(name, module)`` in execution order.
        coverage: their share of the step's activation memory (:class:`Coverage`).
        discovery: how default discovery chose them (``None`` for ``units=``).
        level: ``"blocks"`` or ``"children"``.
        children: the children level of these units, when the blocks are few and
            large (:func:`few_and_large`) and it differs; what ``"auto"`` compares.
    """

    units: list[tuple[str, nn.Module]]
    coverage: Coverage
    discovery: Discovery | None
    level: str = "blocks"
    children: tuple[str, ...] | None = None

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.units]

    def to_meta(self) -> dict[str, Any]:
        """What a profile's ``meta`` records about the choice (besides coverage)."""
        meta: dict[str, Any] = {"units_from": "units=" if self.discovery is None else "measured",
                                "granularity": self.level}
        if self.discovery is not None and self.discovery.joined:
            meta["joined_units"] = dict(self.discovery.joined)
        return meta


def check_granularity(granularity: object) -> str:
    if granularity not in GRANULARITIES:
        raise ProfileError(
            f"granularity={granularity!r} is not one of {list(GRANULARITIES)}: 'blocks' plans "
            "the model's blocks, 'children' their children, 'auto' profiles both when the "
            "blocks are few and large and keeps the better"
        )
    return str(granularity)


def children_level(record: SaveRecord, model: nn.Module, names: list[str]) -> list[str]:
    """Each unit's children that ran once and ran ops, in execution order; a unit
    that wraps a single such child is looked into; a unit without any stays whole."""
    out: list[int] = []
    for name in names:
        current = name
        while True:
            kids = [_usable(record, f"{current}.{c}")
                    for c, _ in model.get_submodule(current).named_children()]
            kids = [k for k in kids if k is not None]
            if len(kids) != 1:
                break
            current = record.calls[kids[0]].name
        out += kids if kids else [record.by_name[current].index]
    return [record.calls[i].name for i in sorted(out)]


def _usable(record: SaveRecord, name: str) -> int | None:
    call = record.call(name)
    return call.index if call is not None and call.calls == 1 and call.ops > 0 else None


def few_and_large(coverage: Coverage) -> bool:
    """Fewer than :data:`FEW_BLOCKS` units, or one holding :data:`LARGE_SHARE` of
    what they hold: then their children may plan better."""
    per_unit = list(coverage.per_unit.values())
    if len(per_unit) < FEW_BLOCKS:
        return True
    return bool(coverage.held_bytes) and max(per_unit) >= LARGE_SHARE * coverage.held_bytes


def choose(
    model: nn.Module,
    record: SaveRecord,
    units: UnitsSpec = None,
    given: list[tuple[str, nn.Module]] | None = None,
    granularity: str = "blocks",
) -> UnitChoice:
    """The units of ``model`` on ``record``: ``given`` (from ``units=``) or discovered.

    Raises:
        NoUnitsError: discovery found no block.
    """
    discovery = None
    if units is None:
        discovery = choose_units(record, model)
        if discovery is None:
            raise no_units_error(model)
        names = list(discovery.units)
    else:
        assert given is not None
        order = {c.name: c.index for c in record.calls}
        # Units that never ran keep their place at the end: the capture pass names them.
        names = sorted((n for n, _ in given), key=lambda n: order.get(n, len(order)))
    level = "blocks"
    children = None
    coverage = measure_coverage(record, names)
    if granularity != "blocks" and all(n in record.by_name for n in names):
        finer = children_level(record, model, names)
        if finer != names and (granularity == "children" or few_and_large(coverage)):
            if granularity == "children":
                names, level = finer, "children"
                coverage = measure_coverage(record, names)
            else:
                children = tuple(finer)
    found = [(n, model.get_submodule(n)) for n in names]
    return UnitChoice(found, coverage, discovery, level, children)


def find_units(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: Any = None,
    units: UnitsSpec = None,
    granularity: str = "blocks",
) -> UnitChoice:
    """The units ``profile()`` would measure for ``model`` on ``sample_batch``, and
    their coverage, from one recorded forward pass (no timing, no replays).

    The model is left as it was (buffers, RNG state, modes).
    """
    from remat.measurement.runner import call_model, compute_loss
    from remat.measurement.state import training_session

    granularity = check_granularity(granularity)
    given = discover_units(model, units) if units is not None else None
    with training_session(model):
        record = record_saves(
            model, lambda: compute_loss(call_model(model, sample_batch), sample_batch, loss_fn))
    return choose(model, record, units, given, granularity)
