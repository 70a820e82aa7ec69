"""What an option does to a module call, below both the profiler and the runtime.

:mod:`.options` runs one call under an option (the profiler measures it, the runtime
trains with it); :mod:`.boundary` says which tensors a unit takes and hands on;
:mod:`.kv_cache`, :mod:`.arguments` and :mod:`.structure` are what both need of a call
and a module; :mod:`.planned` says whether a model has a plan applied.
"""

from importlib import import_module

# The names this package offers outside it (benchmarks, notebooks, users' scripts): each
# from the module that defines it, imported on first use (no import cycles, no cost).
# tests/test_architecture.py holds benchmarks, examples and notebooks to these faces.
_NAMES = {
    "HeadSite": "remat.execute.head",
    "install_head": "remat.execute.head",
    "remove_head": "remat.execute.head",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

