"""Type and range checks for the fields of profiles and plans, run at construction.

A bad value (a string, a bool, NaN, a negative or absurdly large number) is
refused where the object is made or loaded, with the field's name, instead of
surfacing later as a wrong plan or an overflow deep in the solver.

Bounds: byte counts measured on a device are ints in ``[0, MAX_BYTES]``; times
measured on it are finite floats in ``[0, MAX_MS]``. The bounds are far above
anything real and keep every sum the solver forms inside int64.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

import numpy as np

from remat.core.errors import RematError

__all__ = [
    "MAX_BYTES",
    "MAX_INT64",
    "MAX_MS",
    "checked_bool",
    "checked_bytes",
    "checked_list",
    "checked_ms",
    "checked_str",
    "checked_strings",
]

MAX_BYTES = 2**50  # 1 PiB: more than any device holds
MAX_MS = 1e9  # about 11.6 days: more than any training step takes
MAX_INT64 = 2**63 - 1

Error = type[RematError]


def _kind(value: object) -> str:
    return type(value).__name__


def checked_bytes(
    value: object, where: str, error: Error, *, hi: int | None = MAX_BYTES, unit: str = "bytes"
) -> int:
    """``value`` as an int in ``[0, hi]`` (``hi=None``: no upper bound); else ``error``.

    ``unit`` names what the int counts, for the message.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise error(f"{where} must be an int ({unit}), got {value!r} ({_kind(value)})")
    number = int(value)
    if number < 0 or (hi is not None and number > hi):
        bound = f"between 0 and {hi}" if hi is not None else "at least 0"
        raise error(f"{where} must be {bound} ({unit}), got {number}")
    return number


def checked_ms(
    value: object,
    where: str,
    error: Error,
    *,
    hi: float | None = MAX_MS,
    unit: str = "milliseconds",
) -> float:
    """``value`` as a finite float in ``[0, hi]`` (``hi=None``: no upper bound); else ``error``.

    ``unit`` names what the number measures, for the message.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise error(f"{where} must be a number ({unit}), got {value!r} ({_kind(value)})")
    number = float(value)
    if not math.isfinite(number):
        raise error(f"{where} must be a finite number ({unit}), got {number}")
    if number < 0 or (hi is not None and number > hi):
        bound = f"between 0 and {hi:g}" if hi is not None else "at least 0"
        raise error(f"{where} must be {bound} ({unit}), got {number:g}")
    return number


def checked_bool(value: object, where: str, error: Error) -> bool:
    """``value`` as a bool (a numpy bool too); anything else is ``error``."""
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{where} must be true or false, got {value!r} ({_kind(value)})")
    return bool(value)


def checked_str(value: object, where: str, error: Error) -> str:
    """``value`` when it is a str; else ``error``."""
    if not isinstance(value, str):
        raise error(f"{where} must be a string, got {value!r} ({_kind(value)})")
    return value


def checked_list(value: object, where: str, error: Error) -> tuple[object, ...]:
    """``value``'s items, when it is a list-like; a string or a mapping is ``error``.

    A string is iterable, and would otherwise split into characters.
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise error(f"{where} must be a list, got {value!r} ({_kind(value)})")
    return tuple(value)


def checked_strings(value: object, where: str, error: Error) -> tuple[str, ...]:
    """``value`` as a tuple of strings (a list of them, not one string)."""
    items = checked_list(value, where, error)
    for k, item in enumerate(items):
        checked_str(item, f"{where}[{k}]", error)
    return tuple(str(item) for item in items)
