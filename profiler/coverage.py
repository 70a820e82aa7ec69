"""Pass 0 of :mod:`.profile` (units).

Coverage: the share of the step's activation memory that the units hold.

Activation memory is every storage autograd saves for backward during the step
(parameters, buffers and the batch aside), as one forward pass records it
(:mod:`.saves`). The units *hold* a storage when every save of it happened inside
a unit: only those bytes can a plan drop. What no unit holds is blamed on the
outermost module that saved it and contains no unit (or, where the saving code is
a unit-holding module's own ``forward``, on that module's own code; saves made
after the model returned are the loss's), so a user can tell which modules to add.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from remat.core.bytesize import format_bytes
from remat.core.profile import Profile
from remat.profiler.saves import SaveRecord

__all__ = ["WARN_BELOW", "Coverage", "measure_coverage", "warn_if_low"]

log = logging.getLogger("remat")

WARN_BELOW = 0.8  # coverage under which profile() warns
_SHOWN = 5  # uncovered modules named in the profile's meta and the warning
LOSS = "(after the model: the loss)"


@dataclass(frozen=True)
class Coverage:
    """What the units hold of the step's activation memory.

    Attributes:
        activation_bytes: bytes of every storage saved for backward in the step.
        held_bytes: of those, the bytes the units hold.
        per_unit: per unit name, the held bytes it saved first (they sum to ``held_bytes``).
        uncovered: the largest holders of the rest, ``(module, bytes)``, largest first.
    """

    activation_bytes: int
    held_bytes: int
    per_unit: dict[str, int]
    uncovered: tuple[tuple[str, int], ...]

    @property
    def fraction(self) -> float:
        """``held_bytes / activation_bytes`` (1.0 when the step saves nothing)."""
        return self.held_bytes / self.activation_bytes if self.activation_bytes else 1.0

    def to_meta(self) -> dict[str, object]:
        """The fields a :class:`~remat.core.profile.Profile` keeps in its ``meta``."""
        return {
            "activation_bytes": self.activation_bytes,
            "covered_bytes": self.held_bytes,
            "unit_activation_bytes": dict(self.per_unit),
            "uncovered": [[name, nbytes] for name, nbytes in self.uncovered[:_SHOWN]],
        }


def _blame(record: SaveRecord, stack: tuple[int, ...], containing: set[int]) -> str:
    if not stack:
        return LOSS
    for index in stack:  # outermost first
        if index not in containing:
            return record.calls[index].name or "(the model)"
    innermost = record.calls[stack[-1]]
    return f"{innermost.name or type(innermost.module).__name__} (its own code)"


def measure_coverage(record: SaveRecord, unit_names: Sequence[str]) -> Coverage:
    """The coverage of ``unit_names`` (modules of the recorded model) on ``record``."""
    units = [record.by_name[n].index for n in unit_names if n in record.by_name]
    members = set(units)
    containing = {p for u in units for p in record.ancestors(u)}
    per_index = record.held_per_unit(units)
    blamed: dict[str, int] = {}
    for s in record.saved:
        outside = [st for st in s.stacks if not any(i in members for i in st)]
        if outside:
            label = _blame(record, outside[0], containing)
            blamed[label] = blamed.get(label, 0) + s.nbytes
    return Coverage(
        activation_bytes=record.activation_bytes,
        held_bytes=sum(per_index.values()),
        per_unit={record.calls[i].name: b for i, b in per_index.items()},
        uncovered=tuple(sorted(blamed.items(), key=lambda kv: -kv[1])),
    )


def warn_if_low(profile: Profile, model_name: str) -> None:
    """Warn, naming the largest uncovered modules (``profile.meta["uncovered"]``), when
    ``profile.coverage`` is under :data:`WARN_BELOW`."""
    if profile.coverage is None or profile.coverage >= WARN_BELOW:
        return
    meta = profile.meta
    shown = ", ".join(f"{name} {format_bytes(b)}" for name, b in meta.get("uncovered", []))
    log.warning(
        "the units hold %.0f%% of %s's activation memory (%s of %s): a plan cannot drop the "
        "rest. Largest holders outside the units: %s. Pass units= including them (a list of "
        "module names) to plan them too",
        100 * profile.coverage, model_name, format_bytes(meta.get("covered_bytes", 0)),
        format_bytes(meta.get("activation_bytes", 0)), shown,
    )
