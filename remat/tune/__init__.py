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

from remat.core.faces import lazy_names

# The names this package offers outside it (benchmarks, notebooks, users' scripts), by
# the module that defines them: loaded on first use (remat.core.faces).
__all__, __getattr__ = lazy_names(__name__, {
    "verify": ("measure_plan", "verified"),
    "compiled": ("DEFAULT_PARTITIONER_BUDGETS", "measure_compiled", "search_compiled"),
    "granularity": ("level_scores",),
    "profile_cache": ("forget_profiles",),
    "remedies": ("checkpointing_only",),
})
