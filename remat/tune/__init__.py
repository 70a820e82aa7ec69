"""Planning in closed loop, and what lowers the peak beyond a plan: the rooms above the
stages that the API (:mod:`remat.api`, :mod:`remat.preflight`) calls.

* :mod:`remat.tune.verify`: measure a solved plan, solve again below the excess;
* :mod:`remat.tune.compiled`: the search for a plan under ``torch.compile``
  (``compile_planned``, ``measure_compiled``, ``solve_compiled``);
* :mod:`remat.tune.granularity`: the comparison of unit levels (``granularity="auto"``);
* :mod:`remat.tune.profile_cache`: a profile reused while nothing it depends on changed
  (``forget_profiles``);
* :mod:`remat.tune.ambient`: planning inside the caller's own ``torch.autocast``;
* :mod:`remat.tune.remedies`: what sets the smallest peak, and what lowers it;
* :mod:`remat.tune.optimizer_in_backward`: one of those remedies, installed
  (``remat.optimizer_in_backward``).

Importing this package imports none of them.
"""
