"""A Plan: what to do with each unit's activations, and how that was decided.

Plans are data. They are frozen, round-trip through JSON, and carry the
fingerprint of the profile they were solved for, so the runtime can refuse a
model they do not fit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from remat.errors import PlanMismatchError
from remat.solver.profile import Option

__all__ = ["PLAN_SCHEMA_VERSION", "Plan", "Status"]

PLAN_SCHEMA_VERSION = 1
_OPTIONS = tuple(o.value for o in Option)


class Status:
    """How good a plan is known to be."""

    OPTIMAL = "optimal"  # proven optimal for its budget
    FEASIBLE = "feasible"  # fits its budget, optimality not proven (heuristics, time limits)
    MANUAL = "manual"  # written by a user, not solved


@dataclass(frozen=True)
class Plan:
    """Per-unit options and multi-unit checkpoint segments.

    Attributes:
        unit_names: the units, in forward execution order.
        options: per unit, one of ``keep``, ``checkpoint``, ``selective``, ``offload``.
        segments: inclusive ``(first, last)`` unit indices of checkpoint segments that
            span two or more consecutive units of a chain: only the first unit's
            input is held, and the whole segment is recomputed once in its backward.
            Every unit in a segment has the option ``checkpoint``.
        algorithm: what produced the plan (``"dp"``, ``"ilp"``, ``"chen"``, ``"manual"``...).
        status: ``"optimal"``, ``"feasible"`` or ``"manual"``.
        solve_ms: the algorithm's wall time, in milliseconds.
        budget_bytes: the budget it was solved for (``None`` when it had none).
        predicted_peak_bytes, predicted_time_ms: ``simulate()``'s figures for it.
        fingerprint: ``Profile.fingerprint()`` of the profile it was solved for
            (``None`` for a manual plan, which is checked by unit names only).
        unit_types: the units' class names, for error messages and checks.
        device: the device type the profile was measured on (``"cpu"``, ``"cuda"``).
        compiled_peak_bytes, compiled_time_ms: for a plan chosen for
            ``torch.compile`` (``solve(..., compiled=True)``), the peak of its compiled
            training step as the allocator measured it, in bytes, and that step's
            median time, in milliseconds; ``None`` otherwise.
        activation_memory_budget: for such a plan, the
            ``torch._functorch.config.activation_memory_budget`` it was measured with
            (inductor's own recomputation; 1.0 is its default): compile it with
            :func:`remat.compile_planned`, which sets it.
    """

    unit_names: tuple[str, ...]
    options: tuple[str, ...]
    segments: tuple[tuple[int, int], ...] = ()
    algorithm: str = "manual"
    status: str = Status.MANUAL
    solve_ms: float = 0.0
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_time_ms: float | None = None
    fingerprint: str | None = None
    unit_types: tuple[str, ...] | None = None
    device: str | None = None
    compiled_peak_bytes: int | None = None
    compiled_time_ms: float | None = None
    activation_memory_budget: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_names", tuple(self.unit_names))
        object.__setattr__(self, "options", tuple(str(o) for o in self.options))
        object.__setattr__(self, "segments", tuple((int(a), int(b)) for a, b in self.segments))
        if self.unit_types is not None:
            object.__setattr__(self, "unit_types", tuple(self.unit_types))
        n = len(self.unit_names)
        if len(self.options) != n:
            raise PlanMismatchError(
                f"a plan needs one option per unit: {n} units, {len(self.options)} options"
            )
        bad = [o for o in self.options if o not in _OPTIONS]
        if bad:
            raise PlanMismatchError(f"unknown options {bad}; valid options: {list(_OPTIONS)}")
        last = -1
        for a, b in self.segments:
            if not (0 <= a < b < n):
                raise PlanMismatchError(
                    f"segment ({a}, {b}) must span 2+ units within 0..{n - 1} "
                    "(a single checkpointed unit is the option 'checkpoint', not a segment)"
                )
            if a <= last:
                raise PlanMismatchError(f"segments must be sorted and disjoint: {self.segments}")
            last = b
            if any(self.options[i] != Option.CHECKPOINT.value for i in range(a, b + 1)):
                raise PlanMismatchError(f"every unit of segment ({a}, {b}) must be 'checkpoint'")

    # -- reading it -----------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.unit_names)

    def segment_of(self, i: int) -> tuple[int, int] | None:
        """The multi-unit segment unit ``i`` belongs to, or ``None``."""
        for a, b in self.segments:
            if a <= i <= b:
                return (a, b)
        return None

    def decisions(self) -> list[dict[str, Any]]:
        """One row per unit: name, option, and segment (``"2-5"`` or ``""``)."""
        rows = []
        for i, (name, opt) in enumerate(zip(self.unit_names, self.options)):
            seg = self.segment_of(i)
            rows.append(
                {"unit": name, "option": opt, "segment": f"{seg[0]}-{seg[1]}" if seg else ""}
            )
        return rows

    def summary(self) -> str:
        """A short description: ``'keep 4, checkpoint 6, segments [2-5]'``."""
        counts = {o: self.options.count(o) for o in _OPTIONS if o in self.options}
        text = ", ".join(f"{o} {c}" for o, c in counts.items())
        if self.segments:
            text += ", segments " + " ".join(f"[{a}-{b}]" for a, b in self.segments)
        return text

    # -- building one ---------------------------------------------------------------
    @classmethod
    def keep_all(cls, unit_names: Sequence[str], **kw: Any) -> Plan:
        """No checkpointing."""
        return cls(tuple(unit_names), (Option.KEEP.value,) * len(unit_names), **kw)

    @classmethod
    def checkpoint_all(cls, unit_names: Sequence[str], **kw: Any) -> Plan:
        """Checkpoint every unit on its own (what Hugging Face's gradient checkpointing does)."""
        return cls(tuple(unit_names), (Option.CHECKPOINT.value,) * len(unit_names), **kw)

    @classmethod
    def from_options(
        cls,
        unit_names: Sequence[str],
        choices: Mapping[str, str | Option],
        *,
        segments: Iterable[tuple[int, int]] = (),
        **kw: Any,
    ) -> Plan:
        """A manual plan: ``choices`` maps unit names to options; the rest keep."""
        unknown = set(choices) - set(unit_names)
        if unknown:
            raise PlanMismatchError(
                f"no units named {sorted(unknown)}; the units are {list(unit_names)}"
            )
        options = tuple(str(Option(choices.get(name, Option.KEEP))) for name in unit_names)
        return cls(tuple(unit_names), options, tuple(segments), **kw)

    def with_(self, **changes: Any) -> Plan:
        """A copy with some fields changed (plans are frozen)."""
        return replace(self, **changes)

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["segments"] = [list(s) for s in self.segments]
        return {"schema_version": PLAN_SCHEMA_VERSION, **d}

    def to_json(self, path: str | None = None, *, indent: int = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        d = dict(d)
        version = d.pop("schema_version", None)
        if version != PLAN_SCHEMA_VERSION:
            raise PlanMismatchError(
                f"plan schema_version {version!r} is not supported (expected "
                f"{PLAN_SCHEMA_VERSION}); solve the plan again with this remat"
            )
        d["segments"] = tuple(tuple(s) for s in d.get("segments", ()))
        return cls(**d)

    @classmethod
    def from_json(cls, text_or_path: str) -> Plan:
        """Read a plan from a JSON string or a path to a JSON file."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path) as f:
                text = f.read()
        return cls.from_dict(json.loads(text))
