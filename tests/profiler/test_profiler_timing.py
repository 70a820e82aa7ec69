"""How profile() times: early stop within a tolerance, and twin units timed as one."""

from __future__ import annotations

import dataclasses
import logging
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from remat import models
from remat.core.loop import Loop
from remat.measurement.runner import StepRunner, forward_loss
from remat.measurement.timing import Stopwatch, settled
from remat.profiler import profile
from remat.profiler.capture import trace_units
from remat.profiler.replay import time_unit
from remat.profiler.twins import signature
from remat.profiler.units import discover_units

# ---------------------------------------------------------------- settled()


@settings(max_examples=300, deadline=None)
@given(
    samples=st.lists(st.floats(0.1, 100.0), min_size=1, max_size=9),
    tolerance=st.floats(0.0, 0.5),
)
def test_settled_samples_bracket_the_median_of_all(samples: list[float], tolerance: float) -> None:
    """Stopping where settled() says costs at most ``tolerance * scale`` against
    the median of all ``repeats`` samples, whatever the samples not taken."""
    repeats = len(samples)
    scale = min(samples)
    for taken in range(1, repeats + 1):
        if settled(samples[:taken], repeats=repeats, tolerance=tolerance, scale=scale):
            error = abs(statistics.median(samples[:taken]) - statistics.median(samples))
            assert error <= tolerance * scale + 1e-9
            break
    else:
        pytest.fail("settled() must be true once all repeats are taken")


def test_settled_needs_a_majority_and_a_small_spread() -> None:
    assert not settled([10.0], repeats=3, tolerance=0.5, scale=10.0)  # 1 of 3 brackets nothing
    assert settled([10.0, 10.4], repeats=3, tolerance=0.05, scale=10.0)
    assert not settled([10.0, 11.0], repeats=3, tolerance=0.05, scale=10.0)
    assert not settled([10.0, 10.1], repeats=3, tolerance=0.0, scale=10.0)
    assert settled([10.0, 11.0, 30.0], repeats=3, tolerance=0.0, scale=10.0)  # all taken
    assert not settled([10.0, 10.0], repeats=4, tolerance=0.05, scale=10.0)  # 3 of 4 needed


def _mlp_call():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    x = torch.randn(8, 32)
    found = discover_units(model, None)
    trace = trace_units(model, found, lambda: model(x).sum())
    return trace.calls["0"], StepRunner(model, x, lambda out, _: out.sum(), None, Loop(), "cpu")


def test_time_unit_takes_repeats_rounds_at_zero_tolerance() -> None:
    call, runner = _mlp_call()
    samples = time_unit(call, ["keep", "selective"], runner, Stopwatch(torch.device("cpu")),
                        warmup=0, repeats=4, tolerance=0.0)
    assert samples.rounds == 4


class _SteadyWatch(Stopwatch):
    """Runs the work and says it took 1, 1.5 or 1.25 ms, by turns: round counting free of
    the machine's load (the samples differ, so a zero tolerance never settles early)."""

    calls = 0

    def time(self, fn):  # noqa: ANN001, ANN202
        self.calls += 1
        return fn(), (1.0, 1.5, 1.25)[self.calls % 3]


def test_time_unit_stops_once_settled_and_at_max_rounds() -> None:
    call, runner = _mlp_call()
    watch = _SteadyWatch(torch.device("cpu"))
    # A tolerance of 99% settles as soon as a majority (2 of 3) is taken.
    assert time_unit(call, ["keep"], runner, watch, warmup=0, repeats=3,
                     tolerance=0.99).rounds == 2
    samples = time_unit(call, ["keep"], runner, watch, warmup=0, repeats=3, max_rounds=1)
    assert samples.rounds == 1
    # Pooled: a second call adds to the same samples and stops at repeats in all.
    time_unit(call, ["keep"], runner, watch, warmup=0, repeats=3, samples=samples)
    assert samples.rounds == 3


# ---------------------------------------------------------------- twins


class _Block(nn.Module):
    def __init__(self, width: int = 16, *, layer_idx: int = 0, window: int | None = None,
                 extra_on: int | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.layer_idx = layer_idx  # numbers the block: not part of the signature
        self.window = window  # configures it: part of the signature
        self.extra_on = extra_on

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        if mask is not None:
            y = y * mask
        if self.extra_on == self.layer_idx:  # only this block saves an extra tensor
            y = torch.sigmoid(y) * y
        return y


class _Stack(nn.Module):
    def __init__(self, blocks: list[_Block], masks: list[torch.Tensor | None]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.masks = masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, mask in zip(self.blocks, self.masks):
            x = block(x, mask=mask)
        return x


def _signatures(model: nn.Module, x: torch.Tensor) -> list:
    x = x.requires_grad_()
    trace = trace_units(model, discover_units(model, None), lambda: model(x).sum())
    return [signature(trace.calls[name]) for name in trace.order]


def test_transformer_blocks_are_twins() -> None:
    for name in ("gpt", "mlp"):
        ref = models.build(name, size="tiny")
        found = discover_units(ref.model, None)
        trace = trace_units(ref.model, found,
                            lambda r=ref: forward_loss(r.model, r.batch, r.loss_fn))
        sigs = [signature(trace.calls[n]) for n in trace.order]
        # The MLP's first layer sees the batch (no grad), the rest each other's output.
        twins_from = 0 if name == "gpt" else 1
        assert len(set(sigs[twins_from:])) == 1, name
        if name == "mlp":
            assert sigs[0] != sigs[1]


@pytest.mark.transformers
def test_hf_blocks_are_twins_despite_layer_idx() -> None:
    ref = models.build("hf-gpt2", size="tiny")
    trace = trace_units(ref.model, discover_units(ref.model, None),
                        lambda: forward_loss(ref.model, ref.batch, ref.loss_fn))
    assert len({signature(trace.calls[n]) for n in trace.order}) == 1


def test_what_tells_twins_apart() -> None:
    mask = torch.ones(4, 16)
    same = _Stack([_Block(16, layer_idx=i) for i in range(2)], [mask, mask])
    assert len(set(_signatures(same, torch.randn(4, 16)))) == 1
    cases = {
        "a configuring attribute": _Stack([_Block(16), _Block(16, window=4)], [mask, mask]),
        "another mask tensor": _Stack([_Block(16), _Block(16)], [mask, torch.ones(4, 16)]),
        "a mask and none": _Stack([_Block(16), _Block(16)], [mask, None]),
        "a dropout rate": nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1)),
                                        nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2))),
        "a width": nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)),
    }
    for what, model in cases.items():
        first, second = _signatures(model, torch.randn(4, 16))
        assert first != second, what


def test_dtype_tells_twins_apart() -> None:
    f64 = nn.Sequential(*(nn.Linear(16, 16, dtype=torch.float64) for _ in range(3)))
    f32 = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    a = _signatures(f64, torch.randn(4, 16, dtype=torch.float64))[1]
    b = _signatures(f32, torch.randn(4, 16))[1]
    assert a != b


def _profile_stack(caplog: pytest.LogCaptureFixture, *, extra_on: int | None, pool: bool = True):
    torch.manual_seed(0)
    model = _Stack([_Block(64, layer_idx=i, extra_on=extra_on) for i in range(4)], [None] * 4)
    x = torch.randn(32, 64)
    with caplog.at_level(logging.DEBUG, logger="remat"):
        caplog.clear()
        # Not out.sum(): its gradient is an expanded scalar, so the last block's
        # backward (measured in the step) would allocate differently from the others'.
        # Nor a loop that keeps the output: the last block's backward then runs with it
        # alive, where the others' inputs are freed.
        prof = profile(model, x, loss_fn=lambda out, batch: (out * out).mean(), repeats=3,
                       tolerance=0.0, pool_twins=pool, loop=Loop(keep_output=False))
    groups = [r for r in caplog.records if r.getMessage().startswith("timed ")]
    return prof, groups


def test_profile_pools_twins_and_keeps_bytes_per_unit(caplog: pytest.LogCaptureFixture) -> None:
    pooled, groups = _profile_stack(caplog, extra_on=None)
    alone, no_groups = _profile_stack(caplog, extra_on=None, pool=False)
    # Units 1-3 are twins (unit 0 sees the batch, which needs no grad).
    assert [g.getMessage() for g in groups] == [
        "timed 4 units as 2 groups of twins: [['blocks.1', 'blocks.2', 'blocks.3']]"]
    assert not no_groups
    times = [(u.fwd_ms, u.bwd_ms, u.options["selective"].extra_ms) for u in pooled.units]
    assert times[1] == times[2] == times[3]
    # Pooling changes no byte figure.
    def without_times(prof):
        return [dataclasses.replace(
            u, fwd_ms=0.0, bwd_ms=0.0,
            options={o: dataclasses.replace(c, extra_ms=0.0) for o, c in u.options.items()},
        ) for u in prof.units]

    assert without_times(pooled) == without_times(alone)
    assert pooled.meta["pool_twins"] is True and alone.meta["pool_twins"] is False


def test_units_whose_bytes_differ_are_not_pooled(caplog: pytest.LogCaptureFixture) -> None:
    # The last block saves one more tensor: the same signature (layer_idx is ignored),
    # other bytes, so it is timed alone; its would-be twins still get their samples.
    prof, groups = _profile_stack(caplog, extra_on=3)
    assert [g.getMessage() for g in groups] == [
        "timed 4 units as 3 groups of twins: [['blocks.1', 'blocks.2']]"]
    assert prof.units[3].saved_bytes > prof.units[2].saved_bytes
    assert prof.units[1].fwd_ms == prof.units[2].fwd_ms
