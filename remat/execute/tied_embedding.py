"""An input embedding tied to a chunked head: one weight gradient, not three.

A language model whose output head shares its weight with the input embedding (GPT-2,
most small models) gets that weight's gradient from two places: the head's, early in
backward, waits in autograd's buffer for the embedding's, at the very end; the
embedding's backward makes a dense vocabulary-sized gradient of its own, and autograd
adds the two into a third. Three weight-sized tensors at the last step of backward,
which is where such a model's smallest peak sits once every block is checkpointed.

Under a chunked head (:mod:`remat.execute.linear_cross_entropy`), whose weight gradient
exists as one buffer from forward on, the two can meet without the copies: the head
hands its buffer to the embedding call its loss came from and gives autograd no
gradient for the weight; the embedding's backward adds its rows into that buffer in
place and returns it as the weight's whole gradient. The handoff is made only where it
is sure to be collected: the embedding call is found in the loss's graph when the head
runs (a head whose hidden states do not come from it keeps its gradient), one head per
embedding call, and the embedding's backward takes the buffer only after the head's
backward filled it in this same pass.

:func:`tie` installs it on the embeddings of a model that share the head's weight
(:func:`remat.execute.head.install_head`), :func:`untie` removes it; the head's side
calls :func:`claim` and :func:`hand_over`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["TiedEmbeddings", "claim", "hand_over", "tie", "untie"]

_LINK_ATTR = "_remat_tied_embeddings"  # on a head module: its TiedEmbeddings


class TiedEmbeddings:
    """The embedding calls made with a head's weight whose graphs are still alive.

    Kept on the head module while a chunked head is installed; a copy of the model
    (``deepcopy``, pickle) gets an empty one, since graphs are not copied.
    """

    def __init__(self) -> None:
        self._nodes: list[weakref.ref] = []

    def record(self, node: Any) -> None:
        self._nodes = [ref for ref in self._nodes if ref() is not None]
        self._nodes.append(weakref.ref(node))

    def live(self) -> list[Any]:
        return [node for ref in self._nodes if (node := ref()) is not None]

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._nodes = []


def _can_tie(embedding: nn.Module, weight: torch.Tensor) -> bool:
    # The plain lookup only: max_norm rewrites the weight, scale_grad_by_freq and sparse
    # gradients are computed otherwise; a forward someone already replaced is theirs.
    return (type(embedding) is nn.Embedding and embedding.weight is weight
            and embedding.max_norm is None and not embedding.scale_grad_by_freq
            and not embedding.sparse and "forward" not in embedding.__dict__)


def tie(model: nn.Module, head: nn.Linear) -> None:
    """Route the weight gradient of ``model``'s embeddings that share ``head``'s weight
    through the head's buffer (see the module's docstring); a no-op where none does."""
    link = TiedEmbeddings()
    tied = [m for m in model.modules() if _can_tie(m, head.weight)]
    for embedding in tied:
        embedding.forward = _TiedEmbeddingForward(embedding, link)
    if tied:
        setattr(head, _LINK_ATTR, link)


def untie(model: nn.Module, head: nn.Linear) -> None:
    """Undo :func:`tie`."""
    head.__dict__.pop(_LINK_ATTR, None)
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _TiedEmbeddingForward):
            del module.__dict__["forward"]


def claim(head: nn.Linear, hidden: torch.Tensor) -> Any:
    """The embedding call (its autograd node) ``hidden`` came from that will take the
    gradient of ``head``'s weight from the head, claimed for this head; ``None`` if there
    is none (the head then returns its gradient itself)."""
    link = getattr(head, _LINK_ATTR, None)
    if link is None or torch.compiler.is_compiling() or hidden.grad_fn is None:
        return None
    candidates = [n for n in link.live() if n.weight is head.weight and not n.claimed]
    if not candidates:
        return None
    found = _reachable(hidden.grad_fn, {id(n): n for n in candidates})
    if len(found) != 1:
        return None  # none, or several: which one backward reaches last is not ours to pick
    node = found[0]
    node.claimed = True
    return node


def hand_over(node: Any, grad_weight: torch.Tensor) -> None:
    """Give the claimed embedding call the head's finished weight gradient."""
    node.from_head = grad_weight


def _reachable(start: Any, wanted: dict[int, Any]) -> list[Any]:
    found, seen, stack = [], {id(start)}, [start]
    while stack:
        fn = stack.pop()
        if id(fn) in wanted:
            found.append(wanted[id(fn)])
        for next_fn, _ in fn.next_functions:
            if next_fn is not None and id(next_fn) not in seen:
                seen.add(id(next_fn))
                stack.append(next_fn)
    return found


class _TiedEmbeddingForward:
    """An ``nn.Embedding``'s forward whose weight gradient may come through a head's
    buffer. A plain class, so planned models pickle."""

    def __init__(self, module: nn.Embedding, link: TiedEmbeddings) -> None:
        self.module = module
        self.link = link

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Embedding's name
        module = self.module
        # Traced (torch.compile), the graph is not the one backward runs: no handoff.
        if (torch.compiler.is_compiling() or not torch.is_grad_enabled()
                or not module.weight.requires_grad):
            return type(module).forward(module, input)
        out = _Embedding.apply(input, module.weight, module.padding_idx)
        self.link.record(out.grad_fn)
        return out


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor,
                padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the parameter (what claim() matches), not a saved activation
        ctx.rows = weight.shape[0]
        ctx.padding_idx = padding_idx
        ctx.claimed = False
        ctx.from_head = None
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        buffer, ctx.from_head = ctx.from_head, None
        if buffer is None:
            padding = -1 if ctx.padding_idx is None else ctx.padding_idx
            return None, torch.ops.aten.embedding_dense_backward(
                grad, ids, ctx.rows, padding, False), None
        flat_ids, flat = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            flat = flat * (flat_ids != ctx.padding_idx).unsqueeze(1).to(flat.dtype)
        buffer.index_add_(0, flat_ids, flat.to(buffer.dtype))
        return None, buffer, None
