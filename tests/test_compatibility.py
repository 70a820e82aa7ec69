"""One compatibility policy (docs/compatibility.md): before 1.0, no aliases; an old path
is an error that names the new one."""

from __future__ import annotations

import importlib
import json

import pytest

import remat
import remat.solver
from remat.core.plan import (
    _MOVED_ATTRIBUTES,
    CompiledChoice,
    PlanRecord,
    PlanTarget,
    Status,
    Verification,
)

PARTS = {"target": PlanTarget, "record": PlanRecord, "verification": Verification,
         "compiled": CompiledChoice}


@pytest.mark.parametrize(("old", "new"), sorted(remat._MOVED.items()))
def test_an_old_module_path_names_the_new_one(old: str, new: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"{old} moved to {new}"):
        importlib.import_module(old)
    parent, _, name = old.rpartition(".")
    with pytest.raises(ModuleNotFoundError, match=f"moved to {new}"):
        exec(f"from {parent} import {name}", {})  # noqa: S102 - the statement is the test
    new_parent, _, new_name = new.rpartition(".")  # the new path is a module, or a name
    module = importlib.import_module(new_parent)
    assert hasattr(module, new_name) or importlib.import_module(new).__name__ == new


def test_a_missing_module_is_still_the_usual_error() -> None:
    with pytest.raises(ModuleNotFoundError, match="No module named 'remat.nothing'"):
        importlib.import_module("remat.nothing")
    with pytest.raises(AttributeError, match="remat.verify moved to remat.tune.verify"):
        remat.verify  # noqa: B018 - the attribute access is the test


def test_a_renamed_solver_name_names_the_new_one() -> None:
    with pytest.raises(AttributeError, match="use remat.solver.min_peak_bytes_over_heads"):
        remat.solver.min_feasible_peak  # noqa: B018
    assert remat.solver.min_peak_bytes_over_heads.__name__ == "min_peak_bytes_over_heads"


def test_a_plan_field_that_moved_names_where_it_went() -> None:
    plan = remat.Plan.checkpoint_all(["a", "b"])
    with pytest.raises(AttributeError, match=r"use plan\.record\.predicted_peak_bytes"):
        plan.predicted_peak_bytes  # noqa: B018
    for old, new in _MOVED_ATTRIBUTES.items():
        part, _, field = new.partition(".")
        assert field in PARTS[part].__dataclass_fields__, new
        with pytest.raises(AttributeError, match=f"use plan.{new}"):
            getattr(plan, old)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        plan.nothing  # noqa: B018
    assert getattr(plan, "fingerprint", None) is None


def test_status_is_an_enum_of_strings_and_a_record_holds_the_string() -> None:
    record = PlanRecord(status=Status.OPTIMAL)
    assert Status.OPTIMAL == "optimal" and type(record.status) is str
    assert json.dumps(record.status) == '"optimal"' and f"{Status.FEASIBLE}" == "feasible"
