"""Shared helpers for the solver tests: profile builders, hypothesis strategies, brute force.

The brute force enumerates every plan of the plan space (every option a unit has a
cost for, and on a chain every set of disjoint multi-unit checkpoint segments) and
scores each one with ``simulate()`` only, so it shares no code with the solvers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

from hypothesis import assume
from hypothesis import strategies as st

from remat.core.loop import Loop
from remat.core.option import Option
from remat.core.plan import Plan
from remat.core.profile import OptionCost, OutsideCost, Profile, SharedTensor, UnitProfile
from remat.solver.simulate import simulate

KEEP, CKPT, SEL, DER, OFF = (o.value for o in Option)


def cost(
    held: int,
    fwd: int = 0,
    bwd: int = 0,
    *,
    hin: bool = True,
    hout: bool = False,
    ms: float = 0.0,
) -> OptionCost:
    """A short-hand OptionCost."""
    return OptionCost(held, hin, hout, fwd, bwd, ms)


def unit(
    name: str,
    options: dict[str, OptionCost],
    *,
    in_bytes: int = 10,
    out_bytes: int = 10,
    in_grad: int | None = None,
    pgrad: int = 0,
    in_outside: bool = False,
    out_outside: bool = False,
) -> UnitProfile:
    """A short-hand UnitProfile (times are irrelevant to the solver: only extra_ms)."""
    return UnitProfile(
        name=name,
        type_name="Block",
        fwd_ms=1.0,
        bwd_ms=2.0,
        input_bytes=in_bytes,
        output_bytes=out_bytes,
        input_grad_bytes=in_bytes if in_grad is None else in_grad,
        param_grad_bytes=pgrad,
        options=options,
        input_held_outside=in_outside,
        output_held_outside=out_outside,
    )


# ---------------------------------------------------------------------------------
# Brute force
# ---------------------------------------------------------------------------------
def all_plans(profile: Profile) -> Iterator[Plan]:
    """Every plan of the plan space, each exactly once."""
    names = tuple(u.name for u in profile.units)
    n = profile.n

    def rec(i: int, opts: list[str], segs: list[tuple[int, int]]) -> Iterator[Plan]:
        if i == n:
            yield Plan(names, tuple(opts), tuple(segs))
            return
        for o in profile.units[i].options:
            yield from rec(i + 1, [*opts, o], segs)
        if not profile.is_chain:
            return
        j = i
        while j + 1 < n and profile.segment_link(j):
            j += 1
            yield from rec(j + 1, [*opts, *[CKPT] * (j - i + 1)], [*segs, (i, j)])

    yield from rec(0, [], [])


@dataclass(frozen=True)
class Scored:
    """Every plan of a profile with simulate()'s (peak bytes, time ms), for many budgets."""

    plans: tuple[Plan, ...]
    peaks: tuple[int, ...]
    times: tuple[float, ...]

    @classmethod
    def of(cls, profile: Profile) -> Scored:
        plans = tuple(all_plans(profile))
        sims = [simulate(profile, p) for p in plans]
        return cls(plans, tuple(s.peak_bytes for s in sims), tuple(s.time_ms for s in sims))

    @property
    def min_peak(self) -> int:
        return min(self.peaks)

    def best_time(self, budget: int) -> float | None:
        """The least time among plans peaking at most ``budget`` (None if none fits)."""
        fits = [t for p, t in zip(self.peaks, self.times) if p <= budget]
        return min(fits) if fits else None


def brute_force(profile: Profile, budget: int) -> tuple[float, int] | None:
    """(min simulated time, the smallest peak among plans with that time) under ``budget``."""
    best: tuple[float, int] | None = None
    for plan in all_plans(profile):
        peak, ms = simulate(profile, plan)
        if peak <= budget and (best is None or ms < best[0] - 1e-9):
            best = (ms, peak)
    return best


def brute_min_peak(profile: Profile) -> int:
    """The smallest simulated peak over every plan."""
    return min(simulate(profile, plan).peak_bytes for plan in all_plans(profile))


def keep_peak(profile: Profile) -> int:
    return simulate(profile, Plan.keep_all([u.name for u in profile.units])).peak_bytes


# ---------------------------------------------------------------------------------
# Hypothesis strategies
# ---------------------------------------------------------------------------------
_bytes = st.integers(min_value=0, max_value=60)
_pos_ms = st.floats(min_value=0.25, max_value=8.0).map(lambda x: round(x * 4) / 4)


@st.composite
def option_costs(draw: st.DrawFn, name: str) -> OptionCost:
    """A random cost; non-keep options always cost some time (extra_ms > 0)."""
    return OptionCost(
        held_bytes=draw(_bytes),
        holds_input=draw(st.booleans()),
        holds_output=draw(st.booleans()),
        fwd_peak_bytes=draw(_bytes),
        bwd_peak_bytes=draw(_bytes),
        extra_ms=0.0 if name == KEEP else draw(_pos_ms),
        stepped_bwd_peak_bytes=draw(st.sampled_from([None, None, draw(_bytes)])),
    )


@st.composite
def profiles(
    draw: st.DrawFn, max_units: int = 6, chain: bool | None = None, max_plans: int = 3000
) -> Profile:
    """A random profile of 1..max_units units with random option subsets (keep always)."""
    # Half the time the largest sizes: hypothesis would otherwise favour tiny profiles.
    small = st.integers(min_value=1, max_value=max_units)
    n = draw(st.one_of(small, st.integers(min_value=max(1, max_units - 2), max_value=max_units)))
    is_chain = draw(st.booleans()) if chain is None else chain
    sizes = [draw(st.integers(min_value=1, max_value=40)) for _ in range(n + 1)]
    units = []
    for i in range(n):
        # Fewer options per unit on long profiles keeps the brute force affordable.
        most = 3 if n <= 5 else 2
        extra = draw(st.lists(st.sampled_from([CKPT, SEL, DER, OFF]), unique=True, max_size=most))
        options = {name: draw(option_costs(name)) for name in [KEEP, *extra]}
        units.append(
            UnitProfile(
                name=f"u{i}",
                type_name=draw(st.sampled_from(["Attn", "Mlp"])),
                fwd_ms=1.0,
                bwd_ms=2.0,
                input_bytes=sizes[i],
                output_bytes=sizes[i + 1] if is_chain else draw(st.integers(1, 40)),
                input_grad_bytes=draw(st.sampled_from([0, sizes[i]])),
                param_grad_bytes=draw(_bytes),
                options=options,
                input_held_outside=draw(st.booleans()),
                output_held_outside=draw(st.booleans()),
                autocast_cache_bytes=draw(st.sampled_from([0, 0, draw(_bytes)])),
                input_kept_by_caller=draw(st.sampled_from([False, False, True])),
                input_grad_kept_until=None if is_chain else draw(
                    st.sampled_from([None, None, *range(-1, i)])),
                # Off a chain, the code between this unit and the previous one.
                **({} if is_chain or i == 0 else {
                    name: draw(st.sampled_from([0, 0, draw(_bytes)]))
                    for name in ("before_held_bytes", "before_fwd_peak_bytes",
                                 "before_bwd_peak_bytes",
                                 "before_param_grad_bytes")}),
                recompute_state_bytes=draw(st.sampled_from([0, 0, draw(_bytes)])),
            )
        )
    outside = st.builds(
        OutsideCost,
        held_bytes=_bytes,
        fwd_peak_bytes=_bytes,
        bwd_peak_bytes=_bytes,
        param_grad_bytes=_bytes,
        stepped_bwd_peak_bytes=st.sampled_from([None, None, 0, 7, 30, 60]),
    )
    # Every byte figure simulate() may read is drawn, so that a change to its rules
    # the DP does not mirror fails the brute-force comparison.
    optional = {f.name for f in fields(Profile)} & {"loss_bytes"}
    profile = Profile(
        units=tuple(units),
        is_chain=is_chain,
        prefix=draw(outside),
        suffix=draw(outside),
        param_bytes=draw(st.integers(0, 100)),
        optimizer_state_bytes=draw(st.integers(0, 100)),
        optimizer_step_peak_bytes=draw(_bytes),
        step_ms=draw(st.floats(min_value=1.0, max_value=100.0)),
        recompute_rng_bytes=draw(st.sampled_from([0, draw(_bytes)])),
        **{name: draw(_bytes) for name in sorted(optional)},
        **draw(loop_figures(n)),
    )
    # Keep the brute force affordable: skip profiles with too many plans.
    assume(count_plans(profile) <= max_plans)
    return profile


@st.composite
def loop_figures(draw: st.DrawFn, n: int) -> dict:
    """What the training loop adds to a profile: the loop, what it carries and keeps,
    and tensors shared by units (every field simulate() reads about them is drawn)."""
    shared = []
    for _ in range(draw(st.integers(0, 2))):
        first = draw(st.integers(0, n - 1))
        born_after = draw(st.integers(-1, first - 1))
        shared.append(SharedTensor(draw(st.integers(1, 30)), born_after,
                                   first, draw(st.booleans()),
                                   last_user=draw(st.integers(first, n - 1)),
                                   grad_bytes=draw(st.sampled_from([0, draw(_bytes)])),
                                   maker_output=born_after >= 0 and draw(st.booleans())))
    steps, to_none = draw(st.sampled_from([1, 1, 2])), draw(st.booleans())
    # Gradients stepped and freed in backward: only where that loop can hold.
    in_backward = steps == 1 and to_none and draw(st.booleans())
    return {
        "loop": Loop(accumulation_steps=steps, set_to_none=to_none,
                     optimizer_in_backward=in_backward),
        "carried_bytes": draw(st.sampled_from([0, draw(_bytes)])),
        "output_bytes": draw(st.sampled_from([0, draw(_bytes)])),
        "shared": tuple(shared),
        "last_output_kept": draw(st.booleans()),
        "grad_in_flight_bytes": draw(st.sampled_from([0, draw(_bytes)])),
    }


def count_plans(profile: Profile) -> int:
    """How many plans :func:`all_plans` yields, without building them."""
    n = profile.n
    ways = [0] * (n + 1)
    ways[n] = 1
    for i in range(n - 1, -1, -1):
        ways[i] = len(profile.units[i].options) * ways[i + 1]
        if profile.is_chain:
            j = i
            while j + 1 < n and profile.segment_link(j):
                j += 1
                ways[i] += ways[j + 1]
    return ways[0]


def budgets_between(lo: int, hi: int, fractions: Sequence[float]) -> list[int]:
    """Integer budgets at the given fractions of the way from lo to hi."""
    return sorted({lo + int(round(f * (hi - lo))) for f in fractions})


@st.composite
def segment_profiles(draw: st.DrawFn, max_units: int = 8) -> Profile:
    """Chains where segments pay: big keep activations, small boundaries, cheap checkpoints.

    Some units also offer ``selective``, and some lack ``checkpoint`` (which splits runs).
    """
    n = draw(st.integers(min_value=max(2, max_units - 3), max_value=max_units))
    sizes = [draw(st.integers(min_value=1, max_value=8)) for _ in range(n + 1)]
    units = []
    for i in range(n):
        options = {
            KEEP: OptionCost(
                draw(st.integers(15, 60)), draw(st.booleans()), draw(st.booleans()),
                draw(st.integers(0, 70)), draw(st.integers(0, 20)), 0.0,
                stepped_bwd_peak_bytes=draw(st.sampled_from([None, draw(st.integers(0, 40))])),
            )
        }
        if draw(st.integers(0, 5)) > 0:
            options[CKPT] = OptionCost(
                draw(st.integers(0, 3)), True, False, draw(st.integers(0, 10)),
                draw(st.integers(15, 80)), draw(_pos_ms),
                stepped_bwd_peak_bytes=draw(st.sampled_from([None, draw(st.integers(0, 40))])),
            )
        if draw(st.booleans()):
            options[SEL] = OptionCost(
                draw(st.integers(5, 30)), True, draw(st.booleans()), draw(st.integers(0, 70)),
                draw(st.integers(0, 40)), draw(_pos_ms),
                stepped_bwd_peak_bytes=draw(st.sampled_from([None, draw(st.integers(0, 40))])),
            )
        units.append(
            UnitProfile(
                name=f"u{i}", type_name="Block", fwd_ms=1.0, bwd_ms=2.0,
                input_bytes=sizes[i], output_bytes=sizes[i + 1],
                input_grad_bytes=sizes[i], param_grad_bytes=draw(st.integers(0, 10)),
                options=options, input_held_outside=draw(st.booleans()),
                output_held_outside=draw(st.booleans()),
                recompute_state_bytes=draw(st.sampled_from([0, draw(st.integers(0, 10))])),
            )
        )
    return Profile(
        units=tuple(units), is_chain=True,
        suffix=OutsideCost(held_bytes=draw(st.integers(0, 20))),
        param_bytes=draw(st.integers(0, 50)), step_ms=10.0,
        recompute_rng_bytes=draw(st.sampled_from([0, draw(st.integers(0, 10))])),
        **draw(loop_figures(n)),
    )


def transformer_like(
    n: int, seed: int = 0, *, chain: bool = True, varied: bool = False
) -> Profile:
    """A small realistic profile: repeated blocks of two kinds, all four options, noisy times.

    ``varied``: every block's activation bytes also vary by up to 20% (larger DP fronts).
    """
    import random

    rng = random.Random(seed)
    boundary = 1 << 20
    units = []
    for i in range(n):
        held = boundary * (32 if i % 3 else 20)
        if varied:
            held = int(held * rng.uniform(0.8, 1.2))
        ms = (4.0 if i % 3 else 3.0) * rng.uniform(0.95, 1.05)
        options = {
            KEEP: OptionCost(held, True, False, held + boundary, held // 4, 0.0),
            CKPT: OptionCost(0, True, False, boundary + held // 10, held + held // 4, ms),
            SEL: OptionCost(held // 2, True, False, held + boundary, held // 4 + held // 2,
                            ms * 0.2),
            OFF: OptionCost(held // 20, False, False, held + boundary, held + held // 4,
                            ms * 0.6),
        }
        units.append(
            UnitProfile(
                name=f"h.{i}", type_name="Block" if i % 3 else "LocalBlock", fwd_ms=ms,
                bwd_ms=2 * ms, input_bytes=boundary, output_bytes=boundary,
                input_grad_bytes=boundary, param_grad_bytes=4 * boundary, options=options,
                input_held_outside=i == 0,
            )
        )
    return Profile(
        units=tuple(units), is_chain=chain,
        suffix=OutsideCost(held_bytes=4 * boundary, fwd_peak_bytes=8 * boundary),
        param_bytes=64 * boundary, step_ms=3 * 4.0 * n + 10.0,
    )
