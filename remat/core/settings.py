"""Settings as values: what a profile is measured with, and how a plan is verified.

:class:`ProfilingSettings` is every setting the profiler takes, in one frozen value.
``remat.solve``, ``remat.pareto``, ``remat.estimate``, ``remat.profile`` and the trainer
callbacks build it once from their keyword arguments and pass it down, and the profile
cache keys a profile by its fields (:func:`remat.tune.profile_cache.settings_key`): a
setting added here is in the key without a change there, so the key cannot miss one
(it once missed ``warmup``, ``tolerance`` and ``pool_twins``). Its fields and defaults
are the profiler's keyword arguments (``remat.profiler.profile_levels``), checked by
``tests/test_settings.py``.

:class:`Verify` is how ``remat.solve`` verifies its plan: ``verify=True`` is
``Verify()``, ``verify=False`` skips it, and ``verify=remat.Verify(rounds=5, steps=12)``
says how. :func:`verify_setting` reads what a user passed into one value.

Torch-free, like the rest of this floor: ``import remat`` exports :class:`Verify`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from remat.core.checks import check_count
from remat.core.errors import ArgumentError
from remat.core.loop import Loop

__all__ = ["UNKEYED", "ProfilingSettings", "Verify", "verify_setting"]

# Settings that change no figure of a profile, so the profile cache's key leaves them out:
# ``progress`` only draws a line; ``repeats`` is compared apart (a profile timed with more
# repeats than asked serves, one with fewer does not).
UNKEYED = frozenset({"progress", "repeats"})


@dataclass(frozen=True)
class ProfilingSettings:
    """Every setting a profile is measured with (``remat.profiler.profile_levels``'s keyword
    arguments, with its defaults): built once by an entry point, passed down as one value,
    and the profile cache's key (every field but :data:`UNKEYED`).

    Attributes:
        loss_fn: ``loss_fn(output, batch) -> scalar``; ``None``: the output's ``.loss``.
        optimizer: counted in the step (its state and ``step()``), or ``None``.
        units: which modules are units (names, a class or a predicate); ``None``: found.
        options: the options to measure; ``None``: all the device offers.
        loop: the training loop (:class:`~remat.core.loop.Loop`); ``None``: ``Loop()``.
        granularity: ``"blocks"``, ``"children"`` or ``"auto"``.
        head: ``"auto"``, ``"chunked"`` or ``"none"`` (a chunked head measured or not).
        warmup, repeats: un-timed and timed runs of every time figure.
        tolerance: a time figure's timed runs stop once they pin the median this close.
        pool_twins: time twin units (equal copies of one module) as one.
        progress: draw a progress line (``None``: on a terminal only); changes no figure.
    """

    loss_fn: Callable[[Any, Any], Any] | None = None
    optimizer: Any = None
    units: Any = None
    options: Iterable[Any] | None = None
    loop: Loop | None = None
    granularity: str = "blocks"
    head: str = "auto"
    warmup: int = 1
    repeats: int = 3
    tolerance: float = 0.05
    pool_twins: bool = True
    progress: bool | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as the profiler's keyword arguments (``profile_levels(model, batch,
        **settings.as_kwargs())``): the profiler's signature stays its own."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> ProfilingSettings:
        """A copy with ``changes`` (the loop an ambient autocast chose, the optimizer a
        trainer made)."""
        return dataclasses.replace(self, **changes)


DEFAULT_ROUNDS = 3
DEFAULT_STEPS = 1


@dataclass(frozen=True)
class Verify:
    """How ``remat.solve`` verifies a plan: it applies the plan, measures ``steps``
    consecutive optimizer steps of the loop (the peak over all of them), and while that
    is over the budget solves again for a budget lowered by the excess, measuring at most
    ``rounds`` plans.

    ``verify=True`` is ``Verify()``; more ``steps`` catch memory that grows after the first
    steps (a branch that turns on at step k), at one measured step's time each.
    ``timed=True`` times one more step, un-metered, for the plan's
    ``verification.measured_time_ms``; off by default: verification is most of what a
    second budget on a profiled model costs (two metered steps), and one untimed-before
    step's time says little beside the profile's prediction.

    Raises:
        ParameterError: ``rounds`` or ``steps`` is not an int >= 1.
    """

    rounds: int = DEFAULT_ROUNDS
    steps: int = DEFAULT_STEPS
    timed: bool = False

    def __post_init__(self) -> None:
        # Checked when made: a malformed count is a mistake whether or not it is used.
        check_count("rounds", self.rounds, lo=1, owner="remat.Verify()",
                    meaning="the most plans verification measures")
        check_count("steps", self.steps, lo=1, owner="remat.Verify()",
                    meaning="the consecutive optimizer steps verification measures")


def verify_setting(verify: object, *, rounds: object = None, steps: object = None,
                   owner: str = "solve()") -> Verify | None:
    """What ``verify=`` (with the shorthands ``verify_rounds=``, ``verify_steps=``) asks
    for, as one value: a :class:`Verify`, or ``None`` for no verification.

    ``rounds`` and ``steps`` are ``None`` where not given; given, they are checked
    whether or not verification runs (a malformed count is a mistake either way), under
    their own names, and may not be given beside a :class:`Verify` (one place says how).

    Raises:
        ArgumentError: ``verify`` is none of ``True``, ``False``, a :class:`Verify`; or a
            :class:`Verify` came with ``verify_rounds=`` / ``verify_steps=``.
        ParameterError: a count is not an int >= 1.
    """
    if rounds is not None:
        rounds = check_count("verify_rounds", rounds, lo=1, owner=owner, meaning="the most "
                             "plans verification measures; verify=False skips it")
    if steps is not None:
        steps = check_count("verify_steps", steps, lo=1, owner=owner, meaning="the "
                            "consecutive optimizer steps verification measures")
    if isinstance(verify, Verify):
        if rounds is not None or steps is not None:
            raise ArgumentError(
                f"{owner} got verify={verify!r} and verify_rounds= or verify_steps= too: say it "
                "in one place, verify=remat.Verify(rounds=..., steps=...)")
        return verify
    if verify is True:
        return Verify(rounds=DEFAULT_ROUNDS if rounds is None else rounds,
                      steps=DEFAULT_STEPS if steps is None else steps)
    if verify is False:
        return None
    raise ArgumentError(
        f"{owner}: verify must be True (measure the plan: remat.Verify()), False (do not) or "
        f"remat.Verify(rounds=..., steps=...), got verify={verify!r}")
