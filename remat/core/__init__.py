"""The floor every stage stands on: remat's contracts, as plain torch-free data.

What the stages hand each other (:class:`~remat.core.profile.Profile`,
:class:`~remat.core.plan.Plan`, :class:`~remat.core.option.Option`,
:class:`~remat.core.loop.Loop`), how users write a budget (:mod:`.budget`), the
argument checks every entry point shares (:mod:`.checks`), the errors (:mod:`.errors`),
byte formatting and JSON. It imports no other part of remat and no torch.
"""

from remat.core.faces import lazy_names

# The names this package offers outside it (benchmarks, notebooks, users' scripts), by
# the module that defines them: loaded on first use (remat.core.faces).
__all__, __getattr__ = lazy_names(__name__, {
    "bytesize": ("MIB", "format_bytes", "mib"),
    "profile": ("OptionCost", "OutsideCost", "UnitProfile"),
})
