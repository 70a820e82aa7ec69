"""``python -m remat``: profile, solve and draw the trade-off for a built-in or your own model.

    python -m remat demo                                  # the whole pipeline on the default model
    python -m remat estimate --model gpt --optimizer adamw --budget 300MiB
    python -m remat profile  --model gpt --out profile.json
    python -m remat solve    --model gpt --budget 60% --measure
    python -m remat solve    --profile profile.json --budget 300MiB --method ilp
    python -m remat solve    --model mlp --budget 70% --compiled
    python -m remat pareto   --model mymodule:make --loss cross_entropy --out pareto.png

Every error remat detects (a bad budget, an unwritable ``--out``, an unreadable
``--profile``, an empty value, a ``module:function`` that cannot be called as
``--model`` or ``--loss`` calls it...) is one line on stderr and exit status 2, found
before profiling where it can be, and no output file is left half written.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.cli.report import print_table
from remat.core.bytesize import mib
from remat.core.errors import RematError

DEFAULT_MODEL = "gpt"

MODEL_HELP = """\
--model takes a built-in name (mlp, cnn, gpt, hf-gpt2, hf-bert, hf-llama; --size tiny or
small) or module:function. The function takes no arguments (its module must be
importable: run from its folder or set PYTHONPATH) and returns one of
  (model, sample_batch)          the model's output carries its loss (.loss or ["loss"],
                                 as Hugging Face models with labels), or --loss says how
                                 to compute it;
  (model, sample_batch, loss_fn) loss_fn(output, sample_batch) -> scalar tensor;
  (model, sample_batch, target)  a target tensor for --loss cross_entropy or mse;
  a remat.models.ReferenceModel.
The model is called as model(**batch) for a dict, model(*batch) for a tuple or list,
and model(batch) otherwise.

--loss: cross_entropy (the output's logits against the target, flattened), mse (the
output against the target), or module:function naming loss_fn(output, batch)."""

BUDGET_HELP = """\
--budget is the peak of one training step on the device, everything included
(parameters, buffers, gradients, optimizer state with --optimizer, activations):
  bytes            130000000
  SI / binary      8GB, 512MB  /  7.5GiB, 512MiB
  60%              60% of the activation memory: the persistent bytes (parameters,
                   buffers, optimizer state, gradients) plus 60% of what the
                   no-checkpoint peak holds above them ("60% of activations")
  60% of peak      60% of the whole no-checkpoint peak"""


def _methods_help() -> str:
    import textwrap

    from remat.solver.solve import ALGORITHMS

    return textwrap.fill(
        "--method: " + ", ".join(sorted(ALGORITHMS)) + ' (default "optimal": exact dynamic '
        'programming; "ilp": CP-SAT; "chen", "chen-greedy", "uniform": heuristics; "all": '
        'checkpoint every unit; "none": no checkpointing; "uniform" takes k, which the '
        "Python API passes: remat.solve(..., method='uniform', k=4))", width=88)


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


# --------------------------------------------------------------------------- the model
class Workload:
    """What a command runs: the model, its batch, loss, optimizer and loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from remat.cli.losses import loss_from_spec
        from remat.models.load import load_model

        model, batch, third, self.label = load_model(args.model, size=args.size)
        target = third if isinstance(third, torch.Tensor) else None
        loss_fn = None if target is not None else third
        if args.loss is not None:
            loss_fn = loss_from_spec(args.loss, target)
        elif target is not None:
            raise RematError(f"--model {args.model!r} returned a target tensor as its third "
                             "element: say how to compare with it, --loss cross_entropy or mse")
        self.model, self.batch, self.loss_fn = model, batch, loss_fn
        self.optimizer = _optimizer(args.optimizer, model)
        self.loop = _loop(args)

    def profile(self) -> Any:
        import remat

        print(f"profiling {self.label} ...", file=sys.stderr)
        return remat.profile(self.model, self.batch, loss_fn=self.loss_fn,
                             optimizer=self.optimizer, loop=self.loop)


def _optimizer(name: str | None, model: Any) -> Any:
    if not name or name == "none":
        return None
    import torch

    make = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return make(model.parameters(), lr=1e-3)


def _loop(args: argparse.Namespace) -> Any:
    from remat.core.loop import Loop

    return Loop(accumulation_steps=args.accumulation_steps, keep_output=not args.drop_output,
                autocast=args.autocast, grad_scaler=args.autocast == "float16",
                optimizer_in_backward=args.optimizer_in_backward)


def _budget(text: str) -> int | str:
    """A plain count of bytes (``130000000``, ``130_000_000``) is an int; the rest as written."""
    return int(text.replace("_", "")) if re.fullmatch(r"\s*\d[\d_]*\s*", text) else text


# --------------------------------------------------------------------------- checks first
def _preflight(args: argparse.Namespace) -> None:
    """Everything that can be wrong without a profile, checked before profiling starts."""
    from remat.cli.output import check_figure_format, check_writable
    from remat.core.checks import check_budget_arg, check_count
    from remat.solver.solve import check_method

    _check_not_empty(args)
    has_profile = getattr(args, "profile", None) is not None
    if has_profile and getattr(args, "compiled", False):
        raise RematError("solve --compiled compiles candidate plans: it needs --model, not "
                         "--profile")
    if has_profile:
        given = [flag for flag, value, default in (
            ("--loss", args.loss, None), ("--optimizer", args.optimizer, "none"),
            ("--accumulation-steps", args.accumulation_steps, 1),
            ("--autocast", args.autocast, None), ("--drop-output", args.drop_output, False),
            ("--optimizer-in-backward", args.optimizer_in_backward, False))
            if value != default]
        if given:
            verb = "describes" if len(given) == 1 else "describe"
            raise RematError(f"{', '.join(given)} {verb} the training step to profile, and "
                             "--profile was measured already (its loop and optimizer are in "
                             "it); drop them, or profile again with --model")
    if has_profile and getattr(args, "measure", False):
        raise RematError("solve --measure applies the plan to the model and runs a step: it "
                         "needs --model, not --profile")
    if getattr(args, "budget", None) is not None:
        args.budget = check_budget_arg(_budget(args.budget))  # read once, passed on
    if getattr(args, "method", None) is not None:
        check_method(args.method, {})
    if getattr(args, "points", None) is not None:
        check_count("points", args.points, lo=1, meaning="how many budgets to solve at",
                    owner="pareto --points")
    if getattr(args, "out", None) is not None:
        check_writable(args.out)
        if args.command == "pareto":
            check_figure_format(args.out)


def _check_not_empty(args: argparse.Namespace) -> None:
    """No flag is given an empty value (``--out ''``, ``--model "$UNSET"``): read as "not
    given", it would silently do something else (no file written, the default model)."""
    for dest, value in vars(args).items():
        if isinstance(value, str) and not value.strip():
            flag = "--" + dest.replace("_", "-")
            raise RematError(f"{flag} {value!r} is empty: give it a value, or drop {flag} "
                             "for its default")


def _load_profile(args: argparse.Namespace) -> tuple[Any, Workload | None, str]:
    """``(profile, workload, label)``; the workload is ``None`` for a saved profile."""
    import remat

    if getattr(args, "profile", None) is not None:
        return remat.Profile.from_json(args.profile), None, args.profile
    work = Workload(args)
    return work.profile(), work, work.label


def _write_json(path: str, text: str) -> None:
    from remat.cli.output import write_atomic

    write_atomic(path, lambda tmp: Path(tmp).write_text(text))
    print(f"wrote {path}")


# --------------------------------------------------------------------------- commands
def cmd_profile(args: argparse.Namespace) -> None:
    import pandas as pd

    from remat.solver.resolve import no_checkpoint_peak_bytes

    profile, _, label = _load_profile(args)
    frame = profile.to_frame()
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(frame.to_string(index=False))
    print(
        f"\n{label}: {profile.n} units, chain={profile.is_chain}, step {profile.step_ms:.1f} ms, "
        f"no-checkpoint peak {mib(no_checkpoint_peak_bytes(profile))} MiB (predicted) on "
        f"{profile.device}"
    )
    if args.out is not None:
        _write_json(args.out, profile.to_json())


def cmd_solve(args: argparse.Namespace) -> None:
    import remat

    profile, work, label = _load_profile(args)
    if args.compiled:
        from remat.tune.compiled import search_compiled

        assert work is not None  # _preflight refuses --compiled with --profile
        plan = search_compiled(work.model, work.batch, profile, args.budget, method=args.method,
                               loss_fn=work.loss_fn, optimizer=work.optimizer)
    else:
        plan = remat.solve(profile, memory_budget=args.budget, method=args.method)
    print_table(_plan_rows(profile, plan))
    record = plan.record
    print(
        f"\n{label}: {record.algorithm} ({record.status}, {record.solve_ms:.0f} ms to solve): "
        f"{plan.summary()}\npredicted peak {mib(record.predicted_peak_bytes)} MiB "
        f"(budget {mib(plan.budget_bytes)} MiB), predicted step {record.predicted_time_ms:.1f} ms"
    )
    if plan.compiled is not None:
        time_ms = "-" if plan.compiled.time_ms is None else f"{plan.compiled.time_ms:.1f}"
        print(f"compiled (torch.compile) peak {mib(plan.compiled.peak_bytes)} MiB, step "
              f"{time_ms} ms, measured with inductor's activation_memory_budget="
              f"{plan.compiled.activation_memory_budget:g} (compile with remat.compile_planned)")
    if args.measure and work is not None:
        m = _measure_plan(work, plan)
        print(f"measured  peak {mib(m.worst_peak_bytes)} MiB, measured step {m.time_ms:.1f} ms")
    if args.out is not None:
        _write_json(args.out, plan.to_json())


def _measure_plan(work: Workload, plan: Any) -> Any:
    import remat

    remat.apply_plan(work.model, plan)
    try:
        return remat.measure(work.model, work.batch, loss_fn=work.loss_fn,
                             optimizer=work.optimizer, loop=work.loop)
    finally:
        remat.remove_plan(work.model)


def cmd_pareto(args: argparse.Namespace) -> None:
    import remat
    from remat.cli.output import check_figure_format, write_atomic

    profile, _, label = _load_profile(args)
    frontier = remat.pareto(profile, points=args.points)
    _print_frontier(frontier)
    fig = remat.plot_pareto(frontier, x=args.x, title=f"remat on {label}")
    fmt = check_figure_format(args.out)
    write_atomic(args.out, lambda tmp: fig.savefig(tmp, format=fmt, dpi=130))
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


def cmd_estimate(args: argparse.Namespace) -> None:
    from remat.preflight import estimate

    profile, _, label = _load_profile(args)
    print(f"{label}:")
    print(estimate(profile, memory_budget=args.budget))


def cmd_demo(args: argparse.Namespace) -> None:
    """Profile the default model, solve at a budget, apply, train, measure, plot."""
    from remat.cli.demo import run_demo

    run_demo(model_name=args.model, size=args.size, out_dir=Path(args.out_dir))


# --------------------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat",
        description="profile, solve and draw the memory/time trade-off of activation "
        "checkpointing for a built-in or your own model",
        epilog=f"{MODEL_HELP}\n\n{BUDGET_HELP}\n\n{_methods_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what remat does")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, epilog: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def model_args(p: argparse.ArgumentParser, *, allow_profile: bool) -> None:
        g = p.add_argument_group("the model and its training loop")
        g.add_argument("--model", default=DEFAULT_MODEL,
                       help="a built-in name or module:function (below)")
        g.add_argument("--size", default="small", choices=["tiny", "small"],
                       help="size of a built-in model")
        g.add_argument("--loss", help="cross_entropy, mse or module:function (below)")
        g.add_argument("--optimizer", default="none", choices=["none", "sgd", "adam", "adamw"],
                       help="count this optimizer's state and step (default none)")
        g.add_argument("--accumulation-steps", type=int, default=1, metavar="N",
                       help="micro-batches per optimizer step (gradients kept between them)")
        g.add_argument("--autocast", choices=["bfloat16", "float16"],
                       help="forward under torch.autocast (float16 with a gradient scaler)")
        g.add_argument("--drop-output", action="store_true",
                       help="the loop drops the model's output once the loss is taken "
                       "(default: it keeps it, as `out = model(x)` does)")
        g.add_argument("--optimizer-in-backward", action="store_true",
                       help="each parameter stepped by --optimizer in backward as its "
                       "gradient is complete, the gradient freed then "
                       "(remat.optimizer_in_backward)")
        if allow_profile:
            g.add_argument("--profile", help="a saved profile JSON instead of profiling")

    full = f"{MODEL_HELP}\n\n{BUDGET_HELP}"
    p = command("profile", "measure each unit's costs", MODEL_HELP)
    model_args(p, allow_profile=False)
    p.add_argument("--out", help="write the profile as JSON")
    p.set_defaults(func=cmd_profile)

    p = command("solve", "solve for the fastest plan under a budget",
                f"{full}\n\n{_methods_help()}")
    model_args(p, allow_profile=True)
    p.add_argument("--budget", required=True,
                   help='e.g. 130000000, "8GB", "512MiB", "60%%", "60%% of peak" (below)')
    p.add_argument("--method", default="optimal", help="the solver (below)")
    p.add_argument("--measure", action="store_true",
                   help="apply the plan and measure a step (needs --model)")
    p.add_argument("--compiled", action="store_true",
                   help="the model will train under torch.compile: pick the fastest plan whose "
                   "compiled step fits (compiles a few candidates; needs --model)")
    p.add_argument("--out", help="write the plan as JSON")
    p.set_defaults(func=cmd_solve)

    p = command("pareto", "the memory/time frontier and its plot", MODEL_HELP)
    model_args(p, allow_profile=True)
    p.add_argument("--points", type=int, default=20, help="budgets to solve at (>= 1)")
    p.add_argument("--x", default="time", choices=["time", "overhead"])
    p.add_argument("--out", default="pareto.png",
                   help="the plot; its suffix picks the format (png, pdf, svg...)")
    p.set_defaults(func=cmd_pareto)

    p = command("estimate", "will it fit? memory of a training step before training", full)
    model_args(p, allow_profile=True)
    p.add_argument("--budget", help="also say whether this budget fits (forms below)")
    p.set_defaults(func=cmd_estimate)

    p = command("demo", "profile, solve, apply, measure and plot the default model", "")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--out-dir", default="out")
    p.set_defaults(func=cmd_demo)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )
    try:
        _preflight(args)
        args.func(args)
    except RematError as exc:
        print(f"remat: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be read or written, named by the OS
        print(f"remat: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0
