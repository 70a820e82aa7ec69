"""A Plan: the decision (what to do with each unit's activations, for which budget),
what it was made for, and how it came about.

Plans are data: frozen, checked when built or read, and round-tripping through JSON.
A plan is four parts:

* the **decision**: ``unit_names``, ``options``, ``segments`` and ``budget_bytes``,
  which is all :func:`remat.runtime.apply_plan` runs and ``simulate()`` costs;
* its **target** (:class:`PlanTarget`): the model and step it was made for (unit types
  and parameter signatures, device, loop, input shapes), which the runtime checks the
  live model and its inputs against;
* its **record** (:class:`PlanRecord`): how it was produced (algorithm, status, solve
  time) and what was predicted for it;
* what was **measured** of it, when it was: closed-loop verification
  (:class:`Verification`) and, for a plan chosen for ``torch.compile``, the compiled
  choice (:class:`CompiledChoice`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any

from remat.core.errors import PlanError, PlanMismatchError, RematError
from remat.core.fields import (
    MAX_INT64,
    checked_bytes,
    checked_list,
    checked_ms,
    checked_str,
    checked_strings,
)
from remat.core.json_io import (
    JsonSource,
    check_keys,
    from_json_source,
    refuse_other_kind,
    write_json,
)
from remat.core.loop import Loop
from remat.core.option import OPTION_ORDER, Option

__all__ = [
    "PLAN_SCHEMA_VERSION",
    "ChunkedHead",
    "CompiledChoice",
    "Plan",
    "PlanRecord",
    "PlanTarget",
    "Status",
    "Verification",
]

# 3: the decision apart from its target, record, verification and compiled choice;
# 4: a chunked head (read: version 3, which has none; version 2, flat fields, converted)
PLAN_SCHEMA_VERSION = 4
_READABLE_VERSIONS = (2, 3, 4)


class Status(str, Enum):
    """How good a plan is known to be.

    Members are strings (``Status.OPTIMAL == "optimal"``), as :class:`Option`'s are; a
    :class:`PlanRecord` holds the plain string.
    """

    OPTIMAL = "optimal"  # proven optimal for its budget
    FEASIBLE = "feasible"  # fits its budget, optimality not proven (heuristics, time limits)
    MANUAL = "manual"  # written by a user, not solved

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return str.__hash__(self)


Shapes = tuple[tuple[str, tuple[int, ...]], ...]
Counts = tuple[tuple[str, int], ...]


def _set(obj: object, name: str, value: object) -> None:
    """Store a checked (normalised) value on a frozen dataclass."""
    object.__setattr__(obj, name, value)


def _check_optional(obj: object, owner: str,
                    checks: Mapping[str, Callable[[object, str], object]]) -> None:
    """Check (and normalise) each named field of ``obj`` that is not ``None``."""
    for name, check in checks.items():
        value = getattr(obj, name)
        if value is not None:
            _set(obj, name, check(value, f"{owner}.{name}"))


def _bytes(value: object, where: str) -> int:
    return checked_bytes(value, where, PlanError, hi=MAX_INT64)


def _budget(value: object, where: str) -> int:
    # A budget is the user's, as given: any size (a huge one means "no limit").
    return checked_bytes(value, where, PlanError, hi=None)


def _ms(value: object, where: str) -> float:
    return checked_ms(value, where, PlanError, hi=None)


@dataclass(frozen=True)
class PlanTarget:
    """What a plan was made for; :func:`remat.runtime.apply_plan` checks the model against it.

    Attributes:
        unit_types: the units' class names, for error messages and checks.
        unit_signatures: per unit, ``"<parameter count>:<hash>"`` of its parameters'
            names, shapes and dtypes (:mod:`remat.execute.structure`), so a plan is
            refused on a model of another width with the same unit names.
        device: the device type the profile was measured on (``"cpu"``, ``"cuda"``).
        loop: the training loop the plan was solved for (:class:`~remat.core.loop.Loop`).
        input_shapes: the sample batch's tensor shapes the profile was measured with,
            as ``(argument name, shape)`` pairs (``"arg0"``... for positional
            arguments); JSON writes them as an object. The budget holds for inputs up
            to these shapes; the runtime watches for larger ones.
        unit_type_counts: how many modules of each unit class the profiled model had
            (``(class name, count)`` pairs; JSON writes them as an object). A model
            with more of them is deeper than the one profiled: its extra blocks would
            run unplanned, outside the plan's figures, so ``apply_plan`` refuses it.
        world_size: for a model sharded with FSDP2, the ranks its parameters were sharded
            over when the plan was solved (its figures are one rank's: another world size
            is another step, so ``apply_plan`` refuses it); ``None`` for an unsharded model.

    ``None`` in any field: not known, not checked (a manual plan).
    """

    unit_types: tuple[str, ...] | None = None
    unit_signatures: tuple[str, ...] | None = None
    device: str | None = None
    loop: Loop | None = None
    input_shapes: Shapes | None = None
    unit_type_counts: Counts | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if self.world_size is not None and (isinstance(self.world_size, bool) or not isinstance(
                self.world_size, int) or self.world_size < 1):
            raise PlanError(f"Plan.target.world_size must be an int >= 1 (the ranks a sharded "
                            f"model's plan was solved for), got {self.world_size!r}")
        for name in ("unit_types", "unit_signatures"):
            value = getattr(self, name)
            if value is not None:
                _set(self, name, checked_strings(value, f"Plan.target.{name}", PlanError))
        if self.device is not None:
            _set(self, "device", checked_str(self.device, "Plan.target.device", PlanError))
        if self.loop is not None and not isinstance(self.loop, Loop):
            raise PlanError(f"Plan.target.loop must be a remat.Loop, got "
                            f"{type(self.loop).__name__}")
        if self.input_shapes is not None:
            _set(self, "input_shapes", _checked_shapes(self.input_shapes))
        if self.unit_type_counts is not None:
            _set(self, "unit_type_counts", _checked_counts(self.unit_type_counts))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["loop"] = None if self.loop is None else self.loop.to_dict()
        if self.input_shapes is not None:
            d["input_shapes"] = {name: list(shape) for name, shape in self.input_shapes}
        if self.unit_type_counts is not None:
            d["unit_type_counts"] = dict(self.unit_type_counts)
        if self.world_size is None:  # unsharded: the plan file stays as it was
            del d["world_size"]
        return d

    @classmethod
    def from_dict(cls, d: object) -> PlanTarget:
        d = check_keys(d, cls, "the plan's 'target'", PlanError)
        if d.get("loop") is not None:
            try:
                d["loop"] = Loop.from_dict(d["loop"])
            except RematError as err:
                raise PlanError(f"the plan's target 'loop': {err}") from None
        return cls(**d)


@dataclass(frozen=True)
class PlanRecord:
    """How a plan was produced, and what was predicted for it.

    Attributes:
        algorithm: what produced the plan (``"dp"``, ``"ilp"``, ``"chen"``, ``"manual"``...).
        status: ``"optimal"``, ``"feasible"`` or ``"manual"`` (:class:`Status`).
        solve_ms: the algorithm's wall time, in milliseconds.
        predicted_peak_bytes, predicted_time_ms: ``simulate()``'s figures for it.
        persistent_bytes: the bytes of the step that do not grow with the batch
            (parameters, buffers, optimizer state, gradients).
        activation_peak_bytes: the plan's predicted peak of everything else (the
            activations and temporaries) on its own. With ``persistent_bytes`` it
            scales the prediction to inputs larger than the profiled ones.
    """

    algorithm: str = "manual"
    status: str = Status.MANUAL
    solve_ms: float = 0.0
    predicted_peak_bytes: int | None = None
    predicted_time_ms: float | None = None
    persistent_bytes: int | None = None
    activation_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        checked_str(self.algorithm, "Plan.record.algorithm", PlanError)
        _set(self, "status", str(checked_str(self.status, "Plan.record.status", PlanError)))
        _set(self, "solve_ms", _ms(self.solve_ms, "Plan.record.solve_ms"))
        _check_optional(self, "Plan.record", {
            "predicted_peak_bytes": _bytes, "predicted_time_ms": _ms,
            "persistent_bytes": _bytes, "activation_peak_bytes": _bytes})

    @classmethod
    def from_dict(cls, d: object) -> PlanRecord:
        return cls(**check_keys(d, cls, "the plan's 'record'", PlanError))


@dataclass(frozen=True)
class Verification:
    """What closed-loop verification (:mod:`remat.tune.verify`) measured of a plan.

    Attributes:
        rounds: how many plans :func:`remat.solve` measured before this one met the
            budget.
        solved_budget_bytes: the budget the solver was last run with: the user's
            budget less what earlier rounds measured above it.
        measured_peak_bytes: the peak of one optimizer step with the plan applied (the
            higher of the dispatch-level meter's and the allocator's).
        measured_time_ms: that step's time (``None``: not timed).
    """

    rounds: int
    solved_budget_bytes: int
    measured_peak_bytes: int
    measured_time_ms: float | None = None

    def __post_init__(self) -> None:
        _set(self, "rounds", checked_bytes(self.rounds, "Plan.verification.rounds", PlanError,
                                           hi=None, unit="rounds"))
        _set(self, "solved_budget_bytes",
             _budget(self.solved_budget_bytes, "Plan.verification.solved_budget_bytes"))
        _set(self, "measured_peak_bytes",
             _bytes(self.measured_peak_bytes, "Plan.verification.measured_peak_bytes"))
        _check_optional(self, "Plan.verification", {"measured_time_ms": _ms})

    @classmethod
    def from_dict(cls, d: object) -> Verification:
        return cls(**check_keys(d, cls, "the plan's 'verification'", PlanError))


@dataclass(frozen=True)
class CompiledChoice:
    """For a plan chosen for ``torch.compile`` (``solve(..., compiled=True)``), what its
    compiled training step measured.

    Attributes:
        peak_bytes: the compiled step's peak as the allocator measured it.
        time_ms: that step's median time, in milliseconds (``None``: not timed).
        activation_memory_budget: the ``torch._functorch.config.activation_memory_budget``
            it was measured with (inductor's own recomputation; 1.0 is its default):
            compile it with :func:`remat.compile_planned`, which sets it.
    """

    peak_bytes: int
    activation_memory_budget: float
    time_ms: float | None = None

    def __post_init__(self) -> None:
        _set(self, "peak_bytes", _bytes(self.peak_bytes, "Plan.compiled.peak_bytes"))
        _set(self, "activation_memory_budget", checked_ms(
            self.activation_memory_budget, "Plan.compiled.activation_memory_budget", PlanError,
            hi=1.0, unit="a fraction"))
        _check_optional(self, "Plan.compiled", {"time_ms": _ms})

    @classmethod
    def from_dict(cls, d: object) -> CompiledChoice:
        return cls(**check_keys(d, cls, "the plan's 'compiled'", PlanError))


@dataclass(frozen=True)
class ChunkedHead:
    """A plan's decision to compute the output head and its loss over chunks of the tokens
    (:mod:`remat.execute.head`), and the head it was measured on.

    Attributes:
        name: the head module's qualified name (``"lm_head"``).
        kind: ``"causal-lm"`` or ``"head_loss"`` (:class:`remat.core.profile.HeadProfile`).
        signature: the head's parameter signature; the runtime refuses the plan on a
            model whose head has other parameters.
        chunks: how many chunks of the tokens the head and the loss run over.
        why: why the plan chunks the head (the chunked loss is not bitwise the one as
            written: it sums in another order), for the plan's summary.
    """

    name: str
    kind: str
    signature: str
    chunks: int
    why: str = ""

    def __post_init__(self) -> None:
        for name in ("name", "kind", "signature", "why"):
            checked_str(getattr(self, name), f"Plan.head.{name}", PlanError)
        _set(self, "chunks", checked_bytes(self.chunks, "Plan.head.chunks", PlanError,
                                           hi=None, unit="chunks"))
        if self.chunks < 2:
            raise PlanError(f"Plan.head.chunks must be at least 2, got {self.chunks}")

    @classmethod
    def from_dict(cls, d: object) -> ChunkedHead:
        return cls(**check_keys(d, cls, "the plan's 'head'", PlanError))


@dataclass(frozen=True)
class Plan:
    """Per-unit options and multi-unit checkpoint segments, for a budget.

    Attributes:
        unit_names: the units, in forward execution order.
        options: per unit, one of ``keep``, ``checkpoint``, ``selective``, ``offload``.
        segments: inclusive ``(first, last)`` unit indices of checkpoint segments that
            span two or more consecutive units of a chain: only the first unit's
            input is held, and the whole segment is recomputed once in its backward.
            Every unit in a segment has the option ``checkpoint``.
        budget_bytes: the budget it was solved for (``None`` when it had none).
        head: the output head and its loss over chunks of the tokens
            (:class:`ChunkedHead`); ``None``: the head as the model computes it.
        target: what it was made for (:class:`PlanTarget`).
        record: how it was produced and what was predicted (:class:`PlanRecord`).
        verification: what :func:`remat.solve` measured of it (``None``: not verified).
        compiled: its compiled step, for a plan chosen for ``torch.compile``
            (:class:`CompiledChoice`; ``None`` otherwise).

    A field of the wrong type (a string where a list belongs, a float or bool where
    an int does, NaN, a negative figure) is a :class:`PlanError` at construction.
    """

    unit_names: tuple[str, ...]
    options: tuple[str, ...]
    segments: tuple[tuple[int, int], ...] = ()
    budget_bytes: int | None = None
    target: PlanTarget = field(default_factory=PlanTarget)
    record: PlanRecord = field(default_factory=PlanRecord)
    verification: Verification | None = None
    compiled: CompiledChoice | None = None
    head: ChunkedHead | None = None

    def __post_init__(self) -> None:
        _set(self, "unit_names", checked_strings(self.unit_names, "Plan.unit_names", PlanError))
        _set(self, "options", checked_strings(self.options, "Plan.options", PlanError))
        _set(self, "segments", _checked_segments(self.segments))
        _check_optional(self, "Plan", {"budget_bytes": _budget})
        for name, kind in (("target", PlanTarget), ("record", PlanRecord)):
            if not isinstance(getattr(self, name), kind):
                raise PlanError(f"Plan.{name} must be a {kind.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        for name, kind in (("verification", Verification), ("compiled", CompiledChoice),
                           ("head", ChunkedHead)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise PlanError(f"Plan.{name} must be a {kind.__name__} or None, got "
                                f"{type(value).__name__}")
        n = len(self.unit_names)
        if self.target.unit_signatures is not None and len(self.target.unit_signatures) != n:
            raise PlanError(f"Plan.target.unit_signatures has {len(self.target.unit_signatures)} "
                            f"entries for {n} units; one per unit")
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

    def __getattr__(self, name: str) -> Any:
        # Called only for a name the plan does not have: the fields that moved out of the
        # flat version-2 plan say where they went (docs/compatibility.md).
        if name in _V2_DROPPED:
            raise AttributeError(f"Plan.{name} was removed: plan.target holds what it checked")
        moved = _MOVED_ATTRIBUTES.get(name)
        if moved is None:
            raise AttributeError(f"'Plan' object has no attribute {name!r}")
        raise AttributeError(f"Plan.{name} moved: use plan.{moved}")

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
        if self.head is not None:
            text += f", head {self.head.name} over {self.head.chunks} chunks"
            if self.head.why:
                text += f" ({self.head.why})"
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

    def with_target(self, **changes: Any) -> Plan:
        """A copy with some fields of its :class:`PlanTarget` changed."""
        return replace(self, target=replace(self.target, **changes))

    def with_record(self, **changes: Any) -> Plan:
        """A copy with some fields of its :class:`PlanRecord` changed."""
        return replace(self, record=replace(self.record, **changes))

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "unit_names": list(self.unit_names),
            "options": list(self.options),
            "segments": [list(s) for s in self.segments],
            "budget_bytes": self.budget_bytes,
            "target": self.target.to_dict(),
            "record": asdict(self.record),
            "verification": None if self.verification is None else asdict(self.verification),
            "compiled": None if self.compiled is None else asdict(self.compiled),
            "head": None if self.head is None else asdict(self.head),
        }

    def to_json(self, path: JsonSource | None = None, *, indent: int = 1) -> str:
        """The plan as JSON text, also written to ``path`` (a str or Path) when given."""
        return write_json(self.to_dict(), path, indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """A plan from :meth:`to_dict`'s output (or a version-2 plan, converted); a
        malformed one is a :class:`PlanError`."""
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan is a JSON object (a dict), got {type(d).__name__}")
        refuse_other_kind(d, "plan", PlanError)
        version = d.get("schema_version")
        if version not in _READABLE_VERSIONS:
            raise PlanMismatchError(
                f"plan schema_version {version!r} is not supported (this remat reads versions "
                f"{list(_READABLE_VERSIONS)}); solve the plan again with this remat: "
                "remat.solve(model, batch, memory_budget=...).to_json(path)"
            )
        if version == 2:
            d = _from_version_2(d)
        d = check_keys(d, cls, "the plan", PlanError, extra=("schema_version",))
        d.pop("schema_version")
        d["target"] = PlanTarget.from_dict(d.get("target", {}))
        d["record"] = PlanRecord.from_dict(d.get("record", {}))
        for name, kind in (("verification", Verification), ("compiled", CompiledChoice),
                           ("head", ChunkedHead)):
            if d.get(name) is not None:
                d[name] = kind.from_dict(d[name])
        return cls(**d)

    @classmethod
    def from_json(cls, source: JsonSource) -> Plan:
        """Read a plan from a path (a ``str`` or ``pathlib.Path``) or from JSON text.

        Raises:
            PlanError: the file is missing, unreadable, empty, not JSON, a profile, or
                holds a malformed plan; the message names the file and the field.
        """
        return from_json_source(source, "plan", PlanError, cls.from_dict)


# ---------------------------------------------------------------------------------
# Version 2: every field flat; read and converted
# ---------------------------------------------------------------------------------
_V2_TARGET = tuple(f.name for f in fields(PlanTarget))
_V2_RECORD = tuple(f.name for f in fields(PlanRecord))
_V2_VERIFIED = {"verify_rounds": "rounds", "solved_budget_bytes": "solved_budget_bytes",
                "measured_peak_bytes": "measured_peak_bytes",
                "measured_time_ms": "measured_time_ms"}
_V2_COMPILED = {"compiled_peak_bytes": "peak_bytes", "compiled_time_ms": "time_ms",
                "activation_memory_budget": "activation_memory_budget"}
_V2_DROPPED = ("fingerprint",)  # never read: its checks are the target's
# The same fields as attributes: ``plan.predicted_peak_bytes`` -> ``plan.record...``.
_MOVED_ATTRIBUTES = {
    **{name: f"target.{name}" for name in _V2_TARGET},
    **{name: f"record.{name}" for name in _V2_RECORD},
    **{old: f"verification.{new}" for old, new in _V2_VERIFIED.items()},
    **{old: f"compiled.{new}" for old, new in _V2_COMPILED.items()},
}


def _from_version_2(d: Mapping[str, Any]) -> dict[str, Any]:
    """A version-2 plan (flat fields) in the version-3 layout; unknown keys stay top-level,
    where :func:`check_keys` names them."""
    flat = dict(d)
    out: dict[str, Any] = {"schema_version": PLAN_SCHEMA_VERSION}
    for key in ("unit_names", "options", "segments", "budget_bytes"):
        if key in flat:
            out[key] = flat.pop(key)
    out["target"] = {k: flat.pop(k) for k in _V2_TARGET if k in flat}
    out["record"] = {k: flat.pop(k) for k in _V2_RECORD if k in flat}
    verified = {new: flat.pop(old) for old, new in _V2_VERIFIED.items() if old in flat}
    if verified.get("rounds"):
        out["verification"] = verified
    compiled = {new: flat.pop(old) for old, new in _V2_COMPILED.items() if old in flat}
    if compiled.get("peak_bytes") is not None:
        out["compiled"] = {k: v for k, v in compiled.items() if v is not None}
    for key in ("schema_version", *_V2_DROPPED):
        flat.pop(key, None)
    out.update(flat)
    return out


# ---------------------------------------------------------------------------------
# Field checks (see remat.core.fields)
# ---------------------------------------------------------------------------------
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


def _checked_pairs(value: object, where: str, meaning: str,
                   check: Callable[[object, str], Any]) -> tuple[tuple[str, Any], ...]:
    """``{name: value}`` or ``((name, value), ...)`` as the latter, each value checked."""
    pairs = value.items() if isinstance(value, Mapping) else checked_list(value, where,
                                                                          PlanError)
    out = []
    for pair in pairs:
        items = checked_list(pair, where, PlanError)
        if len(items) != 2:
            raise PlanError(f"{where} must map {meaning}, got {pair!r}")
        name = checked_str(items[0], f"a {where} name", PlanError)
        out.append((name, check(items[1], f"{where}[{name!r}]")))
    return tuple(out)


def _checked_shapes(shapes: object) -> Shapes:
    """``{name: shape}`` or ``((name, shape), ...)`` as the latter, checked."""
    def shape(dims: object, where: str) -> tuple[int, ...]:
        return tuple(checked_bytes(d, where, PlanError, hi=None, unit="elements")
                     for d in checked_list(dims, where, PlanError))

    return _checked_pairs(shapes, "Plan.target.input_shapes", "argument names to shapes", shape)


def _checked_counts(counts: object) -> Counts:
    """``{class name: count}`` or ``((name, count), ...)`` as the latter, checked."""
    return _checked_pairs(counts, "Plan.target.unit_type_counts", "unit class names to counts",
                          lambda n, where: checked_bytes(n, where, PlanError, hi=None,
                                                         unit="modules"))
