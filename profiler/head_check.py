"""Pass 4 of :mod:`.profile` (head variants).

Before a chunked head is offered: run the user's step both ways on one example.

A chunked head changes how the user's loss is computed (:mod:`remat.execute.head`). It is
offered only where it is checked on this model, in this loop, on a slice of the sample
batch small enough to fit anywhere (its first example): the loss as the loop computes it
(the model's own, or ``loss_fn``'s, under the loop's autocast) and the gradients of the
head's parameters and of a few others (spread over the model: a dropped auxiliary loss
moves its router's), as written and with the head chunked. The rewrite passes when

* the rewritten step ran, and its loss went through the chunked cross entropy
  (:class:`~remat.execute.lazy_logits.HeadUse`): no operation needed the real logits
  (a soft-cap, a loss with label smoothing, a ``loss_fn`` reading ``output.logits``,
  which would keep the memory the rewrite is for);
* the loss agrees within ``1e-4`` of its size in float32 (``1e-2`` under 16-bit
  autocast or weights), and each gradient compared within ``1e-3`` (``5e-2``) of its
  largest entry (or of a thousandth of the largest of all, for gradients near zero). The
  chunked loss sums in another order, so it is not bitwise; measured differences are
  below 1e-6 in float32 (``benchmarks/head_numerics.py``).

No model-family list is kept: the check is the rule. It costs two forward and backward
passes on one example, and only runs where a chunked head may be measured. RNG and
buffers are restored around each run, and no ``.grad`` is touched (the gradients are
taken with ``torch.autograd.grad``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from remat.execute.head import HeadSite, chunked_head, most_chunks
from remat.execute.lazy_logits import DeferredHead, HeadUse
from remat.measurement.host import host_copies
from remat.measurement.runner import StepRunner, call_model, compute_loss
from remat.measurement.state import ModelState

__all__ = ["HeadCheck", "check_head_rewrite", "one_example"]

log = logging.getLogger("remat")

_OTHERS = 6  # parameters compared besides the head's
_TOLERANCE = {False: (1e-4, 1e-3), True: (1e-2, 5e-2)}  # low precision -> (loss, grads)
_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class HeadCheck:
    """The outcome: ``refusal`` is ``None`` where the rewrite passed, else why not."""

    refusal: str | None
    loss_as_written: float | None = None
    loss_rewritten: float | None = None
    max_grad_difference: float | None = None  # relative, over the gradients compared


def one_example(batch: Any) -> Any:
    """``batch`` cut to its first example: every tensor whose first dimension is the
    batch's (that of ``labels`` where there is one, else of the first tensor)."""
    leaves, _ = tree_flatten(batch)
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    first = labels if isinstance(labels, torch.Tensor) else next(
        (t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is None or first.dim() == 0 or first.shape[0] <= 1:
        return batch
    size = first.shape[0]
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0
                    and t.shape[0] == size else t, batch)


def _compared(model: nn.Module, head: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The head's trainable parameters and ``_OTHERS`` others spread over the model."""
    own = {id(p) for p in head.parameters()}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mine = [(n, p) for n, p in trainable if id(p) in own]
    rest = [(n, p) for n, p in trainable if id(p) not in own]
    if len(rest) > _OTHERS:
        step = (len(rest) - 1) / (_OTHERS - 1)
        rest = [rest[round(k * step)] for k in range(_OTHERS)]
    return mine + rest


def check_head_rewrite(runner: StepRunner, site: HeadSite, state: ModelState) -> HeadCheck:
    """Run ``runner``'s step on one example with the head at ``site`` as written and
    chunked, and compare (see the module docstring). Leaves the model as it was."""
    model = runner.model
    head = model.get_submodule(site.name)
    small = one_example(runner.batch)
    compared = _compared(model, head)
    params = [p for _, p in compared]

    def step() -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        state.rng.restore()
        state.restore_buffers()
        with runner.autocast():
            loss = compute_loss(call_model(model, small), small, runner.loss_fn)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        # Kept off the device: the first run's gradients would otherwise be alive beside
        # the second run's whole step, more than a training step holds (a device at the
        # most frugal plan's peak ran out of memory here by 0.25 MiB).
        with host_copies():
            kept = [None if g is None else g.detach().to("cpu", copy=True) for g in grads]
        del grads
        return loss.detach(), kept

    try:
        loss0, grads0 = step()
        tokens = site.tokens // max(_examples(runner.batch), 1)
        with chunked_head(model, site, most_chunks(tokens) or 1):
            use = _use(head)
            try:
                loss1, grads1 = step()
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # the user's code failing on the rewrite is the answer
                text = " ".join(str(err).split())[:200]
                return HeadCheck(f"the step fails with the head chunked ({type(err).__name__}: "
                                 f"{text})")
    finally:
        state.recover_wrappers()  # a step that raised leaves FSDP2 mid-iteration
        state.rng.restore()
        state.restore_buffers()
    if use is not None:
        if use.materialized:
            ops = ", ".join(dict.fromkeys(use.materialized))
            return HeadCheck(f"the step uses the logits as more than its loss's cross entropy "
                             f"({ops}), so the whole logits would exist anyway",
                             float(loss0), float(loss1))
        if use.fused == 0:
            return HeadCheck("the loss is not a cross entropy on the head's logits",
                             float(loss0), float(loss1))
    low = (runner.loop.autocast is not None
           or any(p.dtype in _LOW for p in params) or loss0.dtype in _LOW)
    loss_tol, grad_tol = _TOLERANCE[low]
    if not torch.isfinite(loss0) or not torch.isfinite(loss1):
        return HeadCheck(f"the loss is not finite on one example ({float(loss0)}, "
                         f"{float(loss1)})", float(loss0), float(loss1))
    if abs(float(loss1) - float(loss0)) > loss_tol * max(1.0, abs(float(loss0))):
        return HeadCheck(f"the loss changes with the head chunked ({float(loss0):.6g} as written, "
                         f"{float(loss1):.6g} chunked): the model computes more than a cross "
                         f"entropy on the head's logits", float(loss0), float(loss1))
    with host_copies():
        worst, name = _worst_gradient(compared, grads0, grads1)
    if worst > grad_tol:
        return HeadCheck(f"the gradient of {name!r} changes with the head chunked (by {worst:.2g} "
                         f"of its largest entry)", float(loss0), float(loss1), worst)
    return HeadCheck(None, float(loss0), float(loss1), worst)


def _examples(batch: Any) -> int:
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        return labels.shape[0]
    return 1


def _use(head: nn.Module) -> HeadUse | None:
    deferred = head.__dict__.get("forward")
    if isinstance(deferred, DeferredHead):
        deferred.use.reset()
        return deferred.use
    return None  # a head_loss head: chunked by remat.head_loss itself


def _worst_gradient(compared: list[tuple[str, nn.Parameter]],
                    grads0: list[torch.Tensor | None],
                    grads1: list[torch.Tensor | None]) -> tuple[float, str]:
    """The largest difference between the two runs' gradients, relative to each one's
    largest entry (with a floor of a thousandth of the largest of all), and whose."""
    scales = [float(g.abs().max()) if g is not None and g.numel() else 0.0 for g in grads0]
    floor = 1e-3 * max(scales, default=0.0)
    worst, name = 0.0, ""
    for (n, _), g0, g1, scale in zip(compared, grads0, grads1, scales):
        if g0 is None and g1 is None:
            continue
        if g0 is None or g1 is None:
            return float("inf"), n
        diff = float((g0.float() - g1.float()).abs().max()) / max(scale, floor, 1e-30)
        if diff > worst:
            worst, name = diff, n
    return worst, name
