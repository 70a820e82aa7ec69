"""Per-rank predictions against measured sharded steps (issue 32, item 3), 2 gloo ranks.

Every rank profiles the ``fully_shard``-ed GPT collectively (``remat.profile`` on the
sharded model: the worst rank's step, the same on each rank), solves it at 4 budgets from
the smallest feasible peak to no checkpointing, applies each plan and measures its step
:data:`RUNS` times (the allocator's view, :func:`remat.integrations.fsdp.measure_rank_step`)
and once by live tensor bytes (:class:`~remat.measurement.simulated_device.SimulatedDevice`).

The prediction must cover every run on every rank (never below the worst), and stay
within 2% of the worst run or, where that is tighter than FSDP2 itself is repeatable,
within :data:`OVER_UNITS` units' gathered parameters of it (the profile counts
:data:`remat.profiler.sharded.IN_FLIGHT` units' in flight in the forward, fewer in the
backward; pinned to one core the suite measured none in flight, 3.8 units under the
prediction, when two were counted in the backward too). FSDP2's collectives make one
step's allocator peak vary from run to run by about one unit's gathered parameters (a
buffer of an all-gather or reduce-scatter alive at the peak in some runs, not in others),
and how many are alive at once depends on how busy the machine is; the per-rank profile
counts FSDP2's buffers around each unit as alive in every run. On this tiny GPT one unit's
parameters (200 KB) are 2 to 4% of the peak.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from remat.profiler.sharded import IN_FLIGHT
from tests.test_fsdp_collective import WORLD, _sharded_gpt, _spawn

RUNS = 10
OVER = 1.02  # above the worst run, or OVER_UNITS units' gathered parameters (docstring)
# The profile counts IN_FLIGHT units' gathered parameters alive in the forward, which a busy
# machine shows; on one core FSDP2's collectives run one after another and none is left
# in flight at the peak, so the prediction may stand that many units above, plus two.
OVER_UNITS = IN_FLIGHT + 2


def _check_accuracy(rank: int, reshard_after_forward: bool) -> None:
    import remat
    from remat.core.errors import InfeasibleBudgetError
    from remat.integrations.fsdp import measure_rank_step
    from remat.measurement.simulated_device import SimulatedDevice
    from remat.measurement.storage import resident_bytes

    model, batch = _sharded_gpt(reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt)
    assert prof.meta.get("fsdp_per_rank") and prof.meta.get("fsdp_world_size") == WORLD
    keep = remat.solve(prof, None).record.predicted_peak_bytes
    try:
        remat.solve(prof, 1)
    except InfeasibleBudgetError as err:
        floor = err.min_feasible_bytes
    slack = OVER_UNITS * max(prof.meta["fsdp_gathered_bytes"])
    rows = []
    for fraction in (0.0, 1 / 3, 2 / 3, 1.0):
        budget = int(floor + fraction * (keep - floor))
        plan = remat.solve(prof, budget)
        predicted = plan.record.predicted_peak_bytes
        remat.apply_plan(model, plan)
        runs = [measure_rank_step(model, batch, optimizer=opt) for _ in range(RUNS)]
        with SimulatedDevice(None, resident_bytes=resident_bytes(model, opt)) as device:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        remat.remove_plan(model)
        rows.append((budget, predicted, min(runs), max(runs), device.peak_bytes))
    for budget, predicted, low, worst, live in rows:
        print(f"\nrank {rank} raf={reshard_after_forward}: budget {budget} B predicted "
              f"{predicted} B measured {low}..{worst} B (allocator, {RUNS} runs) {live} B "
              f"(live); predicted/worst {predicted / worst:.4f}", flush=True)
    for budget, predicted, _low, worst, live in rows:
        assert predicted <= budget
        assert worst <= predicted <= max(OVER * worst, worst + slack), (
            rank, budget, predicted, worst)
        assert live <= predicted, (rank, budget, predicted, live)
    found: list = [None] * WORLD
    dist.all_gather_object(found, [r[1] for r in rows])
    assert all(f == found[0] for f in found), "one profile, one set of plans on every rank"


def _raf_true(rank: int) -> None:
    _check_accuracy(rank, True)


def _raf_false(rank: int) -> None:
    _check_accuracy(rank, False)


@pytest.mark.slow
@pytest.mark.parametrize("check", [_raf_true, _raf_false],
                         ids=["reshard_after_forward", "kept_gathered"])
def test_per_rank_predictions_cover_every_run_and_stay_close(
        free_port: int, check: Callable[[int], None]) -> None:
    _spawn(check, free_port)
