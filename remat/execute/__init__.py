"""What an option does to a module call, below both the profiler and the runtime.

:mod:`.options` runs one call under an option (the profiler measures it, the runtime
trains with it); :mod:`.boundary` says which tensors a unit takes and hands on;
:mod:`.kv_cache`, :mod:`.arguments` and :mod:`.structure` are what both need of a call
and a module; :mod:`.planned` says whether a model has a plan applied.
"""

from remat.core.faces import lazy_names

# The names this package offers outside it (benchmarks, notebooks, users' scripts), by
# the module that defines them: loaded on first use (remat.core.faces).
__all__, __getattr__ = lazy_names(__name__, {
    "head": ("HeadSite", "install_head", "remove_head"),
})
