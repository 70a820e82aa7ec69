"""Planning in closed loop, and what lowers the peak beyond a plan: the rooms above the
stages that the API (:mod:`remat.api`, :mod:`remat.preflight`) calls.

* :mod:`remat.tune.verify`: measure a solved plan, solve again below the excess;
* :mod:`remat.tune.compiled`: the search for a plan under ``torch.compile``
  (``compile_planned``, ``measure_compiled``, ``search_compiled``);
* :mod:`remat.tune.granularity`: the comparison of unit levels (``granularity="auto"``);
* :mod:`remat.tune.profile_cache`: a profile reused while nothing it depends on changed
  (``forget_profiles``);
* :mod:`remat.tune.ambient`: planning inside the caller's own ``torch.autocast``;
* :mod:`remat.tune.remedies`: what sets the smallest peak, and what lowers it;
* :mod:`remat.tune.optimizer_in_backward`: one of those remedies, installed
  (``remat.optimizer_in_backward``).

Importing this package imports none of them; the names benchmarks and scripts may use
are loaded on first use (:data:`_NAMES`).
"""

from importlib import import_module

# The names this package offers outside it (benchmarks, notebooks, users' scripts): each
# from the module that defines it, imported on first use (no import cycles, no cost).
# tests/test_architecture.py holds benchmarks, examples and notebooks to these faces.
_NAMES = {
    "measure_plan": "remat.tune.verify",
    "verified": "remat.tune.verify",
    "measure_compiled": "remat.tune.compiled",
    "search_compiled": "remat.tune.compiled",
    "DEFAULT_PARTITIONER_BUDGETS": "remat.tune.compiled",
    "level_scores": "remat.tune.granularity",
    "forget_profiles": "remat.tune.profile_cache",
    "checkpointing_only": "remat.tune.remedies",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

