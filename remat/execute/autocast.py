"""Running as if no ``torch.autocast`` region were open: one definition, two users.

The capture pass of the profiler (:mod:`remat.profiler.capture`) replays each unit inside
the model's forward, under the loop's autocast; a replay opens that autocast itself for
its forward and runs its backward outside it, as a training loop does. And an entry point
called inside the user's own ``torch.autocast`` (:mod:`remat.tune.ambient`) plans for that
loop but must measure it as declared. Both need the regions open around them closed, not
merely disabled: ``torch.autocast(enabled=False)`` still counts as a region, and
autocast keeps its weight casts until the *outermost* region exits, so the casts of
every forward inside would live on and be measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["outside_autocast"]

_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Inside the block no autocast region is open (their nesting count is taken to 0,
    their cache of casts emptied); after it they are reopened as they were (the cache
    starts empty: casts are made again on use, the same values). Uses torch's
    ``autocast_decrement_nesting`` / ``autocast_increment_nesting``, public in the
    ``torch`` namespace though undocumented."""
    saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICES]
    cache = torch.is_autocast_cache_enabled()
    depth = 0  # how many regions were open
    while True:
        left = torch.autocast_decrement_nesting()
        if left < 0:  # none was open: undo the step
            torch.autocast_increment_nesting()
            break
        depth += 1
        if left == 0:
            break
    torch.clear_autocast_cache()
    try:
        for d, _, _ in saved:
            torch.set_autocast_enabled(d, False)
        yield
    finally:
        torch.clear_autocast_cache()
        for _ in range(depth):
            torch.autocast_increment_nesting()
        for d, enabled, dtype in saved:
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_cache_enabled(cache)
