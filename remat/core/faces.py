"""A package's face: the names it offers outside it, each loaded on first use.

Benchmarks, examples and notebooks import only these (``tests/test_architecture.py``
holds them to it), so the modules behind a face can move without breaking them. Loading
on first use keeps a face free of import cycles and of cost: importing
``remat.measurement`` loads none of its instruments until one is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, offered: Mapping[str, Sequence[str]]
               ) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` for ``package`` offering, from each of its modules (a
    name relative to it), those names (PEP 562)."""
    home = {name: f"{package}.{module}" for module, names in offered.items() for name in names}

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module attribute PEP 562 reads
        if name in home:
            return getattr(import_module(home[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(home), __getattr__
