"""Hugging Face's output capture, kept out of the profiler's replays.

A ``transformers`` model records some of its submodules' outputs (a mixture of experts'
router logits, for its auxiliary loss; attention weights, hidden states) by forward
hooks that append to a collector. The top-level forward sets the collector, in a
``ContextVar``, for the time of its call, and reads it when the call returns.

The profiler replays each unit inside that call, at the unit's own call (the capture
pass: :mod:`remat.profiler.capture`). Without care, each replay's recorded outputs are
appended to the live forward's collector, with their autograd graphs. A replay's
backward starts from the unit's output alone, so the part of the graph that only
the router logits reach is never run, and what it saved stays alive until the
top-level call returns. Checkpoint's recomputed tensors for those nodes stay alive
too. Unit after unit, that is profiling holding more than the step it plans. On the
4-layer Mixtral of ``benchmarks/fsdp_unseen.py`` under FSDP2, 10.0 MiB of the first
layer's replays were alive when the second layer's ran, and that replay ran out of a
device of the floor budget (43.85 MiB a rank). On a 2-layer Mixtral the forward's
output carried 20 router logits instead of 2
(``tests/test_integrations_hf.py::test_the_profilers_replays_add_nothing_to_the_forwards_captured_outputs``).

So the replays run with the collector unset (:func:`outside_output_capture`), as a
recomputation in the backward does: the backward runs after the top-level call has
reset it. A replay records nothing. What the real step's collector keeps of the units
(their router logits, tokens x experts: 8 KiB a layer of that Mixtral), from each
unit's forward to the loss, is measured where the units run for real, in the capture
pass (:func:`recorded_lengths`, :func:`recorded_since`), and counted held through
the whole step: an over-count in the backward, where the real step has let them go.
Left out, a DDP Mixtral's plan with a segment of three layers measured 16 KiB above its
prediction (two layers' logits: a segment's inner units hold nothing in the solver's
model) and its floor was refused by 8 KiB.

The price: none at run time; a ``ContextVar`` set and reset per unit while profiling,
and the collector's lists read before and after each unit's call. Only transformers'
own collector is touched (other context variables, such as torch's configuration
patches, are left alone). Older transformers, without the collector, are left as they
are.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["outside_output_capture", "recorded_lengths", "recorded_since"]

# Where transformers keeps the collector its output-capturing hooks append to.
_COLLECTOR_MODULES = ("transformers.utils.output_capturing", "transformers.utils.generic")


def _collector() -> Any:
    """transformers' active-collector variable, or None where transformers is not
    imported (remat never imports it) or has none."""
    for name in _COLLECTOR_MODULES:
        var = getattr(sys.modules.get(name), "_active_collector", None)
        if var is not None and hasattr(var, "set") and hasattr(var, "reset"):
            return var
    return None


@contextlib.contextmanager
def outside_output_capture() -> Iterator[None]:
    """Run the block with transformers' output collector unset, so that forward hooks
    record nothing of it (module docstring); the collector is put back after."""
    var = _collector()
    if var is None or var.get() is None:
        yield
        return
    token = var.set(None)
    try:
        yield
    finally:
        var.reset(token)


def _live() -> dict | None:
    """The live collector (a dict of lists), or ``None`` outside a capturing forward."""
    var = _collector()
    live = var.get() if var is not None else None
    return live if isinstance(live, dict) else None


def recorded_lengths() -> dict[str, int] | None:
    """How many entries each list of the live collector holds now (``None``: none)."""
    live = _live()
    if live is None:
        return None
    return {k: len(v) for k, v in live.items() if isinstance(v, list)}


def recorded_since(lengths: dict[str, int] | None) -> list[Any]:
    """The entries appended to the live collector's lists since ``lengths``
    (:func:`recorded_lengths`)."""
    live = _live()
    if lengths is None or live is None:
        return []
    return [entry for key, before in lengths.items()
            if isinstance(live.get(key), list) for entry in live[key][before:]]
