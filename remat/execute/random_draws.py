"""Dropout's masks under ``selective``: kept as one byte per element, replayed in backward.

``selective`` keeps the outputs of matmuls and attention and recomputes the rest in
backward, torch's way: the unit's forward runs again, with the RNG state it had. Where
the unit draws dropout masks (``bernoulli``), that means drawing every mask a second
time, and on a CPU drawing is the dearest elementwise work there is: on GPT-2 124M
(dropout 0.1, 512 tokens, one thread) the masks were 288 of the 385 ms a ``selective``
plan recomputed (``benchmarks/results/selective_cost.md``), 24 ms a block against a
125 ms forward.

A Bernoulli draw is 0 or 1, so a ``bool`` holds it exactly. Here the forward keeps a
``bool`` copy of each draw (:func:`recording_policy`) and the recomputation copies it
back instead of drawing (:class:`DrawReplay`): the same values bit for bit, the RNG left
alone (torch restores it around a recomputation either way).

The price: one byte per mask element held from forward to backward (GPT-2's attention
dropout at 512 tokens: 3 MiB a block, against the 12 MiB of the float mask ``keep``
holds), and one cast per mask in forward and in the recomputation. The profiler meters
``selective`` as it runs, masks included, so the solver sees both. Only Bernoulli draws
on plain tensors are kept; other random ops (``randn``, ``native_dropout``'s fused
kernel on CUDA, whose draw is cheap) and tensor subclasses are drawn again as before.
A recomputation that asks for another draw than the forward made (another shape: the
forward took another path) draws it, as torch would. Used by
:class:`remat.execute.options.RecomputeAsForward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BERNOULLI_OPS", "DrawReplay", "Draws", "as_mask", "copy_back", "plain",
           "recording_policy"]

_aten = torch.ops.aten

# Draws of 0 or 1, in place or not.
BERNOULLI_OPS = frozenset({
    _aten.bernoulli_.float, _aten.bernoulli_.Tensor, _aten.bernoulli.default,
    _aten.bernoulli.p,
})
_IN_PLACE = frozenset({_aten.bernoulli_.float, _aten.bernoulli_.Tensor})


def plain(t: object) -> bool:
    """A plain dense tensor (the draws kept are those)."""
    return type(t) is torch.Tensor and t.layout == torch.strided


def as_mask(draw: torch.Tensor) -> torch.Tensor:
    # A new tensor copied into, not ``ne(0)`` (a comparison kernel, 8x slower on a CPU:
    # 2.0 against 0.25 ms for GPT-2's 12 MiB attention mask on one thread) and not
    # ``to(torch.bool)``: below autograd (in a policy, in a dispatch mode) ``aten.to``
    # reaches the modes under it undecomposed, and its schema says it may return its
    # input, so a meter there would not count the new mask. A draw is 0 or 1, so the
    # cast is exact.
    return torch.empty_like(draw, dtype=torch.bool).copy_(draw)


def copy_back(target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Copied from the mask's bytes (``uint8``, 0 or 1), not from ``bool``: the same
    # values, and a CPU converts bytes to floats 8x faster (0.23 against 1.76 ms for the
    # 12 MiB attention mask).
    return target.copy_(mask.view(torch.uint8))


class Draws:
    """The draws of one region's forward, in order: a ``bool`` copy, or ``None`` for a
    draw not kept (a tensor subclass)."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor | None] = []


def recording_policy(policy: Callable[..., Any], draws: Draws) -> Callable[..., Any]:
    """``policy`` (a selective-checkpoint policy) that also keeps each Bernoulli draw on a
    plain tensor in ``draws``, as ``bool``. torch calls a policy once per op of the
    forward, after the op, with its output (``ctx.op_output``): recording there costs no
    dispatch mode of its own around every op."""

    def record(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in BERNOULLI_OPS:
            out = getattr(ctx, "op_output", None)
            draws.masks.append(as_mask(out) if plain(out) else None)
        return policy(ctx, func, *args, **kwargs)

    return record


class DrawReplay(TorchDispatchMode):
    """In the recomputation: each Bernoulli draw answered from :class:`Draws`, in order;
    the masks dropped at the end unless the backward keeps its graph (a second backward
    recomputes again). Where the forward drew nothing it is not pushed at all: no
    dispatch mode around the recomputation's ops."""

    def __init__(self, draws: Draws, graph_is_kept: Callable[[], bool]) -> None:
        super().__init__()
        self.draws = draws
        self.graph_is_kept = graph_is_kept
        self.next = 0
        self._pushed: list[bool] = []

    def __enter__(self) -> DrawReplay:
        self.next = 0
        pushed = bool(self.draws.masks)
        self._pushed.append(pushed)
        return super().__enter__() if pushed else self

    def __exit__(self, *exc: Any) -> Any:
        try:
            if self._pushed.pop():
                return super().__exit__(*exc)
            return None
        finally:
            if not self.graph_is_kept():
                self.draws.masks.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in BERNOULLI_OPS:
            return func(*args, **kwargs)
        masks, i = self.draws.masks, self.next
        self.next += 1
        mask = masks[i] if i < len(masks) else None
        target = args[0]
        if mask is None or not plain(target) or target.shape != mask.shape:
            return func(*args, **kwargs)
        if func in _IN_PLACE:
            return copy_back(target, mask)
        return copy_back(torch.empty_like(mask, dtype=target.dtype), mask)
