"""Checking what callers pass to an algorithm: its budget and its own parameters.

A wrong parameter is a :class:`ParameterError` (a ``ValueError``) naming it and
its valid range; a parameter the algorithm does not take is an
:class:`UnknownParameterError` (a ``TypeError``) listing those it does take.
"""

from __future__ import annotations

import math
import numbers

from remat.errors import BudgetError, RematError

__all__ = [
    "ParameterError",
    "UnknownParameterError",
    "check_budget_bytes",
    "check_count",
    "check_seconds",
]


class ParameterError(RematError, ValueError):
    """An algorithm parameter of the wrong type or out of its range."""


class UnknownParameterError(RematError, TypeError):
    """A keyword parameter the chosen algorithm does not take."""


def check_count(name: str, value: object, *, lo: int, hi: int | None = None,
                meaning: str = "", owner: str = "") -> int:
    """``value`` when it is an int (not a bool) in ``[lo, hi]``; else :class:`ParameterError`.

    The message reads ``"uniform needs k, an int with 1 <= k <= 12 (the number of
    units), got k=13"``.
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    ok = ok and lo <= value and (hi is None or value <= hi)
    if not ok:
        bound = f"{lo} <= {name}" + (f" <= {hi}" if hi is not None else "")
        who = f"{owner} needs" if owner else "needs"
        note = f" ({meaning})" if meaning else ""
        raise ParameterError(f"{who} {name}, an int with {bound}{note}, got {name}={value!r}")
    return int(value)


def check_seconds(name: str, value: object, *, owner: str = "") -> float:
    """``value`` when it is a finite number of seconds > 0; else :class:`ParameterError`."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:
        who = f"{owner} needs" if owner else "needs"
        raise ParameterError(
            f"{who} {name}, a finite number of seconds > 0, got {name}={value!r}"
        )
    return float(value)


def check_budget_bytes(budget_bytes: object) -> int | None:
    """``budget_bytes`` when it is ``None`` or an int of bytes; else :class:`BudgetError`.

    Algorithms take whole bytes; ``solve_profile`` and :func:`parse_budget` accept
    ``"8GB"`` or ``"60%"`` and convert them.
    """
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise BudgetError(
            f"budget_bytes={budget_bytes!r} is not an int of bytes; pass an int, or a string "
            "such as '8GB' or '60%' to solve_profile() (parse_budget() converts them)"
        )
    return int(budget_bytes)
