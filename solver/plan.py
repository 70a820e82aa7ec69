"""A Plan: what to do with each unit's activations, and how that was decided.

Plans are data. They are frozen, round-trip through JSON, and carry the
fingerprint of the profile they were solved for, so the runtime can refuse a
model they do not fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from remat.errors import PlanError, PlanMismatchError, RematError
from remat.solver.field_checks import (
    MAX_INT64,
    checked_bytes,
    checked_list,
    checked_ms,
    checked_str,
    checked_strings,
)
from remat.solver.json_io import (
    JsonSource,
    check_keys,
    read_json_object,
    refuse_other_kind,
    write_json,
)
from remat.solver.loop import Loop
from remat.solver.profile import OPTION_ORDER, Option

__all__ = ["PLAN_SCHEMA_VERSION", "Plan", "Status"]

PLAN_SCHEMA_VERSION = 2  # 2: the loop, and what closed-loop verification measured


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
        loop: the training loop the plan was solved for
            (:class:`~remat.solver.loop.Loop`; ``None`` for a manual plan).
        measured_peak_bytes, measured_time_ms: the peak (the higher of the
            dispatch-level meter's and the allocator's) and the time of one optimizer
            step with the plan applied, when :func:`remat.solve` verified it.
        verify_rounds: how many plans :func:`remat.solve` measured before this one
            met the budget (0: not verified).
        solved_budget_bytes: the budget the solver was last run with: ``budget_bytes``
            less what earlier rounds measured above it (``None``: not verified).
        input_shapes: the sample batch's tensor shapes the profile was measured with,
            as ``(argument name, shape)`` pairs (``"arg0"``... for positional
            arguments); JSON writes them as an object. The budget holds for inputs up
            to these shapes; :func:`remat.apply_plan` watches for larger ones
            (``None``: not known, not checked).
        unit_signatures: per unit, ``"<parameter count>:<hash>"`` of its parameters'
            names, shapes and dtypes (:mod:`remat.runtime.structure`), so a plan is
            refused on a model of another width with the same unit names (``None``:
            checked by names and types only).
        persistent_bytes: the bytes of the step that do not grow with the batch
            (parameters, buffers, optimizer state, gradients).
        activation_peak_bytes: the plan's predicted peak of everything else (the
            activations and temporaries) on its own. With ``persistent_bytes`` it
            scales the prediction to inputs larger than the profiled ones.

    A field of the wrong type (a string where a list belongs, a float or bool where
    an int does, NaN, a negative figure) is a :class:`PlanError` at construction.
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
    loop: Loop | None = None
    measured_peak_bytes: int | None = None
    measured_time_ms: float | None = None
    verify_rounds: int = 0
    solved_budget_bytes: int | None = None
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    unit_signatures: tuple[str, ...] | None = None
    persistent_bytes: int | None = None
    activation_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        _set(self, "unit_names", checked_strings(self.unit_names, "Plan.unit_names", PlanError))
        _set(self, "options", checked_strings(self.options, "Plan.options", PlanError))
        _set(self, "segments", _checked_segments(self.segments))
        if self.unit_types is not None:
            _set(self, "unit_types", checked_strings(self.unit_types, "Plan.unit_types", PlanError))
        if self.unit_signatures is not None:
            _set(self, "unit_signatures", checked_strings(self.unit_signatures,
                                                          "Plan.unit_signatures", PlanError))
            if len(self.unit_signatures) != len(self.unit_names):
                raise PlanError(f"Plan.unit_signatures has {len(self.unit_signatures)} entries "
                                f"for {len(self.unit_names)} units; one per unit")
        if self.input_shapes is not None:
            _set(self, "input_shapes", _checked_shapes(self.input_shapes))
        _check_figures(self)
        if self.loop is not None and not isinstance(self.loop, Loop):
            raise PlanError(f"Plan.loop must be a remat.Loop, got {type(self.loop).__name__}")
        n = len(self.unit_names)
        if len(self.options) != n:
            raise PlanMismatchError(
                f"a plan needs one option per unit: {n} units, {len(self.options)} options"
            )
        bad = [o for o in self.options if o not in OPTION_ORDER]
        if bad:
            raise PlanMismatchError(
                f"unknown options {bad}; valid options: {[o.value for o in OPTION_ORDER]}"
            )
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
        counts = {o.value: self.options.count(o) for o in OPTION_ORDER if o in self.options}
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
        d["loop"] = None if self.loop is None else self.loop.to_dict()
        if self.input_shapes is not None:
            d["input_shapes"] = {name: list(shape) for name, shape in self.input_shapes}
        return {"schema_version": PLAN_SCHEMA_VERSION, **d}

    def to_json(self, path: JsonSource | None = None, *, indent: int = 1) -> str:
        """The plan as JSON text, also written to ``path`` (a str or Path) when given."""
        return write_json(self.to_dict(), path, indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """A plan from :meth:`to_dict`'s output; a malformed one is a :class:`PlanError`."""
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan is a JSON object (a dict), got {type(d).__name__}")
        refuse_other_kind(d, "plan", PlanError)
        version = d.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise PlanMismatchError(
                f"plan schema_version {version!r} is not supported (expected "
                f"{PLAN_SCHEMA_VERSION}); solve the plan again with this remat"
            )
        d = check_keys(d, cls, "the plan", PlanError, extra=("schema_version",))
        d.pop("schema_version")
        if d.get("loop") is not None:
            try:
                d["loop"] = Loop.from_dict(d["loop"])
            except RematError as err:
                raise PlanError(f"the plan's 'loop': {err}") from None
        return cls(**d)

    @classmethod
    def from_json(cls, source: JsonSource) -> Plan:
        """Read a plan from a path (a ``str`` or ``pathlib.Path``) or from JSON text.

        Raises:
            PlanError: the file is missing, unreadable, empty, not JSON, a profile, or
                holds a malformed plan; the message names the file and the field.
        """
        d, where = read_json_object(source, "plan", PlanError)
        try:
            return cls.from_dict(d)
        except PlanError as err:
            raise type(err)(f"{where}: {err}") from None


# ---------------------------------------------------------------------------------
# Field checks (see remat.solver.field_checks)
# ---------------------------------------------------------------------------------
def _set(plan: Plan, name: str, value: object) -> None:
    """Store a checked (normalised) value on the frozen plan."""
    object.__setattr__(plan, name, value)


def _checked_segments(segments: object) -> tuple[tuple[int, int], ...]:
    """``segments`` as ``((first, last), ...)`` of ints; anything else is a PlanError."""
    out = []
    for k, seg in enumerate(checked_list(segments, "Plan.segments", PlanError)):
        where = f"Plan.segments[{k}]"
        pair = checked_list(seg, where, PlanError)
        if len(pair) != 2:
            raise PlanError(f"{where} must be a [first, last] pair of unit indices, got {seg!r}")
        a, b = (checked_bytes(x, where, PlanError, hi=None, unit="unit indices") for x in pair)
        out.append((a, b))
    return tuple(out)


def _checked_shapes(shapes: object) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``{name: shape}`` or ``((name, shape), ...)`` as the latter, checked."""
    where = "Plan.input_shapes"
    pairs = shapes.items() if isinstance(shapes, Mapping) else checked_list(shapes, where,
                                                                            PlanError)
    out = []
    for pair in pairs:
        items = checked_list(pair, where, PlanError)
        if len(items) != 2:
            raise PlanError(f"{where} must map argument names to shapes, got {pair!r}")
        name = checked_str(items[0], f"a {where} name", PlanError)
        dims = checked_list(items[1], f"{where}[{name!r}]", PlanError)
        out.append((name, tuple(checked_bytes(d, f"{where}[{name!r}]", PlanError, hi=None,
                                              unit="elements") for d in dims)))
    return tuple(out)


def _check_figures(plan: Plan) -> None:
    """The text fields are strings, the figures non-negative and finite (or ``None``)."""
    checked_str(plan.algorithm, "Plan.algorithm", PlanError)
    checked_str(plan.status, "Plan.status", PlanError)
    _set(plan, "solve_ms", checked_ms(plan.solve_ms, "Plan.solve_ms", PlanError, hi=None))
    # The budget is the user's, as given: any size (a huge one means "no limit").
    optional: dict[str, Any] = {
        "budget_bytes": lambda v, w: checked_bytes(v, w, PlanError, hi=None),
        "predicted_peak_bytes": lambda v, w: checked_bytes(v, w, PlanError, hi=MAX_INT64),
        "measured_peak_bytes": lambda v, w: checked_bytes(v, w, PlanError, hi=MAX_INT64),
        "solved_budget_bytes": lambda v, w: checked_bytes(v, w, PlanError, hi=None),
        "persistent_bytes": lambda v, w: checked_bytes(v, w, PlanError, hi=MAX_INT64),
        "activation_peak_bytes": lambda v, w: checked_bytes(v, w, PlanError, hi=MAX_INT64),
        "measured_time_ms": lambda v, w: checked_ms(v, w, PlanError, hi=None),
        "compiled_peak_bytes": lambda v, w: checked_bytes(v, w, PlanError, hi=MAX_INT64),
        "predicted_time_ms": lambda v, w: checked_ms(v, w, PlanError, hi=None),
        "compiled_time_ms": lambda v, w: checked_ms(v, w, PlanError, hi=None),
        "activation_memory_budget": lambda v, w: checked_ms(
            v, w, PlanError, hi=None, unit="a fraction"
        ),
        "fingerprint": lambda v, w: checked_str(v, w, PlanError),
        "device": lambda v, w: checked_str(v, w, PlanError),
    }
    for name, check in optional.items():
        value = getattr(plan, name)
        if value is not None:
            _set(plan, name, check(value, f"Plan.{name}"))
    _set(plan, "verify_rounds", checked_bytes(plan.verify_rounds, "Plan.verify_rounds", PlanError,
                                              hi=None, unit="rounds"))
