"""Plain-text tables for the command line and the demo: columns padded to line up.

Cells are formatted by the caller (bytes with :func:`remat.core.bytesize.mib`); this
module only lays them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["format_table", "print_table"]


def format_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The lines of a table: header (the first row's keys), a rule, one line per row."""
    if not rows:
        return []
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols),
             "  ".join("-" * widths[c] for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return lines


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """Print :func:`format_table`'s lines on stdout (nothing for no rows)."""
    for line in format_table(rows):
        print(line)
