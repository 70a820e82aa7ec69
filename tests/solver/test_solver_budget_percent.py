"""One meaning of a percentage: a share of the activation memory; "of peak" says otherwise."""

from __future__ import annotations

import dataclasses
import math
from decimal import Decimal

import pytest
from solver_testlib import keep_peak, transformer_like

from remat import of_activations, of_peak
from remat.core.budget import RelativeBudget, check_budget, parse_budget
from remat.core.errors import BudgetError
from remat.core.loop import Loop
from remat.solver.resolve import resolve_budget

PROFILE = transformer_like(6, seed=2)


def _activation_share(profile, fraction: float) -> int:
    persistent = profile.fixed_bytes + profile.grad_bytes
    return persistent + math.floor(fraction * (keep_peak(profile) - persistent))


@pytest.mark.parametrize("text", ["50%", "50 %", "50% of activations", "50% OF activation",
                                  " 50.0 % of activations "])
def test_a_percentage_is_of_the_activation_memory(text: str) -> None:
    assert resolve_budget(text, PROFILE) == _activation_share(PROFILE, 0.5)


def test_of_peak_is_of_the_whole_no_checkpoint_peak() -> None:
    assert resolve_budget("50% of peak", PROFILE) == math.floor(0.5 * keep_peak(PROFILE))
    assert resolve_budget(of_peak(0.5), PROFILE) == resolve_budget("50% of peak", PROFILE)
    assert resolve_budget(of_activations(0.5), PROFILE) == resolve_budget("50%", PROFILE)


def test_hundred_percent_is_the_no_checkpoint_peak_either_way() -> None:
    assert resolve_budget("100%", PROFILE) == keep_peak(PROFILE)
    assert resolve_budget("100% of peak", PROFILE) == keep_peak(PROFILE)


@pytest.mark.parametrize("loop", [Loop(), Loop(accumulation_steps=4), Loop(set_to_none=False),
                                  Loop(keep_output=False)])
def test_persistent_is_params_state_and_gradients_in_every_loop(loop: Loop) -> None:
    """Every plan's step holds all gradients by the end of backward, so they are persistent
    whether the loop allocates them in the backward pass or keeps them from the start."""
    profile = dataclasses.replace(PROFILE, loop=loop, optimizer_state_bytes=3 << 20)
    persistent = profile.persistent_bytes
    assert persistent == profile.param_bytes + profile.buffer_bytes + (3 << 20) + profile.grad_bytes
    assert persistent <= keep_peak(profile)
    assert resolve_budget("50%", profile) == _activation_share(profile, 0.5)


def test_relative_budgets_print_as_they_parse() -> None:
    for budget in (of_peak(0.6), of_activations(0.125), of_peak(1.5)):
        assert check_budget(str(budget)) == budget
    assert str(of_peak(0.6)) == "60% of peak"
    assert check_budget("60%") == RelativeBudget(Decimal("60"), "activations")


def test_the_syntax_is_checked_without_a_profile() -> None:
    assert check_budget("8GB") == 8 * 10**9
    assert isinstance(check_budget("12%"), RelativeBudget)
    with pytest.raises(BudgetError, match="'of activations' or 'of peak'"):
        check_budget("50% of params")
    with pytest.raises(BudgetError, match="more than 0%"):
        check_budget("0% of peak")
    with pytest.raises(BudgetError, match="no-checkpoint peak"):
        parse_budget(of_peak(0.5))


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), True, "half"])
def test_helpers_refuse_what_is_not_a_fraction(bad: object) -> None:
    with pytest.raises(BudgetError, match="fraction"):
        of_peak(bad)  # type: ignore[arg-type]
    with pytest.raises(BudgetError, match="fraction"):
        of_activations(bad)  # type: ignore[arg-type]
