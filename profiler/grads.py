"""Pass 2 of :mod:`.profile` (outside step).

Where each parameter's gradient is first allocated in the backward pass.

A parameter's gradient bytes are counted at the backward phase that first contributes
to it: the suffix's (the head), a unit's, the prefix's, or off a chain the code's
between two units (a downsampling layer's, counted from its backward on: each unit's
``before_param_grad_bytes``; on a chain such a phase has no code, and what would land
there counts with the prefix). The outside step (:mod:`.instrument`)
sees the outside code's parameters and the phase of their first contribution; its units
are stubs, so the units' parameters are theirs: the parameters a unit owns and any other
its replay gave a gradient. A parameter used in two phases (a unit's parameter the
outside code also uses, an embedding tied to the head) has its contributions summed in a
buffer from the first phase on: ``in_flight``, extra when ``.grad`` is alive already.

In a loop that steps the optimizer in backward (``Loop(optimizer_in_backward=True)``), a
parameter is stepped where its ``.grad`` receives the gradient: at the *last* phase that
contributes to it (the earlier user's, for a tied embedding). :func:`place_steps` says
each phase's backward peak in that loop: the higher of the phase's peak with its
gradients freed once complete (the replays' ``released_bwd_peak_bytes``; for the prefix
and the suffix, with the few parameters the outside code has, its plain peak) and, per
parameter stepped there, the live bytes when ``.grad`` received it (the outside step
watched it for the prefix and the suffix, each option's replay for a unit) plus its own
step's peak. Where the moment was not seen, the step's peak is added whole (an upper
bound); so is that of the code between units (off a chain), which counts with the unit
whose backward runs next.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from remat.profiler.records import GradPlaces, OptionFigures, ParamGrad, Phase, StepPlaces

__all__ = ["place_grads", "place_steps"]


def _position(phase: Phase, n: int) -> int:
    """Order in the backward pass: the suffix first, then unit n-1, the code before it..."""
    if phase[0] == "suffix":
        return 0
    if phase[0] == "unit":
        return 1 + 2 * (n - 1 - phase[1])
    return 2 + 2 * (n - 1 - phase[1])  # ("outside", i): after unit i's backward


def _uses(
    params: Sequence[nn.Parameter],
    units: Sequence[nn.Module],
    outside: Iterable[ParamGrad],
    trained_by_unit: Mapping[int, frozenset[int]],
) -> tuple[dict[int, int], dict[int, set[int]], set[int]]:
    """Per ``id(param)``: its gradient's bytes, the backward positions of its contributors,
    and the ids whose contributions the outside step saw summed across phases."""
    n = len(units)
    nbytes = {id(p): p.numel() * p.element_size() for p in params if p.requires_grad}
    uses: dict[int, set[int]] = {}  # id(param) -> backward positions of its contributors
    in_flight: set[int] = set()
    for grad in outside:
        nbytes[grad.param_id] = grad.nbytes
        uses.setdefault(grad.param_id, set()).add(_position(grad.phase, n))
        if grad.in_flight:
            in_flight.add(grad.param_id)
    for i, module in enumerate(units):
        used = {id(p) for p in module.parameters() if p.requires_grad}
        used |= trained_by_unit.get(i, frozenset())
        for pid in used & nbytes.keys():
            uses.setdefault(pid, set()).add(_position(("unit", i), n))
    return nbytes, uses, in_flight


def place_grads(
    params: Sequence[nn.Parameter],
    units: Sequence[nn.Module],
    outside: Iterable[ParamGrad],
    trained_by_unit: Mapping[int, frozenset[int]],
    *,
    is_chain: bool = True,
) -> GradPlaces:
    """Gradient bytes per place (see the module docstring).

    Args:
        params: the model's parameters.
        units: the unit modules, in forward order.
        outside: what the outside step gave a gradient, with its phase.
        trained_by_unit: per unit index, the ids of the parameters its own replay gave a
            gradient (units measured through a twin are absent: their own parameters
            stand for it).
        is_chain: whether the units are a chain (off one, the code between units has
            gradients of its own place).
    """
    n = len(units)
    nbytes, uses, in_flight = _uses(params, units, outside, trained_by_unit)
    per_unit = [0] * n
    before = [0] * n
    suffix = prefix = extra = 0
    for pid, positions in uses.items():
        first = min(positions)
        if first == 0:
            suffix += nbytes[pid]
        elif first % 2 == 1:
            per_unit[n - 1 - (first - 1) // 2] += nbytes[pid]
        elif (after := n - 1 - (first - 2) // 2) > 0 and not is_chain:
            before[after] += nbytes[pid]  # after unit `after`'s backward: the code before it
        else:
            prefix += nbytes[pid]
        if pid in in_flight or len(positions) > 1:
            extra += nbytes[pid]
    return GradPlaces(tuple(per_unit), suffix, prefix, extra, tuple(before))


def _outside_peak(phase_peak: int, steps: list[tuple[int, int | None]]) -> int:
    """The prefix's or the suffix's backward peak with its parameters stepped: the higher of
    its plain peak and, per parameter, the live bytes when it was ready plus its step's
    peak (its plain peak plus its step's where the moment was not seen)."""
    return max([phase_peak, *(phase_peak + peak if ready is None else ready + peak
                              for peak, ready in steps)])


def place_steps(
    params: Sequence[nn.Parameter],
    units: Sequence[nn.Module],
    outside: Sequence[ParamGrad],
    trained_by_unit: Mapping[int, frozenset[int]],
    step_peaks: Mapping[int, int],
    *,
    unit_figures: Sequence[Mapping[str, OptionFigures]],
    suffix_peak: int,
    prefix_peak: int,
) -> StepPlaces:
    """Every phase's backward peak with each parameter stepped, and its gradient freed, as
    soon as its gradient is complete (see the module docstring).

    Args:
        params, units, outside, trained_by_unit: as for :func:`place_grads`.
        step_peaks: per ``id(param)``, its own optimizer step's peak above the bytes alive
            when it starts (none without an optimizer: the gradients are freed only).
        unit_figures: per unit, its options' replay figures (their backward peaks with
            the unit's gradients freed once complete, and when each was complete).
        suffix_peak, prefix_peak: the suffix's and the prefix's backward peaks, above their
            starts, as the profile records them.
    """
    n = len(units)
    _, uses, _ = _uses(params, units, outside, trained_by_unit)
    seen = {g.param_id: g for g in outside}
    released: list[list[int]] = [[] for _ in range(n)]  # per unit, ids stepped there
    unseen = [0] * n  # per unit, the largest step there whose moment its replays did not see
    suffix: list[tuple[int, int | None]] = []
    prefix: list[tuple[int, int | None]] = []
    for pid, positions in uses.items():
        peak = step_peaks.get(pid, 0)
        grad = seen.get(pid)
        at = _position(grad.ready_phase, n) if grad is not None and grad.ready_phase else None
        # Where .grad receives the sum of its contributions: its step runs there.
        last = max(positions) if at is None else max(*positions, at)
        ready = grad.ready_bytes if grad is not None and at == last else None
        if last == 0:
            suffix.append((peak, ready))
        elif last % 2 == 1:
            released[n - 1 - (last - 1) // 2].append(pid)
        else:
            i = n - 1 - (last - 2) // 2  # after unit i's backward
            if i == 0:
                prefix.append((peak, ready))
            else:  # code between units i-1 and i: before unit i-1's backward
                unseen[i - 1] = max(unseen[i - 1], peak)
    per_unit = []
    for k, module in enumerate(units):
        index = {id(p): j for j, p in enumerate(module.parameters())}
        per_option: dict[str, int | None] = {}
        for option, figures in unit_figures[k].items():
            ready_at = dict(figures.grads_ready)
            base = figures.released_bwd_peak_bytes
            if base is None and not released[k] and not unseen[k]:
                per_option[option] = None  # nothing of its own is freed or stepped there
                continue
            peak = figures.bwd_peak_bytes if base is None else base
            extra = unseen[k]
            for pid in released[k]:
                ready = ready_at.get(index.get(pid, -1))
                if ready is None:
                    extra = max(extra, step_peaks.get(pid, 0))
                else:
                    peak = max(peak, ready + step_peaks.get(pid, 0))
            per_option[option] = peak + extra
        per_unit.append(per_option)
    return StepPlaces(tuple(per_unit), _outside_peak(suffix_peak, suffix),
                      _outside_peak(prefix_peak, prefix))
