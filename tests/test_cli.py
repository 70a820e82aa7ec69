"""The command line: `python -m remat` on a built-in model and on a user factory."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from remat.cli import main


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


# --------------------------------------------------------------------------- import cycles
# The command line and the demo used to import each other's privates. A cycle between
# remat's modules makes the import order decide which names exist; module-level imports
# must form none (an import inside a function runs later, once both modules exist).
PACKAGES = ("remat", "remat.models", "remat.solver", "remat.profiler", "remat.runtime")


def _module_files() -> dict[str, Path]:
    """remat's modules by dotted name (solver/, profiler/, runtime/ are mapped into remat)."""
    files = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        for folder in spec.submodule_search_locations:
            for path in sorted(Path(folder).glob("*.py")):
                files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the module is imported: not function bodies, not
    ``if TYPE_CHECKING:`` blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_statements(node.body)
            yield from _import_time_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(h.body for h in node.handlers)):
                yield from _import_time_statements(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _import_time_statements(node.body)


def _imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The remat modules that ``name`` imports at import time."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in _import_time_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from pkg import sub` imports the submodule; `from mod import name`, the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_remat_modules():
    files = _module_files()
    assert {"remat.cli", "remat.models.demo", "remat.solver.plan"} <= set(files)
    graph = {name: _imported_modules(name, path, set(files)) for name, path in files.items()}
    assert "remat.models.load" in graph["remat.models.demo"]  # the walk sees imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names():
    # Anywhere, lazy imports included: what two modules share belongs in a public place
    # (the demo once borrowed the command line's `_mib` and `_print_table`).
    borrowed = [
        f"{name}: from {node.module} import {alias.name}"
        for name, path in _module_files().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert borrowed == []


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
    loop = json.loads(out.read_text())["loop"]
    assert loop["accumulation_steps"] == 2 and loop["keep_output"] is False
    assert main(["estimate", "--model", "logits_factory:regress", "--loss", "mse"]) == 0
    assert main(["profile", "--model", "logits_factory:make", "--loss", "logits_factory:loss",
                 "--autocast", "bfloat16"]) == 0
    capsys.readouterr()
    # Without --loss the logits-only model stops with the fix, before profiling.
    assert main(["solve", "--model", "logits_factory:make", "--budget", "1GB"]) == 2
    assert "--loss cross_entropy" in capsys.readouterr().err


def test_help_lists_the_contract_methods_and_budget_forms():
    from remat.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    for phrase in ("module:function", "(model, sample_batch, target)", "60% of peak",
                   "chen-greedy", "ilp", "130000000"):
        assert phrase in text, phrase
    solve_help = parser._subparsers._group_actions[0].choices["solve"].format_help()
    assert "--accumulation-steps" in solve_help and "60% of peak" in solve_help
