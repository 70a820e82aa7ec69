"""Memory budgets as users write them: ``8_000_000_000``, ``"8GB"``, ``"7.5GiB"``, ``"60%"``.

A budget is the peak of one training step, everything included. A percentage has
one meaning everywhere in remat: a share of the **activation memory**, the part of
the step's peak that checkpointing can trade::

    "60%"  ==  persistent + 0.60 * (no-checkpoint peak - persistent)

where *persistent* is what every plan's step holds at its end, before
``optimizer.step()``: parameters, buffers, optimizer state (when profiled with an
optimizer) and every parameter's gradient. It is the same in every loop: a plain
loop allocates the gradients during the backward pass and has all of them by its
end; a loop that accumulates micro-batches (or zeroes gradients in place) holds them
from the start. So ``"100%"`` is the no-checkpoint peak, and ``"0%"`` would leave
nothing for activations (no plan gets there: some activations are always live).

The whole-peak meaning stays reachable under an explicit name: ``"60% of peak"``
(or :func:`of_peak`) is 60% of the no-checkpoint peak, parameters included;
``"60% of activations"`` (or :func:`of_activations`) spells the default out.

:func:`check_budget` reads a budget once, without the profile, into a
:data:`Budget` value (bytes, or a :class:`RelativeBudget`): entry points read it
before profiling, so a malformed budget costs nothing, and pass the value on.
:func:`remat.solver.resolve.resolve_budget` turns it into bytes for a profile.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, InvalidOperation

from remat.core.errors import BudgetError

__all__ = [
    "ACCEPTED_FORMS",
    "UNIT_BYTES",
    "Budget",
    "RelativeBudget",
    "check_budget",
    "of_activations",
    "of_peak",
    "parse_budget",
]

# Units exactly as written: SI prefixes are powers of 1000, binary ones powers of 1024.
UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

ACCEPTED_FORMS = (
    "a positive int of bytes (8_000_000_000); a string of a number and a unit, SI "
    "B, KB, MB, GB, TB (powers of 1000) or binary KiB, MiB, GiB, TiB (powers of 1024), "
    "case-insensitive ('8GB', '7.5 GiB', '512MiB'); a percentage of the activation "
    "memory ('60%', the same as '60% of activations': the persistent bytes plus 60% of "
    "what the no-checkpoint peak holds above them); or a percentage of the whole "
    "no-checkpoint peak ('60% of peak'); remat.of_activations(0.6) and "
    "remat.of_peak(0.6) build the last two"
)

# What a percentage can be "of", as written after it.
_OF = {"activations": "activations", "activation": "activations", "peak": "peak"}

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_WITH_UNIT = re.compile(rf"^\s*{_NUMBER}\s*([a-z]+)\s*$", re.IGNORECASE)
_PERCENT = re.compile(rf"^\s*{_NUMBER}\s*%\s*(?:of\s+([a-z]+)\s*)?$", re.IGNORECASE)


@dataclass(frozen=True)
class RelativeBudget:
    """A budget relative to the profile: ``percent`` % of the activation memory or of the
    whole no-checkpoint peak (``of="activations"`` / ``"peak"``).

    Build it with :func:`of_activations` / :func:`of_peak`, or write it as a string
    (``str(budget)`` is ``"60% of peak"``, which parses back to the same budget).
    """

    percent: Decimal
    of: str = "activations"

    def __post_init__(self) -> None:
        if self.of not in ("activations", "peak"):
            raise BudgetError(f"RelativeBudget(of={self.of!r}): valid are 'activations', 'peak'")
        if self.percent <= 0:
            raise _bad(str(self), "it must be more than 0%")

    def __str__(self) -> str:
        return f"{self.percent.normalize():f}% of {self.of}"

    def bytes_for(self, peak_bytes: int, persistent: int = 0) -> int:
        """The budget in bytes when the no-checkpoint peak is ``peak_bytes`` and
        ``persistent`` bytes are what no plan can remove."""
        if self.of == "peak":
            nbytes = _floor(self.percent * peak_bytes / 100)
        else:
            nbytes = persistent + _floor(self.percent * max(peak_bytes - persistent, 0) / 100)
        if nbytes <= 0:
            raise _bad(str(self), "it must be more than 0% (and at least 1 byte)")
        return nbytes


Budget = int | RelativeBudget  # a budget as read once (check_budget): bytes, or relative


def _fraction(fraction: object, name: str) -> Decimal:
    ok = isinstance(fraction, numbers.Real) and not isinstance(fraction, bool)
    if not ok or not math.isfinite(float(fraction)) or float(fraction) <= 0:
        raise BudgetError(f"{name}({fraction!r}): need a fraction > 0, e.g. {name}(0.5) for "
                          "half")
    return Decimal(str(fraction)) * 100


def of_activations(fraction: float) -> RelativeBudget:
    """A budget that leaves ``fraction`` of the activation memory: the persistent bytes
    (parameters, buffers, optimizer state, gradients) plus ``fraction`` of what the
    no-checkpoint peak holds above them. ``of_activations(0.5)`` is ``"50%"``."""
    return RelativeBudget(_fraction(fraction, "of_activations"), "activations")


def of_peak(fraction: float) -> RelativeBudget:
    """``fraction`` of the whole no-checkpoint peak, parameters and optimizer state
    included. ``of_peak(0.5)`` is ``"50% of peak"``."""
    return RelativeBudget(_fraction(fraction, "of_peak"), "peak")


def _bad(budget: object, why: str) -> BudgetError:
    return BudgetError(f"memory_budget={budget!r} is not a valid budget ({why}); "
                       f"accepted forms: {ACCEPTED_FORMS}")


def check_budget(budget: object) -> Budget:
    """Read a budget without the profile: bytes, or a :class:`RelativeBudget`.

    Callers use it to reject a malformed budget before profiling starts.

    Raises:
        BudgetError: naming the bad value and listing the accepted forms.
    """
    if isinstance(budget, RelativeBudget):
        return budget
    if isinstance(budget, bool):
        raise _bad(budget, "a bool is not a number of bytes")
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise _bad(budget, "it must be more than 0 bytes")
        return int(budget)
    if isinstance(budget, numbers.Real):
        why = "not a finite number" if not math.isfinite(float(budget)) else (
            "a float; pass an int of bytes or a string with a unit"
        )
        raise _bad(budget, why)
    if not isinstance(budget, str):
        raise _bad(budget, f"a {type(budget).__name__} is neither bytes nor a string")
    return _parse_text(budget)


def parse_budget(
    budget: object, *, reference_peak_bytes: int | None = None, persistent_bytes: int = 0
) -> int:
    """A budget in bytes, from any accepted form (see :data:`ACCEPTED_FORMS`).

    Args:
        budget: an int of bytes, a string with a unit, a percentage string, or a
            :class:`RelativeBudget`.
        reference_peak_bytes: the no-checkpoint peak in bytes; a percentage without
            it is an error.
        persistent_bytes: what no plan can remove (:func:`persistent_bytes`); a
            percentage of the activation memory is taken of the peak above it.

    Returns:
        The budget in whole bytes (fractions of a byte are rounded down), > 0.

    Raises:
        BudgetError: naming the bad value and listing the accepted forms.
    """
    checked = check_budget(budget)
    if isinstance(checked, int):
        return checked
    if reference_peak_bytes is None:
        raise _bad(budget, "a percentage needs the no-checkpoint peak to be known")
    return checked.bytes_for(reference_peak_bytes, persistent_bytes)


def _parse_text(text: str) -> int | RelativeBudget:
    percent = _PERCENT.match(text)
    if percent:
        of = (percent.group(2) or "activations").lower()
        if of not in _OF:
            raise _bad(text, f"a percentage is 'of activations' or 'of peak', not of {of!r}")
        value = _decimal(percent.group(1))
        if value <= 0:
            raise _bad(text, "it must be more than 0% (and at least 1 byte)")
        return RelativeBudget(value, _OF[of])
    match = _WITH_UNIT.match(text)
    if not match:
        raise _bad(text, "expected a number followed by a unit, or a percentage")
    unit = match.group(2).lower()
    if unit not in UNIT_BYTES:
        raise _bad(text, f"unknown unit {match.group(2)!r}")
    nbytes = _floor(_decimal(match.group(1)) * UNIT_BYTES[unit])
    if nbytes <= 0:
        raise _bad(text, "it must be at least 1 byte")
    return nbytes


def _decimal(digits: str) -> Decimal:
    """Exact decimal arithmetic, so '7.3GB' is 7_300_000_000 bytes, not a float's guess."""
    try:
        return Decimal(digits)
    except InvalidOperation as err:  # the regexes admit only digits and one dot
        raise _bad(digits, "not a number") from err


def _floor(value: Decimal) -> int:
    return int(value.to_integral_value(rounding=ROUND_FLOOR))
