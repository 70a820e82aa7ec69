"""Planning a model that does not fit: ``solve()`` runs inside the memory it plans for.

A CPU run behaves like a device of N bytes (:class:`SimulatedDevice`: live tensor bytes
above N raise ``torch.OutOfMemoryError``). With N the budget, ``solve()`` plans models
whose unplanned step needs at least three times N, never holding more than
``max(budget, smallest feasible peak) + 1%`` while it profiles, solves and verifies; the
planned step fits; its gradients are the unplanned model's, bitwise; and a run that hits
the ceiling leaves the model as it was. On CUDA the same tests run under
``torch.cuda.set_per_process_memory_fraction``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.core.errors import DeviceMemoryError
from remat.measurement.runner import forward_loss
from remat.measurement.simulated_device import SimulatedDevice
from remat.measurement.storage import resident_bytes
from remat.solver import min_peak_bytes
from remat.tune.profile_cache import forget_profiles
from remat.tune.verify import measure_plan

CEILING = 1.01  # remat's own work may exceed max(budget, smallest feasible peak) by 1%
LOOP = remat.Loop(keep_output=False)


def _gpt() -> models.ReferenceModel:
    return models.build("gpt", size="tiny", seed=0, depth=6, width=64, heads=4, seq_len=128,
                        batch_size=8, vocab_size=128)


def _cnn() -> models.ReferenceModel:
    return models.build("cnn", size="tiny", seed=0, widths=(8,), blocks_per_stage=16,
                        image_size=32, batch_size=16)


def _hf_causal_lm() -> models.ReferenceModel:
    pytest.importorskip("transformers")
    return models.build("hf-llama", size="tiny", seed=0, depth=6, width=64, heads=4,
                        seq_len=128, batch_size=8, vocab_size=128)


BUILDERS = {"gpt": _gpt, "cnn": _cnn,
            "hf-llama": pytest.param(_hf_causal_lm, marks=pytest.mark.transformers)}


def _resident(ref: models.ReferenceModel) -> int:
    return resident_bytes(ref.model, batch=ref.batch, device=torch.device("cpu"))


def _grads(model: nn.Module, ref: models.ReferenceModel) -> list[torch.Tensor]:
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    forward_loss(model, ref.batch, ref.loss_fn).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return ([t.detach().clone() for t in model.state_dict().values()]
            + [torch.get_rng_state()])


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_a_model_three_times_the_device_is_planned_on_it(build) -> None:
    ref = build()
    # Uncapped: the unplanned step, its gradients, and the smallest feasible peak.
    unplanned = remat.measure(ref.model, ref.batch, loss_fn=ref.loss_fn, loop=LOOP, repeats=1)
    expected = _grads(ref.model, ref)
    floor = min_peak_bytes(remat.profile(copy.deepcopy(ref.model), ref.batch,
                                         loss_fn=ref.loss_fn, loop=LOOP))
    budget = int(floor * 1.05)
    assert unplanned.worst_peak_bytes >= 3 * budget, (unplanned.worst_peak_bytes, budget)

    forget_profiles()
    before = _snapshot(ref.model)
    with SimulatedDevice(budget, resident_bytes=_resident(ref)) as device:
        plan = remat.solve(ref.model, ref.batch, budget, loss_fn=ref.loss_fn, loop=LOOP)
    assert device.out_of_memory == 0
    assert device.peak_bytes <= CEILING * max(budget, floor), (device.peak_bytes, budget)
    assert _same(_snapshot(ref.model), before)
    assert plan.verification is not None and plan.verification.measured_peak_bytes <= budget

    remat.apply_plan(ref.model, plan)
    try:
        planned = remat.measure(ref.model, ref.batch, loss_fn=ref.loss_fn, loop=LOOP,
                                repeats=1)
        assert planned.peak_bytes <= budget and planned.allocator_peak_bytes <= budget
        with SimulatedDevice(budget, resident_bytes=_resident(ref)):
            got = _grads(ref.model, ref)  # trains on the device
    finally:
        remat.remove_plan(ref.model)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.slow
def test_a_budget_below_the_floor_is_refused_without_holding_more() -> None:
    ref = _gpt()
    floor = min_peak_bytes(remat.profile(copy.deepcopy(ref.model), ref.batch,
                                         loss_fn=ref.loss_fn, loop=LOOP))
    forget_profiles()
    with SimulatedDevice(int(floor * CEILING), resident_bytes=_resident(ref)) as device:
        with pytest.raises(remat.InfeasibleBudgetError) as info:
            remat.solve(ref.model, ref.batch, int(floor * 0.8), loss_fn=ref.loss_fn,
                        loop=LOOP)
    assert device.out_of_memory == 0 and device.peak_bytes <= floor * CEILING
    assert info.value.min_feasible_bytes == floor


class _OneHugeUnit(nn.Module):
    """Small blocks and one that saves twelve activations at once."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(3))
        self.huge = nn.Sequential(*(layer for _ in range(6)
                                    for layer in (nn.Linear(d, d), nn.GELU())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.huge(x)


def test_a_unit_that_does_not_fit_alone_is_named() -> None:
    torch.manual_seed(0)
    model, x = _OneHugeUnit(), torch.randn(4096, 64)
    act = x.numel() * 4
    resident = resident_bytes(model, batch=x, device=torch.device("cpu"))
    before = _snapshot(model)
    # Room for a forward (a few activations at a time), not for the huge unit's twelve.
    with SimulatedDevice(resident + 6 * act, resident_bytes=resident):
        with pytest.raises(DeviceMemoryError, match=r"unit 'huge'.*even alone") as info:
            remat.solve(model, x, resident + 6 * act, loss_fn=lambda o, _b: o.square().mean(),
                        units=["blocks.0", "blocks.1", "blocks.2", "huge"])
    assert "saves" in str(info.value) and "out of memory" in str(info.value)
    assert _same(_snapshot(model), before)  # the run that hit the ceiling left no trace
    assert all(p.grad is None for p in model.parameters())


def test_the_simulated_device_refuses_what_does_not_fit() -> None:
    with SimulatedDevice(1000, resident_bytes=600) as device:
        a = torch.empty(50, dtype=torch.float64)  # 400 B: 1000 in all
        with pytest.raises(torch.OutOfMemoryError, match="simulated device"):
            torch.empty(1, dtype=torch.uint8)
        del a
        b = torch.empty(400, dtype=torch.uint8)
    assert device.peak_bytes == 1000 and device.out_of_memory == 1
    del b
    with SimulatedDevice(None) as meter:  # no capacity: it only measures
        torch.empty(10**6, dtype=torch.uint8)
    assert meter.peak_bytes == 10**6


@pytest.mark.parametrize("build", [_gpt, _cnn], ids=["gpt", "cnn"])
def test_the_simulated_device_sees_the_step_the_measurement_sees(build) -> None:
    """remat's own snapshot (the RNG state, the buffers' copies) is host memory: a device
    of exactly the measured peak fits the measured step. The CPU RNG state (5,056 B) once
    counted, a GPT plan 4.7 KB under its budget ran out of the device in verification."""
    ref = build()
    plan = remat.solve(ref.model, ref.batch, loss_fn=ref.loss_fn, loop=LOOP,
                       options=["checkpoint"], verify=False)
    outside = measure_plan(ref.model, ref.batch, plan, loss_fn=ref.loss_fn, optimizer=None,
                           loop=LOOP)
    # The dispatch-level figure: the device sees what the meter sees (not a kernel's
    # scratch, which only the allocator's view counts).
    with SimulatedDevice(outside.peak_bytes, resident_bytes=_resident(ref)) as device:
        inside = measure_plan(ref.model, ref.batch, plan, loss_fn=ref.loss_fn,
                              optimizer=None, loop=LOOP)
    assert device.out_of_memory == 0
    assert device.peak_bytes == inside.peak_bytes == outside.peak_bytes


def test_a_second_solve_reuses_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.profiler as profiler

    calls = []
    real = profiler.profile_levels

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profiler, "profile_levels", counting)
    forget_profiles()
    ref = models.build("mlp", size="tiny", seed=0)
    remat.solve(ref.model, ref.batch, None, loss_fn=ref.loss_fn, verify=False)
    remat.solve(ref.model, ref.batch, "100%", loss_fn=ref.loss_fn, verify=False)
    remat.estimate(ref.model, ref.batch, loss_fn=ref.loss_fn)
    assert len(calls) == 1  # another budget costs only the solve
    remat.solve(ref.model, ref.batch, "100%", loss_fn=ref.loss_fn, loop=LOOP, verify=False)
    assert len(calls) == 2  # another loop measures anew
    ref.model[0][0].weight.requires_grad_(False)
    remat.solve(ref.model, ref.batch, "100%", loss_fn=ref.loss_fn, loop=LOOP, verify=False)
    assert len(calls) == 3  # and so does a frozen parameter
    remat.solve(ref.model, ref.batch[: len(ref.batch) // 2], "100%",
                loss_fn=lambda out, _b: out.square().mean(), loop=LOOP, verify=False)
    assert len(calls) == 4  # and another batch shape


def test_a_budget_above_what_the_cuda_device_can_give_is_capped(monkeypatch) -> None:
    # CPU-only check of the arithmetic: a profile measured on CUDA, a device with 3 MB free.
    from remat import api
    from remat.measurement import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _i=0: (3_000_000, 8_000_000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _i=0: 1_000_000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _i=0: 1_500_000)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda _i=0: 1.0)
    assert device.device_capacity_bytes(torch.device("cuda")) == 4_500_000
    assert device.device_capacity_bytes(torch.device("cpu")) is None
    prof = remat.Profile.from_json(
        remat.profile(models.build("mlp", size="tiny").model, torch.randn(16, 64),
                      loss_fn=lambda o, _b: o.sum(), repeats=1).to_json())
    on_cuda = type(prof)(**{**{f: getattr(prof, f) for f in prof.__dataclass_fields__},
                            "device": "cuda:0"})
    assert api._within_device(on_cuda, 10**9) == 4_500_000
    assert api._within_device(on_cuda, 10**6) == 10**6
    assert api._within_device(prof, 10**9) == 10**9  # the CPU gives no such ceiling


@pytest.mark.parametrize("compiled", [False, True])
def test_both_searches_plan_within_what_the_device_can_give(monkeypatch, compiled) -> None:
    # The compiled search once took the budget as asked, past the device's capacity.
    from remat import api
    from remat.tune import compiled as compiled_search

    capped = []

    def within(profile, budget):  # a device that can give half of what was asked
        capped.append(budget)
        return budget // 2

    seen = []

    def search(model, batch, prof, budget, **_kw):
        from remat.solver.solve import solve_profile

        seen.append(budget)
        return solve_profile(prof, budget)

    monkeypatch.setattr(api, "_within_device", within)
    monkeypatch.setattr(compiled_search, "search_compiled", search)
    ref = models.build("mlp", size="tiny")
    plan = remat.solve(ref.model, ref.batch, memory_budget=10**9, loss_fn=ref.loss_fn,
                       compiled=compiled, verify=False)
    assert capped == [10**9]
    assert plan.budget_bytes == 10**9 // 2
    assert seen == ([10**9 // 2] if compiled else [])


@pytest.mark.parametrize("entry", ["profile", "solve"])
def test_a_device_the_model_fills_is_named(entry: str) -> None:
    ref = models.build("mlp", size="tiny", seed=0)
    forget_profiles()
    resident = _resident(ref)
    before = _snapshot(ref.model)
    call = {"profile": lambda: remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn),
            "solve": lambda: remat.solve(ref.model, ref.batch, "60%", loss_fn=ref.loss_fn)}
    # The model and its batch fill the device: the first byte profiling asks for fails,
    # in its first forward (the snapshot that puts the model back is host memory).
    with SimulatedDevice(resident, resident_bytes=resident) as device:
        with pytest.raises(DeviceMemoryError, match="forward pass that records") as info:
            call[entry]()
    assert device.out_of_memory == 1
    assert "out of memory" in str(info.value) and "more memory" in str(info.value)
    assert _same(_snapshot(ref.model), before)
    assert all(p.grad is None for p in ref.model.parameters())
