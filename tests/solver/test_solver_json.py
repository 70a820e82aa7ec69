"""Profile/Plan JSON and construction: every malformed input is a ProfileError or PlanError
naming the file and the field, never a raw KeyError, TypeError or a silently wrong value."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from solver_testlib import CKPT, KEEP, cost, transformer_like, unit

from remat.core import json_io
from remat.core.errors import PlanError, PlanMismatchError, ProfileError
from remat.core.fields import MAX_BYTES
from remat.core.plan import Plan, PlanRecord
from remat.core.profile import OptionCost, OutsideCost, Profile
from remat.solver.dp import solve_dp

PROFILE = transformer_like(3, seed=0)
PLAN = solve_dp(PROFILE, None)


def _profile_dict() -> dict[str, Any]:
    return json.loads(PROFILE.to_json())


def _plan_dict() -> dict[str, Any]:
    return json.loads(PLAN.to_json())


# ---------------------------------------------------------------------------------
# Reading: str path, Path, JSON text
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["str", "path", "text"])
def test_profile_and_plan_read_from_every_source(tmp_path: Path, form: str) -> None:
    for obj in (PROFILE, PLAN):
        path = tmp_path / f"{type(obj).__name__}.json"
        obj.to_json(path)  # a Path to write to works too
        source = {"str": str(path), "path": path, "text": obj.to_json()}[form]
        assert type(obj).from_json(source) == obj


# ---------------------------------------------------------------------------------
# Files that are not a usable profile / plan
# ---------------------------------------------------------------------------------
def _write(tmp_path: Path, content: str | bytes | None, name: str = "x.json") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    return path


FILE_CASES = [
    # (id, file content or None for no file, phrase in the message)
    ("missing", None, "does not exist"),
    ("empty", "", "is empty"),
    ("blank", "  \n", "is empty"),
    ("truncated", "TRUNCATED", "not valid JSON"),
    ("not-json", "hello: world", "not valid JSON"),
    ("a-list", "[1, 2]", "holds a JSON list"),
    ("binary", b"\xff\xfe\x00\x01garbage", "not UTF-8"),
]


@pytest.mark.parametrize(("kind", "error"), [(Profile, ProfileError), (Plan, PlanError)])
@pytest.mark.parametrize(("content", "phrase"), [c[1:] for c in FILE_CASES],
                         ids=[c[0] for c in FILE_CASES])
def test_bad_files(tmp_path: Path, kind: type, error: type, content: Any, phrase: str) -> None:
    if content == "TRUNCATED":
        full = (PROFILE if kind is Profile else PLAN).to_json()
        content = full[: len(full) // 2]
    path = _write(tmp_path, content)
    for source in (str(path), path):
        with pytest.raises(error) as err:
            kind.from_json(source)
        assert phrase in str(err.value)
        assert "x.json" in str(err.value)


@pytest.mark.parametrize(("kind", "error"), [(Profile, ProfileError), (Plan, PlanError)])
def test_a_directory_is_not_a_file(tmp_path: Path, kind: type, error: type) -> None:
    with pytest.raises(error, match="is a directory"):
        kind.from_json(tmp_path)


@pytest.mark.parametrize(("kind", "error"), [(Profile, ProfileError), (Plan, PlanError)])
@pytest.mark.parametrize(("raised", "phrase"), [
    (PermissionError(13, "Permission denied"), "permission denied"),
    (OSError(5, "Input/output error"), "cannot be read (Input/output error)"),
])
def test_an_unreadable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type, error: type,
    raised: OSError, phrase: str,
) -> None:
    # chmod cannot make a file unreadable to root, so the read itself fails here.
    def refuse(*args: object, **kwargs: object) -> None:
        raise raised

    path = _write(tmp_path, "{}")
    monkeypatch.setattr(json_io, "open", refuse, raising=False)
    with pytest.raises(error) as err:
        kind.from_json(path)
    assert phrase in str(err.value) and "x.json" in str(err.value)


@pytest.mark.parametrize(("kind", "error"), [(Profile, ProfileError), (Plan, PlanError)])
@pytest.mark.parametrize(("source", "phrase"), [
    ("", "empty string"),
    ("   ", "empty string"),
    (5, "takes a path"),
    (None, "takes a path"),
    (b"{}", "takes a path"),
])
def test_sources_that_are_neither_path_nor_text(
    kind: type, error: type, source: object, phrase: str
) -> None:
    with pytest.raises(error, match=phrase):
        kind.from_json(source)


def test_a_plan_given_as_a_profile_and_back(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    PLAN.to_json(plan_file)
    with pytest.raises(ProfileError) as err:
        Profile.from_json(plan_file)
    assert "this is a plan" in str(err.value) and "Plan.from_json" in str(err.value)
    assert "plan.json" in str(err.value)
    profile_file = tmp_path / "profile.json"
    PROFILE.to_json(profile_file)
    with pytest.raises(PlanError) as err:
        Plan.from_json(profile_file)
    assert "this is a profile" in str(err.value) and "Profile.from_json" in str(err.value)


# ---------------------------------------------------------------------------------
# Profile fields
# ---------------------------------------------------------------------------------
def _edit(path: tuple, value: object, *, delete: bool = False) -> dict:
    """A profile or plan dict with the item at ``path`` (keys and indices) set or deleted."""
    d = _profile_dict() if path[0] == "profile" else _plan_dict()
    node: Any = d
    for key in path[1:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


_DEL = object()  # delete the key instead of setting it
U0 = ("profile", "units", 0)
KEEP_COST = (*U0, "options", "keep")
KEEP_COST_DICT = _profile_dict()["units"][0]["options"]["keep"]

PROFILE_CASES = [
    # (id, path, value, phrases in the message)
    ("unknown-key", ("profile", "bogus"), 1, ["unknown keys ['bogus']", "valid keys"]),
    ("missing-units", ("profile", "units"), _DEL, ["lacks the required keys ['units']"]),
    ("units-null", ("profile", "units"), None, ["'units'", "must be a list"]),
    ("units-string", ("profile", "units"), "abc", ["'units'", "must be a list"]),
    ("units-empty", ("profile", "units"), [], ["at least one unit"]),
    ("unit-not-object", U0, "abc", ["units[0]", "must be a JSON object"]),
    ("unit-unknown-key", (*U0, "colour"), "red", ["units[0] ('h.0')", "unknown keys ['colour']"]),
    ("unit-missing-key", (*U0, "fwd_ms"), _DEL, ["units[0] ('h.0')", "['fwd_ms']"]),
    ("options-string", (*U0, "options"), "abc", ["units[0]", "must map option names"]),
    ("option-unknown-name", (*U0, "options", "magic"), KEEP_COST_DICT,
     ["unknown options ['magic']"]),
    ("cost-unknown-key", (*KEEP_COST, "colour"), 1, ["option 'keep'", "unknown keys"]),
    ("cost-missing-key", (*KEEP_COST, "held_bytes"), _DEL, ["option 'keep'", "['held_bytes']"]),
    ("schema-version", ("profile", "schema_version"), 7, ["schema_version 7"]),
    ("prefix-null", ("profile", "prefix"), None, ["'prefix'", "must be a JSON object"]),
    ("nan-ms", (*U0, "fwd_ms"), math.nan, ["UnitProfile.fwd_ms", "finite"]),
    ("inf-ms", ("profile", "step_ms"), math.inf, ["Profile.step_ms", "finite"]),
    ("huge-ms", ("profile", "step_ms"), 1e300, ["Profile.step_ms", "between 0 and 1e+09"]),
    ("negative-ms", (*KEEP_COST, "extra_ms"), -1.0, ["OptionCost.extra_ms", "between 0"]),
    ("string-ms", ("profile", "step_ms"), "fast", ["Profile.step_ms", "must be a number"]),
    ("bool-ms", ("profile", "step_ms"), True, ["Profile.step_ms", "must be a number"]),
    ("float-bytes", (*KEEP_COST, "held_bytes"), 1e300, ["OptionCost.held_bytes", "an int"]),
    ("huge-bytes", ("profile", "param_bytes"), 2**60, ["Profile.param_bytes", "between 0 and"]),
    ("negative-bytes", ("profile", "param_bytes"), -5, ["Profile.param_bytes", "between 0"]),
    ("bool-bytes", (*U0, "input_bytes"), True, ["UnitProfile.input_bytes", "an int"]),
    ("string-bytes", ("profile", "loss_bytes"), "8", ["Profile.loss_bytes", "an int"]),
    ("nan-bytes", ("profile", "suffix", "held_bytes"), math.nan, ["OutsideCost.held_bytes"]),
    ("string-flag", ("profile", "is_chain"), "yes", ["Profile.is_chain", "true or false"]),
    ("int-flag", (*KEEP_COST, "holds_input"), 1, ["OptionCost.holds_input", "true or false"]),
    ("shape-string", ("profile", "input_shapes"), {"x": "abc"}, ["input_shapes['x']", "list"]),
    ("shape-negative", ("profile", "input_shapes"), {"x": [2, -1]}, ["input_shapes['x']"]),
    ("keep-costs-time", (*KEEP_COST, "extra_ms"), 1.0, ["'keep' option's extra_ms must be 0"]),
    ("batch-bytes", ("profile", "batch_bytes"), -1, ["batch_bytes"]),
    ("device-number", ("profile", "device"), 0, ["Profile.device", "must be a string"]),
]


@pytest.mark.parametrize(("path", "value", "phrases"), [c[1:] for c in PROFILE_CASES],
                         ids=[c[0] for c in PROFILE_CASES])
def test_malformed_profiles(tmp_path: Path, path: tuple, value: object, phrases: list) -> None:
    d = _edit(path, None, delete=True) if value is _DEL else _edit(path, value)
    file = tmp_path / "profile.json"
    file.write_text(json.dumps(d))  # json writes NaN / Infinity, which json reads back
    with pytest.raises(ProfileError) as err:
        Profile.from_json(file)
    message = str(err.value)
    assert "profile.json" in message
    for phrase in phrases:
        assert phrase in message
    with pytest.raises(ProfileError):
        Profile.from_dict(d)


# ---------------------------------------------------------------------------------
# Plan fields
# ---------------------------------------------------------------------------------
PLAN_CASES = [
    # (id, key, value, error type, phrases)
    ("unknown-key", "bogus", 1, PlanError, ["unknown keys ['bogus']"]),
    ("missing-options", "options", _DEL, PlanError, ["lacks the required keys ['options']"]),
    ("segments-null", "segments", None, PlanError, ["Plan.segments must be a list"]),
    ("segments-string", "segments", "0-1", PlanError, ["Plan.segments must be a list"]),
    ("segment-not-pair", "segments", [[0]], PlanError, ["Plan.segments[0]", "pair"]),
    ("segment-string-index", "segments", [["a", 1]], PlanError, ["Plan.segments[0]", "an int"]),
    ("segment-float-index", "segments", [[0.5, 1]], PlanError, ["Plan.segments[0]", "an int"]),
    ("segment-bool-index", "segments", [[False, True]], PlanError, ["Plan.segments[0]"]),
    ("names-string", "unit_names", "abc", PlanError, ["Plan.unit_names must be a list"]),
    ("names-null", "unit_names", None, PlanError, ["Plan.unit_names must be a list"]),
    ("names-numbers", "unit_names", [1, 2, 3], PlanError, ["Plan.unit_names[0]", "string"]),
    ("options-string", "options", "keep", PlanError, ["Plan.options must be a list"]),
    ("options-count", "options", ["keep"], PlanMismatchError, ["one option per unit"]),
    ("options-unknown", "options", ["keep", "magic", "keep"], PlanMismatchError,
     ["unknown options ['magic']"]),
    ("budget-nan", "budget_bytes", math.nan, PlanError, ["Plan.budget_bytes", "an int"]),
    ("budget-bool", "budget_bytes", True, PlanError, ["Plan.budget_bytes", "an int"]),
    ("budget-negative", "budget_bytes", -1, PlanError, ["Plan.budget_bytes", "at least 0"]),
    ("budget-float", "budget_bytes", 1e300, PlanError, ["Plan.budget_bytes", "an int"]),
    ("time-negative", ("record", "predicted_time_ms"), -1.0, PlanError,
     ["Plan.record.predicted_time_ms"]),
    ("time-inf", ("record", "predicted_time_ms"), math.inf, PlanError,
     ["Plan.record.predicted_time_ms", "finite"]),
    ("time-string", ("record", "predicted_time_ms"), "1 ms", PlanError,
     ["Plan.record.predicted_time_ms"]),
    ("solve-ms-nan", ("record", "solve_ms"), math.nan, PlanError,
     ["Plan.record.solve_ms", "finite"]),
    ("peak-huge", ("record", "predicted_peak_bytes"), 2**70, PlanError,
     ["Plan.record.predicted_peak_bytes"]),
    ("status-number", ("record", "status"), 1, PlanError, ["Plan.record.status", "string"]),
    ("record-unknown-key", ("record", "bogus"), 1, PlanError, ["'record'", "unknown keys"]),
    ("record-not-object", ("record",), "dp", PlanError, ["'record'", "JSON object"]),
    ("types-string", ("target", "unit_types"), "Block", PlanError,
     ["Plan.target.unit_types must be a list"]),
    ("verification-negative", ("verification",), {"rounds": 1, "solved_budget_bytes": 10,
                                                  "measured_peak_bytes": -5}, PlanError,
     ["Plan.verification.measured_peak_bytes"]),
    ("schema-version", "schema_version", 7, PlanMismatchError, ["schema_version 7"]),
]


@pytest.mark.parametrize(("key", "value", "error", "phrases"), [c[1:] for c in PLAN_CASES],
                         ids=[c[0] for c in PLAN_CASES])
def test_malformed_plans(
    tmp_path: Path, key: str | tuple[str, ...], value: object, error: type, phrases: list
) -> None:
    path = ("plan", *key) if isinstance(key, tuple) else ("plan", key)
    d = _edit(path, None, delete=True) if value is _DEL else _edit(path, value)
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(d))
    with pytest.raises(error) as err:
        Plan.from_json(file)
    message = str(err.value)
    assert "plan.json" in message
    for phrase in phrases:
        assert phrase in message


def test_a_version_2_plan_is_read() -> None:
    # Version 2 kept every field flat; it is read into the decision and its records.
    v2 = {"schema_version": 2, "unit_names": list(PLAN.unit_names),
          "options": list(PLAN.options), "segments": [list(s) for s in PLAN.segments],
          "algorithm": "dp", "status": "optimal", "solve_ms": 1.5,
          "budget_bytes": 1000, "predicted_peak_bytes": 900, "predicted_time_ms": 12.0,
          "fingerprint": "0123456789abcdef", "unit_types": ["T"] * PLAN.n, "device": "cpu",
          "compiled_peak_bytes": None, "compiled_time_ms": None,
          "activation_memory_budget": None, "loop": {"accumulation_steps": 2},
          "measured_peak_bytes": 950, "measured_time_ms": 13.0, "verify_rounds": 1,
          "solved_budget_bytes": 1000, "input_shapes": {"arg0": [4, 8]},
          "unit_signatures": None, "persistent_bytes": 100, "activation_peak_bytes": 800}
    plan = Plan.from_dict(v2)
    assert plan.options == PLAN.options and plan.budget_bytes == 1000
    assert plan.record.algorithm == "dp" and plan.record.predicted_peak_bytes == 900
    assert plan.target.loop is not None and plan.target.loop.accumulation_steps == 2
    assert plan.target.input_shapes == (("arg0", (4, 8)),)
    assert plan.verification is not None and plan.verification.measured_peak_bytes == 950
    assert plan.compiled is None
    assert Plan.from_json(plan.to_json()) == plan  # and written back as version 3
    with pytest.raises(PlanError, match="unknown keys"):
        Plan.from_dict({**v2, "bogus": 1})


def test_a_huge_budget_round_trips() -> None:
    # The user's budget is kept as given, whatever its size.
    plan = PLAN.with_(budget_bytes=2**70)
    assert Plan.from_json(plan.to_json()).budget_bytes == 2**70


# ---------------------------------------------------------------------------------
# Construction in code
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("build", "phrase"), [
    (lambda: OptionCost(1.5, True, False, 0, 0), "OptionCost.held_bytes"),
    (lambda: OptionCost(1, "no", False, 0, 0), "OptionCost.holds_input"),
    (lambda: OptionCost(1, True, False, 0, 0, math.nan), "OptionCost.extra_ms"),
    (lambda: OptionCost(MAX_BYTES + 1, True, False, 0, 0), "OptionCost.held_bytes"),
    (lambda: OutsideCost(held_bytes=-1), "OutsideCost.held_bytes"),
    (lambda: OutsideCost(fwd_ms=math.inf), "OutsideCost.fwd_ms"),
    (lambda: unit("u", {KEEP: "cheap"}), "must be an OptionCost"),
    (lambda: unit("u", {KEEP: cost(1)}, in_bytes=-1), "UnitProfile.input_bytes"),
    (lambda: Profile(units="abc", is_chain=True), "Profile.units must be a list"),
    (lambda: Profile(units=[1], is_chain=True), "Profile.units[0] must be a UnitProfile"),
    (lambda: Profile(units=(unit("u", {KEEP: cost(1)}),), is_chain=True, param_bytes=1.0),
     "Profile.param_bytes"),
    (lambda: Profile(units=(unit("u", {KEEP: cost(1)}),), is_chain=True, prefix={}),
     "Profile.prefix must be an OutsideCost"),
])
def test_bad_values_are_refused_at_construction(build: Any, phrase: str) -> None:
    with pytest.raises(ProfileError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        build()


@pytest.mark.parametrize(("kwargs", "phrase"), [
    ({"unit_names": "abc", "options": ("keep",) * 3}, "Plan.unit_names must be a list"),
    ({"unit_names": ("a", "b"), "options": "kk"}, "Plan.options must be a list"),
    ({"unit_names": ("a", "b"), "options": (CKPT, CKPT), "segments": None},
     "Plan.segments must be a list"),
    ({"unit_names": ("a",), "options": (KEEP,), "budget_bytes": 1.5}, "Plan.budget_bytes"),
    ({"unit_names": ("a",), "options": (KEEP,), "record": "dp"}, "Plan.record must be a"),
])
def test_bad_plans_are_refused_at_construction(kwargs: dict, phrase: str) -> None:
    with pytest.raises(PlanError, match=phrase):
        Plan(**kwargs)
    with pytest.raises(PlanError, match="Plan.record.solve_ms"):
        PlanRecord(solve_ms=-1.0)


def test_numpy_scalars_become_python_numbers() -> None:
    c = OptionCost(np.int64(5), np.bool_(True), False, np.int32(1), 0, np.float32(0.5))
    assert (type(c.held_bytes), type(c.holds_input), type(c.extra_ms)) == (int, bool, float)
    assert json.loads(json.dumps(c.held_bytes)) == 5  # serialisable
