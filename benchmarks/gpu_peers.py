"""remat against its peers on a GPU, at equal measured peak (issue 24, item 5).

The models, batch and loop of ``gpu_predictions.py`` (Hugging Face GPT-2 124M and a
1.1B Llama-style model, bf16 autocast, fused AdamW, the output dropped). Each peer is
measured as it comes, one optimizer step by ``remat.measure`` (``max_memory_allocated``,
``max_memory_reserved`` after ``empty_cache``, CUDA-event time, median):

* no checkpointing;
* Hugging Face gradient checkpointing of every layer, and of every n-th layer and with
  its checkpoint inputs offloaded where the installed transformers has them
  (``activation_checkpointing_enable(every_n_layers=, offload=)``);
* everything saved offloaded to pinned host memory
  (``torch.autograd.graph.save_on_cpu(pin_memory=True)``);
* ``torch.compile`` with inductor's ``activation_memory_budget`` (allocator only: the
  dispatch level cannot see compiled code).

Then remat is solved for each peer's measured peak as its budget (one profile) and
measured the same way (compiled, at inductor's default budget, against the compiled
peers; remat's memory prediction is for eager execution, so a compiled plan's peak is
measured, not promised): at equal peak, which is faster (the ratio of the two times,
taken in one run). Prints a markdown table and writes it to
benchmarks/results/gpu-<device>.md.

    python3 benchmarks/gpu_peers.py [--models gpt2] [--compile-budgets 1.0 0.5]
    .venv/bin/python benchmarks/gpu_peers.py --smoke       # the script itself, on CPU
"""

from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers_run.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from gpu_predictions import (  # noqa: E402
    LOOP,
    MODELS,
    Case,
    alloc_conf,
    command_line,
    device_slug,
    empty_cache,
    script_device,
    script_parser,
)
from torch import nn  # noqa: E402

import remat  # noqa: E402
from remat.core import mib  # noqa: E402
from remat.tune import measure_compiled  # noqa: E402

COLUMNS = ("model", "peer", "peak MiB", "reserved MiB", "ms", "remat plan at that peak",
           "remat peak MiB", "remat reserved MiB", "remat ms", "peer ms / remat ms")


@dataclass
class Measured:
    """One method's step: allocator peak, reserved peak (CUDA) and median time."""

    peak_bytes: int
    reserved_bytes: int | None
    time_ms: float


class SavedOnHost(nn.Module):
    """Calls ``model`` with every tensor autograd saves in pinned host memory."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> object:
        pin = batch["input_ids"].device.type == "cuda"
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return self.model(**batch)


def measure(case: Case, repeats: int, *, call: nn.Module | None = None) -> Measured:
    """One optimizer step of LOOP on ``case.model`` (through ``call`` when given)."""
    empty_cache(case.batch["input_ids"].device)
    m = remat.measure(case.model, case.batch, optimizer=case.optimizer, loop=LOOP,
                      repeats=repeats, call=call)
    return Measured(m.allocator_peak_bytes, m.reserved_peak_bytes, m.time_ms)


def _hf_checkpointing(model: nn.Module) -> tuple[Callable[..., None], Callable[[], None],
                                                   set[str]]:
    """Hugging Face's switch on and off, and which of ``every_n_layers`` and ``offload``
    the installed transformers takes."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None)
    if enable is None or disable is None:  # transformers before activation_checkpointing_*
        enable, disable = model.gradient_checkpointing_enable, model.gradient_checkpointing_disable
    has = set(inspect.signature(enable).parameters) & {"every_n_layers", "offload"}
    return enable, disable, has


@contextlib.contextmanager
def _hf(model: nn.Module, **kwargs: object) -> Iterator[None]:
    enable, disable, _ = _hf_checkpointing(model)
    if "activation_checkpointing_kwargs" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, **kwargs)
    else:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **kwargs)
    try:
        yield
    finally:
        disable()


def peers(case: Case, repeats: int, compile_budgets: list[float]
          ) -> Iterator[tuple[str, Measured]]:
    """``(name, measured step)`` of each peer on ``case`` (the model left as it was)."""
    yield "no checkpointing", measure(case, repeats)
    _, _, has = _hf_checkpointing(case.model)
    layers = case.model.config.num_hidden_layers
    hf_settings: list[tuple[str, dict[str, object]]] = [("HF checkpointing, every layer", {})]
    if "every_n_layers" in has:
        hf_settings += [(f"HF checkpointing, every {n} layers", {"every_n_layers": n})
                        for n in (2, 3) if n < layers]
    else:
        print("(this transformers has no every_n_layers)", flush=True)
    # (Its offload pins host memory, which a CPU-only torch cannot: CUDA only.)
    if "offload" in has and case.batch["input_ids"].device.type == "cuda":
        hf_settings.append(("HF checkpointing, every layer, inputs offloaded",
                            {"offload": True}))
    for name, kwargs in hf_settings:
        with _hf(case.model, **kwargs):
            measured = measure(case, repeats)
        yield name, measured  # switched off again: the caller applies remat's plans
    yield ("save_on_cpu(pin_memory=True), everything",
           measure(case, repeats, call=SavedOnHost(case.model)))
    for budget in compile_budgets:
        empty_cache(case.batch["input_ids"].device)
        step = measure_compiled(case.model, case.batch, None, optimizer=case.optimizer,
                                loop=LOOP, activation_memory_budget=budget, repeats=repeats)
        assert step.time_ms is not None
        yield (f"torch.compile, activation_memory_budget={budget}",
               Measured(step.peak_bytes, step.reserved_bytes, step.time_ms))


# How far above a peer's measured peak remat's floor may be for the row to plan at the
# floor instead (a few bytes made outside the dispatcher; a GPU's allocator rounds
# blocks to 512 B).
FLOOR_SLACK_BYTES = 256


def _cells(m: Measured) -> list[str]:
    return [mib(m.peak_bytes, 1), "n/a" if m.reserved_bytes is None else
            mib(m.reserved_bytes, 1), f"{m.time_ms:.1f}"]


def rows_for(name: str, case: Case, repeats: int, compile_budgets: list[float]
             ) -> list[list[str]]:
    profile = remat.profile(case.model, case.batch, optimizer=case.optimizer, loop=LOOP)
    rows = []
    for peer, m in peers(case, repeats, compile_budgets):
        row = [f"{name} ({case.note})", peer, *_cells(m)]
        note = ""
        try:
            plan = remat.solve(profile, memory_budget=m.peak_bytes)
        except remat.InfeasibleBudgetError as err:
            plan = None
            over = err.min_feasible_bytes - m.peak_bytes
            if over <= FLOOR_SLACK_BYTES:
                # remat's floor a few bytes above the peer's peak (bytes the profile's
                # replays count a little longer than the step does): planned at the floor,
                # and said so.
                plan = remat.solve(profile, memory_budget=err.min_feasible_bytes)
                note = f" (at remat's floor, {over} B above)"
            else:
                row += [f"below remat's floor ({mib(err.min_feasible_bytes, 1)} MiB)", "", "",
                        "", ""]
        if plan is not None:
            if peer.startswith("torch.compile"):  # compiled against compiled
                step = measure_compiled(case.model, case.batch, plan, optimizer=case.optimizer,
                                        loop=LOOP, repeats=repeats)
                assert step.time_ms is not None
                ours = Measured(step.peak_bytes, step.reserved_bytes, step.time_ms)
                summary = f"{plan.summary()} + torch.compile"
            else:
                remat.apply_plan(case.model, plan)
                try:
                    ours = measure(case, repeats)
                finally:
                    remat.remove_plan(case.model)
                summary = plan.summary()
            row += [summary + note, *_cells(ours), f"{m.time_ms / ours.time_ms:.2f}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    return rows


def main() -> None:
    parser = script_parser(__doc__.split("\n\n")[0], ["gpt2"])
    parser.add_argument("--compile-budgets", nargs="*", type=float, default=[1.0, 0.5])
    args = parser.parse_args()
    device = script_device("gpu_peers", args.smoke)
    start = time.perf_counter()
    rows = []
    for name in args.models:
        case = MODELS[name](device, args.smoke)
        print(f"== {name}: {case.note}", flush=True)
        rows += rows_for(name, case, args.repeats, args.compile_budgets)
        del case
        empty_cache(device)
    import transformers

    command = command_line("gpu_peers.py")
    header = (
        "# remat against its peers on a GPU, at equal measured peak\n\n"
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{machine_line()}; transformers {transformers.__version__}; allocator config: "
        f"`{alloc_conf() or 'default'}`\n"
        f"- command: `{command}` ({time.perf_counter() - start:.0f} s)\n"
        "- loop: bf16 autocast, fused AdamW, output dropped; peak: one optimizer step, "
        "everything included (`torch.cuda.max_memory_allocated`); reserved: "
        "`max_memory_reserved` after `empty_cache()`; ms: CUDA events, median of "
        f"{args.repeats} steps; remat: solved for the peer's measured peak, measured the "
        "same way in the same run\n")
    text = "\n".join([header, *markdown_table(COLUMNS, rows)]) + "\n"
    if args.smoke:
        print(text)
        return
    write_result(args.out or RESULTS / f"gpu-{device_slug()}.md", text)


if __name__ == "__main__":
    main()
