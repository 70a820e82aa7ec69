"""``torch.profiler`` sessions with memory events: one at a time, and quiet.

The allocator's view on CPU (:mod:`.allocator`) reads ``torch.profiler``'s allocation
events. The profiler is a foreign, process-wide facility with two habits remat must not
pass on to its users:

* **It prints.** Kineto writes ``USDT: ... profiler_start`` / ``profiler_stop`` (and,
  at some log levels, ``STAGE:`` lines) to the process's standard error from C++ at the
  start and the end of every session, whatever Python's logging says; and the CPU
  allocator warns once per process, from C++, that a block allocated before a session
  was freed in it. A plan of a few dozen sessions printed dozens of such lines.
  The session's start and stop therefore run with file descriptor 2 redirected to a
  temporary file, and every line but those is written back; the one-time warning is
  drawn out once, in a silent session of its own, before the first real one.
* **It does not nest, and two at once crash.** Two sessions in two threads killed the
  process (SIGSEGV). Sessions are serialised by one lock: a second thread waits.

This is the one place remat starts a ``torch.profiler`` session.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["memory_profile"]

# What the profiler and the CPU allocator print on their own (see the module docstring).
_NOISE = re.compile(
    r"^(USDT:|STAGE:|\[W\S* \S+ CPUAllocator\.cpp:\d+\] Memory block of unknown size)")

_LOCK = threading.RLock()
_primed = False


@contextlib.contextmanager
def _filtered_stderr() -> Iterator[None]:
    """Standard error (the file descriptor, which C++ writes to) into a temporary file;
    afterwards, every line but the profiler's own noise goes back to it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(True)
                    if not _NOISE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _prime() -> None:
    """Draw out the CPU allocator's once-per-process warning in a silent session."""
    global _primed
    if _primed:
        return
    _primed = True
    block = torch.empty(64, dtype=torch.uint8)
    with _filtered_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            del block


@contextlib.contextmanager
def memory_profile(activities: Sequence[ProfilerActivity] = (ProfilerActivity.CPU,)
                   ) -> Iterator[Any]:
    """A ``torch.profiler.profile(profile_memory=True)`` session over the block: the
    profiler object (its events are complete once the block has ended). Sessions of
    several threads run one after the other; the profiler prints nothing."""
    with _LOCK:
        _prime()
        prof = profile(activities=list(activities), profile_memory=True)
        with _filtered_stderr():
            prof.__enter__()
        try:
            yield prof
        finally:
            with _filtered_stderr():
                prof.__exit__(None, None, None)
