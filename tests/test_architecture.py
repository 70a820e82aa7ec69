"""The house is the pipeline: each floor imports only the floors below it, and the rooms
on one floor are siblings that import none of each other.

    core <- execute, measurement, solver <- profiler, runtime <- tune, plot, models
         <- the API (remat, api, preflight) <- cli, integrations

Read from the source (every import statement, inside functions too), so a lazy import
cannot slip past the rule. docs/architecture.md's list of floors is :data:`FLOORS`,
written out (checked below). ``import remat`` and ``import remat.solver`` staying cheap
is checked by ``test_import_cost.py`` and ``solver/test_solver_import.py``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pyproject's package-dir: the card's stages live in top-level folders.
FOLDERS = {"remat": ROOT / "remat", "remat.solver": ROOT / "solver",
           "remat.profiler": ROOT / "profiler", "remat.runtime": ROOT / "runtime"}

# floor -> its rooms -> the packages or modules in each room. A module belongs to the
# longest name listed that is it or a package above it; "remat" is remat/__init__.py
# alone, so a new module beside the API must be given a room here. No room imports a
# sibling: what two siblings would share belongs on a floor below them.
FLOORS: dict[int, dict[str, tuple[str, ...]]] = {
    0: {"core": ("remat.core",)},
    1: {"execute": ("remat.execute",), "measurement": ("remat.measurement",),
        "solver": ("remat.solver",)},
    2: {"profiler": ("remat.profiler",), "runtime": ("remat.runtime",)},
    3: {"tune": ("remat.tune",), "plot": ("remat.plot",), "models": ("remat.models",)},
    4: {"api": ("remat", "remat.api", "remat.preflight")},
    5: {"cli": ("remat.cli", "remat.__main__"), "integrations": ("remat.integrations",)},
}
TORCH_FREE = ("remat.core", "remat.solver")
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "remat" and parts and parts[0] in ("solver", "profiler", "runtime"):
                continue
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _file(module: str) -> Path:
    path = MODULES[module]
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _covers(name: str, module: str) -> bool:
    return module == name or (name != "remat" and module.startswith(name + "."))


def _group(module: str) -> tuple[int, str]:
    """``(floor, room)``: the room of the longest listed name that covers ``module``."""
    best: tuple[int, str, str] | None = None
    for floor, rooms in FLOORS.items():
        for room, names in rooms.items():
            for name in names:
                if _covers(name, module) and (best is None or len(name) > len(best[2])):
                    best = (floor, room, name)
    assert best is not None, f"{module} is on no floor: give it a room in FLOORS"
    return best[0], best[1]


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every import statement of ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in MODULES else base), node.lineno


def _remat_imports(module: str) -> Iterator[tuple[str, int]]:
    for target, line in _imports(module):
        if target == "remat" or target.startswith("remat."):
            yield target, line


def test_every_module_is_on_a_floor() -> None:
    assert len(MODULES) > 80
    for module in MODULES:
        _group(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_floor_imports_only_the_floors_below(module: str) -> None:
    floor, group = _group(module)
    for target, line in _remat_imports(module):
        if target not in MODULES:
            continue  # a name re-exported by a package: its package is checked below
        their_floor, their_group = _group(target)
        where = f"{_file(module)}:{line} imports {target}"
        assert their_floor <= floor, f"{where}, a floor above ({their_floor} > {floor})"
        if their_floor == floor:
            assert their_group == group, (
                f"{where}: {group} and {their_group} are siblings on floor {floor}, "
                "independent of each other")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(TORCH_FREE)))
def test_the_contracts_and_the_solver_import_no_torch(module: str) -> None:
    for target, line in _imports(module):
        assert target.split(".")[0] != "torch", (
            f"{_file(module)}:{line} imports {target}")


# The command line and the demo used to import each other's privates. A cycle between
# remat's modules makes the import order decide which names exist; module-level imports
# must form none (an import inside a function runs later, once both modules exist).
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


def _imported_at_import_time(module: str) -> set[str]:
    """The remat modules that ``module`` imports at import time."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != module)
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


def test_no_import_cycles_between_remat_modules() -> None:
    assert {"remat.cli", "remat.cli.demo", "remat.core.plan"} <= set(MODULES)
    graph = {name: _imported_at_import_time(name) for name in MODULES}
    assert "remat.models.load" in graph["remat.cli.demo"]  # the walk sees imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names() -> None:
    # Anywhere, lazy imports included: what two modules share belongs in a public place
    # (the demo once borrowed the command line's `_mib` and `_print_table`).
    borrowed = [
        f"{name}: from {node.module} import {alias.name}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert borrowed == []


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    # The checks above can fail: a profiler module importing the runtime is caught, and so
    # is the verification importing the plot, siblings on the floor above.
    assert _group("remat.profiler.profile") == (2, "profiler")
    assert _group("remat.runtime.apply") == (2, "runtime")
    assert _group("remat.cli.demo") == (5, "cli")
    assert _group("remat") == (4, "api")
    with pytest.raises(AssertionError, match="on no floor"):
        _group("remat.stray")  # a module dropped beside the API has no room
    probes = {"remat.profiler._probe": "from remat.runtime.apply import apply_plan",
              "remat.tune._probe": "from remat.plot.pareto import plot_pareto"}
    for k, (module, statement) in enumerate(probes.items()):
        MODULES[module] = tmp_path / f"probe{k}.py"
        MODULES[module].write_text(f"def f():\n    {statement}\n")
        try:
            with pytest.raises(AssertionError, match="siblings"):
                test_a_floor_imports_only_the_floors_below(module)
        finally:
            del MODULES[module]


# docs/architecture.md lists the floors as FLOORS holds them, one line per floor:
#   - floor 3: `remat/tune/`, `remat/plot/`, `remat/models/` — free text after the dash
# (a room of several names joins them with " + "), so the page cannot drift from the rule.
def _where(name: str) -> str:
    """A FLOORS name as the page writes it: a package's folder, or a module's file."""
    path = _file(name)
    return f"{path.parent}/" if path.name == "__init__.py" and name != "remat" else str(path)


def floors_as_listed() -> list[str]:
    return [f"- floor {floor}: " + ", ".join(" + ".join(f"`{_where(n)}`" for n in names)
                                             for names in rooms.values())
            for floor, rooms in FLOORS.items()]


def test_the_architecture_page_lists_the_floors() -> None:
    lines = ARCHITECTURE_DOC.read_text(encoding="utf-8").splitlines()
    listed = [line.split(" — ")[0].rstrip() for line in lines if line.startswith("- floor ")]
    expected = floors_as_listed()
    assert listed == expected, (
        f"{ARCHITECTURE_DOC.relative_to(ROOT)}'s floors differ from FLOORS; as FLOORS "
        "has them:\n" + "\n".join(expected))


# The profiler is a row of passes (profiler/profile.py's docstring numbers them): each
# module opens its docstring with the pass it belongs to, or says it is a tool of several,
# and no function runs past a screen, so each pass reads as named steps.
PROFILER = FOLDERS["remat.profiler"]
MAX_FUNCTION_LINES = 80


def _long_functions(folder: Path, limit: int) -> list[str]:
    """``file:line name (n lines)`` for every function or method in ``folder`` longer than
    ``limit`` lines, counted from its ``def`` to its last line."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name} "
                                 f"({length} lines)")
    return found


def test_no_profiler_function_is_over_80_lines() -> None:
    assert _long_functions(PROFILER, MAX_FUNCTION_LINES) == [], (
        "split it into named steps (a small record between them where they share state)")


def test_the_length_rule_catches_a_long_function(tmp_path: Path) -> None:
    (tmp_path / "fits.py").write_text("def fits():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1))
    (tmp_path / "long.py").write_text("class C:\n    def long(self):\n"
                                      + "        x = 1\n" * MAX_FUNCTION_LINES)
    assert _long_functions(tmp_path, MAX_FUNCTION_LINES) == [
        f"long.py:2 long ({MAX_FUNCTION_LINES + 1} lines)"]


def _passes() -> dict[str, tuple[int, str]]:
    """Module name -> (its pass, the pass's name), as profile.py's docstring lists them:
    ``N. **name** (:mod:`.a`, :mod:`.b`): ...``."""
    doc = ast.get_docstring(ast.parse((PROFILER / "profile.py").read_text())) or ""
    passes = {}
    for number, name, modules in re.findall(r"^(\d)\. \*\*(.+?)\*\* \(([^)]*)\)", doc, re.M):
        for module in re.findall(r":mod:`\.(\w+)`", modules):
            passes[module] = (int(number), name)
    return passes


def test_each_profiler_module_says_which_pass_it_is() -> None:
    passes = _passes()
    assert sorted({number for number, _ in passes.values()}) == [0, 1, 2, 3, 4, 5]
    for path in sorted(PROFILER.glob("*.py")):
        if path.stem in ("__init__", "profile"):  # the package, and the row itself
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.splitlines()[0] if doc else ""
        if path.stem in passes:
            number, name = passes[path.stem]
            assert first == f"Pass {number} of :mod:`.profile` ({name}).", (
                f"{path.name}'s docstring opens with {first!r}")
        else:
            assert first.startswith("A tool of "), (
                f"{path.name} is in no pass that profile.py's docstring lists, and says it "
                f"is no tool of several: {first!r}")


# What lives outside the package (benchmarks, examples, the notebook) uses remat as a
# user would: names a package's face offers (`remat`, `remat.solver`, `remat.tune`, ...:
# its `__all__`), never a module inside a package, so modules can move behind the faces.
# The integrations are faces module by module (`from remat.integrations.hf import ...`).
# An ablation swaps a mechanism inside: listed here with why, so none slips in unseen.
OUTSIDE = ("benchmarks", "examples", "notebooks")
ABLATIONS = {
    # runs checkpointed units with autocast's weight cache kept, to measure what
    # dropping it saves: it swaps the context manager where the two callers hold it
    "benchmarks/autocast_cache.py": {"remat.execute.options", "remat.runtime.segments"},
}


def _outside_sources() -> Iterator[tuple[str, str]]:
    for folder in OUTSIDE:
        for path in sorted((ROOT / folder).glob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text())["cells"]
            code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
            yield str(path.relative_to(ROOT)), code


def _off_the_faces(where: str, source: str) -> list[str]:
    """The imports of remat in ``source`` that are not a face's public names."""
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            wrong += [f"{where}: import {a.name}" for a in node.names
                      if a.name.startswith("remat.") and not _is_face(a.name)
                      and a.name not in ABLATIONS.get(where, ())]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat"):
            if not _is_face(node.module):
                wrong.append(f"{where}: from {node.module} import ...")
                continue
            offered = set(getattr(importlib.import_module(node.module), "__all__", ()))
            wrong += [f"{where}: from {node.module} import {a.name} (not in its __all__)"
                      for a in node.names if a.name not in offered
                      and not _is_face(f"{node.module}.{a.name}")]
    return wrong


def _is_face(module: str) -> bool:
    """Whether ``module`` is a package (an ``__init__``), not a module inside one, or an
    integration."""
    if module.startswith("remat.integrations."):
        return True
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


def test_benchmarks_examples_and_the_notebook_use_public_names_only() -> None:
    wrong = [line for where, source in _outside_sources()
             for line in _off_the_faces(where, source)]
    assert wrong == []


def test_the_public_names_rule_catches_an_inner_module() -> None:
    assert _off_the_faces("x.py", "from remat.tune.verify import measure_plan") == [
        "x.py: from remat.tune.verify import ..."]
    assert _off_the_faces("x.py", "from remat.tune import _NAMES") == [
        "x.py: from remat.tune import _NAMES (not in its __all__)"]
    assert _off_the_faces("x.py", "from remat import models\nimport remat.solver") == []
