"""The output head's chunked variants: which head to measure, over which chunk counts,
and what each variant changes in the profile.

With every block checkpointed a language model's step peaks in its head and loss (the
logits, their float32 copy and their gradient). remat can compute both over chunks of
the tokens (:mod:`remat.execute.head`); whether it is worth it is the solver's decision
(:mod:`remat.solver.heads`), made on what each chunk count measured. A variant changes
only the code outside the units, so measuring one is two stub steps' worth of the
outside code (:mod:`.outside_time`, :mod:`.instrument`), never the units.

Which head: with ``head="auto"`` (the default), a head is measured where remat
recognises one (:func:`remat.execute.head.find_head`) and the loop does not keep the
model's output (``Loop(keep_output=False)``): a chunked head returns no logits, so a
loop that reads them cannot use it. ``head="chunked"`` is the user's allowance (the
loop does not read the logits, whatever it keeps), and an error where no head is
recognised; ``head="none"`` never measures one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from torch import nn

from remat.core.errors import ProfileError
from remat.core.loop import Loop
from remat.core.profile import HeadProfile, HeadVariant, Profile
from remat.execute.head import (
    LOOKED_FOR,
    HeadSite,
    chunked_head,
    find_head,
    most_chunks,
    watching_head_loss,
)
from remat.execute.structure import unit_signature

__all__ = ["frugal_forwards", "head_profile", "head_to_measure", "may_measure_head"]

def may_measure_head(setting: str, loop: Loop) -> bool:
    """Whether ``setting`` lets a head be measured in ``loop`` (see the module docstring);
    then the profiler's forward passes run it over the most chunks, holding no more than
    the most frugal plan."""
    return setting == "chunked" or (setting == "auto" and not loop.keep_output)


def head_to_measure(setting: str, loop: Loop, model: nn.Module, batch: Any,
                    through_head_loss: dict[int, int]) -> HeadSite | None:
    """The head whose chunked variants to measure under ``setting`` (see the module
    docstring), or ``None``.

    Raises:
        ProfileError: ``head="chunked"`` and no head is recognised (the message says
            what was looked for and how to name the head).
    """
    if not may_measure_head(setting, loop):
        return None
    found = find_head(model, batch, through_head_loss)
    if isinstance(found, HeadSite):
        return found
    if setting == "chunked":
        raise ProfileError(
            f"head='chunked': remat cannot chunk the head of {type(model).__name__}: {found}. "
            f"It looks for {LOOKED_FOR}; pass head='none' (or 'auto') to plan without it")
    return None


@contextlib.contextmanager
def frugal_forwards(setting: str, loop: Loop, model: nn.Module,
                    batch: Any) -> Iterator[dict[int, int]]:
    """The profiler's forward passes (what modules save, the replays) inside the block:
    where a head may be measured, its loss over the most chunks, so they hold no more
    than the most frugal plan (the head as it is may not fit the device planned for).
    Yields the heads that went through :func:`remat.head_loss` (see
    :func:`remat.execute.head.watching_head_loss`)."""
    frugal = may_measure_head(setting, loop)
    with contextlib.ExitStack() as stack:
        seen = stack.enter_context(watching_head_loss(frugal=frugal))
        found = find_head(model, batch, {}) if frugal else None
        if isinstance(found, HeadSite):  # a causal LM, known before any forward
            stack.enter_context(chunked_head(model, found, most_chunks(found.tokens)))
        yield seen


def head_variant(base: Profile, variant: Profile, chunks: int) -> HeadVariant:
    """What the profile ``variant`` (measured with the head over ``chunks`` chunks)
    changes in ``base``; its step no faster than ``base``'s (chunking recomputes)."""
    return HeadVariant(
        chunks=chunks,
        prefix=variant.prefix,
        suffix=variant.suffix,
        loss_bytes=variant.loss_bytes,
        output_bytes=variant.output_bytes,
        carried_bytes=variant.carried_bytes,
        grad_in_flight_bytes=variant.grad_in_flight_bytes,
        last_output_kept=variant.last_output_kept,
        last_output_held_outside=variant.units[-1].output_held_outside,
        step_ms=max(variant.step_ms, base.step_ms),
    )


def head_profile(base: Profile, site: HeadSite, head: nn.Module,
                 variants: dict[int, Profile], *, as_is: bool) -> Profile:
    """``base`` with the head at ``site`` and its measured ``variants`` (chunk count ->
    the profile measured with it); ``as_is``: ``base`` is the head as it is (else it is
    the variant of the fewest chunks, and every plan must chunk the head)."""
    measured = tuple(head_variant(base, variants[c], c) for c in sorted(variants))
    if not measured:
        return base
    return replace(base, head=HeadProfile(site.name, site.kind, unit_signature(head),
                                          measured, as_is=as_is))
