"""``simulate(profile, plan)``: the specification of a plan's peak memory and time.

It replays one training step event by event -- prefix forward, each unit's
forward, suffix forward, then the backward passes in reverse, then the optimizer
step -- keeping a running count of live bytes above the fixed bytes (parameters,
buffers, optimizer state). Every solver algorithm is tested against it; it is
written to be read, not to be fast.

The rules it encodes:

* A unit's forward peaks at ``live + fwd_peak_bytes`` (its input is live). After
  it, the unit holds ``held_bytes`` and its output becomes live.
* A boundary storage (unit i's output = unit i+1's input on a chain) is counted
  once, and stays alive while anyone holds it: the option of the unit on either
  side (``holds_output`` / ``holds_input``), or the prefix/suffix. It is freed
  when the last holder's backward is done, or at once when nobody holds it.
* A unit in a multi-unit segment runs its forward like ``checkpoint`` but holds
  nothing; only the segment's first input is held. At the backward of the
  segment's last unit the whole segment is recomputed with its ``keep`` costs,
  and its units then run their ``keep`` backward in reverse order, freeing the
  recomputed activations as they go. While it recomputes, the region also holds
  what recomputation itself keeps (in a one-unit ``checkpoint``'s measured backward,
  not in ``keep``'s figures): torch's stash of the RNG state
  (``profile.recompute_rng_bytes``) and each unit's ``recompute_state_bytes``
  (BatchNorm statistics written back after it).
* A unit's backward peaks at ``live + bwd_peak_bytes`` of its option (in the loop's
  terms: :meth:`Profile.bwd_peak`). After it,
  what the unit held is freed, its output's gradient is consumed, and its input's
  gradient and its parameter gradients are live.
* The loss (``loss_bytes``, with the seed gradient) stays alive from the start of
  backward to the end of the step: the caller holds it.
* The loop (``profile.loop``) adds what it keeps alive: the previous iteration's
  loss and output (``carried_bytes``) through the forward pass, until the new
  output is made; the new output (``output_bytes``) from the end of the forward
  pass to the end of the step (and the last unit's output, when it is the model's
  and the loop keeps it: ``last_output_kept``); every parameter gradient from the start, when the
  loop accumulates micro-batches or zeroes gradients in place (backward then adds
  to them instead of allocating them); autocast's weight casts
  (``autocast_cache_bytes``) from each unit's forward to the end of the forward.
* A shared tensor (``profile.shared``) lives from its birth until the backward of
  its first user (see :meth:`Profile.shared_released_after`), or to the end; its
  gradient, when it has one, from its last user's backward until the backward of
  the code that made it (off a chain, when it is its maker's output, until that
  unit's backward starts: from then on it is the unit's output gradient).
* Off a chain, a unit's input gradient is consumed by the code before it at once,
  or, with ``input_grad_kept_until = k``, kept alive until unit k's backward is done
  (``-1``: the prefix's).
* Off a chain, the code between units i-1 and i (unit i's ``before_*`` figures) runs
  after unit i-1's forward: what it holds (``before_held_bytes``) is allocated then and
  its forward peaks ``before_fwd_peak_bytes`` above that, unit i-1's input and output
  still alive. Its backward runs once unit i's is done, with the unit's input gradient
  alive, and peaks ``before_bwd_peak_bytes`` above that; then what it held is freed and
  its parameter gradients (``before_param_grad_bytes``) are live. No event where a peak
  is 0.
* A loop that steps the optimizer in backward (``loop.optimizer_in_backward``)
  frees every parameter gradient right after the backward phase that made it (its
  step ran in a hook as it was complete), so none accumulates to the end of the
  backward pass; a parameter used in two phases (a tied embedding) keeps its summed
  gradient from the suffix's backward to the prefix's (``extra_grad_in_flight_bytes``).
  Each phase's backward peaks at its peak in that loop, the steps of its parameters
  included (``stepped_bwd_peak_bytes``: :meth:`Profile.bwd_peak`), and the optimizer
  step after backward is gone (its peak is 0: ``end_step_peak_bytes``); the optimizer
  state is resident as before.
* The step time is the measured step time plus every option's ``extra_ms``, once
  per micro-batch.

Gradients (of parameters and of activations) are counted apart from the other
live bytes, so the peak can be split into what it is made of (``peak_parts``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from remat.core.errors import PlanMismatchError
from remat.core.option import Option
from remat.core.plan import Plan
from remat.core.profile import OptionCost, Profile

__all__ = ["PEAK_PARTS", "Simulation", "check_plan_fits_profile", "simulate"]

# What a peak is made of, in this order (see Simulation.peak_parts).
PEAK_PARTS = ("parameters", "buffers", "optimizer state", "inputs", "gradients", "activations")


@dataclass(frozen=True)
class Simulation:
    """The simulated step. Unpacks as ``peak_bytes, time_ms = simulate(profile, plan)``.

    Attributes:
        peak_bytes: predicted peak of the step, fixed bytes included.
        time_ms: predicted step time, in milliseconds.
        peak_event: the event at which the peak occurs (``"backward transformer.h.3"``).
        held_after_forward_bytes: activation bytes alive when the forward pass ends
            (above the fixed bytes).
        events: ``(event, live bytes at its peak, fixed bytes included)`` in step order.
        peak_parts: what the peak is made of, by :data:`PEAK_PARTS`: ``parameters``,
            ``buffers``, ``optimizer state``, ``inputs`` (the batch), ``gradients`` (of
            parameters and of activations, alive at the peak event) and ``activations``:
            the rest
            (held activations and boundaries, the loss, and the event's own working
            memory). The parts sum to ``peak_bytes``.
    """

    peak_bytes: int
    time_ms: float
    peak_event: str
    held_after_forward_bytes: int
    events: tuple[tuple[str, int], ...]
    peak_parts: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __iter__(self):  # noqa: ANN204 - tuple-style unpacking
        return iter((self.peak_bytes, self.time_ms))


def check_plan_fits_profile(profile: Profile, plan: Plan) -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` can run on ``profile``'s units."""
    names = tuple(u.name for u in profile.units)
    _check_head(profile, plan)
    if plan.unit_names != names:
        raise PlanMismatchError(
            f"the plan's units {list(plan.unit_names)[:4]}... do not match the profile's "
            f"units {list(names)[:4]}... ({plan.n} vs {len(names)} units); solve a plan for "
            "this profile"
        )
    for unit, opt in zip(profile.units, plan.options):
        if opt not in unit.options:
            raise PlanMismatchError(
                f"unit {unit.name!r} has no measured cost for option {opt!r}; its options "
                f"are {sorted(unit.options)}"
            )
    if plan.segments and not profile.is_chain:
        raise PlanMismatchError(
            "multi-unit segments need a chain of units, and this profile's units are not one "
            "(code runs between them); use per-unit options instead"
        )
    for a, b in plan.segments:
        broken = [k for k in range(a, b) if not profile.segment_link(k)]
        if broken:
            k = broken[0]
            raise PlanMismatchError(
                f"segment ({a}, {b}) spans the link from unit {profile.units[k].name!r} to "
                f"{profile.units[k + 1].name!r}, which no segment may (the model's code keeps "
                "that boundary, or a unit offers no 'checkpoint'); split the segment there"
            )


def _check_head(profile: Profile, plan: Plan) -> None:
    """A plan's chunked head must be the profile's, measured over its chunk count."""
    chosen, head = plan.head, profile.head
    if chosen is None:
        return
    if head is None:
        raise PlanMismatchError(
            f"the plan computes the head {chosen.name!r} over {chosen.chunks} chunks, and this "
            "profile measured no chunked head; profile with head='auto' or head='chunked'")
    if (chosen.name, chosen.kind, chosen.signature) != (head.name, head.kind, head.signature):
        raise PlanMismatchError(
            f"the plan's head is {chosen.name!r} ({chosen.kind}), and this profile's head is "
            f"{head.name!r} ({head.kind}) with other parameters: solve a plan for this profile")
    if chosen.chunks not in head.chunk_counts:
        raise PlanMismatchError(
            f"the plan computes the head over {chosen.chunks} chunks, and this profile measured "
            f"it over {list(head.chunk_counts)}")


class _Replay:
    """Live-byte bookkeeping shared by the forward and backward halves of ``simulate``.

    ``live`` counts every byte above the fixed ones; ``grad`` the gradient bytes
    among them (allocated and freed with :meth:`allocate_grad` / :meth:`free_grad`).
    """

    def __init__(self, fixed_bytes: int, param_grads_at_start: int = 0, *,
                 released: bool = False) -> None:
        self.fixed = fixed_bytes
        self.live = 0
        self.grad = 0
        # Gradients a loop keeps from before (accumulation, zero_grad in place): alive
        # throughout, so backward adds into them instead of allocating them.
        self.param_grads_at_start = param_grads_at_start > 0
        # Gradients a loop steps and frees in backward: gone after their phase.
        self.released = released
        self.allocate_grad(param_grads_at_start)
        self.events: list[tuple[str, int]] = []
        self.grad_at_event: list[int] = []
        self.size: dict[str, int] = {}
        self.holders: dict[str, set[str]] = {}

    def event(self, label: str, transient_above_live: int = 0) -> None:
        self.events.append((label, self.fixed + self.live + transient_above_live))
        self.grad_at_event.append(self.grad)

    def allocate(self, nbytes: int) -> None:
        self.live += nbytes

    def free(self, nbytes: int) -> None:
        self.live -= nbytes

    def allocate_grad(self, nbytes: int) -> None:
        self.live += nbytes
        self.grad += nbytes

    def free_grad(self, nbytes: int) -> None:
        self.live -= nbytes
        self.grad -= nbytes

    def param_grad(self, nbytes: int) -> None:
        """Parameter gradients a backward phase leaves: new bytes, unless alive already or
        freed with the phase (their optimizer step ran in it)."""
        if not self.param_grads_at_start and not self.released:
            self.allocate_grad(nbytes)

    # Boundaries: storages shared by neighbours, alive while someone holds them.
    def create_boundary(self, key: str, nbytes: int, holders: set[str]) -> None:
        self.size[key] = nbytes
        self.holders[key] = set(holders)
        self.live += nbytes

    def release_if_unheld(self, key: str) -> None:
        if key in self.holders and not self.holders[key]:
            self.live -= self.size[key]
            del self.holders[key]

    def drop_holder(self, key: str, holder: str) -> None:
        if key in self.holders:
            self.holders[key].discard(holder)
            self.release_if_unheld(key)


def _effective_cost(profile: Profile, plan: Plan, i: int) -> OptionCost:
    """The cost a unit's forward pays under the plan (segment members hold nothing)."""
    unit = profile.units[i]
    seg = plan.segment_of(i)
    if seg is None:
        return unit.options[plan.options[i]]
    ckpt = unit.options[Option.CHECKPOINT]
    first = i == seg[0]
    return OptionCost(
        held_bytes=ckpt.held_bytes if first else 0,
        holds_input=first,
        holds_output=False,
        fwd_peak_bytes=ckpt.fwd_peak_bytes,
        bwd_peak_bytes=ckpt.bwd_peak_bytes,
        extra_ms=ckpt.extra_ms,
        stepped_bwd_peak_bytes=ckpt.stepped_bwd_peak_bytes,
    )


def simulate(profile: Profile, plan: Plan) -> Simulation:
    """Predict the peak bytes and the time of one training step under ``plan``.

    See the module docstring for the rules. Raises :class:`PlanMismatchError` when
    the plan does not fit the profile.
    """
    check_plan_fits_profile(profile, plan)
    # A chunked head changes the code outside the units: its variant's figures. (Where
    # the head as it is was not measured, the profile's own figures are the fewest
    # chunks', which every stamped plan carries: remat.solver.stamp.)
    profile = profile.with_head(None if plan.head is None else plan.head.chunks)
    units = profile.units
    n = len(units)
    cost = [_effective_cost(profile, plan, i) for i in range(n)]
    chain = profile.is_chain
    r = _Replay(profile.fixed_bytes,
                profile.grad_bytes if profile.grads_alive_at_start else 0,
                released=profile.optimizer_in_backward)
    shared_born: dict[int, list[int]] = {}  # born after unit k's forward (-1: the prefix's)
    shared_freed: dict[int, list[int]] = {}  # freed after unit k's backward
    shared_to_end = []
    grad_made: dict[int, int] = {}  # after unit k's backward: shared tensors' gradients
    grad_used: dict[int, int] = {}  # after unit k's backward (-1: the prefix's): let go
    # Off a chain, gradients that become unit k's output gradient as its backward starts
    # (_backward_unit counts that anew): let go then.
    grad_to_output: dict[int, int] = {}
    for t, released in zip(profile.shared, profile.shared_released_after()):
        shared_born.setdefault(t.born_after, []).append(t.nbytes)
        if released is None:
            shared_to_end.append(t.nbytes)
        else:
            shared_freed.setdefault(released, []).append(t.nbytes)
        if t.grad_bytes and t.last_user > t.born_after:
            grad_made[t.last_user] = grad_made.get(t.last_user, 0) + t.grad_bytes
            # A shared output's gradient is its maker's output gradient, which off a
            # chain _backward_unit counts from its backward on.
            used = grad_to_output if t.maker_output and not chain else grad_used
            used[t.born_after] = used.get(t.born_after, 0) + t.grad_bytes

    # Off a chain, input gradients the code before their unit keeps (a concatenation's
    # backward hands out views of it) until after unit k's backward (-1: the prefix's).
    # When k is the unit just before, its output gradient is part of that storage.
    for j, unit in enumerate(units):
        if unit.input_grad_kept_until is not None and not chain:
            k = unit.input_grad_kept_until
            part = (min(units[k].output_bytes, unit.input_grad_bytes)
                    if 0 <= k == j - 1 else 0)
            grad_to_output[k] = grad_to_output.get(k, 0) + part
            grad_used[k] = grad_used.get(k, 0) + unit.input_grad_bytes - part

    def after_backward(k: int) -> None:
        """What changes once unit k's backward is done, beyond the unit itself (off a
        chain, the gradients it made are allocated with the code before it: see
        _backward_before)."""
        if chain:
            r.allocate_grad(grad_made.get(k, 0))
        r.free_grad(grad_used.get(k, 0))

    # Boundary keys. On a chain "b{i}" is unit i's input and "b{i+1}" its output;
    # off a chain every unit has its own "in{i}" and "out{i}".
    def in_key(i: int) -> str:
        return f"b{i}" if chain else f"in{i}"

    def out_key(i: int) -> str:
        return f"b{i + 1}" if chain else f"out{i}"

    def in_holders(i: int) -> set[str]:
        h = {f"u{i}"} if cost[i].holds_input else set()
        if chain and i > 0:
            if cost[i - 1].holds_output:
                h.add(f"u{i - 1}")
        elif units[i].input_held_outside:
            h.add("outside-in" if not chain else "prefix")
        return h

    def out_holders(i: int) -> set[str]:
        h = {f"u{i}"} if cost[i].holds_output else set()
        if i == n - 1 and profile.last_output_kept:
            h.add("loop")  # never dropped: alive to the end of the step
        if chain and i < n - 1:
            if cost[i + 1].holds_input:
                h.add(f"u{i + 1}")
        elif units[i].output_held_outside:
            h.add("outside-out" if not chain else "suffix")
        return h

    # ---- forward ------------------------------------------------------------------
    # The previous iteration's loss and output stay named by the loop's variables
    # until this forward returns; autocast's cache lives as long as the forward.
    r.allocate(profile.carried_bytes)
    r.event("forward prefix", profile.prefix.fwd_peak_bytes)
    r.allocate(profile.prefix.held_bytes)
    r.allocate(sum(shared_born.get(-1, ())))
    for i, unit in enumerate(units):
        if not chain or i == 0:
            r.create_boundary(in_key(i), unit.input_bytes, in_holders(i))
        r.event(f"forward {unit.name}", cost[i].fwd_peak_bytes)
        r.allocate(cost[i].held_bytes)
        r.allocate(unit.autocast_cache_bytes)
        r.allocate(sum(shared_born.get(i, ())))
        r.create_boundary(out_key(i), unit.output_bytes, out_holders(i))
        if not chain and i < n - 1:
            # The code between this unit and the next runs on this unit's output, with
            # its input not yet let go, and holds what it saves until its backward.
            between = units[i + 1]
            r.allocate(between.before_held_bytes)
            if between.before_fwd_peak_bytes:
                r.event(f"forward before {between.name}", between.before_fwd_peak_bytes)
        r.release_if_unheld(in_key(i))
        if not chain:
            r.release_if_unheld(out_key(i))
    r.event("forward suffix", profile.suffix.fwd_peak_bytes)
    r.allocate(profile.suffix.held_bytes)
    r.allocate(profile.output_bytes)
    r.free(profile.carried_bytes)
    r.free(sum(u.autocast_cache_bytes for u in units))
    if chain:
        r.release_if_unheld(out_key(n - 1))
    held_after_forward = r.live
    r.event("forward end")

    # ---- backward -----------------------------------------------------------------
    r.event("backward suffix",
            profile.bwd_peak(profile.suffix))
    r.free(profile.suffix.held_bytes)
    # The caller's loss and the seed gradient outlive the suffix's other held bytes.
    r.allocate(profile.loss_bytes)
    r.param_grad(profile.suffix.param_grad_bytes)
    r.allocate_grad(profile.extra_grad_in_flight_bytes)  # a tied weight's partial sum
    if chain:
        r.drop_holder(out_key(n - 1), "suffix")
        r.allocate_grad(units[n - 1].output_bytes)  # the gradient of the last unit's output

    i = n - 1
    while i >= 0:
        seg = plan.segment_of(i)
        if seg is None:
            r.free_grad(grad_to_output.get(i, 0))
            _backward_unit(r, profile, i, cost[i], chain, in_key(i), out_key(i))
            if not chain:
                _backward_before(r, profile, i, in_key(i), grad_made.get(i, 0))
            if not chain and units[i].input_grad_kept_until is not None:
                r.allocate_grad(units[i].input_grad_bytes)  # not let go yet: see above
            after_backward(i)
            done = [i]
        else:
            _backward_segment(r, profile, seg, chain, after_backward)
            done = list(range(seg[1], seg[0] - 1, -1))
        for k in done:
            r.free(sum(shared_freed.get(k, ())))
        i = done[-1] - 1

    r.event("backward prefix",
            profile.bwd_peak(profile.prefix))
    after_backward(-1)
    r.free_grad(profile.extra_grad_in_flight_bytes)
    r.free(profile.prefix.held_bytes)
    if chain:
        r.drop_holder(in_key(0), "prefix")
        r.free_grad(units[0].input_grad_bytes)
    r.param_grad(profile.prefix.param_grad_bytes)
    r.event("backward end")
    r.event("optimizer step", profile.end_step_peak_bytes)

    at = max(range(len(r.events)), key=lambda k: r.events[k][1])  # the first highest event
    label, peak = r.events[at]
    time_ms = profile.step_time_ms(sum(c.extra_ms for c in cost))
    parts = _peak_parts(profile, peak, r.grad_at_event[at])
    return Simulation(peak, time_ms, label, held_after_forward, tuple(r.events), parts)


def _peak_parts(profile: Profile, peak: int, grad: int) -> dict[str, int]:
    """The peak split by :data:`PEAK_PARTS`; activations are what the others leave."""
    parts = {
        "parameters": profile.param_bytes,
        "buffers": profile.buffer_bytes,
        "optimizer state": profile.optimizer_state_bytes,
        "inputs": profile.batch_bytes,
        "gradients": grad,
    }
    parts["activations"] = peak - sum(parts.values())
    return parts


def _grad_out_bytes(profile: Profile, i: int, chain: bool) -> int:
    """Bytes of the gradient flowing into unit i's backward (its output's gradient)."""
    units = profile.units
    if chain and i < len(units) - 1:
        return units[i + 1].input_grad_bytes
    return units[i].output_bytes


def _backward_unit(
    r: _Replay, profile: Profile, i: int, cost: OptionCost, chain: bool, ik: str, ok: str
) -> None:
    unit = profile.units[i]
    if not chain:
        # Off a chain the code after the unit has run its backward: it produced the
        # gradient of our output and released its own hold on the output storage.
        r.drop_holder(ok, "outside-out")
        r.allocate_grad(unit.output_bytes)
    r.event(f"backward {unit.name}", profile.bwd_peak(cost))
    r.free(cost.held_bytes)
    r.drop_holder(ik, f"u{i}")
    r.drop_holder(ok, f"u{i}")
    r.free_grad(_grad_out_bytes(profile, i, chain))
    r.allocate_grad(unit.input_grad_bytes)
    r.param_grad(unit.param_grad_bytes)


def _backward_before(r: _Replay, profile: Profile, i: int, ik: str, grads_made: int) -> None:
    """Off a chain, after unit i's backward: the code before it runs its backward on the
    unit's input gradient (the code between two units; for unit 0 the prefix, whose event
    comes at the end), which it consumes; what it held and its hold on the unit's input
    end.

    ``grads_made``: the shared tensors' gradients unit i's backward completed (alive
    from now on). The code's parameter gradients are new bytes from its backward on.
    """
    unit = profile.units[i]
    r.allocate_grad(grads_made)
    if i > 0 and unit.before_bwd_peak_bytes:
        r.event(f"backward before {unit.name}", unit.before_bwd_peak_bytes)
    r.param_grad(unit.before_param_grad_bytes)
    r.free(unit.before_held_bytes)
    r.free_grad(unit.input_grad_bytes)
    r.drop_holder(ik, "outside-in")


def _backward_segment(
    r: _Replay, profile: Profile, seg: tuple[int, int], chain: bool,
    after_backward: Callable[[int], None],
) -> None:
    """Recompute units a..b with their keep costs, then run their keep backwards."""
    a, b = seg
    units = profile.units
    keep = [u.keep for u in units]

    # Recomputation: fresh copies of the segment's inner activations ("r" keys).
    def rkey(k: int) -> str:
        return f"r{k}"

    def recomputed_holders(k: int) -> set[str]:
        """Holders of the recomputed boundary k (input of unit k, output of unit k-1)."""
        h = set()
        if k <= b and keep[k].holds_input:
            h.add(f"u{k}")
        if k - 1 >= a and keep[k - 1].holds_output:
            h.add(f"u{k - 1}")
        return h

    # The region's recompute contexts are entered before its first unit and left after
    # its last: torch's fork_rng stash and the BatchNorm statistics of every unit.
    stash = profile.recompute_rng_bytes + sum(
        units[k].recompute_state_bytes for k in range(a, b + 1))
    r.allocate(stash)
    for k in range(a, b + 1):
        r.event(f"recompute {units[k].name}", keep[k].fwd_peak_bytes)
        r.allocate(keep[k].held_bytes)
        r.create_boundary(rkey(k + 1), units[k].output_bytes, recomputed_holders(k + 1))
        if k > a:
            r.release_if_unheld(rkey(k))
    r.release_if_unheld(rkey(b + 1))  # the recomputed output, unless the unit saves it
    r.free(stash)
    for k in range(b, a - 1, -1):
        r.event(f"backward {units[k].name}",
                profile.bwd_peak(keep[k]))
        r.free(keep[k].held_bytes)
        r.drop_holder(rkey(k + 1), f"u{k}")
        if k > a:
            r.drop_holder(rkey(k), f"u{k}")
        r.free_grad(_grad_out_bytes(profile, k, chain))
        r.allocate_grad(units[k].input_grad_bytes)
        r.param_grad(units[k].param_grad_bytes)
        after_backward(k)
    # The segment's real input, held by its first unit, goes with it, and so does
    # what the first unit held since its forward (its checkpoint ``held_bytes``).
    r.free(units[a].options[Option.CHECKPOINT].held_bytes)
    r.drop_holder(f"b{a}", f"u{a}")
