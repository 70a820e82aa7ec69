"""Reading profiles and plans from JSON: a path or the text itself, checked key by key.

Profiles and plans share the reading rules, so a missing file, a directory, an
empty or truncated file, the other kind of file, or a wrong key gets the same
kind of message for both, naming the file and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from remat.core.errors import RematError

__all__ = [
    "JsonSource",
    "check_keys",
    "from_json_source",
    "kind_of",
    "read_json_object",
    "refuse_other_kind",
    "write_json",
]

Error = type[RematError]
T = TypeVar("T")
JsonSource = str | os.PathLike[str]

# Keys that only one kind of file has: how a profile and a plan tell each other apart.
_MARKS = {"profile": ("units", "is_chain"), "plan": ("unit_names", "options")}
_READERS = {"profile": "Profile.from_json", "plan": "Plan.from_json"}


def kind_of(d: Mapping[str, Any]) -> str | None:
    """``"profile"`` or ``"plan"`` when ``d`` has that kind's telling keys, else ``None``."""
    for kind, marks in _MARKS.items():
        if all(key in d for key in marks):
            return kind
    return None


def refuse_other_kind(d: Mapping[str, Any], kind: str, error: Error) -> None:
    """Raise ``error`` when ``d`` is the other kind of file than ``kind``."""
    other = kind_of(d)
    if other is not None and other != kind:
        marks = " and ".join(repr(k) for k in _MARKS[other])
        raise error(
            f"this is a {other} (it has {marks}), not a {kind}; read it with "
            f"{_READERS[other]}(), or pass the {kind} file instead"
        )


def check_keys(
    d: object, cls: type, where: str, error: Error, *, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``d`` as a dict with only ``cls``'s field names (and ``extra``) and every required one."""
    if not isinstance(d, Mapping):
        raise error(f"{where} must be a JSON object, got {d!r} ({type(d).__name__})")
    fields = dataclasses.fields(cls)
    valid = {f.name for f in fields} | set(extra)
    unknown = sorted(str(k) for k in d if k not in valid)
    if unknown:
        raise error(
            f"{where} has unknown keys {unknown}; the valid keys are {sorted(valid)} "
            "(was it written by another version of remat, or edited?)"
        )
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in d]
    if missing:
        raise error(f"{where} lacks the required keys {missing}; write it again with to_json()")
    return dict(d)


def from_json_source(source: object, kind: str, error: Error,
                     build: Callable[[dict[str, Any]], T]) -> T:
    """``build`` of the JSON object in ``source`` (see :func:`read_json_object`); an
    ``error`` it raises names where the object came from."""
    d, where = read_json_object(source, kind, error)
    try:
        return build(d)
    except error as err:
        raise type(err)(f"{where}: {err}") from None


def read_json_object(source: object, kind: str, error: Error) -> tuple[dict[str, Any], str]:
    """The JSON object in ``source`` and a description of where it came from.

    ``source`` is a ``pathlib.Path``, a ``str`` path, or JSON text (a ``str`` whose
    first non-blank character is ``{`` or ``[``).
    """
    reader = _READERS[kind]
    if isinstance(source, os.PathLike):
        path = os.fspath(source)
        text, where = _read_file(path, kind, error), f"{kind} file {path!r}"
    elif isinstance(source, str):
        if not source.strip():
            raise error(
                f"{reader}() got an empty string; pass the path of a {kind} JSON file "
                "or the JSON text"
            )
        if source.lstrip().startswith(("{", "[")):
            text, where = source, f"{kind} JSON text"
        else:
            text, where = _read_file(source, kind, error), f"{kind} file {source!r}"
    else:
        raise error(
            f"{reader}() takes a path (str or pathlib.Path) or JSON text, got "
            f"{type(source).__name__}"
        )
    if not text.strip():
        raise error(f"{where} is empty; write it again with to_json()")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(
            f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
            "it may be truncated or edited: write it again with to_json()"
        ) from None
    except RecursionError:
        raise error(f"{where} nests too deeply to be a {kind}") from None
    if not isinstance(obj, dict):
        raise error(f"{where} holds a JSON {type(obj).__name__}, not the object a {kind} is")
    return obj, where


def _read_file(path: str, kind: str, error: Error) -> str:
    fix = f"pass the path of a {kind} JSON file (written by to_json()) or the JSON text"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise error(f"{kind} file {path!r} does not exist; {fix}") from None
    except IsADirectoryError:
        raise error(f"{path!r} is a directory, not a {kind} file; {fix}") from None
    except PermissionError:
        raise error(
            f"{kind} file {path!r} cannot be read (permission denied); make it readable"
        ) from None
    except UnicodeDecodeError:
        raise error(f"{kind} file {path!r} is not UTF-8 text, so not a {kind}; {fix}") from None
    except OSError as err:
        raise error(f"{kind} file {path!r} cannot be read ({err.strerror or err}); {fix}") from None


def write_json(d: Mapping[str, Any], path: JsonSource | None, indent: int) -> str:
    """``d`` as JSON text, also written to ``path`` when given."""
    text = json.dumps(d, indent=indent)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text
