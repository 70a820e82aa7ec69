"""What remat adds around a unit, against the peers doing the same recomputation.

At each peer's measured peak, remat's optimal plan for that peak (the peak as the
budget) is applied to a copy of the same model, and the two steps are compared:

* **the 100-layer experiment** of ``checkpoint_sequential``'s own documentation: an
  ``nn.Sequential`` of 100 x [Conv2d, ReLU] (200 modules, 200 units), the peer
  ``checkpoint_sequential(k)`` for k = 2, 4, 8, 16, 32;
* **GPT-2 124M** (``transformers``' default ``GPT2Config``, random weights): the peer
  Hugging Face's gradient checkpointing of every block (``--gpt2``).

Per pair: both peaks (``remat.measure``: the higher of live tensor bytes and the
allocator's view, as a budget counts them), the aten ops per step and
the recomputed forward ops (a dispatch mode counting ops in forward and in backward),
and the step time in ABAB rounds: one thread, the process pinned to one core, each
round times a step of each (the order alternates) after warm-up; the ratio remat/peer
per round, pooled as the median over rounds, with the spread (min-max) of the rounds.

Prints a markdown table and writes it to benchmarks/results/overhead.md.

    .venv/bin/python benchmarks/overhead.py [--rounds 15] [--gpt2]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from peers_variants import CheckpointedSequential  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint_sequential  # noqa: E402

import remat  # noqa: E402
from remat.core import mib  # noqa: E402
from remat.measurement import OpCounter  # noqa: E402

LossFn = Callable[[Any, Any], torch.Tensor]


# --------------------------------------------------------------------------- models
def conv_stack(layers: int = 100, channels: int = 16) -> nn.Sequential:
    """``checkpoint_sequential``'s experiment: layers x [Conv2d, ReLU], one Sequential."""
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*modules)


def conv_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return output.float().pow(2).mean()


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT-2 124M from its default config, random weights; batch 1 x 512 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(use_cache=False)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (1, 512))
    return model, {"input_ids": ids, "labels": ids}


def hf_checkpointing(model: nn.Module) -> nn.Module:
    peer = copy.deepcopy(model)
    peer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return peer.train()


class _BlockAlone(nn.Module):
    """A GPT-2 block as a module of one tensor (its causal mask is its own default)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class GPT2CheckpointSequential(nn.Module):
    """GPT-2 with its blocks run by ``checkpoint_sequential(k)`` (the same weights).

    ``checkpoint_sequential`` needs an ``nn.Sequential`` of one-tensor modules, which
    Hugging Face's loop is not; this runs the model's own embeddings, blocks, final
    norm and head in that order, and its loss equals the model's (checked).
    """

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.model = model
        self.blocks = nn.Sequential(*(_BlockAlone(b) for b in model.transformer.h))
        self.k = k

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        t = self.model.transformer
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = t.drop(t.wte(input_ids) + t.wpe(positions))
        hidden = checkpoint_sequential(self.blocks, self.k, hidden, use_reentrant=False)
        logits = self.model.lm_head(t.ln_f(hidden))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return types.SimpleNamespace(loss=loss)


# --------------------------------------------------------------------------- measuring


def _loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    output = model(**batch) if isinstance(batch, dict) else model(batch)
    return output.loss if loss_fn is None else loss_fn(output, batch)


def step(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> None:
    for p in model.parameters():
        p.grad = None
    _loss(model, batch, loss_fn).backward()


# Ops that compute nothing (views, detach): left out of "recomputed".
_NOT_COMPUTE = frozenset(f"aten.{op}" for op in (
    "detach", "view", "_unsafe_view", "alias", "t", "transpose", "permute", "expand",
    "slice", "select", "unsqueeze", "squeeze", "split", "reshape", "as_strided"))


def op_counts(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> tuple[int, int, int]:
    """(aten ops in the forward, in the backward, compute ops of the forward run again
    in backward: the recomputation)."""
    for p in model.parameters():
        p.grad = None
    with OpCounter() as fwd:
        loss = _loss(model, batch, loss_fn)
    with OpCounter() as bwd:
        loss.backward()
    recomputed = sum(n for op, n in bwd.ops.items()
                     if op in fwd.ops and "backward" not in op and op not in _NOT_COMPUTE)
    return sum(fwd.ops.values()), sum(bwd.ops.values()), recomputed


def timed(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> float:
    start = time.perf_counter()
    step(model, batch, loss_fn)
    return time.perf_counter() - start


@dataclass
class Pair:
    """A peer and remat's plan at the peer's peak, with what was measured of both."""

    model: str
    peer: str
    plan: str = ""
    peer_peak: int = 0
    remat_peak: int = 0
    peer_ops: tuple[int, int, int] = (0, 0, 0)
    remat_ops: tuple[int, int, int] = (0, 0, 0)
    ratios: list[float] = field(default_factory=list)
    peer_ms: float = 0.0
    remat_ms: float = 0.0
    applied: remat.Plan | None = None  # the plan remat ran
    solved: bool = False  # whether remat solved it (else the peer's own, as a manual plan)
    k: int = 0  # the conv stack's peer: checkpoint_sequential(k)


def compare(name: str, setting: str, base: nn.Module, peer: nn.Module, batch: Any,
            loss_fn: LossFn | None, profile: remat.Profile, rounds: int,
            plan: remat.Plan | None = None, loop: remat.Loop | None = None) -> Pair:
    """The peer against remat's optimal plan at the peer's peak, or against ``plan`` (the
    peer's own recomputation, as a manual plan: what remat adds around it)."""
    pair = Pair(name, setting)
    # Both instruments, the higher one: what a budget means to remat (on CPU the
    # allocator also sees oneDNN's scratch in a convolution's backward, which the
    # dispatch-level meter does not: at checkpoint_sequential(2)'s peak, 211 KB).
    measure_kw: dict[str, Any] = {"warmup": 1, "repeats": 1, "loop": loop, "allocator": True}
    if loss_fn is not None:
        measure_kw["loss_fn"] = loss_fn
    pair.peer_peak = remat.measure(peer, batch, **measure_kw).worst_peak_bytes
    if plan is None:
        plan = remat.solve(profile, memory_budget=pair.peer_peak)
        pair.solved = True
    else:
        pair.peer += ", remat running its plan"
    planned = remat.apply_plan(copy.deepcopy(base), plan)
    pair.plan, pair.applied = plan.summary(), plan
    pair.remat_peak = remat.measure(planned, batch, **measure_kw).worst_peak_bytes
    pair.peer_ops = op_counts(peer, batch, loss_fn)
    pair.remat_ops = op_counts(planned, batch, loss_fn)
    for model in (peer, planned):  # warm-up
        timed(model, batch, loss_fn)
    peer_t, remat_t = [], []
    for r in range(rounds):
        order = [(peer, peer_t), (planned, remat_t)]
        for model, times in order if r % 2 == 0 else order[::-1]:
            times.append(timed(model, batch, loss_fn))
        pair.ratios.append(remat_t[-1] / peer_t[-1])
    pair.peer_ms, pair.remat_ms = statistics.median(peer_t) * 1e3, statistics.median(remat_t) * 1e3
    print(f"  {name} {setting}: peer {mib(pair.peer_peak)} MiB {pair.peer_ms:.1f} ms, "
          f"remat {mib(pair.remat_peak)} MiB {pair.remat_ms:.1f} ms "
          f"({pair.plan}), ratio {statistics.median(pair.ratios):.3f}", flush=True)
    return pair


# --------------------------------------------------------------------------- the runs
def sequential_plan(n: int, k: int) -> remat.Plan:
    """``checkpoint_sequential(k)``'s recomputation as a remat plan: k segments of
    ``n // k`` units (the last takes the rest), every one but the last recomputed."""
    size = n // k
    bounds = [(i * size, (i + 1) * size - 1) for i in range(k - 1)]
    names = [str(i) for i in range(n)]
    recomputed = {names[i]: "checkpoint" for a, b in bounds for i in range(a, b + 1)}
    return remat.Plan.from_options(names, recomputed, segments=[s for s in bounds if s[1] > s[0]])


def conv_pairs(rounds: int, ks: Sequence[int]) -> list[Pair]:
    base = conv_stack()
    batch = torch.randn(4, 16, 32, 32)
    profile = remat.profile(base, batch, loss_fn=conv_loss)
    pairs = []
    for k in ks:
        peer = CheckpointedSequential(copy.deepcopy(base), k)
        name, setting = "100 x [Conv2d, ReLU]", f"checkpoint_sequential({k})"
        pairs.append(compare(name, setting, base, peer, batch, conv_loss, profile, rounds,
                             plan=sequential_plan(len(base), k)))
        pairs.append(compare(name, setting, base, peer, batch, conv_loss, profile, rounds))
        pairs[-2].k = pairs[-1].k = k
    return pairs


def gpt2_pairs(rounds: int) -> list[Pair]:
    base, batch = gpt2()
    sequential = GPT2CheckpointSequential(copy.deepcopy(base), 4)
    with torch.no_grad():
        ours, theirs = base.eval()(**batch).loss, sequential.eval()(**batch).loss
    base.train(), sequential.train()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # the same computation
    # A Trainer-style loop: the output dropped after the loss (so the head may be chunked).
    loop = remat.Loop(keep_output=False)
    profile = remat.profile(base, batch, loop=loop)
    name = "GPT-2 124M (1 x 512, output dropped)"
    return [compare(name, "HF checkpointing, every block", base, hf_checkpointing(base),
                    batch, None, profile, rounds, loop=loop),
            compare(name, "checkpoint_sequential(4) over the blocks", base, sequential, batch,
                    None, profile, rounds, loop=loop)]


# ------------------------------------------------------------------ instructions per step
# The stack of the instruction count: convolutions of 2 channels on 8 x 8, so that what
# runs around each unit (remat's or the peer's) is a large share of a step.
SMALL = {"layers": 100, "channels": 2, "image": 8, "batch": 1}


def _small_stack(spec: dict[str, Any]) -> tuple[nn.Sequential, torch.Tensor]:
    base = conv_stack(spec["layers"], spec["channels"])
    torch.manual_seed(1)
    return base, torch.randn(spec["batch"], spec["channels"], spec["image"], spec["image"])


def instruction_configs(spec: dict[str, Any]) -> tuple[dict[str, nn.Module], torch.Tensor]:
    """The models whose steps :mod:`callgrind` counts, by name: the peer at each k, and
    remat applying each plan of ``spec["plans"]`` (as dicts) to the same stack."""
    base, batch = _small_stack(spec)
    models: dict[str, nn.Module] = {
        f"peer {k}": CheckpointedSequential(copy.deepcopy(base), k) for k in spec["ks"]}
    for name, plan in spec["plans"].items():
        models[name] = remat.apply_plan(copy.deepcopy(base), remat.Plan.from_dict(plan))
    return models, batch


@dataclass
class Instructions:
    """Instructions per step at one k: the peer, remat running the peer's plan, remat's
    own plan at the peer's peak."""

    k: int
    peer: int
    running: int
    own: int
    own_plan: str


def instruction_rows(own: dict[int, remat.Plan]) -> list[Instructions]:
    """Count the small stack's steps under callgrind (see :mod:`callgrind`): at each k,
    the peer, remat running the peer's plan, and ``own[k]``: remat's plan at the peer's
    peak on the timed stack (the same 200 units, so the same recomputation as timed)."""
    import callgrind

    ks = sorted(own)
    spec: dict[str, Any] = {**SMALL, "ks": ks, "plans": {}}
    for k in ks:
        spec["plans"][f"running {k}"] = sequential_plan(2 * SMALL["layers"], k).to_dict()
        # Its decisions alone: the signatures it carries are the timed stack's.
        spec["plans"][f"own {k}"] = remat.Plan(own[k].unit_names, own[k].options,
                                               own[k].segments).to_dict()
    names = [f"{what} {k}" for k in ks for what in ("peer", "running", "own")]
    counts = callgrind.count_steps(spec, names)
    rows = [Instructions(k, counts[f"peer {k}"], counts[f"running {k}"], counts[f"own {k}"],
                         own[k].summary()) for k in ks]
    for r in rows:
        print(f"  instructions, k={r.k}: peer {r.peer:,}, remat running its plan "
              f"{r.running:,} ({r.running / r.peer:.3f}), remat's plan {r.own:,} "
              f"({r.own / r.peer:.3f})", flush=True)
    return rows


def instruction_section(rows: Sequence[Instructions] | str) -> list[str]:
    lines = [
        "## Instructions per step (callgrind)",
        "",
        f"The same comparison counted in CPU instructions, which load does not move "
        f"(`benchmarks/callgrind.py`): {SMALL['layers']} x [Conv2d({SMALL['channels']}, "
        f"{SMALL['channels']}), ReLU] on {SMALL['batch']} x {SMALL['channels']} x "
        f"{SMALL['image']} x {SMALL['image']}, where what runs around each unit is a large "
        "share of a step; remat's plan is the one timed above at the peer's peak (the same "
        "200 units, so the same recomputation). Per step: the median of 3 counts of 3 "
        "steps after 3 uncounted ones.",
        "",
    ]
    if isinstance(rows, str):
        return [*lines, f"Not counted on this machine: {rows}.", ""]
    return [*lines, *markdown_table(
        ["k", "peer instructions", "remat running its plan", "remat / peer",
         "remat's plan", "its instructions", "remat / peer"],
        [[r.k, f"{r.peer:,}", f"{r.running:,}", f"**{r.running / r.peer:.3f}**", r.own_plan,
          f"{r.own:,}", f"**{r.own / r.peer:.3f}**"] for r in rows]), ""]


def report(pairs: Sequence[Pair], command: str, started: dt.datetime, seconds: float,
           instructions: Sequence[Instructions] | str = "not asked for") -> str:
    rows = []
    for p in pairs:
        ratio = statistics.median(p.ratios)
        rows.append([
            p.model, p.peer, p.plan, mib(p.peer_peak), mib(p.remat_peak),
            f"{p.peer_ms:.1f}", f"{p.remat_ms:.1f}",
            f"**{ratio:.3f}** ({min(p.ratios):.3f}-{max(p.ratios):.3f})",
            f"{p.peer_ops[0]} / {p.remat_ops[0]}", f"{p.peer_ops[1]} / {p.remat_ops[1]}",
            f"{p.peer_ops[2]} / {p.remat_ops[2]}",
        ])
    pooled = statistics.median(r for p in pairs for r in p.ratios)
    lines = [
        "# remat against the peers at equal peak: what remat adds around a unit",
        "",
        f"Run {started:%Y-%m-%d %H:%M} UTC on {machine_line(threads=1)}, pinned to one core; "
        f"{seconds / 60:.1f} min. Command: `{command}`.",
        "",
        "At each peer's measured peak (`remat.measure`: the higher of live tensor bytes and "
        "the allocator's view, which also sees a kernel's scratch, as a budget counts "
        "them), `remat.solve` "
        "plans the same model with that peak as its budget; \"remat running its plan\" is "
        "remat applying the peer's own recomputation as a manual plan (the same segments), "
        "which isolates what remat adds around a unit. Time: median step "
        "(forward + backward, no optimizer); ratio: remat/peer per ABAB round, median "
        "over the rounds (spread min-max). Ops: aten ops in the forward and in the "
        "backward pass (views and `detach` included), peer / remat; recomputed: the "
        "forward's compute ops run again in backward, peer / remat.",
        "",
        *markdown_table(
            ["model", "peer", "remat's plan", "peer peak MiB", "remat peak MiB",
             "peer ms", "remat ms", "remat / peer", "forward ops", "backward ops",
             "recomputed ops"],
            rows),
        "",
        f"Pooled over every round of every pair: remat/peer **{pooled:.3f}**.",
        "",
        *instruction_section(instructions),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--gpt2", action="store_true", help="also GPT-2 124M (minutes)")
    parser.add_argument("--core", type=int, default=0, help="the core to pin to")
    parser.add_argument("--no-instructions", action="store_true",
                        help="skip the instruction counts (callgrind, about 2 min)")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    started, t0 = dt.datetime.now(dt.UTC), time.perf_counter()
    pairs = conv_pairs(args.rounds, args.ks)
    if args.gpt2:
        pairs += gpt2_pairs(max(3, args.rounds // 3))
    import callgrind

    instructions: list[Instructions] | str = (
        "skipped (--no-instructions)" if args.no_instructions
        else callgrind.available() or instruction_rows(
            {p.k: p.applied for p in pairs if p.k and p.solved and p.applied}))
    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_result(RESULTS / "overhead.md",
                 report(pairs, command.strip(), started, time.perf_counter() - t0,
                        instructions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
