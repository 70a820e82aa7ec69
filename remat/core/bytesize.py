"""Byte counts for people: one way to print them everywhere (errors, CLI, plots, reports).

Parsing what users write (``"8GB"``, ``"7.5GiB"``) is :mod:`remat.core.budget`'s job;
this module only formats. It imports nothing, so the lightest modules can use it.
"""

from __future__ import annotations

__all__ = ["MIB", "format_bytes", "mib"]

MIB = 2**20
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units, two decimals: ``1536 -> '1.50 KiB'``, ``12 -> '12 B'``."""
    value = float(nbytes)
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def mib(nbytes: float | None, digits: int = 1) -> str:
    """A table cell in MiB: ``mib(3 * 2**20) -> '3.0'``; ``'-'`` for ``None``."""
    return "-" if nbytes is None else f"{nbytes / MIB:.{digits}f}"
