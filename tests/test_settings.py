"""Settings as values: the profiling settings are one frozen value, which is also the profile
cache's key; verification is one value; the compiled search is its own entry point; the
budget is resolved to bytes once (issue 30, item 3)."""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import pytest
import torch

import remat
from remat import api, models
from remat.core.errors import ArgumentError
from remat.core.settings import UNKEYED, ProfilingSettings, Verify, verify_setting
from remat.integrations.common import CallbackSettings, solve_plan
from remat.profiler import profile_levels
from remat.tune import compiled as compiled_search
from remat.tune.profile_cache import forget_profiles, settings_key

FIELDS = [f.name for f in dataclasses.fields(ProfilingSettings)]


# profile_levels' keywords that are not settings: ``variants_needed`` is a budget's
# question asked by solve() (the profile records what it skipped: meta["head_variants"]).
_NOT_SETTINGS = frozenset({"variants_needed"})


def _keyword_defaults(fn: Any) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _NOT_SETTINGS}


# --------------------------------------------------------------------- one value, one key
def test_the_value_is_every_setting_the_profiler_takes() -> None:
    # A setting added to the profiler and not here fails this test (and so cannot be
    # missing from the cache's key, which is built from the fields).
    defaults = {f.name: f.default for f in dataclasses.fields(ProfilingSettings)}
    assert defaults == _keyword_defaults(profile_levels)


def test_remat_profile_has_a_real_signature() -> None:
    # Every setting by name, with the profiler's default: no **settings.
    params = inspect.signature(remat.profile).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert _keyword_defaults(remat.profile) == _keyword_defaults(profile_levels)


class _Optimizer:
    state: dict[str, Any] = {}


# One value per field other than its default. A field added to ProfilingSettings without a
# value here fails test_every_field_is_in_the_cache_key: the key must be shown to see it.
OTHER_VALUES: dict[str, Any] = {
    "loss_fn": lambda output, batch: output.sum(),
    "optimizer": _Optimizer(),
    "units": ["0", "1"],
    "options": ("keep", "checkpoint"),
    "loop": remat.Loop(accumulation_steps=2),
    "granularity": "children",
    "head": "none",
    "warmup": 2,
    "repeats": 5,
    "tolerance": 0.2,
    "pool_twins": False,
    "progress": False,
}


@pytest.mark.parametrize("field", FIELDS)
def test_every_field_is_in_the_cache_key(field: str) -> None:
    assert field in OTHER_VALUES, f"give ProfilingSettings.{field} a value in OTHER_VALUES"
    base = ProfilingSettings()
    changed = base.replace(**{field: OTHER_VALUES[field]})
    names = [name for name, _ in settings_key(base)]
    if field in UNKEYED:  # changes no figure (repeats is compared apart, by the cache)
        assert field not in names
        assert settings_key(changed) == settings_key(base)
    else:
        assert field in names
        assert settings_key(changed) != settings_key(base)


def test_the_key_is_read_from_the_fields() -> None:
    assert [name for name, _ in settings_key(ProfilingSettings())] == [
        f for f in FIELDS if f not in UNKEYED]
    # The defaults spelled out are the same key; a list of units keys as its tuple.
    explicit = ProfilingSettings(**{f.name: f.default for f in dataclasses.fields(
        ProfilingSettings)})
    assert settings_key(explicit) == settings_key(ProfilingSettings())
    assert (settings_key(ProfilingSettings(units=["a"]))
            == settings_key(ProfilingSettings(units=("a",))))


def test_the_value_is_frozen_and_becomes_the_profilers_keywords() -> None:
    settings = ProfilingSettings(head="none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.head = "auto"  # type: ignore[misc]
    assert settings.as_kwargs() == {**_keyword_defaults(profile_levels), "head": "none"}
    assert settings.replace(warmup=2).warmup == 2 and settings.warmup == 1


def test_progress_is_not_a_new_profile() -> None:
    forget_profiles()
    ref = models.build("mlp", size="tiny", seed=0)
    first = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1)
    assert remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1,
                         progress=False) is first
    # The value reaches the cache: the same settings built by estimate() reuse it.
    assert remat.estimate(ref.model, ref.batch, loss_fn=ref.loss_fn).parameters == \
        first.param_bytes


# --------------------------------------------------------------------- verification
def test_verify_reads_one_value() -> None:
    assert verify_setting(True) == Verify() == Verify(rounds=3, steps=1)
    assert verify_setting(False) is None
    assert verify_setting(False, rounds=2) is None  # checked, then not run
    assert verify_setting(True, rounds=5, steps=12) == Verify(rounds=5, steps=12)
    assert verify_setting(Verify(steps=4)) == Verify(steps=4)
    with pytest.raises(ArgumentError, match=r"verify must be True .* got verify=1"):
        verify_setting(1)  # an int is not a flag


def test_solve_verifies_as_the_value_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.tune import verify as verification

    seen: dict[str, Any] = {}
    real_measure, real_verified = verification.measure_plan, verification.verified

    def measure_plan(*args: Any, steps: int, **kwargs: Any) -> Any:
        seen.setdefault("steps", steps)
        return real_measure(*args, steps=steps, **kwargs)

    def verified(*args: Any, rounds: int, **kwargs: Any) -> Any:
        seen["rounds"] = rounds
        return real_verified(*args, rounds=rounds, **kwargs)

    monkeypatch.setattr(verification, "measure_plan", measure_plan)
    monkeypatch.setattr(verification, "verified", verified)
    ref = models.build("mlp", size="tiny", seed=0)
    plan = remat.solve(ref.model, ref.batch, "100%", loss_fn=ref.loss_fn,
                       verify=remat.Verify(rounds=2, steps=2))
    assert seen == {"rounds": 2, "steps": 2}
    assert plan.verification is not None


@pytest.mark.parametrize("timed", [False, True])
def test_verification_times_a_step_only_when_asked(timed: bool) -> None:
    # Untimed by default: verification is most of a second budget's cost (two metered
    # steps); a third, timed, step is asked for with Verify(timed=True).
    ref = models.build("mlp", size="tiny", seed=0)
    plan = remat.solve(ref.model, ref.batch, "100%", loss_fn=ref.loss_fn,
                       verify=remat.Verify(timed=timed))
    assert plan.verification is not None and plan.verification.measured_peak_bytes > 0
    assert (plan.verification.measured_time_ms is not None) is timed


# --------------------------------------------------------------------- the budget, once
def test_the_budget_is_resolved_to_bytes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.solver import solve as solver

    resolved: list[Any] = []
    asked: list[Any] = []
    real_resolve, real_solve = api.resolve_budget, solver.solve_profile

    def resolve_budget(budget: Any, profile: Any) -> int:
        resolved.append(budget)
        return real_resolve(budget, profile)

    def solve_profile(profile: Any, budget: Any = None, **kwargs: Any) -> Any:
        asked.append(budget)
        return real_solve(profile, budget, **kwargs)

    monkeypatch.setattr(api, "resolve_budget", resolve_budget)
    monkeypatch.setattr(solver, "solve_profile", solve_profile)
    ref = models.build("mlp", size="tiny", seed=0)
    plan = remat.solve(ref.model, ref.batch, "100%", loss_fn=ref.loss_fn)
    assert len(resolved) == 1
    assert asked and all(type(b) is int for b in asked)  # bytes, never the string again
    assert plan.budget_bytes == asked[0]


# --------------------------------------------------------------------- the compiled search
def test_solve_compiled_is_its_own_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its search keywords are its own, with the search's defaults.
    search_defaults = _keyword_defaults(compiled_search.search_compiled)
    ours = _keyword_defaults(remat.solve_compiled)
    for name in api.COMPILED_SEARCH_PARAMS:
        assert ours[name] == search_defaults[name], name
    assert "verify" not in ours and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        for p in inspect.signature(remat.solve_compiled).parameters.values())

    calls: list[dict[str, Any]] = []

    def search(model: Any, batch: Any, prof: Any, budget: Any, **kwargs: Any) -> Any:
        from remat.solver.solve import solve_profile

        calls.append({"budget": budget, **kwargs})
        return solve_profile(prof, budget)

    monkeypatch.setattr(compiled_search, "search_compiled", search)
    ref = models.build("mlp", size="tiny", seed=0)
    remat.solve_compiled(ref.model, ref.batch, 10**9, loss_fn=ref.loss_fn, points=5,
                         max_compiles=2, partitioner_budgets=(1.0,))
    # solve(compiled=True) is the same call.
    remat.solve(ref.model, ref.batch, 10**9, loss_fn=ref.loss_fn, compiled=True, points=5,
                max_compiles=2, partitioner_budgets=(1.0,))
    assert calls[0] == calls[1]
    assert calls[0]["budget"] == 10**9 and calls[0]["points"] == 5
    assert calls[0]["max_compiles"] == 2 and calls[0]["partitioner_budgets"] == (1.0,)
    assert calls[0]["loss_fn"] is ref.loss_fn


# --------------------------------------------------------------------- the callbacks
def test_a_callback_passes_its_settings_as_one_value(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def solve_with(model: Any, batch: Any, budget: Any, settings: ProfilingSettings,
                   **kwargs: Any) -> str:
        seen.update(settings=settings, budget=budget, **kwargs)
        return "plan"

    monkeypatch.setattr(api, "solve_with", solve_with)
    loss = OTHER_VALUES["loss_fn"]
    callback = CallbackSettings("1GB", profiling=ProfilingSettings(loss_fn=loss, units=["0"]),
                                verify=Verify(rounds=4))
    optimizer, loop = types.SimpleNamespace(), remat.Loop(keep_output=False)
    assert solve_plan(torch.nn.Linear(2, 2), torch.ones(1, 2), loop, optimizer,
                      callback) == "plan"
    assert seen["settings"] == ProfilingSettings(loss_fn=loss, units=["0"], loop=loop,
                                                 optimizer=optimizer)
    assert seen["budget"] == "1GB" and seen["verify"] == Verify(rounds=4)
    # A wrapper's loss and head replace the callback's; no optimizer when not included.
    solve_plan(torch.nn.Linear(2, 2), torch.ones(1, 2), loop, optimizer,
               dataclasses.replace(callback, include_optimizer=False),
               loss_fn=max, head="none")
    assert seen["settings"].loss_fn is max and seen["settings"].head == "none"
    assert seen["settings"].optimizer is None


def test_a_callbacks_verify_is_checked_when_it_is_made() -> None:
    hf = pytest.importorskip("remat.integrations.hf")
    with pytest.raises(ArgumentError, match="RematCallback: verify must be True"):
        hf.RematCallback("1GB", verify="always")
    assert hf.RematCallback("1GB", verify=False).settings.verify is None
    assert hf.RematCallback("1GB", verify=remat.Verify(steps=3)).settings.verify == Verify(
        steps=3)
