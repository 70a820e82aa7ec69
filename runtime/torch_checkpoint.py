"""The one seam between remat and torch's private checkpoint code.

Multi-unit segments (:mod:`.segments`) need a checkpoint region that stays open
across several unit calls, which only torch's non-reentrant checkpoint
*generator* offers: ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``.
It is private, and its signature has moved:

* up to torch 2.14 (the *positional* form): ``(fn, preserve_rng_state, context_fn,
  determinism_check, debug[, early_stop], *args, **kwargs)``;
* on torch's main branch (the *keyword* form): ``(fn, args, kwargs, *,
  preserve_rng_state, context_fn, determinism_check, debug, early_stop, ...)``.

:func:`checkpoint_generator` reads the installed signature once and calls it in
its own form. A signature of neither form raises :class:`CheckpointSeamError`
at the first segment, naming the torch version, instead of a ``TypeError`` deep
inside a training step; ``tests/runtime/test_runtime_torch_seam.py`` checks both
forms and the refusal.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch.utils import checkpoint as _ckpt

from remat.core.errors import RematError

__all__ = ["CheckpointSeamError", "checkpoint_generator", "generator_form"]

_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


class CheckpointSeamError(RematError):
    """torch's private checkpoint generator has a signature remat does not know."""


def generator_form(fn: Callable[..., Any]) -> str:
    """``"positional"`` or ``"keyword"`` (see the module docstring) for a generator function.

    Raises:
        CheckpointSeamError: ``fn``'s signature is of neither form.
    """
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    kinds = [p.kind for p in params]
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    if names[:3] == ["fn", "args", "kwargs"] and all(k == keyword_only for k in kinds[3:]):
        if {"preserve_rng_state", "context_fn"} <= set(names[3:]):
            return "keyword"
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        before = names[: kinds.index(inspect.Parameter.VAR_POSITIONAL)]
        if before[:1] == ["fn"] and set(before[1:]) <= set(_OPTIONS) and "context_fn" in before:
            return "positional"
    raise CheckpointSeamError(
        f"torch {torch.__version__}'s torch.utils.checkpoint."
        f"_checkpoint_without_reentrant_generator has the signature {inspect.signature(fn)}, "
        "which this remat does not know (it knows (fn, preserve_rng_state, context_fn, "
        "determinism_check, debug[, early_stop], *args) and (fn, args, kwargs, *, ...)); "
        "multi-unit segments cannot run: install a torch within remat's supported range "
        "(pyproject.toml), or solve with segments off"
    )


@functools.cache
def _installed_form() -> str:
    return generator_form(_ckpt._checkpoint_without_reentrant_generator)


def checkpoint_generator(
    fn: Callable[..., Any],
    first_input: torch.Tensor,
    *,
    context_fn: Callable[[], tuple[Any, Any]],
    generator: Callable[..., Generator[None, None, None]] | None = None,
) -> Generator[None, None, None]:
    """torch's non-reentrant checkpoint generator for ``fn(first_input)``, not yet started.

    ``next()`` on it saves ``first_input`` and pushes the checkpoint's saved-tensor
    hooks; the second ``next()`` pops them. RNG state is preserved, determinism is
    checked torch's default way, and recomputation stops early once it has what
    backward needs (where torch offers ``early_stop``).

    Args:
        fn: the recompute function, called with ``first_input`` in backward.
        first_input: the one tensor the region holds.
        context_fn: torch's ``context_fn`` (forward and recompute contexts).
        generator: the generator function to call (tests pass stand-ins); default:
            the installed torch's.
    """
    gen_fn = generator or _ckpt._checkpoint_without_reentrant_generator
    form = _installed_form() if generator is None else generator_form(gen_fn)
    if form == "keyword":
        names = _parameter_names(gen_fn)
        options = {k: v for k, v in _values(context_fn).items() if k in names}
        return gen_fn(fn, (first_input,), {}, **options)
    before, at = _positional_template(gen_fn)
    return gen_fn(fn, *before[:at], context_fn, *before[at + 1 :], first_input)


def _values(context_fn: Callable[[], tuple[Any, Any]]) -> dict[str, Any]:
    return {"preserve_rng_state": True, "context_fn": context_fn,
            "determinism_check": "default", "debug": False, "early_stop": True}


@functools.cache
def _parameter_names(gen_fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(gen_fn).parameters)


@functools.cache
def _positional_template(gen_fn: Callable[..., Any]) -> tuple[tuple[Any, ...], int]:
    """The options the positional form takes before ``*args``, in order (``context_fn``
    as None), and where ``context_fn`` goes: read once, for a segment opens at every
    step (``inspect`` costs tens of microseconds, building the arguments a few)."""
    params = inspect.signature(gen_fn).parameters
    names = [name for name, p in params.items() if p.kind < inspect.Parameter.VAR_POSITIONAL]
    values = _values(None)  # type: ignore[arg-type]
    return tuple(values[name] for name in names[1:]), names[1:].index("context_fn")
