"""Pass 4 of :mod:`.profile` (head variants).

The output head's chunked variants: which head to measure, over which chunk counts,
and what each variant changes in the profile.

With every block checkpointed a language model's step peaks in its head and loss (the
logits, their float32 copy and their gradient). remat can compute both over chunks of
the tokens (:mod:`remat.execute.head`); whether it is worth it is the solver's decision
(:mod:`remat.solver.head_choice`), made on what each chunk count measured. A variant changes
only the code outside the units, so measuring one is two stub steps' worth of the
outside code (:mod:`.outside_time`, :mod:`.instrument`), never the units.

Which head: with ``head="auto"`` (the default), a head is measured where remat
recognises one (:func:`remat.execute.head.find_head`), its rewrite passes the check on
one example (:mod:`.head_check`: same loss and gradients, the loss computed through the
chunks), and the loop does not keep the model's output (``Loop(keep_output=False)``): a
loop that keeps it may read the logits after backward, which a chunked head computes
then, outside the plan. ``head="chunked"`` is the user's allowance (the loop does not
read the logits, whatever it keeps), and an error where no head is recognised or the
check fails; ``head="none"`` never measures one. Which variant a plan takes is the
solver's (exact first: :mod:`remat.solver.head_choice`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace

import torch
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
from remat.execute.sharding import refusal_on_every_rank
from remat.execute.structure import unit_signature
from remat.measurement.runner import StepRunner
from remat.measurement.state import ModelState
from remat.profiler.head_check import HeadCheck, check_head_rewrite
from remat.profiler.records import HeadFinding

__all__ = ["checked_head", "frugal_forwards", "head_failed_pass", "head_profile",
           "head_to_measure", "may_measure_head", "model_head"]

log = logging.getLogger("remat")

# Why a head is not offered chunked where its check ran out of memory (profile.py reads it:
# the passes after it compute the head as written, which a chunked plan may not need).
CHECK_DID_NOT_FIT = ("its check on one example (the step as written, unplanned) does not fit "
                     "the device")


def may_measure_head(setting: str, loop: Loop) -> bool:
    """Whether ``setting`` lets a head be measured in ``loop`` (see the module docstring)."""
    return setting == "chunked" or (setting == "auto" and not loop.keep_output)


def _checked(setting: str, runner: StepRunner, site: HeadSite,
             state: ModelState) -> HeadFinding:
    """``site`` where the rewrite passes :func:`check_head_rewrite`, else why not (an
    error where the user asked for the chunked head)."""
    try:
        check = check_head_rewrite(runner, site, state)
    except torch.OutOfMemoryError as err:
        # The check runs one example's step as written, unplanned: on a device sized for
        # the most frugal plan that can be too much. Not a reason to stop profiling (a
        # plan with the head as written may fit): the head is not offered chunked.
        # Known limit: a budget only a chunked head reaches is then infeasible here.
        check = HeadCheck(f"{CHECK_DID_NOT_FIT} ({' '.join(str(err).split())[:160]})")
    agreed = refusal_on_every_rank(runner.model, check.refusal)
    if agreed != check.refusal:
        check = replace(check, refusal=agreed)
    if check.refusal is None:
        log.info("remat: the head %r chunked gives the same loss and gradients on one example "
                 "(loss %.6g as written, %.6g chunked; gradients within %.2g)", site.name,
                 check.loss_as_written, check.loss_rewritten, check.max_grad_difference)
        return HeadFinding(site)
    model = type(runner.model).__name__
    if setting == "chunked":
        raise ProfileError(
            f"head='chunked': remat does not chunk the head {site.name!r} of {model}: "
            f"{check.refusal}; pass head='auto' (it then plans the head as written) or 'none'")
    log.info("remat: the head %r of %s is not chunked: %s", site.name, model, check.refusal)
    return HeadFinding(None, check.refusal)


def model_head(setting: str, loop: Loop, runner: StepRunner, state: ModelState, *,
               check: bool = True) -> HeadFinding:
    """A model's own head (a cross entropy on its output head's logits), found and checked
    before any profiling forward, so those can compute it chunked (:func:`frugal_forwards`);
    empty where ``setting`` and ``loop`` measure no head or the model has none.

    ``check=False`` (a budget's profile with ``head="auto"``): found, not checked; the
    check (two forward and backward passes on one example: a whole step where the batch
    is one example) runs only where the budget needs the chunked head
    (:func:`checked_head`). The profiling forwards compute it chunked meanwhile: they
    save nothing and read no loss, so the rewrite there changes only what they hold; one
    that fails with it is told apart by the check (:func:`head_failed_pass`)."""
    if not may_measure_head(setting, loop):
        return HeadFinding()
    found = find_head(runner.model, runner.batch, {})
    if not isinstance(found, HeadSite):
        return HeadFinding(None, found)
    if not check:
        return HeadFinding(found, checked=False)
    return _checked(setting, runner, found, state)


def checked_head(setting: str, runner: StepRunner, state: ModelState,
                 found: HeadFinding) -> HeadFinding:
    """``found``, its rewrite checked now where it was not yet (:func:`model_head`)."""
    if found.checked or found.site is None:
        return found
    return _checked(setting, runner, found.site, state)


def head_failed_pass(setting: str, runner: StepRunner, state: ModelState,
                     found: HeadFinding) -> HeadFinding | None:
    """After a profiling forward raised with ``found``'s head chunked and unchecked: the
    head checked, where its rewrite is what failed (the finding to run the passes again
    with, the head as written); ``None`` where the rewrite passes its check (the error is
    the model's own)."""
    if found.checked or found.site is None:
        return None
    checked = _checked(setting, runner, found.site, state)
    return checked if checked.site is None else None


def head_to_measure(setting: str, loop: Loop, runner: StepRunner, state: ModelState,
                    through_head_loss: dict[int, int], found: HeadFinding, *,
                    check: bool = True) -> HeadFinding:
    """The head whose chunked variants to measure under ``setting`` (see the module
    docstring): a head that went through :func:`remat.head_loss` (checked here, or with
    ``check=False`` where a budget needs it: :func:`checked_head`), else ``found``
    (:func:`model_head`).

    Raises:
        ProfileError: ``head="chunked"`` and no head is recognised, or its rewrite fails
            the check (the message says what was looked for, or why).
    """
    if not may_measure_head(setting, loop):
        return found
    own = find_head(runner.model, runner.batch, through_head_loss)
    if isinstance(own, HeadSite) and own.kind == "head_loss":
        found = (_checked(setting, runner, own, state) if check
                 else HeadFinding(own, checked=False))
    if found.site is None and setting == "chunked":
        raise ProfileError(
            f"head='chunked': remat cannot chunk the head of {type(runner.model).__name__}: "
            f"{found.refusal}. It looks for {LOOKED_FOR}; pass head='none' (or 'auto') to plan "
            "without it")
    return found


@contextlib.contextmanager
def frugal_forwards(setting: str, loop: Loop, model: nn.Module,
                    found: HeadFinding) -> Iterator[dict[int, int]]:
    """The profiler's forward passes (what modules save, the replays) inside the block:
    where a head may be measured, its loss over the most chunks, so they hold no more
    than the most frugal plan (the head as it is may not fit the device planned for):
    the model's own head where it passed its check (``found``), and any
    :func:`remat.head_loss` head. Yields the heads that went through
    :func:`remat.head_loss` (see :func:`remat.execute.head.watching_head_loss`)."""
    frugal = may_measure_head(setting, loop)
    with contextlib.ExitStack() as stack:
        seen = stack.enter_context(watching_head_loss(frugal=frugal))
        if frugal and found.site is not None:
            stack.enter_context(chunked_head(model, found.site, most_chunks(found.site.tokens)))
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
