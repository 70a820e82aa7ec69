"""The measured profile the solver optimises over: plain, typed, torch-free data.

The step is a sequence ``prefix, unit 0, ..., unit n-1, suffix``: the prefix is
the code before the first unit (embeddings), the suffix the code after the last
(head, loss). Every byte figure is a count of storages, so a tensor shared by two
parts is one *boundary* counted once:

* On a **chain**, unit i's output storage is unit i+1's input storage. It is held
  after the forward pass when either side holds it (``OptionCost.holds_output`` of
  unit i, ``holds_input`` of unit i+1). The ends are held when the prefix/suffix
  holds them (``UnitProfile.input_held_outside`` / ``output_held_outside``).
* Off a chain, code runs between units, so each unit's input and output are
  boundaries of their own, held by the unit's option or by the outside code.

``held_bytes`` figures never include boundary storages: those are counted by the
rule above, which is what keeps adjacent units from being counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from remat.core.errors import ProfileError, RematError
from remat.core.fields import (
    MAX_BYTES,
    MAX_MS,
    checked_bool,
    checked_bytes,
    checked_list,
    checked_ms,
    checked_str,
)
from remat.core.json_io import (
    JsonSource,
    check_keys,
    from_json_source,
    refuse_other_kind,
    write_json,
)
from remat.core.loop import Loop
from remat.core.option import Option

__all__ = [
    "MAX_BYTES",
    "MAX_MS",
    "SCHEMA_VERSION",
    "STEPS_IN_BACKWARD",
    "UNIT_TYPE_COUNTS",
    "HeadProfile",
    "HeadVariant",
    "OptionCost",
    "OutsideCost",
    "Profile",
    "SharedTensor",
    "UnitProfile",
]

# 2: the loop, shared tensors, kept output, autocast caches; 3: no measured unplanned peak
# (the profiler never runs the unplanned step: simulate() predicts it); 4: the head's
# chunked variants (version 3 is read: it has none); 5: the code between units off a chain
# (``UnitProfile.before_*``) and what a checkpoint region's recomputation holds besides
# the units' forwards (recompute_rng_bytes, a unit's recompute_state_bytes); older
# versions read with none, as they were measured
SCHEMA_VERSION = 5
_READABLE_VERSIONS = (3, 4, 5)

# ``Profile.meta`` key: ``{unit class name: how many modules of that class the model had}``,
# recorded by ``remat.profile()``; solved plans carry it (``PlanTarget.unit_type_counts``)
# so that a deeper model than the one profiled is refused.
UNIT_TYPE_COUNTS = "unit_type_counts"

# ``Profile.meta`` key: ``"measured"`` when each parameter's own optimizer step was metered
# (in the ``stepped_bwd_peak_bytes`` figures, which let one profile predict a loop that
# steps the optimizer in backward), else why not: ``"no optimizer"``, or the optimizer's
# refusal.
STEPS_IN_BACKWARD = "steps_in_backward"




@dataclass(frozen=True)
class OptionCost:
    """What one option costs one unit, measured.

    Attributes:
        held_bytes: device bytes the unit holds from its forward to its backward,
            boundary storages (its input's and output's) excluded.
        holds_input: the option keeps the unit's input storage alive until its backward.
        holds_output: the option keeps the unit's output storage alive until its backward.
        fwd_peak_bytes: highest live bytes during the unit's forward, above the live
            bytes at its start (its input is already live then; its output is not).
        bwd_peak_bytes: highest live bytes during the unit's backward, recomputation
            included, above the live bytes at its start (which include what the
            unit holds and the gradient of its output).
        extra_ms: time the option adds to a training step over ``keep``
            (recomputation, copies that are not hidden), in milliseconds.
        stepped_bwd_peak_bytes: ``bwd_peak_bytes`` in a loop that steps the optimizer
            in backward (``Loop(optimizer_in_backward=True)``): each parameter gradient
            freed once its own step, run as it is complete, is done; that step's peak
            included. ``None``: not measured, ``bwd_peak_bytes`` stands for it.
    """

    held_bytes: int
    holds_input: bool
    holds_output: bool
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    extra_ms: float = 0.0
    stepped_bwd_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_fields(self, ints=_OPTION_INTS, bools=_OPTION_BOOLS, floats=("extra_ms",))
        _check_stepped(self)


@dataclass(frozen=True)
class UnitProfile:
    """One unit (a module that is a candidate for checkpointing), measured.

    Attributes:
        name: the module's qualified name in the model (``"transformer.h.3"``).
        type_name: the module's class name.
        fwd_ms, bwd_ms: median forward / backward time of the unit, in milliseconds.
        input_bytes: bytes of its first input's storage (the activation it is fed).
        output_bytes: bytes of its first output's storage.
        input_grad_bytes: bytes of the gradient its backward produces for that
            input (0 when the input does not require grad).
        param_grad_bytes: bytes of parameter gradients first allocated in its backward.
        input_held_outside / output_held_outside: code outside the units (the
            prefix, the suffix, or code between units off a chain) holds that
            storage until its own backward.
        input_kept_by_caller: the model's own code keeps this unit's input referenced
            past the unit's forward (``x = self.stem(x); x = self.blocks(x)`` keeps the
            stem's output while the blocks run), so a segment spanning the link from
            the previous unit into this one would free nothing: none may.
        autocast_cache_bytes: under ``torch.autocast``, the weight casts its forward
            leaves in autocast's cache, alive until the loop's autocast region ends
            (the end of the forward pass). Counted for every option: under ``keep``
            the same casts are usually saved for backward too, so this over-counts
            the forward pass of kept units a little, never under-counts.
        options: the measured cost of every option the runtime offers for this
            unit; ``keep`` is always present.
        input_grad_kept_until: off a chain, the unit (its index; ``-1``: the prefix)
            through whose backward the code before this unit keeps its input's
            gradient alive: a concatenation's backward hands each of its inputs a view
            of it, so it lives until the last of them is used. ``None``: that code
            consumes it at once.
        param_signature: ``"<parameter count>:<hash>"`` of the unit's parameters'
            names, shapes and dtypes (:mod:`remat.execute.structure`); plans carry it
            so that a model of another width is refused. ``None``: not recorded.
        before_held_bytes, before_fwd_peak_bytes, before_bwd_peak_bytes,
            before_param_grad_bytes: off a chain, the code between the previous unit and
            this one (a downsampling layer between two stages of blocks); 0 for the first
            unit (its code is the prefix) and on a chain (there is none). What it holds
            from its forward to its backward (boundaries and shared tensors excluded, as
            for the prefix); its forward peak above the live bytes when the previous
            unit's forward is done, less what it holds; its backward peak above the live
            bytes when this unit's backward is done (its input's gradient alive); and the
            parameter-gradient bytes its backward first allocates. None of these is in
            the prefix's figures. 0 peaks: no such code, or none that rises above its
            start: no event.
        recompute_state_bytes: what a checkpoint region recomputing this unit holds for
            it besides its forward, from the start of the region's recomputation to its
            end: the copies of its BatchNorm running statistics that are written back
            after it (:func:`remat.execute.options.frozen_batchnorm_stats`). Inside the
            ``checkpoint`` option's own ``bwd_peak_bytes``; a multi-unit segment, which
            recomputes with ``keep`` costs, adds it for each of its units.
    """

    name: str
    type_name: str
    fwd_ms: float
    bwd_ms: float
    input_bytes: int
    output_bytes: int
    input_grad_bytes: int
    param_grad_bytes: int
    options: Mapping[str, OptionCost]
    input_held_outside: bool = False
    output_held_outside: bool = False
    autocast_cache_bytes: int = 0
    input_kept_by_caller: bool = False
    param_signature: str | None = None
    input_grad_kept_until: int | None = None
    before_held_bytes: int = 0
    before_fwd_peak_bytes: int = 0
    before_bwd_peak_bytes: int = 0
    before_param_grad_bytes: int = 0
    recompute_state_bytes: int = 0

    def __post_init__(self) -> None:
        checked_str(self.name, "UnitProfile.name", ProfileError)
        kept = self.input_grad_kept_until
        if kept is not None and (isinstance(kept, bool) or not isinstance(kept, int)):
            raise ProfileError(f"unit {self.name!r}: UnitProfile.input_grad_kept_until must "
                               f"be an int or None, got {kept!r}")
        if self.param_signature is not None:
            checked_str(self.param_signature, f"unit {self.name!r}: UnitProfile.param_signature",
                        ProfileError)
        checked_str(self.type_name, f"unit {self.name!r}: UnitProfile.type_name", ProfileError)
        _check_fields(self, ints=_UNIT_INTS, bools=_UNIT_BOOLS, floats=("fwd_ms", "bwd_ms"),
                      owner=f"unit {self.name!r}: UnitProfile")
        if not isinstance(self.options, Mapping):
            raise ProfileError(
                f"unit {self.name!r}: options must map option names to OptionCost, got "
                f"{type(self.options).__name__}"
            )
        unknown = set(self.options) - {o.value for o in Option}
        if unknown:
            raise ProfileError(
                f"unit {self.name!r} has unknown options {sorted(map(str, unknown))}; "
                f"valid: {[o.value for o in Option]}"
            )
        if Option.KEEP not in self.options:
            raise ProfileError(f"unit {self.name!r} has no 'keep' option cost")
        for option, cost in self.options.items():
            if not isinstance(cost, OptionCost):
                raise ProfileError(
                    f"unit {self.name!r}: the cost of option {str(option)!r} must be an "
                    f"OptionCost, got {type(cost).__name__}"
                )
        if self.keep.extra_ms != 0:
            raise ProfileError(
                f"unit {self.name!r}: the 'keep' option's extra_ms must be 0 (every option's "
                f"extra_ms is measured against keep), got {self.keep.extra_ms}"
            )

    @property
    def keep(self) -> OptionCost:
        return self.options[Option.KEEP.value]

    def held_bytes(self, option: str) -> int:  # Option members index options too
        """Bytes the unit holds until its backward under ``option``, its own boundaries included."""
        cost = self.options[option]
        return (
            cost.held_bytes
            + (self.input_bytes if cost.holds_input else 0)
            + (self.output_bytes if cost.holds_output else 0)
        )

    # The figures the issue names, derived from ``keep``.
    @property
    def saved_bytes(self) -> int:
        """Bytes autograd holds for this unit's backward when it is not checkpointed."""
        return self.held_bytes(Option.KEEP.value)

    @property
    def saved_input_bytes(self) -> int:
        return self.input_bytes if self.keep.holds_input else 0

    @property
    def saved_output_bytes(self) -> int:
        return self.output_bytes if self.keep.holds_output else 0


@dataclass(frozen=True)
class OutsideCost:
    """The code before the first unit (prefix) or after the last (suffix).

    Attributes:
        held_bytes: bytes it holds from its forward to its backward, boundary
            storages excluded (for the suffix, the loss and outputs included).
        fwd_peak_bytes: highest live bytes during its forward above its start.
        bwd_peak_bytes: highest live bytes during its backward above its start.
        param_grad_bytes: parameter-gradient bytes first allocated in its backward.
        fwd_ms, bwd_ms: its forward / backward time, in milliseconds.
        stepped_bwd_peak_bytes: ``bwd_peak_bytes`` in a loop that steps the optimizer
            in backward, its parameters' steps included (``None``: not measured,
            ``bwd_peak_bytes`` stands for it); see :class:`OptionCost`.
    """

    held_bytes: int = 0
    fwd_peak_bytes: int = 0
    bwd_peak_bytes: int = 0
    param_grad_bytes: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    stepped_bwd_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_fields(self, ints=_OUTSIDE_INTS, floats=("fwd_ms", "bwd_ms"))
        _check_stepped(self)


@dataclass(frozen=True)
class SharedTensor:
    """A tensor handed to units besides their boundary input: an attention mask, a
    position bias, rotary tables, an encoder's output, a skip connection.

    Its first user (in forward order) holds it until that unit's backward under
    ``checkpoint`` and ``selective`` (they keep every argument) and usually under
    ``keep`` (an attention mask or rotary table is saved for backward), so it counts
    from its birth until the backward of its first user: exact where that user holds
    it, a little high where nobody does, never low. When code outside the units also
    holds it, it counts to the end of the step.

    When it requires a gradient (an encoder's output, a learned position bias), its
    users' backwards sum one for it, alive from the backward of its last user until
    the code that made it has run its own (the backward of unit ``born_after``, or
    the prefix's).

    Attributes:
        nbytes: its storage's bytes.
        born_after: ``-1`` when the prefix makes it, else the unit in (or after) whose
            forward it is made; it counts from the next unit's forward on.
        first_user: the first unit it is handed to (after ``born_after``).
        held_to_end: code outside the units holds it to the end of the backward pass.
        last_user: the last unit it is handed to (``None``: ``first_user``).
        grad_bytes: the bytes of its gradient (0 when it needs none).
        maker_output: it is unit ``born_after``'s own output (an encoder's last block
            feeding every decoder block): that unit's output figures are this storage,
            so its gradient at that unit's backward is the unit's output gradient,
            counted there and not again here.
    """

    nbytes: int
    born_after: int
    first_user: int
    held_to_end: bool = False
    last_user: int | None = None
    grad_bytes: int = 0
    maker_output: bool = False

    def __post_init__(self) -> None:
        _set(self, "nbytes", checked_bytes(self.nbytes, "SharedTensor.nbytes", ProfileError))
        for name in ("born_after", "first_user"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProfileError(f"SharedTensor.{name} must be an int, got {value!r}")
        _set(self, "held_to_end", checked_bool(self.held_to_end, "SharedTensor.held_to_end",
                                               ProfileError))
        _set(self, "grad_bytes", checked_bytes(self.grad_bytes, "SharedTensor.grad_bytes",
                                               ProfileError))
        _set(self, "maker_output", checked_bool(self.maker_output,
                                                "SharedTensor.maker_output", ProfileError))
        if self.maker_output and self.born_after < 0:
            raise ProfileError("SharedTensor.maker_output needs the unit that made it: "
                               f"born_after must be >= 0, got {self.born_after}")
        if self.last_user is None:
            _set(self, "last_user", self.first_user)
        if isinstance(self.last_user, bool) or not isinstance(self.last_user, int) or (
                self.last_user < self.first_user):
            raise ProfileError(f"SharedTensor.last_user must be an int >= first_user="
                               f"{self.first_user}, got {self.last_user!r}")
        if not -1 <= self.born_after < self.first_user:
            raise ProfileError(
                f"a shared tensor is made before its first user: need -1 <= born_after "
                f"< first_user, got born_after={self.born_after}, first_user={self.first_user}"
            )


@dataclass(frozen=True)
class HeadVariant:
    """The step with the output head and its loss computed over ``chunks`` chunks of the
    tokens (:mod:`remat.execute.head`), measured: the figures of the profile it changes.

    Only the code outside the units changes (the head and the loss are the suffix), so a
    variant is what the outside step measured under it: ``prefix``, ``suffix`` and the
    :class:`Profile` fields of the same names, and whether the suffix holds the last
    unit's output (``last_output_held_outside``). ``step_ms`` is never below the
    profile's: chunking recomputes the head's projection, it cannot make it faster, so
    a timing noise never makes the solver choose it where the budget does not need it.
    """

    chunks: int
    prefix: OutsideCost
    suffix: OutsideCost
    loss_bytes: int
    output_bytes: int
    carried_bytes: int
    grad_in_flight_bytes: int
    last_output_kept: bool
    last_output_held_outside: bool
    step_ms: float

    def __post_init__(self) -> None:
        _set(self, "chunks", checked_bytes(self.chunks, "HeadVariant.chunks", ProfileError,
                                           hi=None, unit="chunks"))
        if self.chunks < 2:
            raise ProfileError(f"HeadVariant.chunks must be at least 2, got {self.chunks}")
        for name in ("prefix", "suffix"):
            if not isinstance(getattr(self, name), OutsideCost):
                raise ProfileError(f"HeadVariant.{name} must be an OutsideCost, got "
                                   f"{type(getattr(self, name)).__name__}")
        _check_fields(self, ints=_VARIANT_INTS,
                      bools=("last_output_kept", "last_output_held_outside"),
                      floats=("step_ms",))


@dataclass(frozen=True)
class HeadProfile:
    """The model's output head, where remat can chunk it, and its measured variants.

    Attributes:
        name: the head module's qualified name (``"lm_head"``).
        kind: how its loss is recognised: ``"causal-lm"`` (a Hugging Face causal LM's
            own shifted cross entropy) or ``"head_loss"`` (the model calls
            :func:`remat.head_loss`).
        signature: the head's parameter signature (:mod:`remat.execute.structure`), so
            that a plan choosing a chunked head is refused on a model whose head changed.
        variants: one :class:`HeadVariant` per chunk count measured, ascending.
        as_is: the head as the model computes it was measured, and the profile's own
            figures are its. ``False``: it did not fit the device while profiling (the
            variants, more frugal, were measured first), so the profile's own figures
            are those of the fewest chunks measured, and every plan computes the head
            over chunks (:func:`remat.solver.stamp.stamp_plan` sees to it).
    """

    name: str
    kind: str
    signature: str
    variants: tuple[HeadVariant, ...]
    as_is: bool = True

    def __post_init__(self) -> None:
        for name in ("name", "kind", "signature"):
            checked_str(getattr(self, name), f"HeadProfile.{name}", ProfileError)
        _set(self, "variants", tuple(checked_list(self.variants, "HeadProfile.variants",
                                                  ProfileError)))
        for k, v in enumerate(self.variants):
            if not isinstance(v, HeadVariant):
                raise ProfileError(f"HeadProfile.variants[{k}] must be a HeadVariant, got "
                                   f"{type(v).__name__}")
        _set(self, "as_is", checked_bool(self.as_is, "HeadProfile.as_is", ProfileError))
        if not self.variants:
            raise ProfileError("HeadProfile.variants must hold at least one variant")
        counts = [v.chunks for v in self.variants]
        if counts != sorted(set(counts)):
            raise ProfileError(f"HeadProfile.variants must have distinct chunk counts in "
                               f"ascending order, got {counts}")

    @property
    def chunk_counts(self) -> tuple[int, ...]:
        return tuple(v.chunks for v in self.variants)

    @property
    def required_chunks(self) -> int | None:
        """The chunk count every plan needs at least (``None``: the head as it is will
        do): the fewest measured, where the head as it is did not fit."""
        return None if self.as_is else self.variants[0].chunks

    def variant(self, chunks: int) -> HeadVariant:
        for v in self.variants:
            if v.chunks == chunks:
                return v
        raise ProfileError(f"the head {self.name!r} was not measured over {chunks} chunks; "
                           f"it was over {list(self.chunk_counts)}")

    @classmethod
    def from_dict(cls, d: object, where: str = "the profile's 'head'") -> HeadProfile:
        d = check_keys(d, cls, where, ProfileError)
        variants = []
        for k, v in enumerate(checked_list(d["variants"], f"{where} variants", ProfileError)):
            at = f"{where} variants[{k}]"
            fields = check_keys(v, HeadVariant, at, ProfileError)
            variants.append(_build(HeadVariant, fields, at, **{
                name: _build(OutsideCost, fields[name], f"{at} {name}")
                for name in ("prefix", "suffix")}))
        return _build(cls, d, where, variants=tuple(variants))


@dataclass(frozen=True)
class Profile:
    """A model's measured training step, unit by unit.

    Attributes:
        units: the units in forward execution order.
        is_chain: unit i+1's first input is unit i's first output and nothing
            computes between them; only then may segments span several units.
        prefix, suffix: the code outside the units.
        param_bytes, buffer_bytes, optimizer_state_bytes: persistent bytes,
            alive for the whole step.
        optimizer_step_peak_bytes: peak of ``optimizer.step()`` above the bytes
            alive when it starts (0 without an optimizer), measured whatever the loop;
            a loop that steps the optimizer in backward has no such step
            (:attr:`end_step_peak_bytes`).
        loss_bytes: bytes the caller's loss tensor and autograd's seed gradient keep
            alive from the start of backward to the end of the step (the loss
            storage is also part of ``suffix.held_bytes``; it is not freed with the
            suffix's other held bytes). Usually 8 bytes; CPU ``mse_loss`` returns a
            view of an input-sized buffer, so there it is a whole activation.
        step_ms: the time of one ordinary training step without checkpointing (derived
            by the profiler from the units' and the outside code's times: it never runs
            that step; see :mod:`remat.profiler.assemble`).
        device, dtype: where and in what precision it was measured.
        input_shapes: the sample batch's tensor shapes, by argument name.
        meta: free-form notes (torch version, the meter used, ...).
        loop: the training loop the profile was measured for (accumulation, whether
            the output is kept, autocast...): :class:`~remat.core.loop.Loop`.
        output_bytes: the model output's storages the loop keeps from the end of the
            forward pass to the end of the step (with ``loop.keep_output``; the loss
            aside, which ``loss_bytes`` counts).
        last_output_kept: the loop keeps the last unit's output, which is the model's
            output (``nn.Sequential`` with a ``loss_fn``), from the unit's forward to
            the end of the step, whoever else holds it.
        carried_bytes: what the loop's variables keep from the previous iteration
            while the next forward runs: the last loss's storage, and the last
            output with ``loop.keep_output``.
        batch_bytes: the sample batch's tensors on the model's device: made before
            the step, alive through it (the next batch of a prefetching loader is the
            loader's, not counted).
        grad_in_flight_bytes: partial gradients of parameters used in two phases (an
            embedding tied to the LM head): summed in a buffer from the suffix's
            backward until the prefix's hands the sum to ``.grad``. They are the
            parameter's gradient itself when ``.grad`` is ``None``; when the loop keeps
            gradients alive (``grads_alive_at_start``) they are extra bytes, and so
            they are when it frees each gradient after its phase
            (``optimizer_in_backward``): the sum lives from the suffix's backward to
            the prefix's, counted over that whole span (over, never under, where the
            first contributor is a unit).
        shared: tensors handed to units besides their boundary input
            (:class:`SharedTensor`); in no other figure.
        coverage: the share (0 to 1) of the step's activation memory (the bytes
            autograd saves for backward) that the units hold, i.e. that a plan can
            drop; ``None`` when not measured (a profile made by hand). The profiler
            puts the figures behind it in ``meta``: ``activation_bytes``,
            ``covered_bytes``, ``unit_activation_bytes`` (per unit) and ``uncovered``
            (the largest holders outside the units, ``[module, bytes]``).
        head: the output head remat can chunk, and what each chunk count measured
            (:class:`HeadProfile`); ``None`` when it recognised none or was not asked to
            measure it. A plan choosing a chunk count is costed on :meth:`with_head`.
        recompute_rng_bytes: the RNG state torch's checkpoint stashes while a region
            recomputes (``torch.random.fork_rng``), once per region, as measured on the
            profile's device (the CPU generator's state on CPU; a GPU's states are
            host tensors, so 0 there). Inside the ``checkpoint`` option's own
            ``bwd_peak_bytes``; a multi-unit segment adds it to its recomputation.
        unreduced_grad_bytes: on a model sharded with FSDP2, the root's unsharded
            gradients made before the prefix's backward (a head's, by the suffix or by
            a unit the head is), which wait for the root's reduce-scatter at the end of
            the backward: counted from the suffix's backward through the prefix's
            (``extra_grad_in_flight_bytes``; over, never under, where a unit made
            them). 0 elsewhere.

    Every byte figure here and in the units is an int in ``[0, MAX_BYTES]``, every
    time a finite float in ``[0, MAX_MS]`` milliseconds; anything else (a string,
    a bool, NaN, a negative number) is a :class:`ProfileError` at construction.
    Profiles are immutable: the solver caches its event model on them.
    """

    units: tuple[UnitProfile, ...]
    is_chain: bool
    prefix: OutsideCost = field(default_factory=OutsideCost)
    suffix: OutsideCost = field(default_factory=OutsideCost)
    param_bytes: int = 0
    buffer_bytes: int = 0
    optimizer_state_bytes: int = 0
    optimizer_step_peak_bytes: int = 0
    loss_bytes: int = 0
    step_ms: float = 0.0
    device: str = "cpu"
    dtype: str = "float32"
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    loop: Loop = field(default_factory=Loop)
    output_bytes: int = 0
    carried_bytes: int = 0
    shared: tuple[SharedTensor, ...] = ()
    last_output_kept: bool = False
    grad_in_flight_bytes: int = 0
    batch_bytes: int = 0
    coverage: float | None = None
    head: HeadProfile | None = None
    recompute_rng_bytes: int = 0
    unreduced_grad_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", checked_list(self.units, "Profile.units", ProfileError))
        if self.head is not None and not isinstance(self.head, HeadProfile):
            raise ProfileError(f"Profile.head must be a HeadProfile or None, got "
                               f"{type(self.head).__name__}")
        if self.coverage is not None:
            _set(self, "coverage", checked_ms(self.coverage, "Profile.coverage", ProfileError,
                                              hi=1.0, unit="a share of the activation bytes"))
        if not isinstance(self.loop, Loop):
            raise ProfileError(f"Profile.loop must be a remat.Loop, got {type(self.loop).__name__}")
        _set(self, "shared", tuple(checked_list(self.shared, "Profile.shared", ProfileError)))
        for k, t in enumerate(self.shared):
            if not isinstance(t, SharedTensor):
                raise ProfileError(
                    f"Profile.shared[{k}] must be a SharedTensor, got {type(t).__name__}")
            if t.last_user >= len(self.units):
                raise ProfileError(f"Profile.shared[{k}].last_user={t.last_user} is not a "
                                   f"unit (the profile has {len(self.units)})")
        if not self.units:
            raise ProfileError("a profile needs at least one unit")
        for k, unit in enumerate(self.units):
            if not isinstance(unit, UnitProfile):
                raise ProfileError(
                    f"Profile.units[{k}] must be a UnitProfile, got {type(unit).__name__}"
                )
            between = (unit.before_held_bytes, unit.before_fwd_peak_bytes,
                       unit.before_bwd_peak_bytes, unit.before_param_grad_bytes)
            if any(between) and (self.is_chain or k == 0):
                raise ProfileError(
                    f"unit {unit.name!r}: the before_* figures describe code between two "
                    "units off a chain; they must be 0 on a chain and for the first unit "
                    "(its code is the prefix)")
            kept = unit.input_grad_kept_until
            if kept is not None and (self.is_chain or not -1 <= kept < k):
                raise ProfileError(
                    f"unit {unit.name!r}: input_grad_kept_until={kept} must be None on a "
                    f"chain, else an earlier unit's index or -1 (the prefix)")
        for name in ("prefix", "suffix"):
            if not isinstance(getattr(self, name), OutsideCost):
                kind = type(getattr(self, name)).__name__
                raise ProfileError(f"Profile.{name} must be an OutsideCost, got {kind}")
        _check_fields(self, ints=_PROFILE_INTS, bools=("is_chain", "last_output_kept"),
                      floats=("step_ms",))
        checked_str(self.device, "Profile.device", ProfileError)
        checked_str(self.dtype, "Profile.dtype", ProfileError)
        _set(self, "input_shapes", _checked_shapes(self.input_shapes))
        if not isinstance(self.meta, Mapping):
            raise ProfileError(f"Profile.meta must be a mapping, got {type(self.meta).__name__}")
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ProfileError(f"unit names must be unique, got {names}")
        if self.is_chain:
            for a, b in zip(self.units, self.units[1:]):
                if a.output_bytes != b.input_bytes:
                    raise ProfileError(
                        f"on a chain unit {a.name!r}'s output ({a.output_bytes} B) must be "
                        f"unit {b.name!r}'s input ({b.input_bytes} B)"
                    )

    @property
    def n(self) -> int:
        return len(self.units)

    def with_head(self, chunks: int | None) -> Profile:
        """This step with the head over ``chunks`` chunks (``None``: as measured): the
        variant's figures in place of the outside code's, and no head to choose.

        Cached on the (frozen) profile, so every plan costed on one variant shares its
        event model.
        """
        if chunks is None:
            return self
        if self.head is None:
            raise ProfileError(f"this profile measured no chunked head, so none over {chunks} "
                               "chunks can be costed on it; profile with head='auto' (a loop "
                               "that does not keep the output) or head='chunked'")
        cache = self.__dict__.setdefault(_HEAD_CACHE, {})
        if chunks not in cache:
            v = self.head.variant(chunks)
            last = replace(self.units[-1], output_held_outside=v.last_output_held_outside)
            cache[chunks] = replace(
                self, units=(*self.units[:-1], last), prefix=v.prefix, suffix=v.suffix,
                loss_bytes=v.loss_bytes, output_bytes=v.output_bytes,
                carried_bytes=v.carried_bytes, grad_in_flight_bytes=v.grad_in_flight_bytes,
                last_output_kept=v.last_output_kept, step_ms=v.step_ms, head=None,
                meta={**self.meta, "head_chunks": chunks})
        return cache[chunks]

    @property
    def fixed_bytes(self) -> int:
        """Bytes alive for the whole step: parameters, buffers, optimizer state, the batch."""
        return (self.param_bytes + self.buffer_bytes + self.optimizer_state_bytes
                + self.batch_bytes)

    @property
    def grad_bytes(self) -> int:
        """All parameter-gradient bytes allocated by one backward pass."""
        return (
            self.prefix.param_grad_bytes
            + self.suffix.param_grad_bytes
            + sum(u.param_grad_bytes + u.before_param_grad_bytes for u in self.units)
        )

    @property
    def persistent_bytes(self) -> int:
        """What every plan's step holds by the end of its backward pass: the fixed bytes
        and every parameter's gradient (what no plan removes; ``"0%"`` of activations).
        A loop that frees each gradient in backward (``optimizer_in_backward``) holds no
        gradient then: the fixed bytes alone."""
        return self.fixed_bytes + (0 if self.optimizer_in_backward else self.grad_bytes)

    @property
    def extra_grad_in_flight_bytes(self) -> int:
        """Gradient bytes alive from the suffix's backward to the end of the prefix's
        beside the parameters' gradients: partial sums extra in this loop (see
        ``grad_in_flight_bytes``), and the unsharded gradients a sharded model's root
        holds for its reduce-scatter (``unreduced_grad_bytes``)."""
        extra = self.grads_alive_at_start or self.optimizer_in_backward
        return (self.grad_in_flight_bytes if extra else 0) + self.unreduced_grad_bytes

    @property
    def optimizer_in_backward(self) -> bool:
        """Whether the loop steps each parameter in backward and frees its gradient then
        (:attr:`Loop.optimizer_in_backward`): no parameter gradient outlives its phase."""
        return self.loop.optimizer_in_backward

    def bwd_peak(self, part: OptionCost | OutsideCost) -> int:
        """The peak of a backward (an option's, the prefix's or the suffix's) in this loop:
        its ``stepped_bwd_peak_bytes`` in a loop that steps the optimizer in backward,
        where measured, else its ``bwd_peak_bytes``."""
        stepped = part.stepped_bwd_peak_bytes
        if self.optimizer_in_backward and stepped is not None:
            return stepped
        return part.bwd_peak_bytes

    @property
    def end_step_peak_bytes(self) -> int:
        """The peak of the optimizer step after backward, above the bytes alive then: 0 for a
        loop that steps in backward (its steps are in its phases' peaks)."""
        return 0 if self.optimizer_in_backward else self.optimizer_step_peak_bytes

    @property
    def kept_last_output_bytes(self) -> int:
        """The last unit's output bytes when the loop keeps it to the end, else 0."""
        return self.units[-1].output_bytes if self.last_output_kept else 0

    def step_time_ms(self, extra_ms: float) -> float:
        """One optimizer step's time when each micro-batch adds ``extra_ms`` (the sum of
        the plan's options' ``extra_ms``): ``step_ms`` plus that per micro-batch."""
        return self.step_ms + self.loop.accumulation_steps * extra_ms

    def extra_ms_of(self, step_time_ms: float) -> float:
        """The per-micro-batch ``extra_ms`` sum of a plan whose step takes ``step_time_ms``."""
        return (step_time_ms - self.step_ms) / self.loop.accumulation_steps

    @property
    def grads_alive_at_start(self) -> bool:
        """Whether every parameter's gradient is alive from the start of the step (the
        loop accumulates micro-batches, or zeroes gradients without freeing them)."""
        return self.loop.grads_alive_at_start

    def segment_link(self, i: int) -> bool:
        """Whether units ``i`` and ``i + 1`` may be in one multi-unit segment: they are
        links of a chain, both offer ``checkpoint``, and the model's code does not keep
        the boundary between them (``UnitProfile.input_kept_by_caller``)."""
        if not self.is_chain or not 0 <= i < self.n - 1:
            return False
        a, b = self.units[i], self.units[i + 1]
        return (Option.CHECKPOINT in a.options and Option.CHECKPOINT in b.options
                and not b.input_kept_by_caller)

    def checkpoint_run_start(self, i: int) -> int:
        """The first unit of the run of consecutive units that a multi-unit segment
        containing unit ``i`` could start at (``i`` itself off a chain)."""
        while i > 0 and self.segment_link(i - 1):
            i -= 1
        return i

    def shared_released_after(self) -> tuple[int | None, ...]:
        """Per shared tensor, the unit after whose backward it is freed (``None``: alive
        to the end of the step).

        Its first user holds it until its backward; when that user is in a multi-unit
        segment, the segment holds its units' arguments until its whole backward is
        done, so the rule takes the first unit such a segment could start at: the same
        for every plan, never early.
        """
        return tuple(None if t.held_to_end else self.checkpoint_run_start(t.first_user)
                     for t in self.shared)

    def available_options(self) -> tuple[str, ...]:
        """Options offered by at least one unit, in :class:`Option` order."""
        offered = {o for u in self.units for o in u.options}
        return tuple(o.value for o in Option if o.value in offered)

    def to_frame(self):  # -> pandas.DataFrame (imported lazily: pandas is slow to import)
        """One row per unit: its measured times, bytes, and each option's costs.

        With a measured coverage, the column ``activation_share`` is each unit's share
        of the step's activation memory, and ``frame.attrs["coverage"]`` the units' total
        share (:attr:`coverage`).
        """
        import pandas as pd

        shares = self._activation_shares()
        rows = []
        for u in self.units:
            row = {
                "unit": u.name,
                "type": u.type_name,
                "fwd_ms": u.fwd_ms,
                "bwd_ms": u.bwd_ms,
                "input_bytes": u.input_bytes,
                "output_bytes": u.output_bytes,
                "saved_bytes": u.saved_bytes,
                "saved_input_bytes": u.saved_input_bytes,
                "saved_output_bytes": u.saved_output_bytes,
                "fwd_transient_bytes": u.keep.fwd_peak_bytes,
                "bwd_transient_bytes": u.keep.bwd_peak_bytes,
                "param_grad_bytes": u.param_grad_bytes,
            }
            if shares is not None:
                row["activation_share"] = shares.get(u.name, 0.0)
            for name, c in u.options.items():
                if name == Option.KEEP.value:
                    continue
                row[f"{name}_held_bytes"] = u.held_bytes(name)
                row[f"{name}_extra_ms"] = c.extra_ms
            rows.append(row)
        frame = pd.DataFrame(rows)
        frame.attrs["coverage"] = self.coverage
        return frame

    def _activation_shares(self) -> dict[str, float] | None:
        """Per unit its share of the activation bytes, from ``meta`` (``None``: not measured)."""
        total = self.meta.get("activation_bytes")
        per_unit = self.meta.get("unit_activation_bytes")
        if not isinstance(total, int) or total <= 0 or not isinstance(per_unit, Mapping):
            return None
        return {name: b / total for name, b in per_unit.items() if isinstance(b, (int, float))}

    # -- serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["units"] = [
            {**asdict(u), "options": {k: asdict(v) for k, v in u.options.items()}}
            for u in self.units
        ]
        d["input_shapes"] = {k: list(v) for k, v in self.input_shapes.items()}
        d["meta"] = dict(self.meta)
        d["loop"] = self.loop.to_dict()
        d["shared"] = [asdict(t) for t in self.shared]
        d["head"] = None if self.head is None else asdict(self.head)
        return {"schema_version": SCHEMA_VERSION, **d}

    def to_json(self, path: JsonSource | None = None, *, indent: int = 1) -> str:
        """The profile as JSON text, also written to ``path`` (a str or Path) when given."""
        return write_json(self.to_dict(), path, indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        """A profile from :meth:`to_dict`'s output; a malformed one is a :class:`ProfileError`."""
        if not isinstance(d, Mapping):
            raise ProfileError(f"a profile is a JSON object (a dict), got {type(d).__name__}")
        refuse_other_kind(d, "profile", ProfileError)
        version = d.get("schema_version")
        if version not in _READABLE_VERSIONS:
            raise ProfileError(
                f"profile schema_version {version!r} is not supported (this remat reads "
                f"versions {list(_READABLE_VERSIONS)}); profile the model again with this "
                "version"
            )
        d = check_keys(d, cls, "the profile", ProfileError, extra=("schema_version",))
        d.pop("schema_version")
        units = checked_list(d["units"], "the profile's 'units'", ProfileError)
        d["units"] = tuple(_unit_from_dict(k, u) for k, u in enumerate(units))
        for name in ("prefix", "suffix"):
            if name in d:
                d[name] = _build(OutsideCost, d[name], f"the profile's {name!r}")
        if "loop" in d:
            try:
                d["loop"] = Loop.from_dict(d["loop"])
            except RematError as err:
                raise ProfileError(f"the profile's 'loop': {err}") from None
        if d.get("head") is not None:
            d["head"] = HeadProfile.from_dict(d["head"])
        if "shared" in d:
            d["shared"] = tuple(
                _build(SharedTensor, t, f"the profile's shared[{k}]")
                for k, t in enumerate(checked_list(d["shared"], "the profile's 'shared'",
                                                   ProfileError)))
        return cls(**d)

    @classmethod
    def from_json(cls, source: JsonSource) -> Profile:
        """Read a profile from a path (a ``str`` or ``pathlib.Path``) or from JSON text.

        Raises:
            ProfileError: the file is missing, unreadable, empty, not JSON, a plan, or
                holds a malformed profile; the message names the file and the field.
        """
        return from_json_source(source, "profile", ProfileError, cls.from_dict)


# ---------------------------------------------------------------------------------
# Field checks (see remat.core.fields)
# ---------------------------------------------------------------------------------
_OPTION_INTS = ("held_bytes", "fwd_peak_bytes", "bwd_peak_bytes")
_OPTION_BOOLS = ("holds_input", "holds_output")
_UNIT_INTS = ("input_bytes", "output_bytes", "input_grad_bytes", "param_grad_bytes",
              "autocast_cache_bytes", "before_held_bytes", "before_fwd_peak_bytes",
              "before_bwd_peak_bytes", "before_param_grad_bytes", "recompute_state_bytes")
_VARIANT_INTS = ("loss_bytes", "output_bytes", "carried_bytes", "grad_in_flight_bytes")
_HEAD_CACHE = "_remat_head_variants"
_UNIT_BOOLS = ("input_held_outside", "output_held_outside", "input_kept_by_caller")
_OUTSIDE_INTS = ("held_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "param_grad_bytes")
_PROFILE_INTS = (
    "param_bytes",
    "buffer_bytes",
    "optimizer_state_bytes",
    "optimizer_step_peak_bytes",
    "loss_bytes",
    "output_bytes",
    "carried_bytes",
    "grad_in_flight_bytes",
    "batch_bytes",
    "recompute_rng_bytes",
    "unreduced_grad_bytes",
)


def _set(obj: object, name: str, value: object) -> None:
    """Store a checked (normalised) value on a frozen dataclass."""
    object.__setattr__(obj, name, value)


def _check_fields(
    obj: object,
    *,
    ints: tuple[str, ...] = (),
    bools: tuple[str, ...] = (),
    floats: tuple[str, ...] = (),
    owner: str | None = None,
) -> None:
    """Check and normalise ``obj``'s numeric fields (numpy scalars become Python ones)."""
    owner = owner or type(obj).__name__
    for name in ints:
        _set(obj, name, checked_bytes(getattr(obj, name), f"{owner}.{name}", ProfileError))
    for name in bools:
        _set(obj, name, checked_bool(getattr(obj, name), f"{owner}.{name}", ProfileError))
    for name in floats:
        _set(obj, name, checked_ms(getattr(obj, name), f"{owner}.{name}", ProfileError))


def _check_stepped(obj: OptionCost | OutsideCost) -> None:
    """``stepped_bwd_peak_bytes``: ``None`` or a byte count."""
    if obj.stepped_bwd_peak_bytes is not None:
        _set(obj, "stepped_bwd_peak_bytes", checked_bytes(
            obj.stepped_bwd_peak_bytes, f"{type(obj).__name__}.stepped_bwd_peak_bytes",
            ProfileError))


def _checked_shapes(shapes: object) -> dict[str, tuple[int, ...]]:
    if not isinstance(shapes, Mapping):
        raise ProfileError(
            f"Profile.input_shapes must map argument names to shapes, got {type(shapes).__name__}"
        )
    out = {}
    for name, shape in shapes.items():
        where = f"Profile.input_shapes[{name!r}]"
        dims = checked_list(shape, where, ProfileError)
        out[checked_str(name, "a Profile.input_shapes key", ProfileError)] = tuple(
            checked_bytes(d, where, ProfileError, hi=None, unit="elements") for d in dims
        )
    return out


def _build(cls: type, value: object, where: str, **converted: Any) -> Any:
    """``cls(**value)`` with its keys checked; ``converted`` replaces some values.

    A :class:`ProfileError` names ``where`` (``"the profile's units[3] ('h.3')"``).
    """
    d = {**check_keys(value, cls, where, ProfileError), **converted}
    try:
        return cls(**d)
    except ProfileError as err:
        raise ProfileError(f"{where}: {err}") from None


def _unit_from_dict(k: int, u: object) -> UnitProfile:
    where = f"the profile's units[{k}]"
    if isinstance(u, Mapping) and isinstance(u.get("name"), str):
        where += f" ({u['name']!r})"
    options = check_keys(u, UnitProfile, where, ProfileError)["options"]
    if not isinstance(options, Mapping):
        raise ProfileError(f"{where}: 'options' must map option names to costs, got {options!r}")
    costs = {
        name: _build(OptionCost, cost, f"{where}, option {name!r}")
        for name, cost in options.items()
    }
    return _build(UnitProfile, u, where, options=costs)
