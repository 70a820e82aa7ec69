"""The house is the pipeline: each floor imports only the floors below it, never a sibling.

    core <- execute, measurement, solver <- profiler, runtime <- verify, compiled, api... <- cli

Read from the source (every import statement, inside functions too), so a lazy import
cannot slip past the rule. ``import remat`` and ``import remat.solver`` staying cheap is
checked by ``test_import_cost.py`` and ``solver/test_solver_import.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pyproject's package-dir: the card's stages live in top-level folders.
FOLDERS = {"remat": ROOT / "remat", "remat.solver": ROOT / "solver",
           "remat.profiler": ROOT / "profiler", "remat.runtime": ROOT / "runtime"}

# (floor, packages or modules on it); a module belongs to the longest prefix listed.
FLOORS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("remat.core",)),
    (1, ("remat.execute", "remat.measurement", "remat.solver")),
    (2, ("remat.profiler", "remat.runtime")),
    (3, ("remat", "remat.api", "remat.verify", "remat.compiled", "remat.preflight",
         "remat.granularity", "remat.plot", "remat.plot_labels", "remat.report",
         "remat.output", "remat.losses", "remat.integrations", "remat.models",
         "remat.in_backward")),
    (4, ("remat.cli", "remat.__main__", "remat.models.demo")),
]
TORCH_FREE = ("remat.core", "remat.solver")


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


def _group(module: str) -> tuple[int, str]:
    """``(floor, group)``: the group is the longest listed prefix of ``module``."""
    best: tuple[int, str] | None = None
    for floor, names in FLOORS:
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best[1])):
                best = (floor, name)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


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
        if their_floor == floor and floor in (1, 2):
            assert their_group == group, f"{where}: siblings on floor {floor} are independent"


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
    assert {"remat.cli", "remat.models.demo", "remat.core.plan"} <= set(MODULES)
    graph = {name: _imported_at_import_time(name) for name in MODULES}
    assert "remat.models.load" in graph["remat.models.demo"]  # the walk sees imports
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
    # The checks above can fail: a profiler module importing the runtime is caught.
    assert _group("remat.profiler.profile") == (2, "remat.profiler")
    assert _group("remat.runtime.apply") == (2, "remat.runtime")
    assert _group("remat.models.demo") == (4, "remat.models.demo")
    MODULES["remat.profiler._probe"] = tmp_path / "probe.py"
    (tmp_path / "probe.py").write_text("def f():\n    from remat.runtime.apply import apply_plan\n")
    try:
        with pytest.raises(AssertionError, match="siblings"):
            test_a_floor_imports_only_the_floors_below("remat.profiler._probe")
    finally:
        del MODULES["remat.profiler._probe"]
