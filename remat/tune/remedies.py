"""What sets the smallest peak, and what lowers it below what checkpointing reaches.

Checkpointing only trades activations. Once every block is checkpointed, the peak sits
elsewhere: in the head and its loss (the logits, their float32 copy and their
gradient), in the gradients and the optimizer state, in the recomputation of the
largest block, or in the batch. :func:`floor_cause` says which, from where the smallest
plan peaks and what the bytes there are; :func:`remedies` predicts, for each remedy
remat has, the smallest peak with it:

* **chunked head**: the head and its loss over chunks of the tokens
  (:mod:`remat.solver.head_choice`), where the profile measured it;
* **gradients released**: the optimizer stepped in backward, each parameter as its
  gradient is complete, the gradient freed then (``Loop(optimizer_in_backward=True)``,
  ``remat.optimizer_in_backward``). A change of the loop, not a plan decision: its
  figure is the profile's own step re-simulated under that loop, from the figures every
  profile with a splittable optimizer carries (each phase's backward peak with its
  gradients freed and its parameters' own steps metered: ``stepped_bwd_peak_bytes``), so
  it is predicted like any plan, not measured under the loop;
* **chunked head + gradients released**: both, where both are available;
* **offload**: keeping units' saved activations in host memory (CUDA only).

The estimate (:mod:`remat.preflight`) prints both. Torch-free: profiles in, words and
bytes out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from remat.core.bytesize import format_bytes
from remat.core.errors import LoopError
from remat.core.loop import Loop, loop_code
from remat.core.option import Option
from remat.core.profile import STEPS_IN_BACKWARD, Profile
from remat.solver.head_choice import lowest_floor
from remat.solver.min_peak import min_peak_bytes
from remat.solver.simulate import Simulation

__all__ = ["Remedy", "checkpointing_only", "floor_cause", "remedies"]


@dataclass(frozen=True)
class Remedy:
    """One way below the floor of checkpointing, predicted.

    Attributes:
        name: ``"chunked head"``, ``"offload"``...
        peak_bytes: the smallest peak with it (``None``: not available here).
        note: how (``"head lm_head over 16 chunks"``) or why not, and how to get it.
    """

    name: str
    peak_bytes: int | None
    note: str

    def describe(self, floor_bytes: int) -> str:
        if self.peak_bytes is None:
            return f"{self.name}: not available ({self.note})"
        change = 100 * (self.peak_bytes / max(floor_bytes, 1) - 1)
        return (f"{self.name}: smallest peak {format_bytes(self.peak_bytes)} ({change:+.1f}%), "
                f"{self.note}")


def floor_cause(sim: Simulation) -> str:
    """What the smallest plan's peak (``sim``) is made of, in words: the part of the step
    where it sits, and its largest part."""
    event = sim.peak_event
    if event.endswith(" suffix"):
        where = "the head and the loss (the code after the last unit)"
    elif event.endswith(" prefix"):
        where = "the code before the first unit (the embeddings)"
    elif event == "optimizer step":
        where = "the optimizer's step (its state and every gradient)"
    elif event.startswith(("backward ", "recompute ")):
        where = f"the recomputation and backward of one unit ({event.split(' ', 1)[1]})"
    elif event.startswith("forward ") and event != "forward end":
        where = f"the forward of one unit ({event.split(' ', 1)[1]})"
    else:
        where = "what the step holds between its passes"
    parts = sorted(((b, name) for name, b in sim.peak_parts.items() if b > 0), reverse=True)
    if not parts:
        return where
    nbytes, largest = parts[0]
    name = "the batch" if largest == "inputs" else largest
    return f"{where}; its largest part is {name} ({format_bytes(nbytes)})"


def checkpointing_only(profile: Profile) -> Profile:
    """``profile`` without the remedies: the head as the model computes it, and no
    ``offload`` (what checkpointing alone, the units' recomputation, can reach)."""
    return replace(profile, head=None, units=tuple(
        replace(u, options={o: c for o, c in u.options.items() if o != Option.OFFLOAD.value})
        for u in profile.units))


def remedies(profile: Profile) -> tuple[Remedy, ...]:
    """Each remedy remat has, alone on top of checkpointing, with the smallest peak it
    reaches on ``profile``; then the chunked head and gradients released together, where
    both are available (each lowers a different part of the floor)."""
    head, released = _chunked_head(profile), _gradients_released(profile)
    both = ()
    if head.peak_bytes is not None and released.peak_bytes is not None:
        loop = Loop(**{**profile.loop.to_dict(), "optimizer_in_backward": True})
        _, nbytes = lowest_floor(replace(checkpointing_only(profile), head=profile.head,
                                         loop=loop))
        both = (Remedy("chunked head + gradients released", nbytes,
                       "both of the above, with that loop"),)
    return (head, released, *both, _offload(profile))


def _chunked_head(profile: Profile) -> Remedy:
    name = "chunked head"
    if profile.head is None:
        refused = profile.meta.get("head_not_chunked")
        why = (f"not offered: {refused}" if refused else
               "no head remat can chunk was measured: it is measured for a model with an "
               "output head whose own cross entropy on its logits passes remat's check on "
               "one example (Hugging Face causal LMs, MoE, T5, BART, under peft too), or a "
               "model calling remat.head_loss(), in a loop that drops the output "
               "(Loop(keep_output=False)); head='chunked' allows it in any loop that does not "
               "read the logits")
        return Remedy(name, None, why)
    alone = replace(checkpointing_only(profile), head=profile.head)
    chunks, nbytes = lowest_floor(alone)
    if chunks is None:
        counts = list(profile.head.chunk_counts)
        return Remedy(name, nbytes, f"no lower: the head {profile.head.name!r} over {counts} "
                                    "chunks does not set the peak")
    return Remedy(name, nbytes, f"the head {profile.head.name!r} and its loss over {chunks} "
                                "chunks of the tokens (chosen where the budget needs it)")


def _gradients_released(profile: Profile) -> Remedy:
    """The smallest peak of checkpointing alone with the optimizer stepped in backward: the
    profile re-simulated under that loop (see the module docstring)."""
    name = "gradients released"
    loop = profile.loop
    how = ("each parameter stepped as its gradient is complete, the gradient freed then: "
           "remat.optimizer_in_backward(model, optimizer) and "
           f"loop={loop_code(loop, optimizer_in_backward=True)}; no clip_grad_norm_ over all "
           "parameters")
    if loop.optimizer_in_backward:
        return Remedy(name, min_peak_bytes(checkpointing_only(profile)),
                      f"in use: the loop steps the optimizer in backward ({loop_code(loop)})")
    try:
        released = Loop(**{**loop.to_dict(), "optimizer_in_backward": True})
    except LoopError as err:
        return Remedy(name, None, f"not with this loop: {err}")
    measured = profile.meta.get(STEPS_IN_BACKWARD)
    if measured != "measured":
        why = ("profile with optimizer= the optimizer you train with: its per-parameter steps "
               "are metered then" if measured in (None, "no optimizer") else str(measured))
        return Remedy(name, None, why)
    return Remedy(name, min_peak_bytes(replace(checkpointing_only(profile), loop=released)),
                  how)


def _offload(profile: Profile) -> Remedy:
    name = "offload"
    if Option.OFFLOAD.value not in profile.available_options():
        why = ("needs CUDA" if not profile.device.startswith("cuda")
               else "not among the options profiled: pass options=None")
        return Remedy(name, None, why)
    return Remedy(name, min_peak_bytes(replace(profile, head=None)),
                  "units' saved activations kept in host memory")
