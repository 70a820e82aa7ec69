"""``remat.solve`` per rank on FSDP2-sharded and DDP models remat was not written for.

Spawns ``--ranks`` gloo ranks on the CPU. Each case is a stock model with random weights
(the same on every rank, seed 0), each rank its own micro-batch; every rank shards it as
its users would (each block with ``fully_shard``, then the root), or wraps it in
``DistributedDataParallel``, and calls
``remat.solve(model, batch, memory_budget=..., optimizer=AdamW)`` on the wrapped model,
verification included, at two per-rank budgets: the smallest feasible peak and halfway
from it to no checkpointing. The plan is applied and checked against a second copy of
the model wrapped alike and trained without a plan (one step: the loss, every gradient
and every buffer), then its step is measured ``--runs`` times on every rank by live
tensor bytes (:class:`~remat.measurement.simulated_device.SimulatedDevice`, the rank's
shards included) and as the allocator saw it
(:func:`remat.integrations.fsdp.measure_rank_step`), and run once more inside a
simulated device of the budget (a byte over raises ``torch.OutOfMemoryError``).

Cases:

- ``mixtral-moe``: ``transformers`` Mixtral, a mixture of experts trained with its
  router's load-balancing loss (``output_router_logits=True``), the output dropped;
- ``qwen2-lora``: ``peft`` LoRA (rank 8, query and value projections) on ``transformers``
  Qwen2: FSDP2 gathers the frozen base weights with the adapters;
- ``bart``: ``transformers`` BART, an encoder-decoder (encoder and decoder layers sharded
  apart), the output kept;
- ``qwen2-bf16``: ``transformers`` Qwen2 under bf16 autocast, the output dropped;
- ``gemma2-bf16``: ``transformers`` Gemma 2 (sliding-window and global layers, logits
  soft-capped before the loss) under bf16 autocast, the output dropped;
- ``whisper``: ``transformers`` Whisper, a speech encoder-decoder with a convolution front
  end, the output kept;
- ``deberta-v2``: ``transformers`` DeBERTa-v2 classifying sequences (the relative
  embeddings handed to every block), the output kept;
- ``cnn``: remat's ResNet-style CNN in plain torch (BatchNorm: running statistics
  compared too), cross entropy.

Prints a table and writes it to benchmarks/results/fsdp_unseen.md.

    nice -n 10 .venv/bin/python benchmarks/fsdp_unseen.py --ranks 2 --runs 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from _ranks import on_gloo_ranks  # noqa: E402

FRACTIONS = (0.0, 0.5)  # budgets between the smallest feasible peak (0) and none (1)
MiB = 2**20


@dataclass
class Case:
    """One model as its user would shard it: the model, its layers' lists (each layer
    ``fully_shard``-ed, then the root), the rank's batch, the loop, a loss function
    (``None``: the output's ``.loss``)."""

    model: torch.nn.Module
    layers: list[Any]
    batch: dict[str, torch.Tensor]
    loop: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None


def _ids(vocab: int, shape: tuple[int, int], seed: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _causal_lm(model: torch.nn.Module, layers: Any, seed: int,
               autocast: str | None = None) -> Case:
    """A causal LM's case: random token ids (vocabulary 4096) as their own labels, the
    output dropped, under ``autocast`` where given."""
    import remat

    ids = _ids(4096, (4, 128), seed)
    return Case(model.train(), [layers], {"input_ids": ids, "labels": ids},
                remat.Loop(keep_output=False, autocast=autocast))


def _mixtral(seed: int) -> Case:
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02, use_cache=False)
    model = transformers.MixtralForCausalLM(config)
    return _causal_lm(model, model.model.layers, seed)


def _qwen2_config() -> Any:
    import transformers

    return transformers.Qwen2Config(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, use_cache=False)


def _qwen2_lora(seed: int) -> Case:
    import peft
    import transformers

    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(_qwen2_config()),
                                peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    return _causal_lm(model, model.base_model.model.model.layers, seed)


def _qwen2_bf16(seed: int) -> Case:
    import transformers

    model = transformers.Qwen2ForCausalLM(_qwen2_config())
    return _causal_lm(model, model.model.layers, seed, autocast="bfloat16")


def _bart(seed: int) -> Case:
    import transformers

    import remat

    config = transformers.BartConfig(
        d_model=128, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512,
        vocab_size=4096, max_position_embeddings=256, use_cache=False, dropout=0.0)
    model = transformers.BartForConditionalGeneration(config).train()
    batch = {"input_ids": _ids(4096, (4, 128), seed, low=4),
             "labels": _ids(4096, (4, 64), seed + 1000, low=4)}
    return Case(model, [model.model.encoder.layers, model.model.decoder.layers], batch,
                remat.Loop())


def _gemma2_bf16(seed: int) -> Case:
    import transformers

    config = transformers.Gemma2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=64, vocab_size=4096,
        max_position_embeddings=256, use_cache=False)
    model = transformers.Gemma2ForCausalLM(config)
    return _causal_lm(model, model.model.layers, seed, autocast="bfloat16")


def _whisper(seed: int) -> Case:
    import transformers

    import remat

    config = transformers.WhisperConfig(
        d_model=128, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=2048,
        num_mel_bins=80, max_source_positions=750, max_target_positions=128, use_cache=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        dropout=0.0)
    model = transformers.WhisperForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(seed)
    batch = {"input_features": torch.randn(2, 80, 1500, generator=g),
             "labels": _ids(2048, (2, 64), seed + 1000, low=3)}
    return Case(model, [model.model.encoder.layers, model.model.decoder.layers], batch,
                remat.Loop())


def _deberta(seed: int) -> Case:
    import transformers

    import remat

    config = transformers.DebertaV2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        vocab_size=4096, relative_attention=True, pos_att_type=["p2c", "c2p"], num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.DebertaV2ForSequenceClassification(config).train()
    batch = {"input_ids": _ids(4096, (4, 128), seed),
             "labels": _ids(3, (4, 1), seed + 1000).view(-1)}
    return Case(model, [model.deberta.encoder.layer], batch, remat.Loop())


def _cnn(seed: int) -> Case:
    import remat
    from remat.models import build

    ref = build("cnn", seed=0)
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(ref.batch["x"].shape, generator=g),
             "labels": torch.randint(0, ref.config.num_classes, ref.batch["labels"].shape,
                                     generator=g)}
    return Case(ref.model, [ref.model.blocks], batch, remat.Loop(keep_output=False),
                ref.loss_fn)


CASES: dict[str, tuple[Callable[[int], Case], str]] = {
    "mixtral-moe": (_mixtral, "MoE, router loss"),
    "qwen2-lora": (_qwen2_lora, "peft LoRA, frozen base"),
    "bart": (_bart, "encoder-decoder"),
    "qwen2-bf16": (_qwen2_bf16, "bf16 autocast"),
    "gemma2-bf16": (_gemma2_bf16, "soft-capped logits, sliding window, bf16"),
    "whisper": (_whisper, "speech encoder-decoder, convolutions"),
    "deberta-v2": (_deberta, "relative embeddings to every block, classifier"),
    "cnn": (_cnn, "plain torch, BatchNorm"),
}


WRAPPERS = ("FSDP2", "DDP")


def _wrapped(name: str, rank: int, wrapper: str) -> Case:
    """The case's model (weights seeded alike on every rank) sharded with FSDP2 (each
    layer, then the root) or wrapped by DDP; this rank's batch."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    case = CASES[name][0](rank)
    if wrapper == "DDP":
        case.model = DistributedDataParallel(case.model)
        return case
    for layers in case.layers:
        for layer in layers:
            fully_shard(layer)
    fully_shard(case.model)
    return case


def _loss(case: Case) -> torch.Tensor:
    ctx = (torch.autocast("cpu", dtype=getattr(torch, case.loop.autocast))
           if case.loop.autocast else torch.autocast("cpu", enabled=False))
    with ctx:
        out = case.model(**case.batch)
    return case.loss_fn(out, case.batch) if case.loss_fn else out.loss


def _step(case: Case, opt: torch.optim.Optimizer) -> torch.Tensor:
    loss = _loss(case)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _compare(planned: Case, plain: Case) -> tuple[float, float, bool]:
    """One backward of each: the losses' difference relative to the loss, the largest
    gradient difference relative to the largest gradient, the buffers equal."""
    losses = []
    for case in (planned, plain):
        loss = _loss(case)
        loss.backward()
        losses.append(loss.detach())
    diff, scale = 0.0, 0.0
    for p, q in zip(planned.model.parameters(), plain.model.parameters(), strict=True):
        if q.grad is None:
            continue
        diff = max(diff, (_local(p.grad) - _local(q.grad)).abs().max().item())
        scale = max(scale, _local(q.grad).abs().max().item())
    buffers = all(torch.equal(a, b) for a, b in zip(planned.model.buffers(),
                                                    plain.model.buffers(), strict=True))
    loss_diff = ((losses[0] - losses[1]).abs() / losses[1].abs()).item()
    return loss_diff, diff / scale if scale else diff, buffers


@dataclass
class Row:
    case: str
    budget: int
    plan: str
    predicted: int
    verified: int
    live: list[int]
    allocator: list[int]
    fits: bool
    loss_diff: float
    grad_diff: float
    buffers_equal: bool
    refused: bool = False  # remat.solve refused the budget (the plan column says why)
    wrapper: str = "FSDP2"


def _rank_rows(rank: int, name: str, runs: int, wrapper: str) -> list[Row]:
    import remat
    from remat.integrations.fsdp import measure_rank_step
    from remat.measurement import SimulatedDevice, resident_bytes

    def fresh() -> tuple[Case, Case, list[torch.optim.Optimizer]]:
        planned, plain = _wrapped(name, rank, wrapper), _wrapped(name, rank, wrapper)
        opts = [torch.optim.AdamW([p for p in c.model.parameters() if p.requires_grad])
                for c in (planned, plain)]
        for case, opt in zip((planned, plain), opts):
            _step(case, opt)  # the optimizer's state exists, as in training
        return planned, plain, opts

    planned, plain, opts = fresh()
    prof = remat.profile(planned.model, planned.batch, optimizer=opts[0], loop=planned.loop,
                         loss_fn=planned.loss_fn)
    keep = remat.solve(prof, None).record.predicted_peak_bytes
    try:
        remat.solve(prof, 1)
    except remat.InfeasibleBudgetError as err:
        floor = err.min_feasible_bytes
    rows = []
    for fraction in FRACTIONS:
        budget = int(floor + fraction * (keep - floor))
        planned, plain, opts = fresh()  # the two copies' weights equal again
        solve = dict(optimizer=opts[0], loop=planned.loop, loss_fn=planned.loss_fn)
        try:
            plan = remat.solve(planned.model, planned.batch, memory_budget=budget, **solve)
        except remat.InfeasibleBudgetError as err:
            # The same on every rank: verification decides on the highest peak over the
            # ranks, and the call's profile is the worst rank's. Either may refuse the
            # floor taken from the profile above: verification where the step measured
            # above its prediction, the call's own profile where it measured the floor
            # higher than this one did (two profiles of one model vary).
            short = err.min_feasible_bytes - budget
            by = ("verification" if err.detail.startswith("Round")
                  else "the call's own profile")
            rows.append(Row(name, budget, f"refused by {by}: the smallest feasible budget, "
                            f"{err.min_feasible_bytes:,} B, is {short:,} B above",
                            0, 0, [], [], False, 0.0, 0.0, True, refused=True,
                            wrapper=wrapper))
            continue
        remat.apply_plan(planned.model, plan)
        loss_diff, grad_diff, buffers_equal = _compare(planned, plain)
        opts[0].step()
        opts[0].zero_grad()
        live, allocator = [], []
        for _ in range(runs):
            with SimulatedDevice(None, resident_bytes=resident_bytes(planned.model,
                                                                     opts[0])) as device:
                allocator.append(measure_rank_step(planned.model, planned.batch,
                                                   warmup=0, **solve))
            live.append(device.peak_bytes)
        try:
            with SimulatedDevice(budget, resident_bytes=resident_bytes(planned.model,
                                                                       opts[0])):
                _step(planned, opts[0])
            fits = True
        except torch.OutOfMemoryError:
            fits = False
        rows.append(Row(name, budget, plan.summary(), plan.record.predicted_peak_bytes,
                        plan.verification.measured_peak_bytes, live, allocator, fits,
                        loss_diff, grad_diff, buffers_equal, wrapper=wrapper))
    return rows


def _merge(rows_by_rank: Sequence[list[Row]]) -> list[Row]:
    """Every rank's rows of one plan as one: the worst figure of each, checks all true."""
    merged = []
    for rows in zip(*rows_by_rank, strict=True):
        first = rows[0]
        if first.refused:
            merged.append(first)
            continue
        merged.append(Row(first.case, first.budget, first.plan, first.predicted,
                          max(r.verified for r in rows),
                          [b for r in rows for b in r.live],
                          [b for r in rows for b in r.allocator],
                          all(r.fits for r in rows), max(r.loss_diff for r in rows),
                          max(r.grad_diff for r in rows), all(r.buffers_equal for r in rows),
                          wrapper=first.wrapper))
    return merged


def _all_rows(rank: int, world: int, runs: int, cases: list[str],
              wrappers: list[str]) -> list[Row]:
    """Every case's rows, merged over the ranks."""
    mine = [row for wrapper in wrappers for name in cases
            for row in _rank_rows(rank, name, runs, wrapper)]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return _merge(every)


def measure(world: int, runs: int, cases: list[str], wrappers: list[str]) -> list[Row]:
    return on_gloo_ranks(_all_rows, world, runs, cases, wrappers)


def _pct(predicted: int, measured: int) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}"


def report(rows: Sequence[Row], world: int, runs: int, minutes: float, command: str) -> str:
    header = ["wrapper", "model", "exercises", "budget MiB", "plan", "predicted MiB",
              "verified MiB", "live worst MiB", "(pred - live)/live %",
              "allocator worst MiB", "(pred - allocator)/allocator %",
              "steps inside a device of the budget", "loss diff (relative)",
              "gradients max diff (relative)", "buffers equal"]
    table = [[r.wrapper, r.case, CASES[r.case][1], f"{r.budget / MiB:.2f}", r.plan,
              *["-"] * 10]
             if r.refused else
             [r.wrapper, r.case, CASES[r.case][1], f"{r.budget / MiB:.2f}", r.plan,
              f"{r.predicted / MiB:.2f}", f"{r.verified / MiB:.2f}",
              f"{max(r.live) / MiB:.2f}", _pct(r.predicted, max(r.live)),
              f"{max(r.allocator) / MiB:.2f}", _pct(r.predicted, max(r.allocator)),
              "yes" if r.fits else "**no**", f"{r.loss_diff:.1e}",
              f"{r.grad_diff:.1e}", "yes" if r.buffers_equal else "**no**"] for r in rows]
    refused = [r for r in rows if r.refused]
    rows = [r for r in rows if not r.refused]
    below_live = [r for r in rows if r.predicted < max(r.live)]
    below_alloc = [r for r in rows if r.predicted < max(r.allocator)]
    lines = [
        "# FSDP2 and DDP on models remat was not written for: per-rank plans, checked",
        "",
        f"Run {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC on {machine_line(1)}, {world} gloo "
        f"ranks (1 thread each); {minutes:.1f} min. Command: `{command}`.",
        "",
        "Each rank calls `remat.solve` (verification included) on its `fully_shard`-ed "
        "model (each layer, then the root) or its DDP-wrapped one, its own micro-batch, "
        "AdamW over the trainable parameters, at the smallest feasible per-rank peak and "
        "halfway to no checkpointing; the plan applied is checked against the same model "
        "wrapped alike "
        f"and trained without a plan (one step: loss, gradients, buffers), then its step "
        f"measured {runs} times on every rank (worst over every run of every rank) and "
        "run once inside a simulated device of the budget. Models and what they exercise: "
        "`benchmarks/fsdp_unseen.py`'s docstring.",
        "",
        *markdown_table(header, table),
        "",
        f"The prediction was below the live peak in {len(below_live)} of {len(rows)} plans "
        f"and below the allocator's worst run in {len(below_alloc)}; "
        f"{sum(not r.fits for r in rows)} planned steps ran out of a device of the budget; "
        f"{len(refused)} budgets were refused by `remat.solve` (the plan column says "
        "whether by its verification or its own profile). "
        "Loss and gradients equal bitwise give 0; a chunked head sums its chunks in "
        "another order (float tolerance).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--wrappers", nargs="+", default=list(WRAPPERS), choices=WRAPPERS)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = measure(args.ranks, args.runs, args.cases, args.wrappers)
    whole = args.cases == list(CASES) and args.wrappers == list(WRAPPERS)
    command = "python benchmarks/fsdp_unseen.py" + (
        f" --ranks {args.ranks}" if args.ranks != 2 else "") + (
        f" --runs {args.runs}" if args.runs != 3 else "") + (
        f" --cases {' '.join(args.cases)}" if args.cases != list(CASES) else "") + (
        f" --wrappers {' '.join(args.wrappers)}" if args.wrappers != list(WRAPPERS) else "")
    text = report(rows, args.ranks, args.runs, (time.perf_counter() - start) / 60, command)
    write_result(RESULTS / ("fsdp_unseen.md" if whole else "fsdp_unseen-partial.md"), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
