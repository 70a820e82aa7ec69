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


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The heads whose rewrite was checked (two passes on one example each)."""
    import remat.profiler.heads as heads

    seen: list[str] = []
    real = heads.check_head_rewrite

    def counted(runner, site, state):  # type: ignore[no-untyped-def]
        seen.append(site.name)
        return real(runner, site, state)

    monkeypatch.setattr(heads, "check_head_rewrite", counted)
    return seen


def test_the_rewrite_is_checked_only_where_the_budget_needs_it(
        case_and_floors, runs, checks) -> None:
    """A budget above the head as written never chunks it: its check (a whole step's
    worth where the batch is one example) does not run; below, it runs once, before the
    variant is measured."""
    case, floor, lowest = case_and_floors
    assert _solve(case, int(floor * 1.2)).head is None
    assert checks == []
    forget_profiles()
    assert _solve(case, int((floor + lowest) / 2)).head is not None
    assert len(checks) == 1 and runs[-2:] == [None, 16]


def test_a_rewrite_failing_its_check_where_the_budget_needs_it_is_not_measured(
        case_and_floors, runs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked only then, and failing: the head as it is is all the profile has, so a
    budget only the chunked head meets is infeasible, and the profile says why."""
    import remat.profiler.heads as heads
    from remat.profiler.head_check import HeadCheck

    monkeypatch.setattr(heads, "check_head_rewrite",
                        lambda *_: HeadCheck("the loss changes with the head chunked (test)"))
    case, floor, lowest = case_and_floors
    with pytest.raises(remat.RematError, match="smallest peak any plan reaches"):
        _solve(case, int((floor + lowest) / 2))
    assert runs == [None]
    prof = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=DROP, repeats=1)
    assert prof.head is None and "test" in prof.meta["head_not_chunked"]


def _rewrite_failing_in_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's chunked rewrite raises wherever it runs (passes and check alike)."""
    import contextlib

    import remat.profiler.head_check as head_check
    import remat.profiler.heads as heads

    @contextlib.contextmanager
    def failing(model, site, chunks):  # type: ignore[no-untyped-def]
        head = model.get_submodule(site.name)

        def fails(*_: object, **__: object) -> None:
            raise ValueError("this rewrite fails on this model (test)")

        head.forward = fails
        try:
            yield
        finally:
            del head.forward

    monkeypatch.setattr(heads, "chunked_head", failing)
    monkeypatch.setattr(head_check, "chunked_head", failing)


def test_a_rewrite_failing_in_an_unchecked_pass_is_checked_and_left_out(
        monkeypatch: pytest.MonkeyPatch, checks: list[str]) -> None:
    """The profiling forwards compute the head chunked before its check: where one fails
    with it, the check decides whose failure it is; the rewrite's, so the passes run
    again with the head as written and the plan is made without it."""
    _rewrite_failing_in_the_forward(monkeypatch)
    case = lm.hf_gpt2()
    forget_profiles()
    plan = remat.solve(case.model, case.batch, "1GB", loop=DROP)
    forget_profiles()
    assert checks == ["lm_head"]  # a budget the head as written meets: only after the failure
    assert plan.head is None and plan.verification is not None


def test_a_models_own_failure_in_an_unchecked_pass_is_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the rewrite passes its check, the failure is the model's: raised as it is."""
    import remat.profiler.heads as heads
    from remat.profiler.head_check import HeadCheck

    _rewrite_failing_in_the_forward(monkeypatch)
    monkeypatch.setattr(heads, "check_head_rewrite", lambda *_: HeadCheck(None, 1.0, 1.0, 0.0))
    case = lm.hf_gpt2()
    forget_profiles()
    with pytest.raises(ValueError, match="fails on this model"):
        remat.solve(case.model, case.batch, "1GB", loop=DROP)
    forget_profiles()
