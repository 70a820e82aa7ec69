"""How fast the exact solvers are on realistic profiles: DP and CP-SAT at 100/300/1000 units.

Profiles are transformer-like: a chain of blocks of three kinds repeating in a
fixed pattern (dense, mixture-of-experts, local attention), byte counts derived
from the shapes (identical for blocks of one kind, as a profiler measures them)
and times with a few percent of measurement noise. Every unit offers all four
options. The budget is half way between the smallest feasible peak and the
no-checkpoint peak, where it binds.

Run: ``.venv/bin/python benchmarks/solver_speed.py`` (writes
``benchmarks/results/solver_speed.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from _common import RESULTS, machine_line, markdown_table, write_result

from remat import Option, Plan, Profile, RematError
from remat.core import MIB, OptionCost, OutsideCost, UnitProfile, mib
from remat.solver import min_peak_bytes, no_checkpoint_peak_bytes, solve_dp, solve_ilp

log = logging.getLogger("solver_speed")

COLUMNS = ("units", "DP s (median)", "ILP s", "ILP status", "optimal time agree?",
           "ILP s, DP-hinted", "status", "agree?", "budget MiB", "overhead %", "DP plan")


@dataclass(frozen=True)
class BlockKind:
    """One kind of transformer block, as multiples of the boundary size ``s*b*h``.

    Attributes:
        name: class name of the block.
        keep_held: bytes autograd saves, boundary excluded, in boundary units.
        attn_share: the part of ``keep_held`` that selective recomputation drops.
        fwd_ms: forward time in milliseconds (before noise).
        param_grad_mib: parameter-gradient MiB.
        offload_cost: offload's added time as a multiple of ``fwd_ms`` (copies not hidden).
    """

    name: str
    keep_held: float
    attn_share: float
    fwd_ms: float
    param_grad_mib: int
    offload_cost: float


KINDS = (
    BlockKind("DenseBlock", keep_held=32.0, attn_share=0.55, fwd_ms=4.0, param_grad_mib=24,
              offload_cost=0.6),
    BlockKind("MoEBlock", keep_held=48.0, attn_share=0.35, fwd_ms=6.0, param_grad_mib=96,
              offload_cost=0.8),
    BlockKind("LocalAttnBlock", keep_held=22.0, attn_share=0.2, fwd_ms=3.0, param_grad_mib=24,
              offload_cost=0.5),
)
PATTERN = (0, 0, 1, 0, 2)  # dense, dense, moe, dense, local -- repeated


def _options(kind: BlockKind, boundary: int, fwd_ms: float) -> dict[str, OptionCost]:
    """The four options' costs of one block, from its kind and measured forward time."""
    held = int(kind.keep_held * boundary)
    temp = held // 10  # forward temporaries (attention softmax, GELU input, ...)
    attn = int(held * kind.attn_share)
    return {
        Option.KEEP.value: OptionCost(held, True, False, held + boundary + temp, held // 4),
        Option.CHECKPOINT.value: OptionCost(
            0, True, False, boundary + temp, held + held // 4, extra_ms=fwd_ms
        ),
        Option.SELECTIVE.value: OptionCost(
            held - attn, True, False, held + boundary + temp, held // 4 + attn,
            extra_ms=fwd_ms * kind.attn_share * 0.4,
        ),
        Option.OFFLOAD.value: OptionCost(
            held // 20, False, False, held + boundary + temp, held // 4 + held,
            extra_ms=fwd_ms * kind.offload_cost,
        ),
    }


def transformer_profile(n_units: int, seed: int = 0, boundary_mib: int = 8) -> Profile:
    """A chain of ``n_units`` transformer-like blocks with all four options."""
    rng = random.Random(seed)
    boundary = boundary_mib * MIB
    units = []
    for i in range(n_units):
        kind = KINDS[PATTERN[i % len(PATTERN)]]
        fwd_ms = kind.fwd_ms * rng.uniform(0.95, 1.05)
        units.append(
            UnitProfile(
                name=f"model.layers.{i}",
                type_name=kind.name,
                fwd_ms=fwd_ms,
                bwd_ms=2 * fwd_ms,
                input_bytes=boundary,
                output_bytes=boundary,
                input_grad_bytes=boundary,
                param_grad_bytes=kind.param_grad_mib * MIB,
                options=_options(kind, boundary, fwd_ms),
                input_held_outside=i == 0,
            )
        )
    step_ms = 3 * sum(u.fwd_ms for u in units) + 20.0
    return Profile(
        units=tuple(units),
        is_chain=True,
        prefix=OutsideCost(held_bytes=boundary, fwd_peak_bytes=2 * boundary,
                           param_grad_bytes=200 * MIB, fwd_ms=1.0, bwd_ms=2.0),
        suffix=OutsideCost(held_bytes=8 * boundary, fwd_peak_bytes=16 * boundary,
                           bwd_peak_bytes=8 * boundary, param_grad_bytes=200 * MIB,
                           fwd_ms=5.0, bwd_ms=10.0),
        param_bytes=sum(u.param_grad_bytes for u in units) + 400 * MIB,
        optimizer_state_bytes=2 * (sum(u.param_grad_bytes for u in units) + 400 * MIB),
        step_ms=step_ms,
    )


def binding_budget(profile: Profile) -> int:
    """Half way between the smallest feasible peak and the no-checkpoint peak."""
    lo = min_peak_bytes(profile)
    hi = no_checkpoint_peak_bytes(profile)
    return lo + (hi - lo) // 2


def _time_dp(profile: Profile, budget: int, repeats: int) -> tuple[float, Plan]:
    """Median wall seconds of ``repeats`` DP solves, and the plan. Each solves a fresh
    copy of the profile, so the time includes building its event model (which later
    solves of the same profile reuse)."""
    times = []
    plan = None
    for _ in range(repeats):
        fresh = dataclasses.replace(profile)
        start = time.perf_counter()
        plan = solve_dp(fresh, budget)
        times.append(time.perf_counter() - start)
    assert plan is not None
    return statistics.median(times), plan


@dataclass(frozen=True)
class IlpRun:
    """One CP-SAT run: wall seconds (model building included), status, and agreement."""

    seconds: float
    status: str
    agree: str


def _run_ilp(
    profile: Profile, budget: int, dp_plan: Plan, limit_s: float, hint: Plan | None
) -> IlpRun:
    start = time.perf_counter()
    try:
        plan = solve_ilp(profile, budget, time_limit_s=limit_s, hint=hint)
    except RematError as err:  # no plan within the time limit
        log.info("ilp: %s", err)
        return IlpRun(time.perf_counter() - start, "no plan in time", "n/a")
    seconds = time.perf_counter() - start
    record = plan.record
    assert record.predicted_peak_bytes is not None and record.predicted_peak_bytes <= budget
    assert record.predicted_time_ms is not None and dp_plan.record.predicted_time_ms is not None
    gap = plan.record.predicted_time_ms - dp_plan.record.predicted_time_ms
    # Equal up to CP-SAT's integer-nanosecond time scaling (see solver/ilp.py).
    if abs(gap) <= 1e-6 * profile.n:
        agree = "yes"
    elif gap > 0 and plan.record.status != "optimal":
        agree = f"no proof: ILP {gap:+.3f} ms"
    else:
        agree = f"NO (ILP {gap:+.6f} ms)"
    return IlpRun(seconds, plan.record.status, agree)


def _row(n: int, repeats: int, ilp_limit_s: float) -> list[str]:
    """One table row: DP and CP-SAT (cold and DP-hinted) on ``n`` units."""
    profile = transformer_profile(n, seed=n)
    budget = binding_budget(profile)
    dp_s, dp_plan = _time_dp(profile, budget, repeats)
    cold = _run_ilp(profile, budget, dp_plan, ilp_limit_s, hint=None)
    warm = _run_ilp(profile, budget, dp_plan, ilp_limit_s, hint=dp_plan)
    assert dp_plan.record.predicted_time_ms is not None
    over = 100 * (dp_plan.record.predicted_time_ms / profile.step_ms - 1)
    return [str(n), f"{dp_s:.3f}", f"{cold.seconds:.1f}", cold.status, cold.agree,
            f"{warm.seconds:.1f}", warm.status, warm.agree, mib(budget, 0), f"{over:.2f}",
            dp_plan.summary()]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--repeats", type=int, default=5, help="DP runs per size (median)")
    parser.add_argument("--ilp-time-limit", type=float, default=60.0, help="seconds")
    parser.add_argument("--out", type=Path, default=RESULTS / "solver_speed.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for n in args.sizes:
        rows.append(_row(n, args.repeats, args.ilp_time_limit))
        log.info(" | ".join(rows[-1]))
    table = "\n".join(markdown_table(COLUMNS, rows))
    write_result(
        args.out,
        "# Solver speed\n\n"
        f"Transformer-like chains (pattern {PATTERN} of {[k.name for k in KINDS]}), all four "
        "options, budget half way between the smallest feasible peak and the no-checkpoint "
        f"peak. DP: median of {args.repeats} runs, each on a fresh profile (building "
        f"the event model included). ILP: CP-SAT, one run each, time limit "
        f"{args.ilp_time_limit:g} s, model building included; cold (no hint) and warm-started "
        "with the DP's plan as a hint (CP-SAT must still prove optimality itself). "
        "'agree' compares simulate()'s times of the two plans, up to the ILP's 1 ns "
        f"rounding per unit. Machine: {machine_line()}.\n\n{table}\n",
    )
    return table


if __name__ == "__main__":
    main()
