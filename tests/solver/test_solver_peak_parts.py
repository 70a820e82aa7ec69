"""simulate()'s peak_parts: what the peak is made of, by a hand count and on random profiles."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_testlib import KEEP, all_plans, cost, profiles, unit

from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver.simulate import PEAK_PARTS, simulate


def test_parts_of_a_hand_counted_peak() -> None:
    # Two kept units on a chain: each holds 100 B and its 10 B input, peaks 50 B above
    # that in its backward; 10 B boundaries and input gradients, 5 B of parameter
    # gradients each. The last unit's backward is the peak: both units' 100 B, the
    # held boundaries b0 and b1 (20 B) and its 50 B working memory are activations; the
    # gradient of its output (10 B) is the only gradient alive.
    units = tuple(unit(f"u{i}", {KEEP: cost(100, bwd=50)}, in_grad=10, pgrad=5) for i in range(2))
    profile = Profile(units=units, is_chain=True, param_bytes=1000, buffer_bytes=100,
                      optimizer_state_bytes=2000)
    sim = simulate(profile, Plan.keep_all(["u0", "u1"]))
    assert sim.peak_event == "backward u1"
    assert sim.peak_parts == {
        "parameters": 1000, "buffers": 100, "optimizer state": 2000, "inputs": 0,
        "gradients": 10, "activations": 270,
    }
    assert sim.peak_bytes == 3380


SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(profiles(max_units=5, max_plans=300), st.randoms(use_true_random=False))
def test_parts_sum_to_the_peak(profile: Profile, rng) -> None:
    plans = list(all_plans(profile))
    for plan in rng.sample(plans, min(10, len(plans))):
        sim = simulate(profile, plan)
        assert tuple(sim.peak_parts) == PEAK_PARTS
        assert sum(sim.peak_parts.values()) == sim.peak_bytes
        assert min(sim.peak_parts.values()) >= 0
        assert sim.peak_parts["parameters"] == profile.param_bytes


@SETTINGS
@given(profiles(max_units=5, max_plans=300), st.randoms(use_true_random=False))
def test_at_the_optimizer_step_every_parameter_gradient_is_alive(profile: Profile, rng) -> None:
    # A huge optimizer step puts the peak there, after the whole backward pass: then
    # the gradients are exactly the parameter gradients (activation gradients are
    # consumed), and the rest is the loss, what the loop keeps to the end (its output,
    # shared tensors held to the end) and the step's working memory.
    after = dataclasses.replace(profile.loop, optimizer_in_backward=False)
    big = dataclasses.replace(profile, optimizer_step_peak_bytes=10**9, loop=after)
    plan = rng.choice(list(all_plans(big)))
    sim = simulate(big, plan)
    assert sim.peak_event == "optimizer step"
    assert sim.peak_parts["gradients"] == big.grad_bytes
    kept = (big.output_bytes + big.kept_last_output_bytes
            + sum(t.nbytes for t in big.shared if t.held_to_end))
    assert sim.peak_parts["activations"] == big.loss_bytes + kept + 10**9


@SETTINGS
@given(profiles(max_units=5, max_plans=300), st.randoms(use_true_random=False))
def test_stepped_in_backward_no_parameter_gradient_outlives_its_phase(profile: Profile,
                                                                      rng) -> None:
    # With the optimizer stepped in backward there is no step after it (however large
    # the step after backward measured), no gradient is alive at the end of backward,
    # and a phase's step in backward puts the peak at that phase.
    loop = dataclasses.replace(profile.loop, accumulation_steps=1, set_to_none=True,
                               optimizer_in_backward=True)
    big = dataclasses.replace(profile, optimizer_step_peak_bytes=10**9, loop=loop)
    plan = rng.choice(list(all_plans(big)))
    sim = simulate(big, plan)
    assert sim.peak_bytes < 10**9
    events = dict(sim.events)
    assert events["optimizer step"] == events["backward end"]
    assert big.persistent_bytes == big.fixed_bytes
    stepped = dataclasses.replace(big, suffix=dataclasses.replace(
        big.suffix, stepped_bwd_peak_bytes=10**9))
    sim = simulate(stepped, plan)
    assert sim.peak_event == "backward suffix"
    # Not in the loop that steps after backward: the figure is the in-backward loop's.
    plain = dataclasses.replace(stepped, optimizer_step_peak_bytes=0, loop=dataclasses.replace(
        loop, optimizer_in_backward=False))
    assert simulate(plain, plan).peak_bytes < 10**9
