"""Counting the aten ops a region runs: how remat shows that a planned segment runs the
same ops as ``checkpoint_sequential`` (``benchmarks/overhead.py``, and a test holds it).

It errs on no side: every op the dispatcher runs under it is counted once, views and
``detach`` included, and nothing else (a Python frame costs time but no op).
"""

from __future__ import annotations

import collections
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter"]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run under it, by overload packet (``ops["aten.mm"]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
