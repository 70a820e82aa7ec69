"""``python -m remat``: profile, solve and draw the trade-off for a built-in or your own model.

    python -m remat demo                                  # the whole pipeline on the default model
    python -m remat profile --model gpt --out profile.json
    python -m remat solve   --model gpt --budget 60% --measure
    python -m remat solve   --profile profile.json --budget 300MiB --method ilp
    python -m remat solve   --model mlp --budget 70% --compiled
    python -m remat pareto  --model mymodule:make --out pareto.png

``--model`` takes a built-in name (``remat.models``) or ``module:function``, where
the function returns ``(model, sample_batch)``, ``(model, sample_batch, loss_fn)``
or a ``remat.models.ReferenceModel``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.bytesize import mib
from remat.errors import RematError
from remat.report import print_table

DEFAULT_MODEL = "gpt"


def _plan_rows(profile: Any, plan: Any) -> list[dict[str, Any]]:
    rows = []
    for unit, decision in zip(profile.units, plan.decisions()):
        cost = unit.options[decision["option"]]
        held = unit.held_bytes(decision["option"])
        rows.append(
            {
                "unit": unit.name,
                "type": unit.type_name,
                "option": decision["option"],
                "segment": decision["segment"],
                "keep MiB": mib(unit.saved_bytes),
                "held MiB": mib(held) if not decision["segment"] else "seg",
                "extra ms": f"{cost.extra_ms:.2f}",
            }
        )
    return rows


def _profile_for(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, str]:
    """``(profile, model, batch, loss_fn, label)``; model is None for a saved profile."""
    import remat
    from remat.models.load import load_model

    if getattr(args, "profile", None):
        return remat.Profile.from_json(args.profile), None, None, None, args.profile
    model, batch, loss_fn, label = load_model(args.model, size=args.size)
    print(f"profiling {label} ...", file=sys.stderr)
    return remat.profile(model, batch, loss_fn=loss_fn), model, batch, loss_fn, label


def cmd_profile(args: argparse.Namespace) -> None:
    import pandas as pd

    profile, *_, label = _profile_for(args)
    frame = profile.to_frame()
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(frame.to_string(index=False))
    print(
        f"\n{label}: {profile.n} units, chain={profile.is_chain}, step {profile.step_ms:.1f} ms, "
        f"measured peak {mib(profile.measured_peak_bytes)} MiB on {profile.device}"
    )
    if args.out:
        profile.to_json(args.out)
        print(f"wrote {args.out}")


def _measure_plan(model: Any, batch: Any, loss_fn: Any, plan: Any) -> Any:
    import remat

    remat.apply_plan(model, plan)
    try:
        return remat.measure(model, batch, loss_fn=loss_fn)
    finally:
        remat.remove_plan(model)


def cmd_solve(args: argparse.Namespace) -> None:
    import remat

    if args.compiled and getattr(args, "profile", None):
        raise RematError("solve --compiled compiles candidate plans: it needs --model, "
                         "not --profile")
    profile, model, batch, loss_fn, label = _profile_for(args)
    if args.compiled:
        from remat.compiled import solve_compiled

        plan = solve_compiled(model, batch, profile, args.budget, method=args.method,
                              loss_fn=loss_fn)
    else:
        plan = remat.solve(profile, memory_budget=args.budget, method=args.method)
    print_table(_plan_rows(profile, plan))
    print(
        f"\n{label}: {plan.algorithm} ({plan.status}, {plan.solve_ms:.0f} ms to solve): "
        f"{plan.summary()}\npredicted peak {mib(plan.predicted_peak_bytes)} MiB "
        f"(budget {mib(plan.budget_bytes)} MiB), predicted step {plan.predicted_time_ms:.1f} ms"
    )
    if plan.compiled_peak_bytes is not None:
        print(f"compiled (torch.compile) peak {mib(plan.compiled_peak_bytes)} MiB, step "
              f"{plan.compiled_time_ms:.1f} ms, measured with inductor's "
              f"activation_memory_budget={plan.activation_memory_budget:g} (compile with "
              "remat.compile_planned)")
    if args.measure and model is not None:
        m = _measure_plan(model, batch, loss_fn, plan)
        print(f"measured  peak {mib(m.peak_bytes)} MiB, measured step {m.time_ms:.1f} ms")
    if args.out:
        plan.to_json(args.out)
        print(f"wrote {args.out}")


def cmd_pareto(args: argparse.Namespace) -> None:
    import remat

    profile, *_ = _profile_for(args)
    frontier = remat.pareto(profile, points=args.points)
    _print_frontier(frontier)
    fig = remat.plot_pareto(frontier, x=args.x)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


def _print_frontier(frontier: Any) -> None:
    rows = [
        {
            "kind": r.kind,
            "algorithm": r.algorithm,
            "peak MiB": mib(r.peak_bytes),
            "time ms": f"{r.time_ms:.1f}",
            "overhead %": f"{r.overhead_pct:.1f}",
            "plan": r.plan,
        }
        for r in frontier.itertuples()
    ]
    print_table(rows)


def cmd_demo(args: argparse.Namespace) -> None:
    """Profile the default model, solve at a budget, apply, train, measure, plot."""
    from remat.models.demo import run_demo

    run_demo(model_name=args.model, size=args.size, out_dir=Path(args.out_dir))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log what remat does")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser, *, allow_profile: bool) -> None:
        p.add_argument("--model", default=DEFAULT_MODEL, help="built-in name or module:function")
        p.add_argument("--size", default="small", choices=["tiny", "small"])
        if allow_profile:
            p.add_argument("--profile", help="a saved profile JSON instead of profiling")

    p = sub.add_parser("profile", help="measure each unit's costs")
    model_args(p, allow_profile=False)
    p.add_argument("--out", help="write the profile as JSON")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("solve", help="solve for the fastest plan under a budget")
    model_args(p, allow_profile=True)
    p.add_argument("--budget", required=True, help='e.g. "8GB", "512MiB", "60%%"')
    p.add_argument("--method", default="optimal")
    p.add_argument("--measure", action="store_true", help="apply the plan and measure a step")
    p.add_argument("--compiled", action="store_true",
                   help="the model will train under torch.compile: pick the fastest plan whose "
                   "compiled step fits (compiles a few candidates)")
    p.add_argument("--out", help="write the plan as JSON")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("pareto", help="the memory/time frontier and its plot")
    model_args(p, allow_profile=True)
    p.add_argument("--points", type=int, default=20)
    p.add_argument("--x", default="time", choices=["time", "overhead"])
    p.add_argument("--out", default="pareto.png")
    p.set_defaults(func=cmd_pareto)

    p = sub.add_parser("demo", help="profile, solve, apply, measure and plot the default model")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--out-dir", default="out")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )
    try:
        args.func(args)
    except RematError as exc:
        print(f"remat: error: {exc}", file=sys.stderr)
        return 2
    return 0
