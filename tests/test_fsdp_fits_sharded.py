"""Planning a model that only fits sharded, within a device of the per-rank budget (issue 32,
item 2), on 2 gloo ranks.

Each rank holds a device of ``capacity`` bytes, simulated
(:class:`~remat.measurement.simulated_device.SimulatedDevice`: live tensor bytes above it
raise ``torch.OutOfMemoryError``). The capacity is a per-rank budget between the smallest
feasible peak and no checkpointing of the sharded step, and the model's unsharded
parameters, gradients and AdamW state alone (4 float32 copies of every parameter) are
more than it: no rank could hold the model unsharded, so no rank-0 profile of it could
run there. Inside that device every rank calls ``remat.solve`` on the ``fully_shard``-ed
model (profiling and verification included: no pass gathers more than FSDP2 itself),
applies the plan and trains a few steps, measured under the capacity; each step's loss
equals the unplanned sharded model's (trained outside the device, where it fits).

Two models: a Llama-style ``transformers`` model from a ``LlamaConfig`` (random weights)
and remat's own GPT. Only the options ``keep`` and ``checkpoint``, the head as written:
the test is about what fits, and so takes seconds, not minutes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.test_fsdp_collective import _spawn

STEPS = 3
FLOAT32_COPIES = 4  # parameters, gradients and AdamW's two moments
SETTINGS = {"options": ("keep", "checkpoint"), "head": "none"}

# name -> (remat.models.build arguments, the attribute path of the blocks)
MODELS = {
    "llama": ({"name": "hf-llama", "depth": 6, "width": 256, "heads": 4, "seq_len": 64,
               "vocab_size": 2048, "batch_size": 2}, "model.layers"),
    "gpt": ({"name": "gpt", "size": "tiny", "depth": 8, "width": 128, "seq_len": 64,
             "batch_size": 2}, "blocks"),
}


def _sharded(name: str) -> tuple[torch.nn.Module, dict, int]:
    """The model ``name`` sharded with FSDP2 (each block, then the root), its batch and its
    parameter count (unsharded)."""
    from torch.distributed.fsdp import fully_shard

    from remat.models import build

    args, blocks = MODELS[name]
    ref = build(**args, dropout=0.0, seed=0)
    count = sum(p.numel() for p in ref.model.parameters())
    module = ref.model
    for attr in blocks.split("."):
        module = getattr(module, attr)
    for block in module:
        fully_shard(block)
    fully_shard(ref.model)
    return ref.model, ref.batch, count


def _capacity(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer) -> int:
    """Halfway between the smallest feasible per-rank peak and no checkpointing's, from the
    collective profile: a budget that only a plan with checkpointing meets."""
    import remat
    from remat.core.errors import InfeasibleBudgetError

    prof = remat.profile(model, batch, optimizer=opt, **SETTINGS)
    keep = remat.solve(prof, None).record.predicted_peak_bytes
    try:
        remat.solve(prof, 1)
    except InfeasibleBudgetError as err:
        return (err.min_feasible_bytes + keep) // 2
    raise AssertionError("a budget of 1 byte should be infeasible")


def _train(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _check_plans_within_a_device_of_the_budget(rank: int, name: str) -> None:
    import remat
    from remat.measurement.simulated_device import SimulatedDevice
    from remat.measurement.storage import resident_bytes

    planned, batch, count = _sharded(name)
    unplanned, _, _ = _sharded(name)
    opt, unplanned_opt = (torch.optim.AdamW(m.parameters()) for m in (planned, unplanned))
    capacity = _capacity(planned, batch, opt)
    unsharded_state = FLOAT32_COPIES * 4 * count
    assert unsharded_state > capacity, (unsharded_state, capacity)

    with SimulatedDevice(capacity, resident_bytes=resident_bytes(planned, opt)) as device:
        plan = remat.solve(planned, batch, memory_budget=capacity, optimizer=opt, **SETTINGS)
        remat.apply_plan(planned, plan)
        losses = _train(planned, batch, opt)
    expected = _train(unplanned, batch, unplanned_opt)

    assert "checkpoint" in plan.options, plan.summary()
    assert device.out_of_memory == 0 and device.peak_bytes <= capacity, (
        device.peak_bytes, capacity)
    assert all(torch.isfinite(torch.tensor(losses))) and losses == expected, (losses, expected)
    peaks: list = [None] * 2
    dist.all_gather_object(peaks, device.peak_bytes)
    print(f"\nrank {rank} {name}: {count:,} parameters, unsharded state {unsharded_state:,} B "
          f"= {unsharded_state / capacity:.2f} x the capacity {capacity:,} B; planned "
          f"{plan.summary()}, peak {device.peak_bytes:,} B (ranks: {peaks})", flush=True)


def _llama(rank: int) -> None:
    _check_plans_within_a_device_of_the_budget(rank, "llama")


def _gpt(rank: int) -> None:
    _check_plans_within_a_device_of_the_budget(rank, "gpt")


@pytest.mark.slow
@pytest.mark.parametrize("check", [
    pytest.param(_llama, id="llama", marks=pytest.mark.transformers), pytest.param(_gpt, id="gpt")])
def test_a_model_that_only_fits_sharded_is_planned_and_trains_within_the_device(
        free_port: int, check: object) -> None:
    _spawn(check, free_port)  # type: ignore[arg-type]
