"""The instrumented baseline step: what the code *outside* the units costs.

One ordinary training step (no checkpointing) runs under a :class:`TimelineMeter`
with marks at every unit boundary:

* forward pre/post hooks on the units mark where each unit starts and ends;
* tensor hooks on each unit's first input and output mark where its backward
  starts (its output's gradient is ready) and ends (its input's gradient is
  ready). Tensor hooks do not change the graph, unlike module backward hooks;
* ``saved_tensors_hooks`` (identity) record which code saved which storage, to
  tell whether the prefix / suffix / code between units holds a boundary;
* post-hooks on the graph nodes that feed a parameter's ``AccumulateGrad`` tell
  in which backward phase its first gradient contribution appears: that is where
  its gradient bytes are counted. A parameter used twice (a tied embedding) has
  its contributions summed before ``AccumulateGrad`` runs once, at the earlier
  user's backward, but a gradient-sized buffer is alive from the later user's
  backward (the first to run) on, and that is what the live bytes see.

Figures are then read off the per-storage timeline, so that ``simulate()`` adding
them to the units' isolated figures reproduces this step. In particular
``held_bytes`` of the prefix/suffix are the storages that code allocated and that
are still alive when the forward pass ends; off a chain, what the code between
units holds is folded into the prefix's ``held_bytes``.

On a chain the step also gives each unit's **keep** figures, exactly as an
isolated metered replay defines them (:func:`~remat.profiler.replay.measure_option`),
so that replay need not run: its forward peak and held bytes are what the unit
allocated between its marks, its backward peak what its backward added above the
live bytes at its start (the output's gradient is already live there, as the
replay counts it), whether it holds its input / output is whether its own code
saved that storage, and its input gradient is the one its input's hook sees.
Where the step cannot tell (see :func:`_keep_figures`) the replay runs. The
figures equal the replay's on every reference model and on the test models
(``tests/profiler/test_profiler_baseline.py`` checks it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.errors import ProfileError
from remat.profiler.replay import OptionFigures
from remat.profiler.step import LossFn, call_model, compute_loss
from remat.profiler.timeline import TimelineMeter
from remat.runtime.boundary import boundary_input, boundary_output, storage_nbytes

__all__ = ["BaselineStep", "instrumented_step"]

log = logging.getLogger("remat")

Phase = tuple[Any, ...]  # ("prefix",), ("unit", i), ("between", i), ("suffix",), ("outside", i)


@dataclass
class BaselineStep:
    """Byte figures of the outside code and the unit boundaries, from one instrumented step.

    All bytes are above the fixed bytes. ``input_bytes`` / ``output_bytes`` are 0 for
    a boundary whose storage was not allocated during the step (a tensor of the
    sample batch): it is alive all along and not part of the measured peak.
    """

    n: int
    prefix_held: int = 0
    prefix_fwd_peak: int = 0
    prefix_bwd_peak: int = 0
    prefix_param_grad: int = 0
    suffix_held: int = 0
    suffix_fwd_peak: int = 0
    suffix_bwd_peak: int = 0
    suffix_param_grad: int = 0
    unit_param_grad: list[int] = field(default_factory=list)
    input_bytes: list[int] = field(default_factory=list)
    output_bytes: list[int] = field(default_factory=list)
    input_held_outside: list[bool] = field(default_factory=list)
    output_held_outside: list[bool] = field(default_factory=list)
    input_is_prev_output: list[bool] = field(default_factory=list)
    peak_bytes: int = 0
    held_after_forward_bytes: int = 0
    step_unit_held: list[int] = field(default_factory=list)
    forward_transient_bytes: int = 0
    loss_bytes: int = 0
    phase_ms: dict[str, float] = field(default_factory=dict)
    keep: list[OptionFigures | None] = field(default_factory=list)  # on a chain, per unit


def instrumented_step(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    units: list[tuple[str, nn.Module]],
    *,
    is_chain: bool,
    device_type: str,
    optimizer: torch.optim.Optimizer | None = None,
) -> BaselineStep:
    """Run one instrumented training step; ``units`` in execution order.

    Gradients must be ``None`` on entry (they are allocated inside the region).
    """
    n = len(units)
    index = {id(m): i for i, (_, m) in enumerate(units)}
    meter = TimelineMeter(device_type=device_type)
    clock: dict[str, float] = {}
    fwd_phase: list[Phase] = [("prefix",)]
    in_rec: list[int | None] = [None] * n
    out_rec: list[int | None] = [None] * n
    in_nbytes = [0] * n
    out_nbytes = [0] * n
    saved: list[tuple[Phase, int]] = []
    in_grad_nbytes = [0] * n
    needs_bwd = [False] * n  # the unit's first output requires grad
    first_grad_tick: dict[int, int] = {}  # id(param) -> clock at its first gradient
    grad_records: dict[int, int] = {}  # gradient storage record -> tick it is counted from
    handles: list[Any] = []

    def mark(label: str) -> None:
        meter.mark(label)
        clock[label] = time.perf_counter()

    def backward_event(kind: str, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            label = f"{kind}{i}"
            if label not in meter.ticks:
                mark(label)
                if kind == "be":
                    in_grad_nbytes[i] = storage_nbytes(grad)

        return hook

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = index[id(module)]
        mark(f"fs{i}")
        fwd_phase[0] = ("unit", i)
        located = boundary_input(args, kwargs)
        x = located[1] if located is not None else None
        in_rec[i] = meter.record_of(x)
        in_nbytes[i] = storage_nbytes(x) if in_rec[i] is not None else 0
        if x is not None and x.requires_grad:
            handles.append(x.register_hook(backward_event("be", i)))

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        i = index[id(module)]
        mark(f"fe{i}")
        fwd_phase[0] = ("between", i) if i < n - 1 else ("suffix",)
        y = boundary_output(output)
        out_rec[i] = meter.record_of(y)
        out_nbytes[i] = storage_nbytes(y) if out_rec[i] is not None else 0
        needs_bwd[i] = y is not None and y.requires_grad
        if needs_bwd[i]:
            handles.append(y.register_hook(backward_event("bs", i)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        rec = meter.record_of(t)
        if rec is not None:  # parameters, buffers and the batch have no record
            saved.append((fwd_phase[0], rec))
        # A detached alias: same storage, same lifetime, but no reference cycle
        # through grad_fn when an op saves its own output.
        return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    try:
        for _, m in units:
            handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
        with meter:
            mark("start")
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                output = call_model(model, batch)
                loss = compute_loss(output, batch, loss_fn)
                del output
            mark("F")
            # The caller's loss (and the seed gradient backward() makes for it) stay
            # alive through the whole backward pass, whatever storage the loss has.
            loss_bytes = (
                loss.untyped_storage().nbytes() if meter.record_of(loss) is not None else 0
            ) + loss.numel() * loss.element_size()
            handles.extend(_hook_gradient_producers(loss, model, meter, first_grad_tick))
            loss.backward()
            del loss
            mark("B")
            for p in model.parameters():
                rec = meter.record_of(p.grad)
                if rec is not None:
                    tick = first_grad_tick.get(id(p), meter.records[rec].born)
                    grad_records[rec] = min(tick, grad_records.get(rec, tick))
            if optimizer is not None:
                optimizer.step()
                mark("O")
    finally:
        for h in handles:
            h.remove()

    missing = [name for i, (name, _) in enumerate(units)
               if f"fs{i}" not in meter.ticks or f"fe{i}" not in meter.ticks]
    if missing:
        raise ProfileError(
            f"units {missing} ran in the first forward pass but not in the second; the "
            "profiler needs the same units to run on every step with this batch"
        )
    figures = _figures(meter, clock, n, is_chain, in_rec, out_rec, in_nbytes, out_nbytes, saved,
                       grad_records)
    figures.loss_bytes = loss_bytes
    if is_chain:
        figures.keep = [
            _keep_figures(meter, i, in_rec[i], out_rec[i], needs_bwd[i], saved, in_grad_nbytes[i],
                          figures.step_unit_held[i])
            for i in range(n)
        ]
    return figures


def _hook_gradient_producers(
    loss: torch.Tensor, model: nn.Module, meter: TimelineMeter, first_tick: dict[int, int]
) -> list[Any]:
    """Post-hook every graph node that hands a gradient to a parameter's ``AccumulateGrad``;
    each records the clock when it first produces one for that parameter."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    handles = []
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        feeds = []
        for nxt, _ in node.next_functions:
            var = getattr(nxt, "variable", None) if nxt is not None else None
            if var is not None and id(var) in trainable:
                feeds.append(id(var))
            elif nxt is not None:
                stack.append(nxt)
        if feeds:
            def hook(_grad_inputs: Any, _grad_outputs: Any, feeds: list[int] = feeds) -> None:
                for pid in feeds:
                    first_tick.setdefault(pid, meter.clock)

            handles.append(node.register_hook(hook))
    return handles


def _figures(
    meter: TimelineMeter,
    clock: dict[str, float],
    n: int,
    is_chain: bool,
    in_rec: list[int | None],
    out_rec: list[int | None],
    in_nbytes: list[int],
    out_nbytes: list[int],
    saved: list[tuple[Phase, int]],
    grad_records: dict[int, int],
) -> BaselineStep:
    tick, reading = meter.ticks, meter.readings
    F = tick["F"]
    last = n - 1
    r = BaselineStep(n)
    r.peak_bytes = meter.peak_bytes
    r.held_after_forward_bytes = reading["F"].live_bytes

    # -- forward: what each outside part allocated and still holds at the end -----
    r.prefix_fwd_peak = meter.peak_between("start", "fs0")
    r.prefix_held = meter.alive_bytes(F, born_until=tick["fs0"], exclude=[in_rec[0]])
    for i in range(last):  # code between units (none on a chain): folded into the prefix
        r.prefix_held += meter.alive_bytes(
            F, born_after=tick[f"fe{i}"], born_until=tick[f"fs{i + 1}"], exclude=[in_rec[i + 1]]
        )
    r.suffix_held = meter.alive_bytes(F, born_after=tick[f"fe{last}"], born_until=F)
    # Storages alive when the suffix starts that are not held (the prefix's locals
    # that live until the model's forward returns, say) still weigh on the suffix's
    # peak, while simulate() counts only held bytes there: add them to its peak.
    # On a chain simulate() still counts the last unit's output there; off a chain
    # it has already let it go unless someone holds it.
    transient = meter.dying_bytes(
        tick[f"fe{last}"], F, exclude=[out_rec[last]] if is_chain else []
    )
    r.suffix_fwd_peak = (
        meter.peak_between(f"fe{last}", "F") - reading[f"fe{last}"].live_bytes + transient
    )
    r.step_unit_held = [
        meter.alive_bytes(
            F, born_after=tick[f"fs{i}"], born_until=tick[f"fe{i}"], exclude=[out_rec[i]]
        )
        for i in range(n)
    ]
    r.forward_transient_bytes = max(
        meter.dying_bytes(tick[f"fs{i}"], F, exclude=[in_rec[i]]) for i in range(n)
    )

    # -- backward ---------------------------------------------------------------------
    if f"bs{last}" in tick:
        r.suffix_bwd_peak = meter.peak_between("F", f"bs{last}") - reading["F"].live_bytes
    if "be0" in tick:
        r.prefix_bwd_peak = meter.peak_between("be0", "B") - reading["be0"].live_bytes
    r.unit_param_grad = [0] * n
    for rec, first_tick in grad_records.items():
        phase = _backward_phase(meter, first_tick)
        nbytes = meter.records[rec].nbytes
        if phase[0] == "unit":
            r.unit_param_grad[phase[1]] += nbytes
        elif phase[0] == "suffix":
            r.suffix_param_grad += nbytes
        else:  # the prefix, and off a chain the code between units
            r.prefix_param_grad += nbytes

    # -- boundaries ---------------------------------------------------------------------
    def held_outside(rec: int | None, own: set[Phase]) -> bool:
        return rec is not None and any(rec == s and p not in own for p, s in saved)

    r.input_bytes, r.output_bytes = list(in_nbytes), list(out_nbytes)
    r.input_is_prev_output = [False] + [
        in_rec[i] is not None and in_rec[i] == out_rec[i - 1] for i in range(1, n)
    ]
    r.input_held_outside = [
        held_outside(in_rec[i], {("unit", i)} | ({("unit", i - 1)} if is_chain else set()))
        for i in range(n)
    ]
    r.output_held_outside = [
        held_outside(out_rec[i], {("unit", i)} | ({("unit", i + 1)} if is_chain else set()))
        for i in range(n)
    ]

    # -- wall time of the outside phases (under instrumentation: proportions only) ----
    end_fwd = clock["F"]
    r.phase_ms = {
        "prefix_fwd": (clock["fs0"] - clock["start"]) * 1e3,
        "between_fwd": sum(clock[f"fs{i + 1}"] - clock[f"fe{i}"] for i in range(last)) * 1e3,
        "suffix_fwd": (end_fwd - clock[f"fe{last}"]) * 1e3,
        "suffix_bwd": (clock.get(f"bs{last}", end_fwd) - end_fwd) * 1e3,
        "prefix_bwd": (clock["B"] - clock["be0"]) * 1e3 if "be0" in clock else 0.0,
    }
    log.debug("baseline step: held after forward %d B, peak %d B, per-unit held in step %s",
              r.held_after_forward_bytes, r.peak_bytes, r.step_unit_held)
    return r


def _backward_phase(meter: TimelineMeter, tick: int) -> Phase:
    """The backward phase running at ``tick``: ``("suffix",)``, ``("unit", i)`` or
    ``("outside", i)`` (after unit i's backward: the prefix, or code between units)."""
    labels = [m.label for m in meter.marks]
    phase: Phase = ("suffix",)
    for label in labels[labels.index("F") + 1 :]:
        if label in ("B", "O") or meter.ticks[label] >= tick:
            break
        kind, i = label[:2], int(label[2:])
        # On a chain one tensor is unit i's input and unit i-1's output, so "end of
        # unit i" and "start of unit i-1" are marked together, in either order.
        if kind == "bs":
            phase = ("unit", i)
        elif phase == ("unit", i):
            phase = ("outside", i)
    return phase


def _keep_figures(
    meter: TimelineMeter,
    i: int,
    in_rec: int | None,
    out_rec: int | None,
    needs_bwd: bool,
    saved: list[tuple[Phase, int]],
    in_grad_nbytes: int,
    held: int,
) -> OptionFigures | None:
    """Unit ``i``'s keep figures read off the step, as :func:`~remat.profiler.replay.measure_option`
    defines them; ``None`` where the step cannot tell.

    It cannot when a boundary storage is not the step's (the batch: whether the unit
    holds it is not on the timeline); when one outlives the step (something other than
    autograd holds it, a module caching its output, say: the replay sees that holder,
    the saved-tensor records do not); or when the backward's marks are not those of
    the replay's backward: the replay seeds the output's gradient when the output
    requires grad (both marks then needed, the input's only when it takes a
    gradient) and runs no backward otherwise (no mark may then appear either).
    """
    tick, reading = meter.ticks, meter.readings
    fs, fe, bs, be = f"fs{i}", f"fe{i}", f"bs{i}", f"be{i}"
    if in_rec is None or out_rec is None or (bs in tick, be in tick) != (needs_bwd, needs_bwd):
        return None
    if meter.records[in_rec].died is None or meter.records[out_rec].died is None:
        return None
    own = ("unit", i)
    bwd_peak = meter.peak_between(bs, be) - reading[bs].live_bytes if needs_bwd else 0
    return OptionFigures(
        held_bytes=max(held, 0),
        holds_input=any(rec == in_rec and phase == own for phase, rec in saved),
        holds_output=any(rec == out_rec and phase == own for phase, rec in saved),
        fwd_peak_bytes=meter.peak_between(fs, fe) - reading[fs].live_bytes,
        bwd_peak_bytes=max(bwd_peak, 0),
        input_grad_bytes=in_grad_nbytes,
    )
