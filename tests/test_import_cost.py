"""``import remat`` and ``import remat.runtime`` stay cheap: no solver back-ends, no plotting."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("ortools", "pandas", "matplotlib")


@pytest.mark.parametrize(
    ("module", "also_absent"),
    [("remat", ("torch",)), ("remat.core.errors", ("torch",)), ("remat.runtime", ())],
)
def test_import_loads_no_heavy_module(module: str, also_absent: tuple[str, ...]) -> None:
    code = (
        f"import sys, {module}\n"
        f"print(','.join(m for m in {HEAVY + also_absent!r} if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "", f"import {module} loaded {loaded}"
