"""Pass 5 of :mod:`.profile` (assembly).

Turning the profiler's measurements into a :class:`Profile`.

Unit figures come from the isolated replays (:mod:`.replay`, at each unit's call);
everything outside the units, the boundary storages and the outside code's parameter
gradients from the outside step (:mod:`.instrument`); the units' parameter gradients
from the parameters they own and their replays (:mod:`.grads`); times from un-metered
runs.

The unplanned step is never run, so its time is **derived**: one micro-batch is the
outside code's forward and backward (:mod:`.outside_time`: stub steps less their stubs'
own time) plus every unit's keep forward and backward (its replays), and an optimizer
step of the loop is ``accumulation_steps`` micro-batches and the optimizer's step. The
prefix's and suffix's times split the outside code's in the proportions the outside step
showed (code between units, off a chain, counts as prefix). ``simulate()`` uses only
``step_ms`` and the options' ``extra_ms``, so the split is informational, and since
every plan's time is ``step_ms`` plus its options' extra, an error in the derived
``step_ms`` moves every plan alike and never changes which is fastest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from remat.core.option import Option
from remat.core.profile import (
    STEPS_IN_BACKWARD,
    OptionCost,
    OutsideCost,
    Profile,
    SharedTensor,
    UnitProfile,
)
from remat.execute.structure import unit_signature
from remat.profiler.records import (
    Measurements,
    OptionFigures,
    OutsideStep,
    StepPlaces,
    UnitInStep,
    UnitTiming,
)

__all__ = ["build_profile", "input_shapes", "model_dtype"]


def input_shapes(batch: Any) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a batch by argument name (``"arg0"``... for positional ones)."""
    if isinstance(batch, torch.Tensor):
        return {"arg0": tuple(batch.shape)}
    if isinstance(batch, Mapping):
        return {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if isinstance(batch, (tuple, list)):
        return {f"arg{i}": tuple(v.shape) for i, v in enumerate(batch)
                if isinstance(v, torch.Tensor)}
    return {}


def model_dtype(model: nn.Module) -> str:
    """The dtype of the first floating-point parameter (``"float32"``, ``"bfloat16"``...)."""
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def _split(total: float, parts: Mapping[str, float]) -> dict[str, float]:
    """``total`` (clipped at 0) shared in proportion to ``parts`` (equally when all are 0)."""
    total = max(total, 0.0)
    weight = sum(parts.values())
    if weight <= 0:
        return {k: total / len(parts) for k in parts}
    return {k: total * v / weight for k, v in parts.items()}


def _dedupe_shared_boundaries(
    units: tuple[UnitInStep, ...], holds_input: list[bool], is_chain: bool
) -> tuple[UnitInStep, ...]:
    """Off a chain, a unit's input can be the previous unit's output storage (a view ran
    between them): count it once, as that output, held from outside while the next unit
    (or outside code) holds it."""
    if is_chain:
        return units
    out = list(units)
    for i in range(1, len(out)):
        if out[i].input_is_prev_output:
            held = out[i - 1].output_held_outside or holds_input[i] or out[i].input_held_outside
            out[i - 1] = replace(out[i - 1], output_held_outside=held)
            out[i] = replace(out[i], input_bytes=0)
    return tuple(out)


def _extra_ms(option: str, timing: UnitTiming, keep_ms: float) -> float:
    """Time an option adds to a step over keep, in milliseconds.

    ``checkpoint`` recomputes the unit's forward once: its keep forward time. The
    other options are timed (forward + backward) and compared with keep.
    """
    if option == Option.KEEP:
        return 0.0
    if option == Option.CHECKPOINT.value and option not in timing.total_ms:
        return timing.fwd_ms[Option.KEEP]
    return max(timing.total_ms[option] - keep_ms, 0.0)


def _unit_profile(
    name: str,
    module: nn.Module,
    in_step: UnitInStep,
    figures: dict[str, OptionFigures],
    timing: UnitTiming,
    param_grad_bytes: int,
    stepped: Mapping[str, int | None],
) -> UnitProfile:
    keep_ms = timing.total_ms[Option.KEEP]
    costs = {
        o: OptionCost(
            held_bytes=f.held_bytes,
            holds_input=f.holds_input,
            holds_output=f.holds_output,
            fwd_peak_bytes=f.fwd_peak_bytes,
            bwd_peak_bytes=f.bwd_peak_bytes,
            extra_ms=_extra_ms(o, timing, keep_ms),
            stepped_bwd_peak_bytes=stepped.get(o),
        )
        for o, f in figures.items()
    }
    return UnitProfile(
        name=name,
        type_name=type(module).__name__,
        fwd_ms=timing.fwd_ms[Option.KEEP],
        bwd_ms=timing.bwd_ms[Option.KEEP],
        input_bytes=in_step.input_bytes,
        output_bytes=in_step.output_bytes,
        input_grad_bytes=figures[Option.KEEP].input_grad_bytes,
        param_grad_bytes=param_grad_bytes,
        options=costs,
        input_held_outside=in_step.input_held_outside,
        output_held_outside=in_step.output_held_outside,
        autocast_cache_bytes=max(f.forward_cache_bytes for f in figures.values()),
        param_signature=unit_signature(module),
        input_grad_kept_until=in_step.input_grad_kept_until,
        before_held_bytes=in_step.before_held_bytes,
        before_fwd_peak_bytes=in_step.before_fwd_peak_bytes,
        before_bwd_peak_bytes=in_step.before_bwd_peak_bytes,
    )


def _suffix_fwd_peak(m: Measurements) -> int:
    """The suffix's forward peak: with the units' inputs that died in it held (their own
    options save them, ``keep`` included), or as measured (see ``OutsideStep``)."""
    base = m.base
    if base.units_inputs_dying and all(m.figures[m.units[i][0]][Option.KEEP].holds_input
                                       for i in base.units_inputs_dying):
        return base.suffix_fwd_peak_inputs_held
    return max(base.suffix.fwd_peak_bytes, 0)


def build_profile(
    m: Measurements,
    *,
    device: torch.device,
    dtype: str,
    shapes: Mapping[str, tuple[int, ...]],
    meta: Mapping[str, Any],
) -> Profile:
    """The :class:`Profile` of measurements ``m`` (see the module docstring for times)."""
    base = m.base
    steps = _step_places(m)
    units = _unit_profiles(m, steps)
    prefix, suffix = _outside_costs(m, steps)
    return Profile(
        units=tuple(units),
        is_chain=m.chain.is_chain,
        prefix=prefix,
        suffix=suffix,
        param_bytes=m.param_bytes,
        buffer_bytes=m.buffer_bytes,
        optimizer_state_bytes=m.outside.optimizer_state_bytes,
        loss_bytes=base.loss_bytes,
        optimizer_step_peak_bytes=m.outside.optimizer_step_peak_bytes,
        batch_bytes=m.batch_bytes,
        recompute_rng_bytes=m.recompute_rng_bytes,
        step_ms=_step_ms(m, units),
        device=str(device),
        dtype=dtype,
        input_shapes=dict(shapes),
        loop=m.loop,
        output_bytes=base.output_bytes,
        last_output_kept=base.last_output_kept,
        grad_in_flight_bytes=m.grads.in_flight_bytes,
        unreduced_grad_bytes=m.base.unreduced_grad_bytes,
        carried_bytes=(base.loss_storage_bytes + base.output_bytes
                       + (units[-1].output_bytes if base.last_output_kept else 0)),
        shared=_shared_tensors(base),
        meta=_meta(m, meta),
    )


def _step_places(m: Measurements) -> StepPlaces:
    """Each phase's backward peak when stepping in backward; where those were not placed,
    each phase's plain peak stands for it."""
    return m.steps or StepPlaces(tuple({} for _ in m.units), m.base.suffix.bwd_peak_bytes,
                                 m.base.prefix.bwd_peak_bytes)


def _unit_profiles(m: Measurements, steps: StepPlaces) -> list[UnitProfile]:
    """The units in execution order: their replays' figures on the boundaries the
    outside step saw (each shared boundary counted once)."""
    in_step = _dedupe_shared_boundaries(
        m.base.units, [m.figures[n][Option.KEEP].holds_input for n, _ in m.units],
        m.chain.is_chain)
    kept = m.inputs_kept_by_caller or [False] * len(m.units)
    stashed = m.recompute_state_bytes or [0] * len(m.units)
    before = m.grads.before_units or (0,) * len(m.units)
    return [
        replace(_unit_profile(name, module, in_step[i], m.figures[name], m.timings[name],
                              m.grads.units[i], steps.units[i]),
                input_kept_by_caller=kept[i], before_param_grad_bytes=before[i],
                recompute_state_bytes=stashed[i])
        for i, (name, module) in enumerate(m.units)
    ]


def _outside_costs(m: Measurements, steps: StepPlaces) -> tuple[OutsideCost, OutsideCost]:
    """The prefix's and the suffix's costs; their times split the outside code's in the
    proportions the outside step showed (code between units counts as prefix)."""
    base, outside = m.base, m.outside
    fwd_ms = _split(outside.forward_ms, {
        "prefix": base.phase_ms["prefix_fwd"] + base.phase_ms["between_fwd"],
        "suffix": base.phase_ms["suffix_fwd"],
    })
    bwd_ms = _split(outside.backward_ms, {
        "prefix": base.phase_ms["prefix_bwd"],
        "suffix": base.phase_ms["suffix_bwd"],
    })
    prefix = OutsideCost(
        # The units' recorded outputs (remat.execute.output_capture), which the outside
        # step's stubs do not make: held from the forward on, counted from the prefix.
        held_bytes=base.prefix.held_bytes + m.recorded_bytes,
        fwd_peak_bytes=max(base.prefix.fwd_peak_bytes, 0),
        bwd_peak_bytes=max(base.prefix.bwd_peak_bytes, 0),
        param_grad_bytes=m.grads.prefix_bytes,
        fwd_ms=fwd_ms["prefix"],
        bwd_ms=bwd_ms["prefix"],
        stepped_bwd_peak_bytes=max(steps.prefix_bytes, 0),
    )
    suffix = OutsideCost(
        held_bytes=base.suffix.held_bytes,
        fwd_peak_bytes=_suffix_fwd_peak(m),
        bwd_peak_bytes=max(base.suffix.bwd_peak_bytes, 0),
        param_grad_bytes=m.grads.suffix_bytes,
        fwd_ms=fwd_ms["suffix"],
        bwd_ms=bwd_ms["suffix"],
        stepped_bwd_peak_bytes=max(steps.suffix_bytes, 0),
    )
    return prefix, suffix


def _step_ms(m: Measurements, units: list[UnitProfile]) -> float:
    """The loop's optimizer step, derived: ``accumulation_steps`` micro-batches (the
    outside code's time and every unit's keep forward and backward) and the optimizer's."""
    outside = m.outside
    micro_batch_ms = (outside.forward_ms + outside.backward_ms
                      + sum(u.fwd_ms + u.bwd_ms for u in units))
    return m.loop.accumulation_steps * micro_batch_ms + outside.optimizer_ms


def _shared_tensors(base: OutsideStep) -> tuple[SharedTensor, ...]:
    """The storages handed to units besides their boundary input, as the profile keeps
    them: made no later than just before their first user."""
    return tuple(
        SharedTensor(t.nbytes, min(t.born_after, t.users[0] - 1), t.users[0], t.held_to_end,
                     last_user=t.users[-1], grad_bytes=t.grad_bytes,
                     maker_output=t.maker_output and t.born_after < t.users[0])
        for t in base.shared
    )


def _meta(m: Measurements, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` and what the profile says of how it was measured."""
    return {
        **meta,
        "outside_step_peak_bytes": m.fixed_bytes + m.base.peak_bytes,
        "held_after_forward_bytes": m.base.held_after_forward_bytes,
        "forward_transient_bytes": m.base.forward_transient_bytes,
        "step_ms": "derived",
        "no_checkpoint_peak": "predicted",
        "chain_breaks": list(m.chain.breaks),
        # Whether each parameter's own step was metered (what stepping the optimizer
        # in backward adds), or why not.
        STEPS_IN_BACKWARD: m.outside.param_steps,
    }
