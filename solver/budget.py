"""Memory budgets as users write them: ``8_000_000_000``, ``"8GB"``, ``"7.5GiB"``, ``"60%"``."""

from __future__ import annotations

import math
import numbers
import re
from decimal import ROUND_FLOOR, Decimal, InvalidOperation

from remat.errors import BudgetError

__all__ = ["ACCEPTED_FORMS", "UNIT_BYTES", "parse_budget"]

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
    "case-insensitive ('8GB', '7.5 GiB', '512MiB'); or a percentage of the "
    "no-checkpoint peak ('60%')"
)

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_WITH_UNIT = re.compile(rf"^\s*{_NUMBER}\s*([a-z]+)\s*$", re.IGNORECASE)
_PERCENT = re.compile(rf"^\s*{_NUMBER}\s*%\s*$")


def _bad(budget: object, why: str) -> BudgetError:
    return BudgetError(f"memory_budget={budget!r} is not a valid budget ({why}); "
                       f"accepted forms: {ACCEPTED_FORMS}")


def parse_budget(budget: object, *, reference_peak_bytes: int | None = None) -> int:
    """A budget in bytes, from any accepted form (see :data:`ACCEPTED_FORMS`).

    Args:
        budget: an int of bytes, a string with a unit, or a percentage string.
        reference_peak_bytes: the no-checkpoint peak in bytes, which a percentage
            is taken of; a percentage without it is an error.

    Returns:
        The budget in whole bytes (fractions of a byte are rounded down), > 0.

    Raises:
        BudgetError: naming the bad value and listing the accepted forms.
    """
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
    return _parse_text(budget, reference_peak_bytes)


def _parse_text(text: str, reference_peak_bytes: int | None) -> int:
    percent = _PERCENT.match(text)
    if percent:
        return _percent_of(text, _decimal(percent.group(1)), reference_peak_bytes)
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


def _percent_of(text: str, percent: Decimal, reference_peak_bytes: int | None) -> int:
    if reference_peak_bytes is None:
        raise _bad(text, "a percentage needs the no-checkpoint peak to be known")
    nbytes = _floor(percent * reference_peak_bytes / 100)
    if nbytes <= 0:
        raise _bad(text, "it must be more than 0% (and at least 1 byte)")
    return nbytes


def _decimal(digits: str) -> Decimal:
    """Exact decimal arithmetic, so '7.3GB' is 7_300_000_000 bytes, not a float's guess."""
    try:
        return Decimal(digits)
    except InvalidOperation as err:  # the regexes admit only digits and one dot
        raise _bad(digits, "not a number") from err


def _floor(value: Decimal) -> int:
    return int(value.to_integral_value(rounding=ROUND_FLOOR))
