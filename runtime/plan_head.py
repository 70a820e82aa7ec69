"""A plan's chunked head on the live model: checked, installed, removed.

A plan that chose to compute the head and its loss over chunks of the tokens
(:class:`~remat.core.plan.ChunkedHead`) was measured on one head: the module, its
parameters and how its loss is computed. Applied to a model whose head or loss
changed, its figures would not hold, so it is refused here like any other mismatched
plan; otherwise :func:`remat.execute.head.install_head` puts the chunked computation
in place for as long as the plan is applied.
"""

from __future__ import annotations

from torch import nn

from remat.core.errors import PlanMismatchError
from remat.core.plan import Plan
from remat.execute.head import HeadSite, head_refusal, install_head, remove_head
from remat.execute.structure import describe_mismatch, unit_signature

__all__ = ["check_head", "install_plan_head", "remove_plan_head"]


def check_head(model: nn.Module, plan: Plan) -> None:
    """Refuse ``plan`` on ``model`` unless its chunked head (if any) is ``model``'s.

    Raises:
        PlanMismatchError: the head module is missing, has other parameters, or its loss
            is not computed the way the plan's head was (the message says how).
    """
    chosen = plan.head
    if chosen is None:
        return
    redo = "; profile and solve again for this model (remat.solve(model, batch, ...))"
    try:
        head = model.get_submodule(chosen.name)
    except AttributeError:
        raise PlanMismatchError(
            f"the plan computes the head {chosen.name!r} over {chosen.chunks} chunks, and "
            f"{type(model).__name__} has no module {chosen.name!r}{redo}") from None
    if not isinstance(head, nn.Linear) or unit_signature(head) != chosen.signature:
        raise PlanMismatchError(
            f"the plan was made for another head: {chosen.name!r} ({type(head).__name__}) "
            f"{describe_mismatch(head, chosen.signature)}{redo}")
    if chosen.kind == "causal-lm":
        refusal = head_refusal(head)
        if refusal is not None:
            raise PlanMismatchError(
                f"the plan computes the head {chosen.name!r} and its loss over {chosen.chunks} "
                f"chunks, and remat cannot defer that head's logits on {type(model).__name__}: "
                f"{refusal}{redo}")
    elif chosen.kind != "head_loss":
        raise PlanMismatchError(
            f"the plan's head kind {chosen.kind!r} is not one this remat knows ('causal-lm', "
            f"'head_loss'){redo}")


def install_plan_head(model: nn.Module, plan: Plan) -> HeadSite | None:
    """Compute ``model``'s head over the plan's chunks from now on (checked first)."""
    if plan.head is None:
        return None
    site = HeadSite(plan.head.name, plan.head.kind)
    install_head(model, site, plan.head.chunks, planned=True)
    return site


def remove_plan_head(model: nn.Module, site: HeadSite | None) -> None:
    """Undo :func:`install_plan_head`."""
    if site is not None:
        remove_head(model, site)
