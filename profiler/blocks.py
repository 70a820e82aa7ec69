"""Pass 0 of :mod:`.profile` (units).

The repeated blocks of a model, read off its module tree (no measurement).

A *block* is a candidate unit. In order of trust:

1. **marked blocks**: Hugging Face ``GradientCheckpointingLayer`` s (the layers a
   model itself would checkpoint); blocks inside them are not blocks of their own;
2. **listed blocks**: the children of every ``nn.Sequential`` / ``nn.ModuleList``
   whose 2+ children share one type (a transformer's layers, each stage of a CNN),
   and, across containers, the children of a container all of whose children have
   such types (a stage holding a single block); the children of a model that is an
   ``nn.Sequential``;
3. only when neither exists, **repeated classes**: modules of a class defined
   outside ``torch.nn`` that occurs at least twice (U-Net ``Down`` / ``Up`` blocks
   kept as attributes), outermost only.

Blocks can nest (a stage that is itself a listed block holds listed blocks);
:func:`block_levels` tells outer from inner. Which level becomes the units, and
which other modules join them, is measured (:mod:`remat.profiler.discovery`).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

__all__ = ["block_names", "is_marked_block", "outermost", "repeated_class_blocks"]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def is_marked_block(module: nn.Module) -> bool:
    """A Hugging Face ``GradientCheckpointingLayer`` (checked by name: importing
    transformers is slow, and models without it must not need it)."""
    return any(c.__name__ == "GradientCheckpointingLayer"
               and c.__module__.startswith("transformers") for c in type(module).__mro__)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _listed_blocks(model: nn.Module) -> list[str]:
    found: list[str] = []
    block_types: set[type] = set()
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, _CONTAINERS)]
    for name, m in containers:
        children = list(m.named_children())
        if (len(children) >= 2 and len({type(c) for _, c in children}) == 1) or (
                m is model and children):
            found += [_join(name, c) for c, _ in children]
            kind = type(children[0][1])
            if not issubclass(kind, _CONTAINERS):  # a Sequential of anything says little
                block_types.add(kind)
    for name, m in containers:  # a stage of one block (or of blocks of several types)
        children = list(m.named_children())
        if children and all(type(c) in block_types for _, c in children):
            found += [_join(name, c) for c, _ in children]
    return found


def repeated_class_blocks(model: nn.Module) -> list[str]:
    """Modules of a class from outside ``torch.nn`` that occurs 2+ times, outermost only."""
    modules = [(n, m) for n, m in model.named_modules() if n]
    counts = Counter(type(m) for _, m in modules)
    repeated = [(n, m) for n, m in modules
                if counts[type(m)] >= 2 and not type(m).__module__.startswith("torch.")
                and any(True for _ in m.children())]
    return outermost([n for n, _ in repeated])


def outermost(names: list[str]) -> list[str]:
    """``names`` without those inside another of them, in the given order."""
    chosen = set(names)
    return [n for n in names
            if not any(".".join(n.split(".")[:k]) in chosen for k in range(1, n.count(".") + 1))]


def block_names(model: nn.Module) -> list[str]:
    """Every block of ``model`` (see the module docstring), nested ones included,
    in module order, without duplicates."""
    order = {n: k for k, (n, _) in enumerate(model.named_modules())}
    marked = [n for n, m in model.named_modules() if n and is_marked_block(m)]
    listed = [n for n in _listed_blocks(model) if n in order]
    if marked:
        inside = set(marked)
        # Listed blocks inside a marked one are its parts, not blocks.
        listed = [n for n in listed if n not in inside and not any(
            n.startswith(m + ".") for m in marked)]
    found = set(marked) | set(listed)
    if not found:
        found = set(repeated_class_blocks(model))
    return sorted(found, key=order.__getitem__)
