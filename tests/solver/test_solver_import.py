"""``import remat.solver`` is cheap: ortools, pandas, matplotlib and torch load only when used."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("ortools", "pandas", "matplotlib", "torch")


def _loaded_after(code: str) -> set[str]:
    """The HEAVY packages in sys.modules after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("code", [
    "import remat.solver",
    "import remat.solver.solve",
    "import remat.solver.pareto",
    "from remat.solver import solve_profile, ALGORITHMS, simulate, solve_dp",
    "from remat.core import budget, checks, errors, loop, option, plan, profile",
])
def test_importing_the_solver_loads_nothing_heavy(code: str) -> None:
    assert _loaded_after(code) == set()


def test_heavy_names_load_on_first_use() -> None:
    loaded = _loaded_after("from remat.solver import solve_ilp")
    assert "ortools" in loaded and not loaded & {"matplotlib", "torch"}
    # The frontier imports pandas only to build its frame.
    code = ("from remat.solver import pareto_frontier, frontier_plans, min_peak_bytes_over_heads\n"
            "import sys; assert 'pandas' not in sys.modules")
    assert _loaded_after(code) == set()


def test_every_public_name_resolves() -> None:
    import remat.solver

    for name in remat.solver.__all__:
        assert getattr(remat.solver, name) is not None, name
    assert set(remat.solver.__all__) <= set(dir(remat.solver))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        remat.solver.nothing  # noqa: B018 - the attribute access is the test
