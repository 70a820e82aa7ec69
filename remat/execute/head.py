"""The output head and its loss, computed over chunks of the tokens: the whole logits never exist.

With every block checkpointed, a language model's step peaks in its head: the logits
(tokens x vocabulary), their float32 copy for the loss and their gradient, alive together.
Chunked, the projection and the cross entropy run over ``chunks`` slices of the tokens,
each slice's gradients computed while its logits exist (in forward), summed into one
weight gradient: one slice's logits at a time, at the unchunked head's three products.

Two ways in, one computation (:func:`chunked_cross_entropy`):

* :func:`head_loss`, for a model of one's own: ``loss = remat.head_loss(self.head, hidden,
  target)`` in its forward, the plain ``cross_entropy(head(hidden).float(), target)``
  unless a plan chose a chunked head for ``self.head`` (:func:`chunked_head`);
* a model that computes its own cross entropy on its head's logits (Hugging Face causal
  LMs, T5, under peft or accelerate too; :func:`find_head`): under a chunked head the
  head returns lazy logits (:mod:`remat.execute.lazy_logits`) and the model's forward,
  run as written, computes its cross entropy on them over chunks; anything else it or
  the caller does with them computes the real logits. Whether the loss really went
  through the chunks, with the same loss and gradients, is checked on the user's model
  before the option is offered (:mod:`remat.profiler.head_check`).

The profiler measures each chunk count as a variant of the code outside the units, the
solver chooses one only when the budget needs it, and the runtime installs it; the
profiler and the runtime both use what is here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.execute.lazy_logits import deferred_head, remove_deferred_head
from remat.execute.linear_cross_entropy import IGNORE_INDEX, chunked_cross_entropy
from remat.execute.tied_embedding import tie, untie

__all__ = [
    "IGNORE_INDEX",
    "HeadSite",
    "LOOKED_FOR",
    "CHUNK_COUNTS",
    "chunk_counts",
    "find_head",
    "head_refusal",
    "chunked_cross_entropy",
    "chunked_head",
    "head_loss",
    "install_head",
    "most_chunks",
    "remove_head",
    "watching_head_loss",
]

_CHUNKS_ATTR = "_remat_head_chunks"  # on a head module: the chunk count a plan chose


def head_loss(
    head: nn.Linear,
    hidden: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The mean cross entropy of ``head(hidden)`` against ``target``, for a model's forward.

    ``cross_entropy(head(hidden).float(), target, ignore_index=...)``, as written; when a
    plan chose a chunked head for ``head`` (``remat.apply_plan``), the same loss over
    chunks of the tokens (:func:`chunked_cross_entropy`), so the whole logits never exist.
    Using it in a forward is what lets remat plan the head of a model of one's own.
    """
    chunks = getattr(head, _CHUNKS_ATTR, None)
    if _watching is not None:
        _watching.setdefault(id(head), target.numel())
        if chunks is None and _frugal:
            chunks = most_chunks(target.numel())
    if chunks is not None and torch.is_grad_enabled():
        return chunked_cross_entropy(hidden, head, target, chunks=chunks,
                                     ignore_index=ignore_index)
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=ignore_index)


# While the profiler watches a forward pass: the heads that went through head_loss (by
# id) and their token counts, so it can tell a model that computes its loss there; and
# whether they compute it over the most chunks (a pass that must hold no more than the
# most frugal plan).
_watching: dict[int, int] | None = None
_frugal = False


@contextlib.contextmanager
def watching_head_loss(*, frugal: bool = False) -> Iterator[dict[int, int]]:
    """Inside the block, each :func:`head_loss` call records its head (by ``id``) and the
    number of its target's tokens in the dict yielded; with ``frugal``, it computes its
    loss over :func:`most_chunks` chunks."""
    global _watching, _frugal
    outer = _watching, _frugal
    _watching, _frugal = {}, frugal
    try:
        yield _watching
    finally:
        _watching, _frugal = outer


# The chunk counts worth measuring: a chunk's logits are 1/4, 1/16, 1/64 of the whole;
# each chunk keeps at least MIN_TOKENS_PER_CHUNK tokens (a matrix product of fewer rows
# is mostly overhead).
CHUNK_COUNTS = (4, 16, 64)
MIN_TOKENS_PER_CHUNK = 16


def chunk_counts(tokens: int) -> tuple[int, ...]:
    """The chunk counts worth measuring for a loss over ``tokens`` tokens, ascending."""
    return tuple(c for c in CHUNK_COUNTS if tokens // c >= MIN_TOKENS_PER_CHUNK)


def most_chunks(tokens: int) -> int | None:
    """The most chunks worth it for ``tokens`` tokens (``None``: too few to chunk)."""
    counts = chunk_counts(tokens)
    return counts[-1] if counts else None


# ---------------------------------------------------------------------------------
# A model's own cross entropy on its head's logits (Hugging Face models)
# ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadSite:
    """Where a model's head is and how its loss is computed.

    Attributes:
        name: the head module's qualified name (``"lm_head"``, ``"base_model.model.lm_head"``
            under peft).
        kind: ``"causal-lm"`` (the model computes a cross entropy on the head's logits
            itself: :mod:`remat.execute.lazy_logits` defers them; the name is kept from
            when only causal LMs were recognised) or ``"head_loss"`` (a model that calls
            :func:`head_loss`).
        tokens: how many tokens the loss is over in the batch it was found on.
    """

    name: str
    kind: str
    tokens: int = 0


# What find_head() looks for, for the error when it finds nothing.
LOOKED_FOR = (
    "a plain nn.Linear output head (`lm_head`, or the model's get_output_embeddings()) of a "
    "model that computes its own cross entropy on the head's logits, with `labels` in the "
    "batch (Hugging Face causal LMs, T5; under peft too), or a model whose forward computes "
    "its loss as `remat.head_loss(self.<head>, hidden, target)`"
)


def _output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The qualified name and module of ``model``'s output head: a module named ``lm_head``
    (at any depth: peft wraps the model), else what ``get_output_embeddings()`` gives."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head":
            return name, module
    get = getattr(model, "get_output_embeddings", None)
    found = get() if callable(get) else None
    if isinstance(found, nn.Module):
        for name, module in model.named_modules():
            if module is found:
                return name, module
    return None


def head_refusal(head: nn.Module) -> str | None:
    """Why remat cannot defer the logits of ``head``, or ``None``: it must be a plain
    ``nn.Linear`` whose forward nobody replaced or hooked (accelerate's device hooks, a
    LoRA adapter on the head compute something else)."""
    if type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not a plain nn.Linear"
    if "forward" in head.__dict__:
        return "its output head's forward was replaced (a wrapper or hook of someone else's)"
    if head._forward_hooks or head._forward_pre_hooks:
        return "its output head has forward hooks, which would see no logits"
    return None


def find_head(model: nn.Module, batch: Any, through_head_loss: dict[int, int]) -> HeadSite | str:
    """The head of ``model`` trained on ``batch`` that remat may chunk, or why there is none.

    ``through_head_loss``: the heads that went through :func:`head_loss` in a forward on
    ``batch`` (:func:`watching_head_loss`); one of them is the head. Else the model's
    output head (an ``lm_head``, or its output embeddings) with ``labels`` in the batch: a
    candidate only; whether its loss really is a cross entropy on its logits, and the
    rewrite keeps loss and gradients, is checked by running both
    (:mod:`remat.profiler.head_check`).
    """
    for name, module in model.named_modules():
        if id(module) in through_head_loss and isinstance(module, nn.Linear):
            return HeadSite(name, "head_loss", through_head_loss[id(module)])
    found = _output_head(model)
    if found is None:
        return "it has no output head (`lm_head`, or get_output_embeddings())"
    name, head = found
    refusal = head_refusal(head)
    if refusal is not None:
        return refusal
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        return "the batch has no `labels` tensor (the model computes no loss of its own)"
    return HeadSite(name, "causal-lm", labels.numel())


@contextlib.contextmanager
def chunked_head(model: nn.Module, site: HeadSite | None, chunks: int | None) -> Iterator[None]:
    """Inside the block the model's head runs over ``chunks`` chunks (``None``, or no
    ``site``: as it is). :func:`install_head` and :func:`remove_head` do the same for as
    long as a plan is on."""
    if site is None or chunks is None:
        yield
        return
    install_head(model, site, chunks)
    try:
        yield
    finally:
        remove_head(model, site)


def install_head(model: nn.Module, site: HeadSite, chunks: int | None, *,
                 planned: bool = False) -> None:
    """The head of ``model`` at ``site`` runs over ``chunks`` chunks from now on: the
    logits deferred (:mod:`remat.execute.lazy_logits`) or, for :func:`head_loss`, its
    chunk count set; the model's forward is not touched. ``planned``: for as long as a
    plan is on (a step that computes the whole logits after all is then warned of)."""
    if chunks is None:
        return
    head = model.get_submodule(site.name)
    if site.kind == "causal-lm":
        deferred_head(head, chunks, planned=planned)
    else:
        setattr(head, _CHUNKS_ATTR, chunks)
    tie(model, head)


def remove_head(model: nn.Module, site: HeadSite) -> None:
    """Undo :func:`install_head` (a no-op where nothing was installed)."""
    head = model.get_submodule(site.name)
    remove_deferred_head(head)
    head.__dict__.pop(_CHUNKS_ATTR, None)
    untie(model, head)
