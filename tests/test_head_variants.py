"""The head's chunked variants are measured only where a budget needs them.

With ``head="auto"`` a plan chunks the head only below the smallest peak of the head as
written, so ``remat.solve`` asks the profiler to measure the head as it is first and,
only for a budget under that floor, its most frugal chunked variant (issue: planning
cost). Each test counts the profiler's outside runs (the head as it is, or over a chunk
count).
"""

from __future__ import annotations

import loop_models as lm
import pytest

import remat
import remat.profiler.outside as outside
from remat.solver import min_peak_bytes
from remat.solver.head_choice import lowest_floor
from remat.tune.profile_cache import forget_profiles

DROP = remat.Loop(keep_output=False)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The chunk counts of the outside runs measured (``None``: the head as it is)."""
    seen: list[int | None] = []
    real = outside._measure

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(args[8])  # chunks
        return real(*args, **kwargs)

    monkeypatch.setattr(outside, "_measure", counted)
    forget_profiles()
    yield seen
    forget_profiles()


@pytest.fixture(scope="module")
def case_and_floors():
    case = lm.causal_lm_head_loss()
    full = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=DROP, repeats=1)
    chunks, lowest = lowest_floor(full)
    assert chunks is not None
    forget_profiles()
    return case, min_peak_bytes(full), lowest


def _solve(case, budget, **kw):  # type: ignore[no-untyped-def]
    return remat.solve(case.model, case.batch, budget, loss_fn=case.loss_fn, loop=DROP, **kw)


def test_a_budget_above_the_head_as_written_measures_no_variant(case_and_floors, runs) -> None:
    case, floor, _ = case_and_floors
    plan = _solve(case, int(floor * 1.2))
    assert plan.head is None
    assert runs == [None]  # one outside run: the head as it is
    prof = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=DROP)
    # remat.profile() (no budget) does not take the partial profile: it measures them all.
    assert prof.head is not None and prof.head.chunk_counts == (4, 16)
    assert runs[1:] == [16, 4, None]  # most frugal first, as without a budget


def test_a_budget_below_it_measures_the_most_frugal_after_the_head_as_it_is(
        case_and_floors, runs) -> None:
    case, floor, lowest = case_and_floors
    plan = _solve(case, int((floor + lowest) / 2))
    assert plan.head is not None and plan.head.chunks == 16
    assert runs == [None, 16]  # as it is, then the most chunks only
    assert plan.verification is not None
    assert plan.verification.measured_peak_bytes <= plan.budget_bytes


def test_a_lower_second_budget_measures_them_once_and_keeps_them(case_and_floors, runs) -> None:
    case, floor, lowest = case_and_floors
    assert _solve(case, int(floor * 1.2)).head is None
    assert _solve(case, int((floor + lowest) / 2)).head is not None
    assert runs == [None, 16, 4, None]  # the second solve profiled once more, with them
    assert _solve(case, int(floor * 1.2)).head is None
    assert runs == [None, 16, 4, None]  # the third one took the cached full profile


def test_a_chunked_head_asked_for_measures_every_variant(case_and_floors, runs) -> None:
    case, floor, _ = case_and_floors
    _solve(case, int(floor * 1.2), head="chunked")
    assert runs == [16, 4, None]


def test_a_head_check_that_does_not_fit_the_device_leaves_the_head_as_written(
        case_and_floors, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check runs one example's step unplanned; on a device sized for the most frugal
    # plan that can run out of memory: the profile goes on, with the head as written.
    import torch

    import remat.profiler.heads as heads

    def too_big(*_: object) -> None:
        raise torch.OutOfMemoryError("simulated device out of memory: test")

    monkeypatch.setattr(heads, "check_head_rewrite", too_big)
    case, _, _ = case_and_floors
    forget_profiles()
    prof = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=DROP, repeats=1)
    forget_profiles()
    assert prof.head is None
    assert "does not fit the device" in prof.meta["head_not_chunked"]
