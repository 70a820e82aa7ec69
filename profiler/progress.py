"""A tool of every pass of :mod:`.profile`.

A one-line progress display on stderr, shown only on a terminal.

``progress=None`` or ``True`` shows it when stderr is a TTY; ``False`` never
does. Everything else the profiler has to say goes through ``logging`` (logger
``"remat"``).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Rewrites one status line (``remat: profiling [3/12] unit transformer.h.2``)."""

    def __init__(self, total: int, enabled: bool | None = None, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        on_terminal = bool(isatty()) if callable(isatty) else False
        self.enabled = on_terminal and enabled is not False
        self.total = max(total, 1)
        self.done = 0
        self.start = time.perf_counter()
        self.history: list[tuple[str, float]] = []  # (what, perf_counter when it began)
        self._width = 0

    def step(self, what: str) -> None:
        """Advance by one and show ``what`` is running now."""
        self.done = min(self.done + 1, self.total)
        self.history.append((what, time.perf_counter()))
        self._show(what)

    def durations(self) -> dict[str, float]:
        """Seconds each step took (the last one up to now), by its label."""
        ends = [t for _, t in self.history[1:]] + [time.perf_counter()]
        return {what: end - t for (what, t), end in zip(self.history, ends)}

    def _show(self, what: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        line = f"remat: profiling [{self.done}/{self.total}] {what} ({elapsed:.1f}s)"
        pad = max(self._width - len(line), 0)
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """End the line (nothing is written when disabled)."""
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
