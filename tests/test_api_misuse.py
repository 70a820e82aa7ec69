"""Misuse of every entry point: a RematError naming the input and the fix, before any work.

The API cases check the exception's type and a phrase of its message, and that
profiling never started where the mistake can be seen without a profile; the
command-line cases check exit status 2, one line on stderr and no file written.
The user's own exceptions (a loss or a model that raises) pass through unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

import remat
import remat.profiler.profile  # noqa: F401 - patched by no_profiling
from remat.cli.commands import main
from remat.core.errors import (
    ArgumentError,
    BudgetError,
    LoopError,
    ParameterError,
    PlanMismatchError,
    ProfileError,
    RematError,
    UnknownParameterError,
)
from remat.core.plan import Plan, PlanTarget
from remat.models import build
from remat.plot import PlotError
from remat.solver.solve import UnknownMethodError

REF = build("mlp", size="tiny", seed=0)
MODEL, BATCH, LOSS = REF.model, REF.batch, REF.loss_fn
PROFILE = remat.profile(MODEL, BATCH, loss_fn=LOSS)


class ProfilingStarted(AssertionError):
    """Raised by the stand-in profiler: the mistake was not caught before profiling."""


@pytest.fixture
def no_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler's first step after its checks (finding the units) fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ProfilingStarted("profiling started before the argument was checked")

    monkeypatch.setattr(sys.modules["remat.profiler.profile"], "discover_units", refuse)


def _generator() -> Any:
    yield BATCH


META = build("mlp", size="tiny", seed=0).model.to("meta")  # as built under torch.device("meta")
UNITS = [u.name for u in PROFILE.units]


def _on_device(device: str) -> Plan:
    """A plan whose target device is ``device`` (an edited plan file)."""
    return Plan.checkpoint_all(UNITS, target=PlanTarget(device=device))


def _in_autocast(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` run inside ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    def run() -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call()
    return run


CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("plan path", lambda: remat.apply_plan(MODEL, "plan.json"), ArgumentError,
     "remat.Plan.from_json('plan.json')"),
    ("plan dict", lambda: remat.apply_plan(MODEL, {"unit_names": []}), ArgumentError,
     "Plan.from_dict"),
    ("apply to a non-model", lambda: remat.apply_plan("model", PROFILE), ArgumentError,
     "torch.nn.Module"),
    ("profile a string", lambda: remat.profile("not a model", BATCH), ArgumentError,
     "needs model, a torch.nn.Module, got the str 'not a model'"),
    ("optimizer by name", lambda: remat.profile(MODEL, BATCH, loss_fn=LOSS, optimizer="adam"),
     ArgumentError, "torch.optim.AdamW(model.parameters())"),
    ("optimizer class", lambda: remat.profile(MODEL, BATCH, optimizer=torch.optim.Adam),
     ArgumentError, "not an instance"),
    ("loss not callable", lambda: remat.profile(MODEL, BATCH, loss_fn="mse"), ArgumentError,
     "loss_fn must be a callable"),
    ("generator batch", lambda: remat.profile(MODEL, _generator(), loss_fn=LOSS),
     ArgumentError, "next(iter(loader))"),
    ("loader batch", lambda: remat.measure(MODEL, torch.utils.data.DataLoader([BATCH])),
     ArgumentError, "pass one"),
    ("loop as a dict", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS,
                                           loop={"accumulation_steps": 2}),
     ArgumentError, "remat.Loop(**loop)"),
    ("solve without a batch", lambda: remat.solve(MODEL, memory_budget="1GB"), ArgumentError,
     "sample batch"),
    ("bad budget", lambda: remat.solve(MODEL, BATCH, "lots", loss_fn=LOSS), BudgetError,
     "accepted forms"),
    ("percentage of what", lambda: remat.solve(MODEL, BATCH, "50% of params", loss_fn=LOSS),
     BudgetError, "'of activations' or 'of peak'"),
    ("unknown method", lambda: remat.solve(MODEL, BATCH, "1GB", method="greedy", loss_fn=LOSS),
     UnknownMethodError, "valid methods"),
    ("unknown keyword", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS, k=2),
     UnknownParameterError, "does not take ['k']"),
    ("verify rounds", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS, verify_rounds=0),
     ParameterError, "verify_rounds"),
    ("pareto points 0", lambda: remat.pareto(MODEL, BATCH, loss_fn=LOSS, points=0),
     ParameterError, "points"),
    ("pareto points 2.5", lambda: remat.pareto(PROFILE, points=2.5), ParameterError,
     "got points=2.5"),
    ("uniform k=0", lambda: remat.solve(PROFILE, method="uniform", k=0), ParameterError,
     "k, an int"),
    ("plot an empty frame", lambda: remat.plot_pareto(pd.DataFrame()), PlotError, "empty"),
    ("plot a list", lambda: remat.plot_pareto([1, 2]), PlotError, "DataFrame"),
    ("plot bad measured", lambda: remat.plot_pareto(remat.pareto(PROFILE, points=2),
                                                    measured=[{"peak": 1}]),
     PlotError, "peak_bytes and time_ms"),
    ("estimate a string", lambda: remat.estimate("gpt", BATCH), ArgumentError,
     "torch.nn.Module"),
    ("estimate bad budget", lambda: remat.estimate(PROFILE, memory_budget="8 gigs"),
     BudgetError, "unknown unit"),
    ("activation_budget of a string", lambda: remat.api.activation_budget(PROFILE, "0.5"),
     ParameterError, "needs fraction, a number within [0, 1]"),
    ("activation_budget of a percentage", lambda: remat.api.activation_budget(PROFILE, "50%"),
     ParameterError, "pass 0.5"),
    ("activation_budget of a model", lambda: remat.api.activation_budget(MODEL, 0.5),
     ArgumentError, "needs a remat Profile"),
    ("remove_plan of a string", lambda: remat.remove_plan("not a model"), ArgumentError,
     "remove_plan() needs model, a torch.nn.Module"),
    ("a plan on device gpu0", lambda: remat.apply_plan(MODEL, _on_device("gpu0")),
     PlanMismatchError, "'gpu0' is not a device torch knows"),
    ("a plan on device xyz", lambda: remat.apply_plan(MODEL, _on_device("xyz")),
     PlanMismatchError, "target 'device'"),
    ("estimate a meta model", lambda: remat.estimate(META, BATCH, loss_fn=LOSS), ArgumentError,
     "model.to_empty(device='cpu')"),
    ("profile a meta model", lambda: remat.profile(META, BATCH, loss_fn=LOSS), ArgumentError,
     "on the 'meta' device"),
    ("solve a meta model", lambda: remat.solve(META, BATCH, "1GB", loss_fn=LOSS), ArgumentError,
     "on the 'meta' device"),
    ("verify steps", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS, verify_steps=0),
     ParameterError, "verify_steps"),
    ("solve in autocast, another loop", _in_autocast(lambda: remat.solve(
        MODEL, BATCH, "1GB", loss_fn=LOSS, loop=remat.Loop())), LoopError,
     "loop=remat.Loop() says the forward runs without autocast"),
    ("profile in autocast, another autocast", _in_autocast(lambda: remat.profile(
        MODEL, BATCH, loss_fn=LOSS, loop=remat.Loop(autocast="float16"))), LoopError,
     "Pass loop=remat.Loop(autocast='bfloat16')"),
    ("pareto in autocast, another loop", _in_autocast(lambda: remat.pareto(
        MODEL, BATCH, loss_fn=LOSS, loop=remat.Loop(accumulation_steps=2))), LoopError,
     "loop=remat.Loop(accumulation_steps=2, autocast='bfloat16')"),
    ("estimate in autocast, another loop", _in_autocast(lambda: remat.estimate(
        MODEL, BATCH, loss_fn=LOSS, loop=remat.Loop())), LoopError, "estimate() runs inside"),
    # Timing counts: ints, not floats or bools, checked before the profile cache is read.
    ("profile repeats 2.5", lambda: remat.profile(MODEL, BATCH, loss_fn=LOSS, repeats=2.5),
     ProfileError, "profile() needs repeats, an int with 1 <= repeats"),
    ("profile warmup True", lambda: remat.profile(MODEL, BATCH, loss_fn=LOSS, warmup=True),
     ProfileError, "got warmup=True"),
    ("profile tolerance '5%'", lambda: remat.profile(MODEL, BATCH, loss_fn=LOSS,
                                                     tolerance="5%"),
     ProfileError, "0 <= tolerance < 1"),
    ("measure repeats 1.5", lambda: remat.measure(MODEL, BATCH, loss_fn=LOSS, repeats=1.5),
     ProfileError, "measure() needs repeats, an int with 0 <= repeats"),
    ("measure steps True", lambda: remat.measure(MODEL, BATCH, loss_fn=LOSS, steps=True),
     ParameterError, "got steps=True"),
    ("measure time_within 1.5", lambda: remat.measure(MODEL, BATCH, loss_fn=LOSS,
                                                      time_within=1.5),
     ParameterError, "got time_within=1.5"),
    ("verify rounds without verify", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS,
                                                         verify=False, verify_rounds=2.5),
     ParameterError, "got verify_rounds=2.5"),
    ("apply_plan strict 'yes'", lambda: remat.apply_plan(MODEL, _on_device("cpu"),
                                                         strict="yes"),
     ArgumentError, "strict must be True or False, got strict='yes'"),
    ("apply_plan strict_shapes 1", lambda: remat.apply_plan(MODEL, _on_device("cpu"),
                                                            strict_shapes=1),
     ArgumentError, "strict_shapes must be True or False"),
    ("a loss of no arguments", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=os.getcwd),
     ArgumentError, "loss_fn is called as loss_fn(output, batch), and getcwd()"),
    # Verification is one value: True, False or remat.Verify(rounds=..., steps=...).
    ("verify a string", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS, verify="yes"),
     ArgumentError, "verify must be True (measure the plan: remat.Verify()), False (do not) "
     "or remat.Verify(rounds=..., steps=...), got verify='yes'"),
    ("Verify rounds 0", lambda: remat.Verify(rounds=0), ParameterError,
     "remat.Verify() needs rounds, an int with 1 <= rounds"),
    ("Verify steps 1.5", lambda: remat.Verify(steps=1.5), ParameterError, "got steps=1.5"),
    ("verify said twice", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS,
                                              verify=remat.Verify(), verify_rounds=2),
     ArgumentError, "say it in one place, verify=remat.Verify(rounds=..., steps=...)"),
    # The compiled search is its own entry point.
    ("solve_compiled a profile", lambda: remat.solve_compiled(PROFILE, None, "1GB"),
     ArgumentError, "solve_compiled() measures candidate plans compiled, so it needs the model"),
    ("solve_compiled no budget", lambda: remat.solve_compiled(MODEL, BATCH, None, loss_fn=LOSS),
     ArgumentError, "needs the model, a sample batch and a budget"),
    ("solve_compiled bad method", lambda: remat.solve_compiled(MODEL, BATCH, "1GB", loss_fn=LOSS,
                                                               method="greedy"),
     UnknownMethodError, "valid methods"),
    ("solve compiled, a solver keyword", lambda: remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS,
                                                             compiled=True, k=2),
     UnknownParameterError, "solve(compiled=True) does not take ['k']"),
]


@pytest.mark.parametrize(("name", "call", "error", "phrase"), CASES, ids=[c[0] for c in CASES])
def test_api_misuse(no_profiling: None, name: str, call: Callable[[], Any],
                    error: type[Exception], phrase: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, RematError)
    assert phrase in str(info.value)


def test_the_users_own_exceptions_pass_through() -> None:
    def bad_loss(output: Any, batch: Any) -> Any:
        raise ZeroDivisionError("the user's loss")

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("the user's model")

    with pytest.raises(ZeroDivisionError, match="the user's loss"):
        remat.profile(MODEL, BATCH, loss_fn=bad_loss)
    with pytest.raises(KeyError, match="the user's model"):
        remat.solve(Broken(), torch.randn(2, 4), "1GB", loss_fn=lambda o, b: o.sum())


def test_a_complex_loss_is_named() -> None:
    def complex_loss(output: Any, batch: Any) -> torch.Tensor:
        return output.square().mean() * (1 + 1j)

    for call in (remat.profile, remat.measure):
        with pytest.raises(ProfileError, match="must be a real scalar tensor, got a complex64"):
            call(MODEL, BATCH, loss_fn=complex_loss)


def test_the_user_autocast_is_left_as_it_was_after_a_refusal() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(LoopError):
            remat.solve(MODEL, BATCH, "1GB", loss_fn=LOSS, loop=remat.Loop())
        assert torch.is_autocast_enabled("cpu")
        assert MODEL(BATCH).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_callback_budget_is_checked_when_made() -> None:
    pytest.importorskip("transformers")
    from remat.integrations.hf import RematCallback

    with pytest.raises(BudgetError, match="accepted forms"):
        RematCallback(memory_budget="eight gigs")
    with pytest.raises(UnknownMethodError):
        RematCallback(memory_budget="1GB", method="fastest")


# --------------------------------------------------------------------------- command line
CLI_CASES: list[tuple[str, list[str], str]] = [
    ("bad budget", ["solve", "--model", "mlp", "--size", "tiny", "--budget", "lots",
                    "--out", "{out}"], "accepted forms"),
    ("points 0", ["pareto", "--model", "mlp", "--size", "tiny", "--points", "0",
                  "--out", "{png}"], "points"),
    ("plot format", ["pareto", "--model", "mlp", "--size", "tiny", "--out", "{dir}/x.xyz"],
     "cannot write .xyz"),
    ("missing profile", ["solve", "--profile", "{dir}/missing.json", "--budget", "1GB",
                         "--out", "{out}"], "does not exist"),
    ("garbage profile", ["pareto", "--profile", "{garbage}", "--out", "{png}"], "garbage.json"),
    ("measure a profile", ["solve", "--profile", "{dir}/p.json", "--budget", "1GB",
                           "--measure"], "needs --model"),
    ("loop options with a profile", ["pareto", "--profile", "{dir}/p.json", "--optimizer",
                                     "adamw", "--out", "{png}"], "--optimizer describes"),
    ("compile a profile", ["solve", "--profile", "{dir}/p.json", "--budget", "1GB",
                           "--compiled"], "needs --model"),
    ("no such folder", ["solve", "--model", "mlp", "--size", "tiny", "--budget", "1GB",
                        "--out", "{dir}/nowhere/plan.json"], "does not exist"),
    ("out is a folder", ["profile", "--model", "mlp", "--size", "tiny", "--out", "{dir}"],
     "is a folder"),
    ("out under a file", ["solve", "--model", "mlp", "--size", "tiny", "--budget", "1GB",
                          "--out", "{garbage}/plan.json"], "is a file, not a folder"),
    ("unknown method", ["solve", "--model", "mlp", "--size", "tiny", "--budget", "1GB",
                        "--method", "greedy", "--out", "{out}"], "valid methods"),
    ("loss needs a target", ["solve", "--model", "mlp", "--size", "tiny", "--budget", "1GB",
                             "--loss", "cross_entropy", "--out", "{out}"], "target"),
    ("unknown loss", ["solve", "--model", "mlp", "--size", "tiny", "--budget", "1GB",
                      "--loss", "hinge", "--out", "{out}"], "valid are cross_entropy, mse"),
    ("accumulation 0", ["estimate", "--model", "mlp", "--size", "tiny",
                        "--accumulation-steps", "0"], "accumulation_steps"),
    ("a model without its module", ["solve", "--model", ":make", "--budget", "1GB"],
     "--model ':make': name both the module and the function"),
    ("a model without its function", ["estimate", "--model", "os:"], "name both"),
    ("a model that is not a function", ["estimate", "--model", "os:sep"], "not a function"),
    ("a loss without names", ["solve", "--model", "mlp", "--size", "tiny", "--loss", ":",
                              "--budget", "1GB"], "--loss ':': name both"),
    ("a loss of no arguments", ["solve", "--model", "mlp", "--size", "tiny", "--loss",
                                "os:getcwd", "--budget", "1GB"],
     "--loss 'os:getcwd': the loss is called as function(output, batch)"),
    ("a model that takes arguments", ["estimate", "--model", "os.path:join"],
     "--model 'os.path:join': the function is called with no arguments"),
    ("an empty --out", ["profile", "--model", "mlp", "--size", "tiny", "--out", ""],
     "--out '' is empty"),
    ("an empty pareto --out", ["pareto", "--model", "mlp", "--size", "tiny", "--out", ""],
     "--out '' is empty"),
    ("an empty --profile", ["solve", "--profile", "", "--budget", "1GB"],
     "--profile '' is empty"),
    ("an empty --model", ["estimate", "--model", ""], "--model '' is empty"),
    ("an empty --loss", ["solve", "--model", "mlp", "--size", "tiny", "--loss", "",
                         "--budget", "1GB"], "--loss '' is empty"),
]


@pytest.mark.parametrize(("name", "argv", "phrase"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_misuse_is_one_line_and_exit_2(no_profiling: None, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], name: str,
                                           argv: list[str], phrase: str) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json {")
    before = set(tmp_path.iterdir())
    args = [a.format(dir=tmp_path, out=tmp_path / "plan.json", png=tmp_path / "p.png",
                     garbage=garbage) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("remat: error: "), err
    assert phrase in err
    assert set(tmp_path.iterdir()) == before  # nothing written, not even a temporary file


def test_cli_failure_after_profiling_writes_nothing(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["solve", "--model", "mlp", "--size", "tiny", "--budget", "1B",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("remat: error: ")]
    assert len(errors) == 1 and "infeasible" in errors[0]
    assert list(tmp_path.iterdir()) == []
