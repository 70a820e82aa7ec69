"""The one seam to torch's private checkpoint generator reads both known signatures."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint

from remat.runtime.torch_checkpoint import (
    CheckpointSeamError,
    checkpoint_generator,
    generator_form,
)


def _positional(fn, preserve_rng_state=True, context_fn=None, determinism_check="default",  # noqa: ANN001
                debug=False, early_stop=True, *args, **kwargs) -> Generator[None, None, None]:
    _positional.seen = dict(fn=fn, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                            determinism_check=determinism_check, debug=debug,
                            early_stop=early_stop, args=args, kwargs=kwargs)
    yield


def _positional_without_early_stop(fn, preserve_rng_state=True, context_fn=None,  # noqa: ANN001
                                   determinism_check="default", debug=False, *args, **kwargs
                                   ) -> Generator[None, None, None]:
    _positional_without_early_stop.seen = dict(args=args, debug=debug)
    yield


def _keyword(fn, args, kwargs, *, preserve_rng_state=True, context_fn=None,  # noqa: ANN001
             determinism_check="default", debug=False, early_stop=True,
             respect_saved_tensors_hooks=None) -> Generator[None, None, None]:
    _keyword.seen = dict(fn=fn, args=args, kwargs=kwargs, context_fn=context_fn,
                         early_stop=early_stop)
    yield


def _unknown(fn, inputs, *, recompute=True) -> Generator[None, None, None]:  # noqa: ANN001
    yield


def _context() -> tuple[Any, Any]:
    raise AssertionError("not entered by the stand-ins")


@pytest.mark.parametrize(
    ("fn", "form"),
    [(_positional, "positional"), (_positional_without_early_stop, "positional"),
     (_keyword, "keyword")],
)
def test_known_forms_are_recognised(fn: Any, form: str) -> None:
    assert generator_form(fn) == form


def test_installed_torch_has_a_known_form() -> None:
    assert generator_form(torch_checkpoint._checkpoint_without_reentrant_generator) in (
        "positional", "keyword")


def test_positional_form_gets_the_input_after_its_options() -> None:
    x = torch.ones(2)
    gen = checkpoint_generator(len, x, context_fn=_context, generator=_positional)
    next(gen)
    seen = _positional.seen
    assert seen["fn"] is len and seen["args"] == (x,) and seen["context_fn"] is _context
    assert seen["preserve_rng_state"] is True and seen["early_stop"] is True


def test_positional_form_without_early_stop() -> None:
    x = torch.ones(2)
    next(checkpoint_generator(len, x, context_fn=_context,
                              generator=_positional_without_early_stop))
    assert _positional_without_early_stop.seen == {"args": (x,), "debug": False}


def test_keyword_form_gets_args_and_kwargs() -> None:
    x = torch.ones(2)
    next(checkpoint_generator(len, x, context_fn=_context, generator=_keyword))
    seen = _keyword.seen
    assert seen["args"] == (x,) and seen["kwargs"] == {} and seen["context_fn"] is _context


def test_an_unknown_signature_fails_loudly() -> None:
    with pytest.raises(CheckpointSeamError, match="signature .* which this remat does not know"):
        checkpoint_generator(len, torch.ones(2), context_fn=_context, generator=_unknown)
