"""Where each parameter's gradient is first allocated in the backward pass.

A parameter's gradient bytes are counted at the backward phase that first contributes
to it: the suffix's (the head), a unit's, or the prefix's (the code between units off a
chain counts with the prefix, as in ``simulate()``). The outside step (:mod:`.instrument`)
sees the outside code's parameters and the phase of their first contribution; its units
are stubs, so the units' parameters are theirs: the parameters a unit owns and any other
its replay gave a gradient. A parameter used in two phases (a unit's parameter the
outside code also uses, an embedding tied to the head) has its contributions summed in a
buffer from the first phase on: ``in_flight``, extra when ``.grad`` is alive already.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from remat.profiler.instrument import ParamGrad, Phase

__all__ = ["GradPlaces", "place_grads"]


@dataclass(frozen=True)
class GradPlaces:
    """Parameter-gradient bytes per place: the units (in order), the suffix, the prefix,
    and those summed across phases (``in_flight_bytes``)."""

    units: tuple[int, ...]
    suffix_bytes: int
    prefix_bytes: int
    in_flight_bytes: int


def _position(phase: Phase, n: int) -> int:
    """Order in the backward pass: the suffix first, then unit n-1, the code before it..."""
    if phase[0] == "suffix":
        return 0
    if phase[0] == "unit":
        return 1 + 2 * (n - 1 - phase[1])
    return 2 + 2 * (n - 1 - phase[1])  # ("outside", i): after unit i's backward


def place_grads(
    params: Sequence[nn.Parameter],
    units: Sequence[nn.Module],
    outside: Iterable[ParamGrad],
    trained_by_unit: Mapping[int, frozenset[int]],
) -> GradPlaces:
    """Gradient bytes per place (see the module docstring).

    Args:
        params: the model's parameters.
        units: the unit modules, in forward order.
        outside: what the outside step gave a gradient, with its phase.
        trained_by_unit: per unit index, the ids of the parameters its own replay gave a
            gradient (units measured through a twin are absent: their own parameters
            stand for it).
    """
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
    per_unit = [0] * n
    suffix = prefix = extra = 0
    for pid, positions in uses.items():
        first = min(positions)
        if first == 0:
            suffix += nbytes[pid]
        elif first % 2 == 1:
            per_unit[n - 1 - (first - 1) // 2] += nbytes[pid]
        else:
            prefix += nbytes[pid]
        if pid in in_flight or len(positions) > 1:
            extra += nbytes[pid]
    return GradPlaces(tuple(per_unit), suffix, prefix, extra)
