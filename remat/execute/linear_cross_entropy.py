"""A linear layer and its cross entropy, fused over chunks of the tokens, gradients in forward.

``cross_entropy(linear(hidden).float(), target)`` without the whole logits: each chunk of
the tokens gets its logits, their float32 log-softmax, the loss's share and, while the
chunk's logits exist anyway, its gradients (``softmax - one_hot`` into the hidden states'
gradient and, added in place into one buffer, the weight's). Backward then only scales
what forward computed by the loss's incoming gradient.

Why gradients in forward rather than the logits recomputed in backward (a checkpoint per
chunk, what this replaced): three matrix products a chunk instead of four, so the head
costs what the unchunked one does; and one weight-gradient buffer instead of autograd
summing a full-size partial gradient per chunk (two weight gradients alive at once, the
head's peak on a large vocabulary). The price: a forward under grad that is never
backpropagated wasted the gradients' products, and double backward is not supported.

:func:`chunked_cross_entropy` is the head's one computation, for the two ways in
(:mod:`remat.execute.head`'s ``head_loss`` and the lazy logits of
:mod:`remat.execute.lazy_logits`); it claims a tied embedding's handoff
(:mod:`remat.execute.tied_embedding`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from remat.core.errors import LoopError
from remat.execute.tied_embedding import claim, hand_over

__all__ = ["chunked_cross_entropy", "linear_cross_entropy"]

IGNORE_INDEX = -100  # the index cross_entropy ignores by default

# Under autocast the weight's gradient is summed in the weight's own dtype (float32 for
# an autocast model): a chunk's low-precision product is added in vocabulary slices of
# this many rows, so the cast copy stays small.
_SLICE_ROWS = 8192


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    chunks: int,
    ignore_index: int,
    divide_by: torch.Tensor | float | None,
    tied_to: Any = None,
) -> torch.Tensor:
    """The sum of ``cross_entropy(linear(hidden, weight, bias).float(), target)`` over the
    tokens that count (``target != ignore_index``), divided by ``divide_by`` (default:
    their number), computed over ``chunks`` slices of the tokens.

    ``tied_to``: an embedding call that takes the weight's gradient from here
    (:func:`remat.execute.tied_embedding.claim`); autograd then gets none for the weight
    from this loss, the embedding's backward returns both parts.
    """
    return _LinearCrossEntropy.apply(hidden, weight, bias, target, chunks, ignore_index,
                                     divide_by, tied_to)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Linear,
    target: torch.Tensor,
    *,
    chunks: int,
    ignore_index: int = IGNORE_INDEX,
    divide_by: torch.Tensor | float | None = None,
    bias_add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cross_entropy(head(hidden).float(), target)`` over ``chunks`` slices of the tokens.

    ``hidden`` is ``(..., features)``, ``target`` the matching ``(...)`` class indices. The
    sum over the tokens that count is divided by ``divide_by`` (default: their number, the
    mean ``cross_entropy`` takes). The slices' gradients are computed with their logits
    (:mod:`remat.execute.linear_cross_entropy`); the values are the plain computation's
    up to the order of a float32 sum. ``bias_add``: one score per class added to the
    head's output before the loss (the model adds it after the head).
    """
    bias = head.bias
    if bias_add is not None:
        bias = bias_add if bias is None else bias + bias_add
    tied_to = None
    if torch.is_grad_enabled() and head.weight.requires_grad:
        tied_to = claim(head, hidden)
    return linear_cross_entropy(hidden, head.weight, bias, target, chunks=chunks,
                                ignore_index=ignore_index, divide_by=divide_by,
                                tied_to=tied_to)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, target: torch.Tensor, chunks: int,
                ignore_index: int, divide_by: torch.Tensor | float | None,
                tied_to: Any) -> torch.Tensor:
        dtype = _compute_dtype(hidden)
        features = hidden.shape[-1]
        flat = hidden.reshape(-1, features)
        labels = target.reshape(-1).to(hidden.device)
        if divide_by is None:
            divide_by = (labels != ignore_index).sum()
        scale = 1.0 / (divide_by.to(hidden.device, torch.float32)
                       if torch.is_tensor(divide_by) else float(divide_by))
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros_like(bias) if want_bias and bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # The products run in the compute dtype (autocast's, else the inputs'), as
        # F.linear would under the same autocast; the loss in float32.
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            start = 0
            for h, t in zip(flat.chunk(chunks), labels.chunk(chunks)):
                rows = slice(start, start + h.shape[0])
                start = rows.stop
                h = h.to(dtype)
                log_probs = torch.log_softmax(F.linear(h, w, b).float(), dim=-1)
                total += F.nll_loss(log_probs, t, ignore_index=ignore_index, reduction="sum")
                if grad_hidden is None and grad_weight is None and grad_bias is None:
                    continue
                grad_logits = _grad_logits(log_probs, t, ignore_index, scale)
                del log_probs
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0).to(grad_bias.dtype)
                grad_logits = grad_logits.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[rows] = grad_logits @ w
                if grad_weight is not None:
                    _add_product(grad_weight, grad_logits, h)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.hidden_shape = hidden.shape
        ctx.tied_to = tied_to if grad_weight is not None else None
        return total * scale

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise LoopError(
                "the chunked head's loss was backpropagated twice (retain_graph=True): its "
                "gradients are computed in forward and scaled in place by the one "
                "backward; plan this loop without a chunked head (remat.solve(..., "
                "head='none')) or backpropagate the loss once")
        grad_hidden, grad_weight, grad_bias = ctx.grads
        # Drop the context's references, so autograd can take the buffers as they are.
        ctx.grads = None
        for grad in (grad_hidden, grad_weight, grad_bias):
            if grad is not None:
                grad.mul_(grad_loss.to(grad.dtype))
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(ctx.hidden_shape)
        if ctx.tied_to is not None:
            hand_over(ctx.tied_to, grad_weight)
            grad_weight = None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _grad_logits(log_probs: torch.Tensor, target: torch.Tensor, ignore_index: int,
                 scale: torch.Tensor | float) -> torch.Tensor:
    """The gradient of ``scale * nll_loss(log_probs, target, reduction="sum")`` through
    the log-softmax with respect to the logits: ``scale * (softmax - one_hot)`` on the
    rows that count, zero on ignored ones; computed in ``log_probs``'s storage."""
    counts = target != ignore_index
    grad = log_probs.exp_()
    picked = torch.where(counts, target, 0).unsqueeze(1)
    grad.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=grad.dtype))
    return grad.mul_((counts.unsqueeze(1) * scale).to(grad.dtype))


def _add_product(grad_weight: torch.Tensor, grad_logits: torch.Tensor,
                 h: torch.Tensor) -> None:
    """``grad_weight += grad_logits.T @ h``, in place in ``grad_weight``'s dtype."""
    if grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits.t(), h)
        return
    for start in range(0, grad_weight.shape[0], _SLICE_ROWS):
        rows = slice(start, start + _SLICE_ROWS)
        grad_weight[rows] += (grad_logits[:, rows].t() @ h).to(grad_weight.dtype)
