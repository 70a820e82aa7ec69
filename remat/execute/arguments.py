"""A unit call's arguments as they were at the call, for its recomputation.

torch's checkpoint recomputes a unit with the argument objects of its first call. A
container among them (a list, a dict) may have changed by then: torchvision's
DenseNet hands each dense layer the list of every earlier layer's output and appends
the layer's own output to that list after the call, so a recomputation would see more
features than the forward did (torch fails on a shape, or computes something else).
A snapshot keeps each container's contents as at the call, around the same tensors
and objects, and rebuilds fresh containers for every replay (a replay may change
them too). It holds nothing the call's arguments did not already hold.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

__all__ = ["CallArguments"]


class CallArguments:
    """``(args, kwargs)`` of one call, their containers copied, their leaves shared."""

    __slots__ = ("_args", "_kwargs", "_leaves", "_spec")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The usual call holds no container (``block(x)``, ``block(x, mask=m)``):
        # kept as it is, without pytree's flatten (several microseconds a unit call).
        self._args: tuple[Any, ...] | None = None
        self._kwargs: dict[str, Any] = {}
        self._leaves: list[Any] = []
        self._spec: Any = None
        if not any(map(_is_container, args)) and not any(map(_is_container, kwargs.values())):
            self._args, self._kwargs = args, dict(kwargs)
        else:
            self._leaves, self._spec = tree_flatten((args, kwargs))

    def rebuild(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh containers holding what the call's containers held at the call."""
        if self._args is not None:
            return self._args, dict(self._kwargs)
        return tree_unflatten(list(self._leaves), self._spec)


def _is_container(value: Any) -> bool:
    # What pytree would open: the built-in containers and their subclasses
    # (namedtuples, OrderedDict), and any registered node type.
    return isinstance(value, (tuple, list, dict)) or type(value) in SUPPORTED_NODES
