"""The memory meter: live tensor bytes and their peak over a region of code.

It is a ``TorchDispatchMode``, so it sees every tensor that forward, autograd's
backward and checkpoint recomputation allocate, on any device. It counts
*storages*, not tensors: views and in-place results alias a storage that is
already counted (the op schema says so), and a storage is counted once however
many tensors share it. A storage stops counting when Python's last reference to
it dies (a weakref callback), which is when its memory goes back to the
allocator.

Only storages allocated inside the region count: parameters and anything else
that existed before ``__enter__`` are outside the measurement, so the figures are
deltas over the region, which is what a planner needs.

What it cannot see: scratch buffers that kernels allocate internally without
going through the dispatcher (e.g. a backward matmul's contiguous copy, oneDNN's
convolution workspaces). On CUDA the allocator's own ``memory_allocated`` /
``max_memory_allocated`` deltas are reported beside the dispatch-level figures, so
both views can be compared (:mod:`remat.measurement.allocator` gives the allocator's view on
CPU too). One tensor made outside the dispatcher it does count: the CPU RNG state
that ``torch.utils.checkpoint`` stashes per region (``torch.get_rng_state()``,
about 5 KB), by wrapping that function while the meter is active.

A composite op that may return its input or a copy (``to``, ``reshape``) reaches a mode
whole only when called below autograd (a selective-checkpoint policy's own ops): its
output counts as an alias only where its storage is an argument's (:func:`may_copy`).

c10d's collectives work in place (``allreduce_`` sums its tensors where they are, DDP's
gradient buckets included) but their schemas return those tensors without saying they
alias them: an output of a ``c10d`` op whose storage is one of its arguments' is counted
as what it is, that argument (counted by allocation, every bucket DDP reduced in a step
was a new bucket's bytes).

Nor does the dispatcher see a storage resized in place (``UntypedStorage.resize_``):
that is how FSDP frees a unit's all-gathered parameters after its forward or backward
(``resize_(0)``) and allocates them again for the next use, keeping the same storage
objects for the whole run. Counted by allocation alone, every gathered parameter would
stay live from its first gather to the end (the whole model's parameters, unsharded), or
never count at all where the storage was made before the region. So while a meter is
active ``UntypedStorage.resize_`` is wrapped (:func:`_metered_resize`): a counted
storage's new size is counted at once, a storage from before the region that grows in
it from empty is counted from then on (as a new allocation), and one from before the
region that shrinks is not subtracted, as for any storage freed that predates it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.measurement.deaths import note_death, now_if_recording
from remat.measurement.storage import local_shard

__all__ = ["MemoryMeter", "MeterMark", "may_copy", "returns_alias"]

_active: list[MemoryMeter] = []  # meters entered and not exited, innermost last
_unwrapped_resize = torch.UntypedStorage.resize_


def _metered_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """``UntypedStorage.resize_`` while a meter is active: each active meter hears of the
    resize (before it, so a simulated device can refuse it; after it, to count it)."""
    before = storage.nbytes()
    for meter in list(_active):
        meter._resizing(storage, before, int(size))
    out = _unwrapped_resize(storage, size)
    for meter in list(_active):
        meter._resized(storage, before)
    return out


@dataclass(frozen=True)
class MeterMark:
    """A reading taken with :meth:`MemoryMeter.mark`.

    ``live_bytes`` is the live figure at the mark; ``peak_bytes`` the highest live
    figure between the previous mark (or ``__enter__``) and this one.
    """

    label: str
    live_bytes: int
    peak_bytes: int


def returns_alias(func: torch._ops.OpOverload) -> list[bool]:
    """Per return of ``func``: does it alias an input (a view, an in-place or out= result)?"""
    try:
        return [r.alias_info is not None for r in func._schema.returns]
    except AttributeError:  # not an OpOverload with a schema: treat outputs as fresh
        return []


@functools.cache
def may_copy(func: torch._ops.OpOverload) -> bool:
    """Whether ``func``'s schema says it returns an input though it may return a copy: a
    composite op (``to``, ``reshape``, ``contiguous``), which reaches a mode undecomposed
    only when called below autograd (in a selective-checkpoint policy, in another mode's
    ``__torch_dispatch__``). Its output aliases an input only where its storage is one."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd")
    except (AttributeError, RuntimeError):
        return False


def _input_storages(args: tuple, kwargs: dict | None) -> tuple[int, ...]:
    """The ids of the storages of the tensors among an op's arguments."""
    return tuple(id(t.untyped_storage()) for t in tree_flatten((args, kwargs or {}))[0]
                 if isinstance(t, torch.Tensor) and t.layout == torch.strided)


def _is_input(t: torch.Tensor, inputs: tuple[int, ...]) -> bool:
    """Whether ``t`` returns one of the op's argument storages (an in-place result)."""
    return bool(inputs) and t.layout == torch.strided and id(t.untyped_storage()) in inputs


class MemoryMeter(TorchDispatchMode):
    """Measure live tensor bytes (storages allocated in the region) and their peak.

    Args:
        device_type: count only storages on this device type (``"cpu"``,
            ``"cuda"``); ``None`` (default) counts every device.

    Readings, in bytes: ``live_bytes``, ``peak_bytes``; on CUDA also
    ``cuda_live_bytes`` and ``cuda_peak_bytes`` (allocator deltas since
    ``__enter__``). ``mark(label)`` records a reading and restarts the peak, so a
    region can be cut into phases.

    Example::

        with MemoryMeter() as meter:
            loss = model(x).sum()
            after_forward = meter.mark("forward")
            loss.backward()
        print(after_forward.live_bytes, meter.peak_bytes)
    """

    def __init__(self, *, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        # Re-entrant: a weakref callback (``_release``) can fire inside a locked section
        # when an allocation there triggers Python's cyclic GC on the same thread.
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes, while alive
        self._refs: dict[int, weakref.ref] = {}
        # Each counted storage's device type, address and when it was counted there, for
        # its death (deaths.py).
        self._ptrs: dict[int, tuple[str, int, int]] = {}
        self._live = 0
        self._peak_since_mark = 0
        self._overall_peak = 0
        self.marks: list[MeterMark] = []
        self._cuda_start: int | None = None

    # -- readings ---------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        """Bytes of storages allocated in the region that are still alive."""
        return self._live

    @property
    def peak_bytes(self) -> int:
        """Highest ``live_bytes`` since ``__enter__``."""
        return self._overall_peak

    @property
    def cuda_live_bytes(self) -> int | None:
        """``torch.cuda.memory_allocated()`` delta since ``__enter__`` (None off CUDA)."""
        if self._cuda_start is None:
            return None
        return torch.cuda.memory_allocated() - self._cuda_start

    @property
    def cuda_peak_bytes(self) -> int | None:
        """``torch.cuda.max_memory_allocated()`` delta since ``__enter__`` (None off CUDA)."""
        if self._cuda_start is None:
            return None
        return torch.cuda.max_memory_allocated() - self._cuda_start

    def mark(self, label: str = "") -> MeterMark:
        """Record the live figure and the peak since the last mark; restart that peak."""
        with self._lock:
            reading = MeterMark(label, self._live, self._peak_since_mark)
            self._peak_since_mark = self._live
        self.marks.append(reading)
        return reading

    def reset_peak(self) -> None:
        """Restart the peak since the last mark at the current live figure."""
        with self._lock:
            self._peak_since_mark = self._live

    # -- the mode ---------------------------------------------------------------
    def __enter__(self) -> MemoryMeter:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        self._get_rng_state = torch.get_rng_state
        torch.get_rng_state = self._tracked_rng_state
        if not _active:
            torch.UntypedStorage.resize_ = _metered_resize  # type: ignore[method-assign]
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._cuda_start is not None:
            torch.cuda.synchronize()
        torch.get_rng_state = self._get_rng_state
        if self in _active:
            _active.remove(self)
        if not _active:
            torch.UntypedStorage.resize_ = _unwrapped_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _tracked_rng_state(self) -> torch.Tensor:
        state = self._get_rng_state()
        self._track(state, aliased=False)
        return state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        aliases = returns_alias(func)
        if len(aliases) == 1:
            outputs = (out,)  # one return, possibly a Tensor[] (split, chunk, unbind)
        else:
            outputs = out if isinstance(out, (tuple, list)) else (out,)
        by_storage = any(aliases) and may_copy(func)
        inputs = (_input_storages(args, kwargs) if by_storage or func.namespace == "c10d"
                  else ())
        for i, value in enumerate(outputs):
            aliased = aliases[i] if i < len(aliases) and not by_storage else False
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t, aliased=aliased or _is_input(t, inputs))
        return out

    def _track(self, t: torch.Tensor, *, aliased: bool) -> None:
        # A DTensor (FSDP2's optimizer state, made by zeros_like on its parameters) by its
        # local shard: the wrapper's storage reports the global size, world-size times
        # what this rank allocates (the ops on the shard run below this mode, unseen).
        t = local_shard(t)
        if t.layout != torch.strided or t.device.type == "meta":
            return
        if self.device_type is not None and t.device.type != self.device_type:
            return
        st = t.untyped_storage()
        key = id(st)
        nbytes = st.nbytes()
        with self._lock:
            if key in self._sizes:
                # Already counted; an in-place resize_ may have changed its size.
                self._live += nbytes - self._sizes[key]
                self._sizes[key] = nbytes
            elif aliased:
                return  # a view or in-place result of a storage from before the region
            else:
                self._sizes[key] = nbytes
                self._refs[key] = weakref.ref(st, lambda _ref, k=key: self._release(k))
                self._ptrs[key] = (st.device.type, st.data_ptr(), now_if_recording())
                self._live += nbytes
            if self._live > self._peak_since_mark:
                self._peak_since_mark = self._live
            if self._live > self._overall_peak:
                self._overall_peak = self._live

    def _counts_device(self, device: torch.device) -> bool:
        return device.type != "meta" and (self.device_type is None
                                          or device.type == self.device_type)

    def _resizing(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """Called before ``storage`` is resized in place from ``before`` to ``after`` bytes
        (a hook for :class:`~remat.measurement.simulated_device.SimulatedDevice`)."""

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """Count ``storage``'s in-place resize from ``before`` bytes (module docstring)."""
        if not self._counts_device(storage.device):
            return
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._sizes:
                self._live += nbytes - self._sizes[key]
                self._sizes[key] = nbytes
            elif before == 0 and nbytes > 0:  # freed before the region, allocated in it
                self._sizes[key] = nbytes
                self._refs[key] = weakref.ref(storage, lambda _ref, k=key: self._release(k))
                self._live += nbytes
            else:
                return
            # resize_ moves it
            self._ptrs[key] = (storage.device.type, storage.data_ptr(), now_if_recording())
            if self._live > self._peak_since_mark:
                self._peak_since_mark = self._live
            if self._live > self._overall_peak:
                self._overall_peak = self._live

    def _release(self, key: int) -> None:
        with self._lock:
            self._live -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)
            where = self._ptrs.pop(key, None)
        if where is not None:
            note_death(*where)
