"""The floor every stage stands on: remat's contracts, as plain torch-free data.

What the stages hand each other (:class:`~remat.core.profile.Profile`,
:class:`~remat.core.plan.Plan`, :class:`~remat.core.option.Option`,
:class:`~remat.core.loop.Loop`), how users write a budget (:mod:`.budget`), the
argument checks every entry point shares (:mod:`.checks`), the errors (:mod:`.errors`),
byte formatting and JSON. It imports no other part of remat and no torch.
"""

from importlib import import_module

# The names this package offers outside it (benchmarks, notebooks, users' scripts): each
# from the module that defines it, imported on first use (no import cycles, no cost).
# tests/test_architecture.py holds benchmarks, examples and notebooks to these faces.
_NAMES = {
    "MIB": "remat.core.bytesize",
    "mib": "remat.core.bytesize",
    "format_bytes": "remat.core.bytesize",
    "OptionCost": "remat.core.profile",
    "OutsideCost": "remat.core.profile",
    "UnitProfile": "remat.core.profile",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

