"""remat against its peers, side by side in one run: peak memory and step time per budget.

One command: measure (``peers_run.py``: writes ``peers.csv`` and ``peers.json``),
then report (``peers_report.py``: writes ``peers.md`` and ``peers.png`` from those
two files alone). ``--report-only`` skips the measuring and re-renders the report
from the files already in the output folder, e.g. the committed run in
``benchmarks/results``. What is measured, and how, is in ``peers_run.py`` and in
the report's "How to read this".

Usage::

    .venv/bin/python benchmarks/peers.py                # full run: about 10 min on 2 cores
    .venv/bin/python benchmarks/peers.py --report-only  # re-render results/peers.md and .png
    .venv/bin/python benchmarks/peers.py --no-remat-compile  # without remat + torch.compile
    .venv/bin/python benchmarks/peers.py --quick        # tiny models, a smoke test
    .venv/bin/python benchmarks/peers.py --models mlp,cnn --budgets 0.5 --no-compile
"""

# ruff: noqa: E402  (the environment must be set before torch is imported)
from __future__ import annotations

import os

# On a shared 2-core machine, spinning OpenMP workers (torch's pool and the compiled
# kernels' own) starve each other: with the default active wait, eager steps ran 3-5x
# slower and a tiny compiled MLP took ~700 ms a step instead of ~1 ms. Passive waiting
# is fair to every method.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _common import RESULTS
from peers_data import DEFAULT_BUDGETS, DEFAULT_MODELS, DEFAULT_THREADS, write_csv, write_json
from peers_report import report, write_report


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: re-render peers.md and peers.png from the folder's "
                        "peers.csv and peers.json")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated reference models (default: %(default)s)")
    p.add_argument("--budgets", default=",".join(f"{f:g}" for f in DEFAULT_BUDGETS),
                   help="comma-separated fractions of the activation memory (default: "
                        "%(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="tiny models, 3 timed steps; writes to a temporary folder unless --out")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per method (>= 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per eager method")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help="torch intra-op threads (default %(default)s: on a shared 2-core machine "
                        "a 2-thread step runs at half speed whenever another process holds a "
                        "core, which made timings bimodal; one thread is steadier)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip torch.compile (the peer and remat optimal + torch.compile)")
    p.add_argument("--no-remat-compile", action="store_true",
                   help="skip remat optimal + torch.compile (a compiled search per budget)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: "
                   "benchmarks/results)")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.budgets = [float(f) for f in args.budgets.split(",") if f.strip()]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.repeats < 3:
        p.error("--repeats must be at least 3")
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "remat-peers-quick" if args.quick else RESULTS
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and report (or only report); 1 when some method failed (the rest is written)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        text = report(args.out)
        print(text)
        print(f"re-rendered {args.out / 'peers.md'} and peers.png from peers.csv and peers.json")
        return 0
    import peers_run  # imports torch: only when measuring

    settings = peers_run.Settings(
        models=args.models, fractions=args.budgets,
        sizes=peers_run.QUICK_SIZES if args.quick else peers_run.FULL_SIZES,
        repeats=args.repeats, warmup=args.warmup, threads=args.threads,
        compile=not args.no_compile, remat_compile=not args.no_remat_compile)
    results = peers_run.run(settings, [".venv/bin/python", "benchmarks/peers.py", *argv])
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "peers.csv", results)
    write_json(args.out / "peers.json", results)
    print("\n" + write_report(results, args.out))
    print(f"wrote {args.out / 'peers.md'}, peers.csv, peers.json, peers.png in "
          f"{results.run.elapsed_s / 60:.1f} min")
    return 1 if results.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
