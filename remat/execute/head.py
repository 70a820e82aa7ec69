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
* Hugging Face causal language models (:func:`causal_lm_refusal`): an ``lm_head`` and the
  model's own shifted cross entropy (``ForCausalLMLoss``: ignore index -100, the mean
  over the tokens that count, or the sum over ``num_items_in_batch``), recognised without
  help; under a chunked head the model's forward runs its base model and this loss,
  and returns the loss with **no logits** (``logits=None``).

The profiler measures each chunk count as a variant of the code outside the units, the
solver chooses one only when the budget needs it, and the runtime installs it; the
profiler and the runtime both use what is here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.execute.linear_cross_entropy import linear_cross_entropy
from remat.execute.tied_embedding import claim, tie, untie

__all__ = [
    "IGNORE_INDEX",
    "HeadSite",
    "LOOKED_FOR",
    "CHUNK_COUNTS",
    "causal_lm_refusal",
    "chunk_counts",
    "find_head",
    "chunked_cross_entropy",
    "chunked_head",
    "head_loss",
    "install_head",
    "most_chunks",
    "remove_head",
    "watching_head_loss",
]

IGNORE_INDEX = -100
_CHUNKS_ATTR = "_remat_head_chunks"  # on a head module: the chunk count a plan chose


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Linear,
    target: torch.Tensor,
    *,
    chunks: int,
    ignore_index: int = IGNORE_INDEX,
    divide_by: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``cross_entropy(head(hidden).float(), target)`` over ``chunks`` slices of the tokens.

    ``hidden`` is ``(..., features)``, ``target`` the matching ``(...)`` class indices. The
    sum over the tokens that count is divided by ``divide_by`` (default: their number, the
    mean ``cross_entropy`` takes). The slices' gradients are computed with their logits
    (:mod:`remat.execute.linear_cross_entropy`); the values are the plain computation's
    up to the order of a float32 sum.
    """
    tied_to = None
    if torch.is_grad_enabled() and head.weight.requires_grad:
        tied_to = claim(head, hidden)
    return linear_cross_entropy(hidden, head.weight, head.bias, target, chunks=chunks,
                                ignore_index=ignore_index, divide_by=divide_by,
                                tied_to=tied_to)


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
# Hugging Face causal language models
# ---------------------------------------------------------------------------------
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True)
class HeadSite:
    """Where a model's head is and how its loss is computed.

    Attributes:
        name: the head module's qualified name (``"lm_head"``).
        kind: ``"causal-lm"`` (a Hugging Face causal LM; the model's forward is replaced
            under a chunked head) or ``"head_loss"`` (a model that calls :func:`head_loss`).
        tokens: how many tokens the loss is over in the batch it was found on.
    """

    name: str
    kind: str
    tokens: int = 0


# What find_head() looks for, for the error when it finds nothing.
LOOKED_FOR = (
    "a Hugging Face causal LM (an nn.Linear `lm_head` after its `base_model`, `labels` in the "
    "batch, the model's own ForCausalLMLoss, no logit soft-capping or scaling), or a model "
    "whose forward computes its loss as `remat.head_loss(self.<head>, hidden, target)`"
)


def _for_causal_lm_loss() -> Any:
    utils = sys.modules.get("transformers.loss.loss_utils")
    return getattr(utils, "ForCausalLMLoss", None)


def causal_lm_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a Hugging Face causal LM whose head remat can chunk, or
    ``None`` when it is: an ``nn.Linear`` ``lm_head``, a ``base_model``, the model's own
    ``ForCausalLMLoss``, and no change to the logits before the loss (soft-capping, a
    scale)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return "it has no nn.Linear `lm_head`"
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        return "it has no `base_model` to run before its `lm_head`"
    loss = _for_causal_lm_loss()
    if loss is None or getattr(model, "loss_function", None) is not loss:
        return "its loss_function is not transformers' ForCausalLMLoss"
    config = getattr(model, "config", None)
    for name in _LOGIT_CHANGES:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"its config's {name}={value!r} changes the logits before the loss"
    return None


def find_head(model: nn.Module, batch: Any, through_head_loss: dict[int, int]) -> HeadSite | str:
    """The head of ``model`` trained on ``batch`` that remat can chunk, or why there is none.

    ``through_head_loss``: the heads that went through :func:`head_loss` in a forward on
    ``batch`` (:func:`watching_head_loss`); one of them is the head, else a Hugging Face
    causal LM's ``lm_head`` with ``labels`` in the batch.
    """
    for name, module in model.named_modules():
        if id(module) in through_head_loss and isinstance(module, nn.Linear):
            return HeadSite(name, "head_loss", through_head_loss[id(module)])
    refusal = causal_lm_refusal(model)
    if refusal is not None:
        return refusal
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        return "the batch has no `labels` tensor (the model computes no loss of its own)"
    return HeadSite("lm_head", "causal-lm", labels.numel())


class _ChunkedCausalLMForward:
    """A causal LM's ``forward`` under a chunked head: its base model, then the model's
    own loss over chunks; no logits. A plain class, so planned models pickle."""

    def __init__(self, model: nn.Module, chunks: int) -> None:
        self.model = model
        self.chunks = chunks

    def __call__(self, input_ids: Any = None, labels: Any = None, *args: Any,
                 **kwargs: Any) -> Any:
        model = self.model
        if labels is None or not torch.is_grad_enabled() or args:
            return type(model).forward(model, input_ids, *args, labels=labels, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        shift = kwargs.pop("shift_labels", None)
        outputs = model.base_model(input_ids=input_ids, **kwargs)
        hidden = outputs[0]
        if shift is None:
            shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        loss = chunked_cross_entropy(hidden, model.lm_head, shift, chunks=self.chunks,
                                     divide_by=num_items)
        return _causal_lm_output(loss, outputs)

    @property
    def __signature__(self) -> inspect.Signature:
        # Hugging Face's Trainer reads the forward's signature to pick the batch's columns.
        return inspect.signature(type(self.model).forward.__get__(self.model))


def _causal_lm_output(loss: torch.Tensor, outputs: Any) -> Any:
    module = sys.modules.get("transformers.modeling_outputs")
    output = module.CausalLMOutputWithPast  # type: ignore[union-attr]
    get = functools.partial(getattr, outputs)
    return output(loss=loss, logits=None, past_key_values=get("past_key_values", None),
                  hidden_states=get("hidden_states", None), attentions=get("attentions", None))


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


def install_head(model: nn.Module, site: HeadSite, chunks: int | None) -> None:
    """The head of ``model`` at ``site`` runs over ``chunks`` chunks from now on."""
    if chunks is None:
        return
    head = model.get_submodule(site.name)
    if site.kind == "causal-lm":
        model.forward = _ChunkedCausalLMForward(model, chunks)
    else:
        setattr(head, _CHUNKS_ATTR, chunks)
    tie(model, head)


def remove_head(model: nn.Module, site: HeadSite) -> None:
    """Undo :func:`install_head` (a no-op where nothing was installed)."""
    head = model.get_submodule(site.name)
    if site.kind == "causal-lm":
        if isinstance(model.__dict__.get("forward"), _ChunkedCausalLMForward):
            del model.__dict__["forward"]
    else:
        head.__dict__.pop(_CHUNKS_ATTR, None)
    untie(model, head)
