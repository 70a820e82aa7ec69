"""What remat can do with a unit's activations: the options, as values every stage shares.

The profiler measures each option, the solver chooses among them, and the runtime
runs them (:mod:`remat.execute.options` is where an option becomes torch machinery).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["OPTION_ORDER", "Option"]


class Option(str, Enum):
    """What the runtime can do with a unit's activations.

    Members are strings (``Option.KEEP == "keep"``) and hash like them, so they
    index the ``options`` mappings of a profile directly.
    """

    KEEP = "keep"  # hold what autograd saves (no checkpointing)
    CHECKPOINT = "checkpoint"  # hold only the input; recompute the forward in backward
    SELECTIVE = "selective"  # hold matmul/conv/attention outputs; recompute the rest
    DERIVE = "derive"  # hold what autograd saves, less what cheap ops make again from it
    OFFLOAD = "offload"  # saved tensors to pinned CPU memory (CUDA only)

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return str.__hash__(self)

    @property
    def needs_cuda(self) -> bool:
        """Whether the option only runs on a CUDA device."""
        return self is Option.OFFLOAD

    @property
    def recomputes(self) -> bool:
        """Whether the option recomputes the unit's forward in its backward: a checkpoint
        region, which holds every tensor argument until then."""
        return self in (Option.CHECKPOINT, Option.SELECTIVE)

    def unavailable_on(self, device_type: str) -> str | None:
        """Why this option cannot run on ``device_type`` (``"cpu"``, ``"cuda"``), or ``None``."""
        if self.needs_cuda and device_type != "cuda":
            return (
                f"option {self.value!r} needs CUDA (it moves saved tensors from a CUDA device "
                f"to pinned CPU memory), so it cannot run on {device_type!r}; use 'checkpoint', "
                "'selective' or 'derive' there"
            )
        return None


OPTION_ORDER: tuple[Option, ...] = tuple(Option)
