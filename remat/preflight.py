"""``remat.estimate`` (this module: ``remat.preflight``): will the training step fit, before
training starts?

One profile of the step answers it: what the parameters, buffers, gradients and
optimizer state take, what the activations take, the peak without checkpointing and
the smallest peak any plan reaches, and where each peak sits (the event, and what
the bytes there are made of). With a budget it also says whether it fits as is,
fits with checkpointing (and at what slowdown), or cannot fit (and by how much).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from remat.core.bytesize import format_bytes
from remat.core.checks import check_budget_arg, check_head_setting, check_inputs
from remat.core.errors import InfeasibleBudgetError
from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.core.settings import ProfilingSettings
from remat.solver.head_choice import min_peak_bytes_over_heads
from remat.solver.simulate import Simulation, simulate
from remat.tune.remedies import Remedy, checkpointing_only, floor_cause, remedies

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

__all__ = ["Estimate", "Peak", "estimate"]

_MIB = 2**20


@dataclass(frozen=True)
class Peak:
    """One predicted peak: its bytes, step time, where it sits and what it is made of."""

    bytes: int
    time_ms: float
    event: str
    parts: Mapping[str, int] = field(default_factory=dict)
    plan: str = ""

    @classmethod
    def of(cls, sim: Simulation, plan: Plan) -> Peak:
        return cls(sim.peak_bytes, sim.time_ms, sim.peak_event, dict(sim.peak_parts),
                   plan.summary())

    def where(self) -> str:
        """``"at 'backward h.3': activations 80.00 MiB, parameters 12.00 MiB, ..."``."""
        shown = sorted(((b, n) for n, b in self.parts.items() if b > 0), reverse=True)
        return f"at {self.event!r}: " + ", ".join(f"{n} {format_bytes(b)}" for b, n in shown)


@dataclass(frozen=True)
class Verdict:
    """The answer for one budget: ``fits`` as is, ``fits with checkpointing``, or not."""

    budget_bytes: int
    status: str  # "fits", "fits with checkpointing", "does not fit"
    plan: str = ""
    time_ms: float | None = None
    peak_bytes: int | None = None

    def describe(self, no_checkpoint: Peak, lowest_bytes: int) -> str:
        head = f"budget {format_bytes(self.budget_bytes)}: {self.status}"
        if self.status == "fits":
            return f"{head} without checkpointing"
        if self.status == "does not fit":
            short = lowest_bytes - self.budget_bytes
            return (f"{head}: the smallest peak any plan reaches is {format_bytes(lowest_bytes)}"
                    f", {format_bytes(short)} above it; checkpointing only reduces activations")
        slowdown = 100 * ((self.time_ms or 0) / max(no_checkpoint.time_ms, 1e-9) - 1)
        return (f"{head}: optimal plan {self.plan}, predicted peak "
                f"{format_bytes(self.peak_bytes or 0)}, step {slowdown:+.1f}% time")


@dataclass(frozen=True)
class Estimate:
    """What one training step needs, predicted from a profile (:func:`estimate`).

    Attributes:
        parameters, buffers, gradients, optimizer_state, inputs: bytes of each
            (gradients: every parameter's, as the backward pass leaves them; inputs:
            the batch's tensors on the device).
        persistent: their sum: what no plan removes.
        activations: the activation memory: the no-checkpoint peak above
            ``persistent``, what checkpointing trades (``"50%"`` budgets half of it).
        no_checkpoint: the peak without checkpointing (:class:`Peak`).
        smallest: the smallest peak checkpointing alone reaches (the units' options but
            offload, the head as the model computes it), and that plan.
        floor: what ``smallest`` is made of, in words (:func:`remat.tune.remedies.floor_cause`).
        remedies: for each remedy remat has (a chunked head, gradients released in
            backward, offload), the smallest peak with it, predicted
            (:class:`remat.tune.remedies.Remedy`).
        lowest: the smallest peak remat's plans reach in this loop, every remedy a plan
            can choose included (gradients released is a change of the loop: see
            ``remedies``).
        verdict: the answer for ``memory_budget``, when one was given.
        loop, device: the loop and the device the profile is for.
        buckets: of ``buffers``, the gradient buckets of ``DistributedDataParallel``'s
            Reducer (a model estimated through its DDP wrapper; 0 otherwise).
    """

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    inputs: int
    persistent: int
    activations: int
    no_checkpoint: Peak
    smallest: Peak
    loop: Loop
    device: str
    verdict: Verdict | None = None
    floor: str = ""
    remedies: tuple[Remedy, ...] = ()
    lowest: int | None = None
    buckets: int = 0

    @property
    def lowest_bytes(self) -> int:
        return self.smallest.bytes if self.lowest is None else self.lowest

    def fits(self, budget: int | str) -> bool:
        """Whether some plan's predicted peak fits ``budget`` (bytes or ``"8GB"``; a
        percentage is taken of this estimate's activation memory)."""
        return self.lowest_bytes <= self._bytes(budget)

    def _bytes(self, budget: int | str) -> int:
        checked = check_budget_arg(budget)
        if isinstance(checked, int):
            return checked
        return checked.bytes_for(self.no_checkpoint.bytes, self.persistent)

    def _gradients(self) -> str:
        """What the gradients row means in this loop."""
        if self.loop.optimizer_in_backward:
            return "each freed in backward once stepped: not persistent in this loop"
        return "every parameter's, by the end of backward"

    @staticmethod
    def _predicted() -> str:
        """remat's profiler never runs the unplanned step (it may not fit): its peak is
        ``simulate()``'s prediction, and the estimate says so."""
        return "predicted, not run: "

    def to_frame(self) -> pd.DataFrame:
        """One row per figure: ``item``, ``bytes``, ``MiB``, ``note``."""
        import pandas as pd

        rows = [
            ("parameters", self.parameters, ""),
            ("buffers", self.buffers, ""),
            ("gradients", self.gradients, self._gradients()),
            ("optimizer state", self.optimizer_state,
             "" if self.optimizer_state else "no optimizer given"),
            ("inputs", self.inputs, "the batch on the device"),
            ("persistent", self.persistent, "what no plan removes"),
            ("activations", self.activations, "no-checkpoint peak above persistent: what "
             "checkpointing trades ('100%')"),
            ("no-checkpoint peak", self.no_checkpoint.bytes,
             f"{self._predicted()}{self.no_checkpoint.where()}"),
            ("smallest peak", self.smallest.bytes,
             f"checkpointing alone, {self.smallest.where()}; plan {self.smallest.plan}; "
             f"set by {self.floor}"),
        ]
        rows += [(f"with {r.name}", r.peak_bytes, r.note) for r in self.remedies
                 if r.peak_bytes is not None]
        rows.append(("lowest peak", self.lowest_bytes,
                     "plans in this loop, every remedy a plan can choose included"))
        if self.verdict is not None:
            rows.append(("budget", self.verdict.budget_bytes, self.verdict.status))
        return pd.DataFrame(
            [{"item": item, "bytes": b, "MiB": round(b / _MIB, 2), "note": note}
             for item, b, note in rows]
        )

    def __str__(self) -> str:
        width = 20

        def line(label: str, nbytes: int, note: str = "") -> str:
            return f"  {label:<{width}} {format_bytes(nbytes):>12}" + (f"   {note}" if note else "")

        slowdown = 100 * (self.smallest.time_ms / max(self.no_checkpoint.time_ms, 1e-9) - 1)
        lines = [
            f"remat estimate ({self.device}; loop: {self.loop.describe()})",
            line("parameters", self.parameters),
            line("buffers", self.buffers,
                 f"(DDP's gradient buckets {format_bytes(self.buckets)} included)"
                 if self.buckets else ""),
            line("gradients", self.gradients,
                 "(freed in backward, each once stepped)" if self.loop.optimizer_in_backward
                 else ""),
            line("optimizer state", self.optimizer_state,
                 "" if self.optimizer_state else "(no optimizer given)"),
            line("inputs", self.inputs, "(the batch on the device)"),
            line("activations", self.activations,
                 "(no-checkpoint peak above the four above)" if self.loop.optimizer_in_backward
                 else "(no-checkpoint peak above the five above)"),
            line("no-checkpoint peak", self.no_checkpoint.bytes,
                 f"{self._predicted()}{self.no_checkpoint.where()}"),
            line("smallest peak", self.smallest.bytes,
                 f"checkpointing alone, {self.smallest.where()} (plan: {self.smallest.plan}; "
                 f"step {slowdown:+.1f}% time)"),
        ]
        if self.floor:
            lines.append(f"  set by {self.floor}")
        if self.remedies:
            lines.append("  below it (predicted):")
            lines += [f"    {r.describe(self.smallest.bytes)}" for r in self.remedies]
        if self.verdict is not None:
            lines.append(self.verdict.describe(self.no_checkpoint, self.lowest_bytes))
        return "\n".join(lines)


def estimate(
    model_or_profile: nn.Module | Profile,
    sample_batch: Any = None,
    *,
    optimizer: Any = None,
    loop: Loop | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    units: Any = None,
    options: Sequence[str] | None = None,
    memory_budget: int | str | None = None,
    head: str = "auto",
) -> Estimate:
    """Predict what one training step of ``loop`` needs, before training.

    Args:
        model_or_profile: the model (profiled once, timings taken once: a few steps'
            time) or a :class:`Profile` measured before.
        sample_batch: one micro-batch, as for :func:`remat.profile`.
        optimizer: count its state and its step (pass the optimizer you will train with).
        loop: the training loop (:class:`remat.Loop`); default a plain loop, or inside a
            ``torch.autocast`` ``Loop(autocast=<its dtype>)`` (:mod:`remat.tune.ambient`).
        loss_fn, units, options: as for :func:`remat.profile`.
        memory_budget: also answer whether this budget fits (bytes, ``"8GB"``, ``"60%"``).
        head: measure a chunked head (``"auto"``, ``"chunked"``, ``"none"``), as for
            :func:`remat.solve` (a :class:`Profile` given is read as ``head`` asks).

    A profile of the model from an earlier call is reused where nothing in
    :mod:`remat.tune.profile_cache`'s key changed; the estimate runs no step, so a change the
    key cannot see (a global the loss reads) needs ``forget_profiles()`` first.

    Returns:
        An :class:`Estimate`: ``print(est)`` reads it out, ``est.to_frame()`` tabulates it.
    """
    check_inputs("estimate()", model_or_profile, sample_batch, loss_fn=loss_fn,
                  optimizer=optimizer, loop=loop)
    check_budget_arg(memory_budget)
    check_head_setting(head, "estimate()")
    if isinstance(model_or_profile, Profile):
        from remat.api import profile_for_head

        prof = profile_for_head(model_or_profile, head, "estimate()")
    else:
        from remat.api import profile_with

        # Inside a torch.autocast, the estimate is for that loop (remat.tune.ambient).
        settings = ProfilingSettings(loss_fn=loss_fn, optimizer=optimizer, units=units,
                                     options=options, loop=loop, head=head)
        prof = profile_with(model_or_profile, sample_batch, settings, "estimate()")
    return estimate_profile(prof, memory_budget)


def estimate_profile(profile: Profile, memory_budget: int | str | None = None) -> Estimate:
    """:func:`estimate` of a profile (no torch needed)."""
    from remat.solver.min_peak import min_peak_plan
    from remat.solver.resolve import no_checkpoint

    alone = checkpointing_only(profile)
    smallest_plan = min_peak_plan(alone)
    no_ckpt = Peak.of(no_checkpoint(profile), Plan.keep_all([u.name for u in profile.units]))
    smallest_sim = simulate(alone, smallest_plan)
    smallest = Peak.of(smallest_sim, smallest_plan)
    persistent = profile.persistent_bytes
    verdict = None
    if memory_budget is not None:
        verdict = _verdict(profile, memory_budget, no_ckpt)
    return Estimate(
        parameters=profile.param_bytes,
        buffers=profile.buffer_bytes,
        gradients=profile.grad_bytes,
        optimizer_state=profile.optimizer_state_bytes,
        inputs=profile.batch_bytes,
        persistent=persistent,
        activations=max(no_ckpt.bytes - persistent, 0),
        no_checkpoint=no_ckpt,
        smallest=smallest,
        loop=profile.loop,
        device=profile.device,
        verdict=verdict,
        floor=floor_cause(smallest_sim),
        remedies=remedies(profile),
        lowest=min_peak_bytes_over_heads(profile),
        buckets=int(profile.meta.get("ddp_bucket_bytes", 0)),  # tune.replicated.DDP_BUCKET_BYTES
    )


def _verdict(profile: Profile, memory_budget: int | str, no_ckpt: Peak) -> Verdict:
    from remat.solver.resolve import resolve_budget
    from remat.solver.solve import solve_profile

    budget = resolve_budget(memory_budget, profile)
    if no_ckpt.bytes <= budget:
        return Verdict(budget, "fits", no_ckpt.plan, no_ckpt.time_ms, no_ckpt.bytes)
    try:
        plan = solve_profile(profile, budget)
    except InfeasibleBudgetError:
        return Verdict(budget, "does not fit")
    return Verdict(budget, "fits with checkpointing", plan.summary(),
                   plan.record.predicted_time_ms, plan.record.predicted_peak_bytes)
