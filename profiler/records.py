"""A tool of every pass of :mod:`.profile`.

The records the profiler's passes hand each other, in one place.

A pass imports the records it reads and fills from here, never from another pass, so
that the passes stay a row (:mod:`.profile` names them and runs them in order): each
depends on what came before only through these records. A record's fields say what
was measured and on what footing; how it is measured is the pass's own docstring.
Records a pass keeps to itself (its watches, its samples) stay in the pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.core.loop import Loop
from remat.execute.head import HeadSite
from remat.measurement.state import RngState

__all__ = [
    "Captured",
    "ChainCheck",
    "GradPlaces",
    "HeadFinding",
    "Measurements",
    "OptionFigures",
    "OutsideFigures",
    "OutsideRun",
    "OutsideStep",
    "OutsideTimes",
    "ParamGrad",
    "Phase",
    "SharedInStep",
    "StepPlaces",
    "TimedRuns",
    "TimingPolicy",
    "UnitCall",
    "UnitInStep",
    "UnitTiming",
    "UnitTrace",
]


# --------------------------------------------------------------------------------------
# Pass 1, capture and replays: how each unit was called, and what the pass learned
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Captured:
    """A unit's input tensor, detached from the graph, and whether it required grad."""

    tensor: torch.Tensor
    requires_grad: bool
    boundary: bool = False  # the call's boundary input (:mod:`remat.execute.boundary`)

    def fresh(self) -> torch.Tensor:
        """A new leaf on the same storage, requiring grad as the original did."""
        return self.tensor.detach().requires_grad_(self.requires_grad)


@dataclass
class UnitCall:
    """How one unit was called in the capture pass."""

    name: str
    module: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    rng: RngState | None = None
    out_shape: tuple[int, ...] | None = None
    out_dtype: torch.dtype | None = None
    out_device: torch.device | None = None
    out_requires_grad: bool = False
    calls: int = 0
    writes_input: bool = False  # a replay found it writes its input in place

    @property
    def first_input(self) -> Captured | None:
        """The captured boundary input (``None`` when the call had no tensor argument)."""
        for leaf in tree_flatten((self.args, self.kwargs))[0]:
            if isinstance(leaf, Captured) and leaf.boundary:
                return leaf
        return None

    def inputs(self, first: torch.Tensor | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh ``(args, kwargs)`` for a replay: ``first`` as the boundary input, new
        leaves (requiring grad as in the model) for the other tensors."""
        leaves, spec = tree_flatten((self.args, self.kwargs))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Captured):
                leaves[i] = first if leaf.boundary else leaf.fresh()
        args, kwargs = tree_unflatten(leaves, spec)
        return tuple(args), dict(kwargs)

    def release(self) -> None:
        """Drop the captured inputs (their memory) once the unit is measured."""
        self.args, self.kwargs = (), {}


@dataclass(frozen=True)
class ChainCheck:
    """Whether the units form a chain, and if not, why (one line per break)."""

    is_chain: bool
    breaks: tuple[str, ...] = ()


@dataclass
class UnitTrace:
    """What the capture pass learned: execution order, calls, chain check, and per unit in
    order whether the model's code keeps its boundary input alive past the unit's
    forward (``x = self.stem(x); x = self.blocks(x)`` keeps the stem's output while the
    blocks run), so that no multi-unit segment may span the link into it (known only
    when the pass released the captured inputs: else all ``False``); and the bytes the
    units' calls appended to ``transformers``' output collector (a MoE's router logits,
    kept to the loss: :mod:`remat.execute.output_capture`)."""

    order: list[str]
    calls: dict[str, UnitCall]
    chain: ChainCheck
    kept_by_caller: list[bool] = field(default_factory=list)
    recorded_bytes: int = 0


@dataclass(frozen=True)
class TimingPolicy:
    """How units are timed: un-timed rounds first, at most ``repeats`` timed rounds,
    early stop within ``tolerance``, twins measured once or not."""

    warmup: int
    repeats: int
    tolerance: float
    pool_twins: bool


@dataclass(frozen=True)
class OptionFigures:
    """One option's measured bytes for one unit (:mod:`.replay` says what each is)."""

    held_bytes: int
    holds_input: bool
    holds_output: bool
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    input_grad_bytes: int
    forward_cache_bytes: int = 0  # freed when the loop's autocast region ends
    # ids of the parameters its backward gave a gradient (the unit's own, and any other)
    params_trained: frozenset[int] = frozenset()
    # With each of the unit's parameter gradients freed once complete: the backward's peak
    # (None: no parameter of the unit got one), and per parameter (its index among the
    # unit's parameters: the same for twins) the live bytes when it was complete; both
    # above the backward's start, as bwd_peak_bytes.
    released_bwd_peak_bytes: int | None = None
    grads_ready: tuple[tuple[int, int], ...] = ()
    # keep's: live bytes above the backward's start, less the output's gradient, when it
    # first unpacked a saved tensor, where a region recomputing the unit starts its
    # recomputation (the gradient cast to a lower precision is made before it); None where
    # not recorded (:mod:`.recomputed`).
    recompute_start_bytes: int | None = None
    # keep's: its forward's peak up to its last save, above its start, where torch's early
    # stop ends a recomputation of the unit; None where not recorded.
    recompute_peak_bytes: int | None = None


@dataclass(frozen=True)
class UnitTiming:
    """Median times of the isolated replays, in milliseconds, per option."""

    fwd_ms: dict[str, float]
    bwd_ms: dict[str, float]
    total_ms: dict[str, float]


# --------------------------------------------------------------------------------------
# Pass 3, outside time: the stub steps' times and the optimizer's figures
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OutsideTimes:
    """Medians over the timed stub steps, in milliseconds, and the optimizer's figures.

    ``forward_ms`` / ``backward_ms``: one micro-batch's outside code (the stubs' own time
    taken out); ``optimizer_ms``: ``optimizer.step()`` and ``zero_grad`` (or every
    parameter's own step, in a loop that steps in backward);
    ``optimizer_state_bytes`` / ``optimizer_step_peak_bytes``: see the module docstring;
    ``param_step_peaks``: per ``id(parameter)``, the peak of its own step above the bytes
    alive when it starts; ``param_steps``: ``"measured"``, or why not (no optimizer, one
    that cannot be split per parameter).
    """

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    optimizer_state_bytes: int = 0
    optimizer_step_peak_bytes: int = 0
    param_step_peaks: Mapping[int, int] = field(default_factory=dict)
    param_steps: str = "no optimizer"


# --------------------------------------------------------------------------------------
# Pass 2, outside step: the outside code's bytes and the unit boundaries
# --------------------------------------------------------------------------------------

# Who was running when a storage was saved for backward: ("prefix",), ("unit", i),
# ("between", i) (code after unit i, off a chain) or ("suffix",).
Phase = tuple[Any, ...]


@dataclass(frozen=True)
class OutsideFigures:
    """The prefix's or the suffix's bytes in the step, above the fixed bytes."""

    held_bytes: int = 0
    fwd_peak_bytes: int = 0
    bwd_peak_bytes: int = 0


@dataclass(frozen=True)
class ParamGrad:
    """A parameter the outside code gave a gradient in the step: its ``id``, the bytes of
    its gradient, and the backward phase of its first contribution (``("suffix",)``, or
    ``("outside", i)``: after unit i's backward, the prefix for i = 0); ``in_flight``: its
    contributions were summed in a buffer across phases (a tied embedding); ``ready_phase``
    and ``ready_bytes``: the phase in which ``.grad`` received the sum, and the live bytes
    then above that phase's start (``None``: not seen)."""

    param_id: int
    nbytes: int
    phase: Phase
    in_flight: bool = False
    ready_phase: Phase | None = None
    ready_bytes: int = 0


@dataclass(frozen=True)
class UnitInStep:
    """One unit as the step saw it: its boundaries, who holds them, its gradients.

    ``input_bytes`` / ``output_bytes`` are 0 for a boundary whose storage was not
    allocated during the step (a tensor of the sample batch): it is alive all along
    and not part of the measured peak.

    Attributes:
        input_bytes, output_bytes: its boundary storages' bytes.
        input_held_outside, output_held_outside: code outside the unit (and, on a
            chain, outside its neighbour) saved that storage for backward.
        input_is_prev_output: its input storage is the previous unit's output storage.
        input_grad_kept_until: off a chain, the unit through whose backward the code
            before this one kept its input's gradient (``-1``: the prefix); ``None``:
            consumed at once (``UnitProfile.input_grad_kept_until``).
        before_held_bytes, before_fwd_peak_bytes, before_bwd_peak_bytes: off a chain,
            the code between the previous unit and this one: what it holds for backward,
            its forward peak above the previous unit's end less that, and its backward
            peak above this unit's input gradient being ready
            (``UnitProfile.before_held_bytes``...); 0 for the first unit and on a chain.
    """

    input_bytes: int
    output_bytes: int
    input_held_outside: bool
    output_held_outside: bool
    input_is_prev_output: bool
    input_grad_kept_until: int | None = None
    before_held_bytes: int = 0
    before_fwd_peak_bytes: int = 0
    before_bwd_peak_bytes: int = 0


@dataclass(frozen=True)
class SharedInStep:
    """A storage handed to units besides their boundary input (a mask, a position bias).

    Attributes:
        nbytes: its bytes.
        born_after: ``-1`` when the prefix made it, else the unit in (or after) whose
            forward it was made.
        users: the units it was handed to, in forward order.
        held_to_end: code outside the units (the prefix, code between units) saved it
            for backward, or it outlived the step.
        grad_bytes: the bytes of its gradient, when it requires one (0 otherwise).
        maker_output: it is unit ``born_after``'s boundary output.
    """

    nbytes: int
    born_after: int
    users: tuple[int, ...]
    held_to_end: bool
    grad_bytes: int = 0
    maker_output: bool = False


@dataclass(frozen=True)
class OutsideStep:
    """Byte figures of the outside code and the unit boundaries, from the outside step.

    All bytes are above the fixed bytes. Storages in ``shared`` are in no other
    figure: not in the prefix's, the suffix's or a unit's held bytes, nor in the
    suffix's forward peak. With a loop that keeps the model's output, the output's
    storages are ``output_bytes`` and not in the prefix's or the suffix's, except the
    last unit's output when it is the model's (``last_output_kept``).
    """

    units: tuple[UnitInStep, ...]
    is_chain: bool
    prefix: OutsideFigures
    suffix: OutsideFigures
    peak_bytes: int
    held_after_forward_bytes: int
    forward_transient_bytes: int
    loss_bytes: int
    phase_ms: Mapping[str, float] = field(default_factory=dict)
    loss_storage_bytes: int = 0
    output_bytes: int = 0
    last_output_kept: bool = False
    shared: tuple[SharedInStep, ...] = ()
    param_grads: tuple[ParamGrad, ...] = ()
    # The units whose input died during the suffix's forward (a local of the model's
    # held it), and the suffix's forward peak were they all saved by the units' options
    # (see where it is computed).
    units_inputs_dying: tuple[int, ...] = ()
    suffix_fwd_peak_inputs_held: int = 0
    unreduced_grad_bytes: int = 0  # FSDP2's root's unsharded gradients before the prefix's backward

    @property
    def n(self) -> int:
        return len(self.units)


@dataclass(frozen=True)
class GradPlaces:
    """Parameter-gradient bytes per place: the units (in order), the suffix, the prefix,
    those summed across phases (``in_flight_bytes``) and, per unit, the code's before it
    off a chain (``before_units``: 0 for unit 0, whose code is the prefix)."""

    units: tuple[int, ...]
    suffix_bytes: int
    prefix_bytes: int
    in_flight_bytes: int
    before_units: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlaces:
    """Each phase's backward peak in a loop that steps the optimizer in backward: per unit
    (in order) per option (``None``: the plain figure stands), the suffix, the prefix."""

    units: tuple[Mapping[str, int | None], ...]
    suffix_bytes: int
    prefix_bytes: int


# --------------------------------------------------------------------------------------
# Pass 4, head variants: which head is measured, and each run of the outside code
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadFinding:
    """The head to measure (``site``), or why none is (``refusal``; ``None`` where no head
    was looked for)."""

    site: HeadSite | None = None
    refusal: str | None = None
    # False: found, its rewrite not yet checked (a budget's profile checks it only where
    # the budget needs the chunked head: :func:`remat.profiler.heads.checked_head`).
    checked: bool = True


@dataclass(frozen=True)
class TimedRuns:
    """How the stub steps are timed: ``profile()``'s ``warmup``, ``repeats``, ``tolerance``,
    and the units' own time in a step (their replays'), the rest of the step whose time
    the tolerance is a fraction of."""

    warmup: int
    repeats: int
    tolerance: float
    units_ms: float = 0.0


@dataclass(frozen=True)
class OutsideRun:
    """The outside code measured with the head over ``chunks`` chunks (``None``: as it is)."""

    chunks: int | None
    step: OutsideStep
    times: OutsideTimes
    grads: GradPlaces
    steps: StepPlaces


# --------------------------------------------------------------------------------------
# Assembly: everything measured, before it becomes a Profile
# --------------------------------------------------------------------------------------

@dataclass
class Measurements:
    """Everything :func:`profile` measured, before it becomes a :class:`Profile`."""

    units: list[tuple[str, nn.Module]]  # execution order
    chain: ChainCheck
    base: OutsideStep
    figures: dict[str, dict[str, OptionFigures]]
    timings: dict[str, UnitTiming]
    outside: OutsideTimes
    grads: GradPlaces
    fixed_bytes: int
    param_bytes: int
    buffer_bytes: int
    loop: Loop  # always the profiled loop: the default is made once, by loop_or_default
    batch_bytes: int = 0
    inputs_kept_by_caller: list[bool] = field(default_factory=list)
    steps: StepPlaces | None = None  # backward peaks when stepping in backward, per place
    # What a checkpoint region's recomputation holds besides the units' forwards: per
    # unit (execution order) its BatchNorm statistics' copies, and torch's RNG stash.
    recompute_state_bytes: list[int] = field(default_factory=list)
    recompute_rng_bytes: int = 0
    # What the units' calls appended to transformers' output collector (a MoE's router
    # logits), kept from each unit's forward to the loss: held through the step.
    recorded_bytes: int = 0
