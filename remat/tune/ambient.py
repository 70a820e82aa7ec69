"""Planning inside the user's own ``torch.autocast``: plan for that loop, or refuse.

``with torch.autocast("cpu", dtype=torch.bfloat16): plan = remat.solve(model, batch, ...)``
describes a loop whose forward runs under autocast, and the training that follows
usually runs under the same ``with``. A plan for the default ``Loop()`` (no autocast)
would count every activation at the wrong size (+15% over its budget in training on
a small MLP), and the profiler would measure a mixture of both loops. So the entry
points that plan (``solve``, ``pareto``, ``profile``, ``estimate``) look at the
autocast around them before they start:

* no ``loop=`` given: the plan is for ``Loop(autocast=<that dtype>)``, and one line on
  the ``remat`` logger says so;
* a ``loop=`` that says another autocast: :class:`~remat.core.errors.LoopError`, naming
  ``Loop(autocast=...)``; never a plan for a loop other than the one around it.

The work itself then runs *outside* the ambient autocast (:func:`planning`, with
:func:`remat.execute.autocast.outside_autocast`): the profiler and verification apply
the loop's own autocast to the forward only, as the loop does (its backward runs outside
autocast).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat.core.errors import LoopError
from remat.core.loop import AUTOCAST_DTYPES, Loop, loop_code
from remat.execute.autocast import outside_autocast

__all__ = ["ambient_autocast", "loop_for_ambient", "planning"]

log = logging.getLogger("remat")


def _device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter (or buffer); ``"cpu"`` without."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device.type
    return "cpu"


def ambient_autocast(device_type: str) -> str | None:
    """The dtype of the ``torch.autocast`` active for ``device_type`` now (``"bfloat16"``),
    or ``None`` when autocast is off there."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:  # a device type autocast does not know (meta): none can be on
        return None
    return str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")


def loop_for_ambient(loop: Loop | None, ambient: str | None, device_type: str,
                     where: str) -> Loop | None:
    """The loop to plan for, given the autocast around the call (see the module docstring)."""
    if ambient is None:
        return loop
    around = f"torch.autocast({device_type!r}, dtype=torch.{ambient})"
    if ambient not in AUTOCAST_DTYPES:
        raise LoopError(
            f"{where} runs inside {around}, and a remat.Loop describes autocast with "
            f"{' or '.join(AUTOCAST_DTYPES)} only; call {where} outside that autocast with "
            "loop=remat.Loop(autocast=...) for the loop you train with")
    if loop is None:
        log.info("remat: %s runs inside %s: planning for loop=remat.Loop(autocast=%r), the "
                 "loop around it (pass loop= to say otherwise)", where, around, ambient)
        return Loop(autocast=ambient)
    if loop.autocast != ambient:
        raise LoopError(
            f"{where} runs inside {around}, and loop={loop_code(loop)} says the forward runs "
            f"{'under autocast ' + loop.autocast if loop.autocast else 'without autocast'}: "
            f"a plan must be for the loop that runs. Pass loop="
            f"{loop_code(loop, autocast=ambient)} if you train under this autocast, or call "
            f"{where} outside it")
    return loop


@contextlib.contextmanager
def planning(model: Any, loop: Loop | None, where: str) -> Iterator[Loop | None]:
    """The loop to plan for (:func:`loop_for_ambient`), with the ambient autocast closed
    inside (:func:`remat.execute.autocast.outside_autocast`), so the work measures the
    loop as declared. A profile (not a model) passes."""
    if not isinstance(model, nn.Module):
        yield loop
        return
    device_type = _device_type(model)
    ambient = ambient_autocast(device_type)
    loop = loop_for_ambient(loop, ambient, device_type, where)
    if ambient is None:
        yield loop
        return
    with outside_autocast():
        yield loop
