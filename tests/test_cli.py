"""The command line: `python -m remat` on a built-in model and on a user factory."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from remat.cli.commands import main


def test_solve_prints_plan_and_measures(capsys, tmp_path):
    out = tmp_path / "plan.json"
    code = main(
        ["solve", "--model", "gpt", "--size", "tiny", "--budget", "95%", "--measure",
         "--out", str(out)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "predicted peak" in text and "measured  peak" in text
    assert json.loads(out.read_text())["unit_names"]


def test_profile_then_pareto_from_saved_profile(capsys, tmp_path):
    prof = tmp_path / "profile.json"
    assert main(["profile", "--model", "gpt", "--size", "tiny", "--out", str(prof)]) == 0
    png = tmp_path / "pareto.png"
    assert main(["pareto", "--profile", str(prof), "--points", "5", "--out", str(png)]) == 0
    assert png.stat().st_size > 0
    assert "optimal" in capsys.readouterr().out


def test_user_factory(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_factory.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def make():\n"
        "    blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]\n"
        "    model = nn.Sequential(*blocks)\n"
        "    return model, torch.randn(512, 32), lambda out, batch: out.square().mean()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["solve", "--model", "my_factory:make", "--budget", "90%"]) == 0
    assert "predicted peak" in capsys.readouterr().out
    assert main(["solve", "--model", "my_factory:make", "--budget", "90%", "--compiled"]) == 0
    assert "compiled (torch.compile) peak" in capsys.readouterr().out


def test_errors_are_reported_not_raised(capsys):
    assert main(["solve", "--model", "mlp", "--size", "tiny", "--budget", "lots"]) == 2
    assert "remat: error:" in capsys.readouterr().err
    assert main(["solve", "--model", "nosuchmodule:make", "--budget", "1GB"]) == 2
    assert main(["solve", "--profile", "p.json", "--budget", "1GB", "--compiled"]) == 2
    assert "needs --model" in capsys.readouterr().err


@pytest.mark.slow
def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert "demo" in result.stdout


# --------------------------------------------------------------------------- any model
def test_a_plain_byte_count_is_a_budget(capsys):
    assert main(["solve", "--model", "mlp", "--size", "tiny", "--budget", "130000000"]) == 0
    assert "budget 124.0 MiB" in capsys.readouterr().out


def test_logits_model_with_a_named_loss_and_loop_options(tmp_path, capsys, monkeypatch):
    (tmp_path / "logits_factory.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def make():\n"
        "    blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]\n"
        "    model = nn.Sequential(*blocks, nn.Linear(32, 10))\n"
        "    return model, torch.randn(256, 32), torch.randint(0, 10, (256,))\n"
        "def regress():\n"
        "    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)]\n"
        "    model = nn.Sequential(*blocks)\n"
        "    return model, torch.randn(64, 8), torch.randn(64, 8)\n"
        "def loss(output, batch):\n"
        "    return output.float().pow(2).mean()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.json"
    assert main(["solve", "--model", "logits_factory:make", "--loss", "cross_entropy",
                 "--budget", "90%", "--optimizer", "adamw", "--accumulation-steps", "2",
                 "--drop-output", "--measure", "--out", str(out)]) == 0
    assert "measured  peak" in capsys.readouterr().out
    loop = json.loads(out.read_text())["target"]["loop"]
    assert loop["accumulation_steps"] == 2 and loop["keep_output"] is False
    assert main(["estimate", "--model", "logits_factory:regress", "--loss", "mse"]) == 0
    assert main(["profile", "--model", "logits_factory:make", "--loss", "logits_factory:loss",
                 "--autocast", "bfloat16"]) == 0
    capsys.readouterr()
    # Without --loss the logits-only model stops with the fix, before profiling.
    assert main(["solve", "--model", "logits_factory:make", "--budget", "1GB"]) == 2
    assert "--loss cross_entropy" in capsys.readouterr().err


def test_help_lists_the_contract_methods_and_budget_forms():
    from remat.cli.commands import build_parser

    parser = build_parser()
    text = parser.format_help()
    for phrase in ("module:function", "(model, sample_batch, target)", "60% of peak",
                   "chen-greedy", "ilp", "130000000"):
        assert phrase in text, phrase
    solve_help = parser._subparsers._group_actions[0].choices["solve"].format_help()
    assert "--accumulation-steps" in solve_help and "60% of peak" in solve_help


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_users_mode(tmp_path, capsys, umask):
    # A temporary file is private (0o600); the file it becomes is the user's, as
    # open(path, "w") would make it.
    from remat.cli.output import write_atomic

    old = os.umask(umask)
    try:
        plan = tmp_path / "plan.json"
        assert main(["solve", "--model", "gpt", "--size", "tiny", "--budget", "95%",
                     "--out", str(plan)]) == 0
        other = tmp_path / "other.txt"
        write_atomic(other, lambda tmp: Path(tmp).write_text("x"))
    finally:
        os.umask(old)
    for path in (plan, other):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    capsys.readouterr()


def test_the_optimizer_stepped_in_backward(capsys):
    """``--optimizer-in-backward``: the plan is for that loop; without an optimizer, or with
    accumulation, it stops with the fix."""
    assert main(["estimate", "--model", "gpt", "--size", "tiny", "--optimizer", "adamw",
                 "--optimizer-in-backward"]) == 0
    out = capsys.readouterr().out
    assert "optimizer in backward" in out and "gradients released" in out
    assert main(["estimate", "--model", "gpt", "--size", "tiny",
                 "--optimizer-in-backward"]) == 2
    assert "pass optimizer=" in capsys.readouterr().err
    assert main(["estimate", "--model", "gpt", "--size", "tiny", "--optimizer", "adamw",
                 "--optimizer-in-backward", "--accumulation-steps", "2"]) == 2
    assert "accumulation_steps=1" in capsys.readouterr().err
