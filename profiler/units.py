"""Pass 0 of :mod:`.profile` (units).

Units: the modules whose activations a plan keeps, checkpoints or offloads.

Default discovery is **measured** (:func:`remat.profiler.choice.find_units`, which
``profile()`` runs): the repeated blocks of the whole model (:mod:`.blocks`),
at the level that holds its activation memory, joined by the modules that make
them a chain or hold what they miss (:mod:`.discovery`). Without a sample batch
nothing can be measured, and :func:`discover_units` returns every block of the
innermost level instead. Either way, no block found is :class:`NoUnitsError`,
asking for ``units=``.

``units=`` takes a list of module names, a module class or tuple of classes (every
module of that type, outermost only), or a predicate ``(name, module) -> bool``
(outermost matches only, like FSDP's auto-wrap policy). A single string naming a
``ModuleList`` / ``Sequential`` means its children. Units must be disjoint
subtrees, and never the model itself.

:func:`longest_list` is the discovery remat had before it measured (the longest
uniform list only): kept to compare with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from remat.core.errors import NoUnitsError, ProfileError
from remat.profiler.blocks import block_names

__all__ = ["UnitsSpec", "discover_units", "longest_list", "no_units_error"]

UnitsSpec = (
    Sequence[str]
    | str
    | type[nn.Module]
    | tuple[type[nn.Module], ...]
    | Callable[[str, nn.Module], bool]
    | None
)

_UNITS_HELP = (
    "pass units= as a list of module names (['blocks.0', 'blocks.1']), a module class "
    "(units=MyBlock), or a predicate units=lambda name, module: ..."
)


def _containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``ModuleList`` / ``Sequential`` modules whose 2+ children all have one type."""
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            found.append((name, m))
    return found


def _children(prefix: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
    sep = "." if prefix else ""
    return [(f"{prefix}{sep}{n}", c) for n, c in container.named_children()]


def no_units_error(model: nn.Module) -> NoUnitsError:
    """The error for a model in which default discovery finds no block."""
    return NoUnitsError(
        f"cannot find units in {type(model).__name__}: it is not an nn.Sequential, has no "
        "nn.ModuleList/nn.Sequential of 2+ modules of one type (like a transformer's layers), "
        f"no Hugging Face layers and no class of its own used twice; {_UNITS_HELP}"
    )


def longest_list(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the longest uniform ``ModuleList`` / ``Sequential`` (the first on
    a tie), or of the model when it is an ``nn.Sequential``: remat's discovery before
    it measured, which can miss most of a model (one stage of a CNN, a decoder)."""
    if isinstance(model, nn.Sequential) and len(model) > 0:
        return _children("", model)
    candidates = _containers(model)
    if not candidates:
        raise no_units_error(model)
    name, container = max(candidates, key=lambda c: len(list(c[1].children())))
    return _children(name, container)


def _innermost_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block (:mod:`.blocks`) that holds no other block, in module order."""
    names = block_names(model)
    inner = [n for n in names if not any(b.startswith(n + ".") for b in names)]
    if not inner:
        raise no_units_error(model)
    return [(n, model.get_submodule(n)) for n in inner]


def _outermost(
    model: nn.Module, match: Callable[[str, nn.Module], bool]
) -> list[tuple[str, nn.Module]]:
    """Modules (never the root) that ``match``, skipping those inside an earlier match."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not name or any(name.startswith(c + ".") for c, _ in chosen):
            continue
        if match(name, m):
            chosen.append((name, m))
    return chosen


def _by_names(model: nn.Module, names: Sequence[str]) -> list[tuple[str, nn.Module]]:
    units = []
    for name in names:
        if not isinstance(name, str):
            raise ProfileError(f"units= names must be strings, got {name!r}; {_UNITS_HELP}")
        if name == "":
            raise ProfileError("a unit cannot be the model itself (name ''); name its submodules")
        try:
            units.append((name, model.get_submodule(name)))
        except AttributeError as exc:
            raise ProfileError(
                f"the model has no submodule {name!r} (given in units=); submodule names look "
                f"like {[n for n, _ in list(model.named_modules())[1:4]]}"
            ) from exc
    return units


def _check_disjoint(units: list[tuple[str, nn.Module]]) -> None:
    seen: dict[int, str] = {}
    for name, m in units:
        if id(m) in seen:
            raise ProfileError(f"units {seen[id(m)]!r} and {name!r} are the same module")
        seen[id(m)] = name
    for name, m in units:
        for sub_name, sub in m.named_modules():
            if sub is not m and id(sub) in seen:
                raise ProfileError(
                    f"units must be disjoint, but unit {name!r} contains unit {seen[id(sub)]!r} "
                    f"(as {name}.{sub_name}); keep only one of them"
                )


def discover_units(model: nn.Module, units: UnitsSpec = None) -> list[tuple[str, nn.Module]]:
    """The units of ``model`` as ``(qualified name, module)`` pairs, in module order.

    With ``units=None`` this is the unmeasured default: every block of the innermost
    level (:mod:`.blocks`). ``profile()`` measures instead
    (:func:`remat.profiler.choice.find_units`), which may choose another level and
    add the modules between or around the blocks.

    Execution order (what a profile records) may differ; the profiler reorders
    them after running the model.

    Raises:
        NoUnitsError: nothing found (by default discovery, or nothing matched ``units=``).
        ProfileError: an unknown name, overlapping or duplicate units.
    """
    if units is None:
        found = _innermost_blocks(model)
    elif isinstance(units, str):
        target = _by_names(model, [units])[0][1]
        if isinstance(target, (nn.ModuleList, nn.Sequential)):
            found = _children(units, target)
        else:
            found = [(units, target)]
    elif isinstance(units, type) or (
        isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)
    ):
        classes = units
        found = _outermost(model, lambda _n, m: isinstance(m, classes))
    elif callable(units):
        predicate = units
        found = _outermost(model, lambda n, m: bool(predicate(n, m)))
    elif isinstance(units, Sequence):
        found = _by_names(model, list(units))
    else:
        raise ProfileError(f"cannot read units={units!r}; {_UNITS_HELP}")
    if not found:
        raise NoUnitsError(f"units={units!r} matched no module of {type(model).__name__}; "
                           f"{_UNITS_HELP}")
    _check_disjoint(found)
    return found
