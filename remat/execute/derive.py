"""``derive``: hold what autograd saves, except what cheap ops make again from it.

Why. Much of what a transformer block saves for backward is a few elementwise ops away
from other tensors it saves: dropout's output is the softmax's output times the mask
(both saved), the four 4h-wide tensors of GPT-2's tanh GELU are made from its input, a
norm's output from its input and statistics, autocast's low-precision copies from what
they copy. ``selective`` frees them too, but it runs the unit's whole elementwise
forward again (dropout draws, softmax, every norm) and, through torch's checkpoint,
holds the unit's arguments. ``derive`` runs again only the ops that make the tensors it
let go, from tensors that are held anyway. torch.compile's partitioner does this inside
a compiled graph; eagerly, nothing did.

How, for one call of a unit (:func:`forward_deriving`):

1. The forward runs under :class:`_Recorder`, a dispatch mode that notes each op's
   outputs by data pointer, shape, strides and dtype (autograd may hand the pack hook
   another Python object for the same view) with how they were made, where the op is
   one :data:`DERIVABLE_OPS` lists: elementwise math, casts, copies, views, the norms'
   kernels (no random draw; the output a function of the inputs). A write of that kind
   (``div_``) is noted as its out-of-place twin (``div``) read from the value before
   it; a Bernoulli draw (dropout's mask) as a ``bool`` copy taken in forward, which
   makes the draw again exactly at a quarter of its bytes. Any other op's outputs are
   noted as not derivable.
2. A pack hook holds every tensor autograd saves, as a detached alias, in a
   :class:`_Saved` handle.
3. When the forward returns, the handles are split (:meth:`_Recorder.resolve`), in the
   order autograd saved them: a tensor is derived when the ops that made it, followed
   back, reach only tensors that stay held (another handle's), parameters and buffers
   of the unit, or tiny constants, each at the version it had when it was used, and
   when those ops write at most :data:`MAX_PASSES` times its bytes; otherwise it is held,
   and may let a later one be made from it. A tensor whose storage stays held anyway
   is not let go (that frees nothing), nor, under autocast's weight cache, a cast of a
   weight (the cache holds it until the forward ends, as the profile counts for every
   option). The derived handles let go of their tensors and keep the ops, bound to the
   held tensors.
4. In backward, a derived handle's unpack runs its ops under ``no_grad`` with autocast
   off; a value made for a handle that is still to be unpacked is kept until it is, so
   each op runs once per backward.

The price. The dispatch mode is Python on every op of the unit's forward (about 10 us an
op on a CPU), and the backward runs the derived tensors' ops again: elementwise work,
the cheapest per byte there is (``benchmarks/results/selective_cost.md``). A held tensor
a recipe reads is held until the last derived tensor that reads it is unpacked, which
can be later than autograd alone would hold it; the profiler meters ``derive`` as it
runs, so the solver sees that.

Checks, and what each costs:

* Same values: a recipe runs the same kernels on the same tensors, so the values are the
  same bits. The profiler proves it once per distinct unit, in its first timed run
  (``verify``: every tensor held as ``keep`` holds it, and every recipe run when the
  backward asks for its tensor and compared with it bit for bit, strides included), and
  drops the option for a unit where it fails.
* Writes: autograd does not check the version of a tensor a hook hands back, so each
  handle does (a compare per unpack): a saved tensor written in place after it was saved
  raises autograd's own error, derived or not, and a tensor written after an op read it
  is not a recipe's input.
* Other hooks: under another ``saved_tensors_hooks`` (torch's checkpoint,
  ``save_on_cpu``, a user's) the forward runs plainly: those hooks decide what is saved.
  Under ``torch.compile`` too: the compiler's partitioner does this itself.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.core.errors import RematError
from remat.execute.random_draws import BERNOULLI_OPS, as_mask, copy_back, plain

__all__ = ["DERIVABLE_OPS", "DeriveFreesNothing", "DeriveMismatch", "forward_deriving",
           "outer_hooks_active"]

log = logging.getLogger(__name__)
_aten = torch.ops.aten


def _packets(*names: str) -> frozenset[Any]:
    # getattr: an op a torch build lacks is left out, not an import error.
    return frozenset(p for p in (getattr(_aten, n, None) for n in names) if p is not None)


# Ops whose outputs are a deterministic function of their arguments, cheap per byte, and
# free of side effects: elementwise math, casts, copies, views, concatenation and the
# norms' own kernels. Not random draws, not softmax (whose input is rarely held), not
# matmuls (``selective`` and ``checkpoint`` are for those).
_VIEWS = _packets(
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "split", "split_with_sizes", "unbind", "as_strided",
    "unflatten", "flatten", "alias", "lift_fresh", "detach")
_TRANSCENDENTAL = _packets(
    "exp", "log", "tanh", "sigmoid", "silu", "gelu", "erf", "sin", "cos", "pow", "sqrt",
    "rsqrt", "elu", "native_layer_norm", "_fused_rms_norm")
_ARITHMETIC = _packets(
    "abs", "add", "sub", "rsub", "mul", "div", "neg", "reciprocal", "relu", "leaky_relu",
    "hardtanh", "clamp", "clamp_min", "clamp_max", "where", "masked_fill", "maximum",
    "minimum", "sign", "square", "_to_copy", "clone", "cat")
DERIVABLE_OPS = _VIEWS | _TRANSCENDENTAL | _ARITHMETIC

# What remaking a tensor may cost, in passes over its bytes: a tensor is derived when
# the ops its recipe runs (those no earlier recipe runs) write at most this many times
# its bytes, a view counting nothing and a transcendental op (or a norm) twice. GPT-2's
# tanh GELU: its output and the two tensors it multiplies are one pass each and derived;
# the tanh itself is seven (pow, three arithmetic ops, tanh) and held.
MAX_PASSES = 2
_WEIGHT_VIEW, _WEIGHT_ARITHMETIC, _WEIGHT_TRANSCENDENTAL = 0, 1, 2

# The share of what a unit saves that derive must let go of for the profiler to time
# and meter it: below it derive is all but keep (a ResNet block: 512 bytes of 63 MB), and
# its runs would cost a CNN of distinct blocks a plain step (issue 31: planning within
# 10 steps).
WORTH_PROFILING = 0.05

# An argument this small (elements) is held by the recipe itself when no handle holds
# it: scalars made into tensors, a norm's eps. Holding it costs nothing worth metering.
_TINY = 64


class DeriveMismatch(RematError):
    """A recipe made another value than the tensor it replaces (the profiler's check)."""


class DeriveFreesNothing(RematError):
    """Under ``verify``: ``derive`` would let go of less than :data:`WORTH_PROFILING` of
    what the unit saves (``keep`` with a dispatch mode around it, all but); raised when
    the forward returns, so that the profiler spends no backward, timing or metering on
    it."""


def outer_hooks_active() -> bool:
    """Whether some ``saved_tensors_hooks`` (a checkpoint region, ``save_on_cpu``) are on."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


_Key = tuple[Any, ...]


def _key(t: torch.Tensor) -> _Key | None:
    """Where ``t``'s values are: the same key, the same elements (two views of one
    storage that look alike are one value). None for tensors without plain storage
    (subclasses, sparse), which are never derived."""
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        return None
    if t.layout != torch.strided:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


class _Leaf:
    """An argument not made by a derivable op here: bound at resolve to a held tensor."""

    __slots__ = ("key", "tensor", "version")

    def __init__(self, key: _Key | None, version: int, tensor: torch.Tensor | None) -> None:
        self.key, self.version, self.tensor = key, version, tensor


class _Call:
    """One derivable op as the forward called it: the op, its arguments (tensors as
    sources), what it costs to run again, and the backward's cache of its outputs
    (``values``, kept while ``pending`` handles are still to read one)."""

    __slots__ = ("func", "args", "kwargs", "cost", "pending", "values")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 cost: int) -> None:
        self.func, self.args, self.kwargs, self.cost = func, args, kwargs, cost
        self.pending = 0
        self.values: list[Any] | None = None


class _Made:
    """One output of a :class:`_Call`, at the version it was made."""

    __slots__ = ("call", "index", "key", "version", "ok", "held")

    def __init__(self, call: _Call, index: int, key: _Key, version: int) -> None:
        self.call, self.index, self.key, self.version = call, index, key, version
        self.ok: bool | None = None  # derivable from what is held (decided at resolve)
        self.held: torch.Tensor | None = None  # a held tensor with this value


def _sources(a: Any, source: Callable[[torch.Tensor], Any]) -> Any:
    """``a`` with each tensor replaced by its source (an op's arguments: tensors,
    scalars, and lists or tuples of them)."""
    if isinstance(a, torch.Tensor):
        return source(a)
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(source(x) if isinstance(x, torch.Tensor) else x for x in a)
    return a


def _each(a: Any) -> Any:
    """The sources within one argument (:func:`_sources`' result)."""
    if isinstance(a, (list, tuple)):
        return (x for x in a if isinstance(x, (_Made, _Leaf)))
    return (a,) if isinstance(a, (_Made, _Leaf)) else ()


class _Saved:
    """What the pack hook returns: the saved tensor, or (once derived) its recipe."""

    __slots__ = ("tensor", "version", "recipe", "ref", "owner")

    def __init__(self, tensor: torch.Tensor, owner: _Recorder) -> None:
        # A detached alias (same storage, same version counter), never the tensor
        # itself: a saved output refers to its node, whose saved variables refer to
        # this handle, a cycle through autograd's graph that no collector breaks, so a
        # graph dropped without a backward (the forward of an evaluation) would keep
        # every tensor it saved.
        self.tensor: torch.Tensor | None = tensor.detach()
        self.version = tensor._version
        self.recipe: _Made | None = None
        self.ref: weakref.ref[torch.Tensor] = weakref.ref(tensor)
        self.owner = owner

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t is not None:
            _check_version(t, self.version)
            if self.recipe is not None:  # verifying (:meth:`_Recorder.resolve`)
                _verify(self.recipe, t, self.owner)
            return t
        original = self.ref()
        if original is not None:
            _check_version(original, self.version)
        recipe = self.recipe
        assert recipe is not None
        value = self.owner.compute(recipe)
        call = recipe.call
        call.pending -= 1
        if call.pending <= 0:
            call.values = None
        return value


def _check_version(t: torch.Tensor, version: int) -> None:
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.dtype}{list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (remat's 'derive' option, which checks "
            "what autograd checks)")


def _weight(func: Any) -> int:
    packet = getattr(func, "overloadpacket", None)
    if packet in _VIEWS:
        return _WEIGHT_VIEW
    return _WEIGHT_TRANSCENDENTAL if packet in _TRANSCENDENTAL else _WEIGHT_ARITHMETIC


def _from_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A Bernoulli draw made again from its ``bool`` copy (:meth:`_Recorder._draw`)."""
    return copy_back(torch.empty_like(mask, dtype=dtype), mask)


_TWINS: dict[Any, Any] = {}


def _functional_twin(func: Any, args: tuple[Any, ...]) -> Any | None:
    """The derivable out-of-place overload of the in-place op ``func`` (``div_.Scalar``:
    ``div.Scalar``), or None; only where no argument's dtype differs from the written
    tensor's (the out-of-place op would promote where the in-place one casts back)."""
    twin = _TWINS.get(func, False)
    if twin is False:
        name = func._schema.name.split("::")[-1]
        twin = None
        if name.endswith("_") and not name.startswith("_"):
            packet = getattr(_aten, name[:-1], None)
            if packet is not None and packet in _ARITHMETIC | _TRANSCENDENTAL:
                twin = getattr(packet, func._overloadname, None)
        _TWINS[func] = twin
    if twin is None or not args or not isinstance(args[0], torch.Tensor):
        return None
    dtype = args[0].dtype
    if any(isinstance(a, torch.Tensor) and a.dtype != dtype for a in args[1:]):
        return None
    return twin


class _Recorder(TorchDispatchMode):
    """Notes how each value of one forward was made (module docstring, step 1)."""

    def __init__(self, module: nn.Module, saved: set[int] | None = None) -> None:
        super().__init__()
        self.module = module
        self.saved = saved
        self.made: dict[_Key, _Made | None] = {}
        self.handles: list[_Saved] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        call = None
        if func._schema.is_mutable:
            # A write: its result is a recipe where the op has a functional twin that is
            # derivable (``div_`` is ``div``), read from the written tensor's value
            # before the write; the sources are taken before the op runs.
            twin = _functional_twin(func, args)
            if twin is not None:
                call = self._call(twin, args, kwargs)
        elif packet in DERIVABLE_OPS:
            call = self._call(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in BERNOULLI_OPS:
            call = self._draw(out)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        made = self.made
        # Versions are counted above this mode, once the op returns: a written tensor
        # (the output of a write) will be one version on, and a view will share its
        # base's counter (here it still has a fresh one).
        bump = 1 if call is not None and func._schema.is_mutable else 0
        base = (args[0]._version if packet in _VIEWS and args
                and isinstance(args[0], torch.Tensor) else None)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and (key := _key(o)) is not None:
                # Every op's outputs are noted, the others' as None: a storage freed
                # and reused within the forward must not keep an older value's recipe.
                version = base if base is not None else o._version + bump
                made[key] = None if call is None else _Made(call, i, key, version)
                if call is not None and not call.cost:
                    call.cost = _weight(call.func) * o.numel() * o.element_size()
        # A write into an argument that is not an output (running statistics) is seen
        # by the version each use recorded.
        return out

    def _call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        source = self._source
        return _Call(func, tuple(_sources(a, source) for a in args),
                     {k: _sources(v, source) for k, v in kwargs.items()}, 0)

    def _draw(self, out: Any) -> _Call | None:
        """A Bernoulli draw (dropout's mask) as a recipe: the forward keeps it as one
        byte per element (:func:`~remat.execute.random_draws.as_mask`), which makes the
        draw again exactly (it is 0 or 1) at a quarter of a float mask's bytes."""
        draw = out if isinstance(out, torch.Tensor) else None
        if draw is None or not plain(draw) or not draw.is_floating_point():
            return None
        mask = as_mask(draw)
        return _Call(_from_mask, (_Leaf(None, mask._version, mask),), {"dtype": draw.dtype}, 0)

    def _source(self, t: torch.Tensor) -> Any:
        key = _key(t)
        m = self.made.get(key) if key is not None else None
        if m is not None and m.version == t._version:
            return m
        if t.numel() <= _TINY:
            # A copy, taken now: a later write into ``t`` cannot reach it (an alias made
            # below autograd would not even share its version counter).
            copy = t.clone()
            return _Leaf(key, copy._version, copy)
        return _Leaf(key, t._version, None)

    def pack(self, t: torch.Tensor) -> _Saved:
        if self.saved is not None and t.layout == torch.strided:
            self.saved.add(id(t.untyped_storage()))
        saved = _Saved(t, self)
        self.handles.append(saved)
        return saved

    # -- resolve (step 3) ------------------------------------------------------------

    def resolve(self, *, verify: bool, cast_cache: bool = False) -> tuple[int, int]:
        """Let go of every handle's tensor that a recipe makes again at a price within
        :data:`MAX_PASSES`; the bytes let go and the bytes saved, once per storage.
        ``cast_cache``: autocast
        keeps its casts of the weights until the forward pass ends, and the profile
        counts that cache alike for every option of a unit, so those casts are held as
        ``keep`` holds them (letting them go would free them in backward only, where the
        profile does not look)."""
        # The recorder lets go of both: each handle refers to it (``owner``), so its
        # list of them would be a cycle that holds every saved tensor of the unit until
        # Python's cycle collector runs, not until autograd lets go of each.
        handles, made = self.handles, self.made
        self.handles, self.made = [], {}
        storages = [h.tensor.untyped_storage() for h in handles]  # type: ignore[union-attr]
        saved_bytes = sum({st.data_ptr(): st.nbytes() for st in storages}.values())
        del storages
        held: dict[_Key, torch.Tensor] = {}
        for p in (*self.module.parameters(), *self.module.buffers()):
            if (k := _key(p)) is not None:
                held[k] = p
        weights = set(held)
        candidates: list[tuple[_Saved, _Made]] = []
        for h in handles:
            t = h.tensor
            assert t is not None
            k = _key(t)
            m = made.get(k) if k is not None else None
            if m is not None and m.version == h.version:
                candidates.append((h, m))
            elif k is not None:
                held.setdefault(k, t)
        # In the order autograd saved them (the forward's): a tensor that cannot be made
        # from what is held, or only at too high a price, is held, which may let a later
        # one be made from it. Being derivable only grows with what is held, so a True
        # stays true; a False is forgotten each time something more is held.
        seen: list[_Made] = []
        runs: set[int] = set()  # the calls some recipe already runs (id)
        derived: list[tuple[_Saved, _Made]] = []
        for h, m in candidates:
            t = h.tensor
            assert t is not None
            if m.key in held:
                continue
            if _derivable(m, held, seen) and not (cast_cache and _weight_cast(m, weights)):
                calls = _new_calls(m, runs)
                if sum(c.cost for c in calls) <= MAX_PASSES * t.numel() * t.element_size():
                    runs.update(id(c) for c in calls)
                    derived.append((h, m))
                    continue
            held[m.key] = t
            m.ok, m.held = True, t
            for r in seen:
                if r.ok is False:
                    r.ok = None
        storages = {t.untyped_storage().data_ptr() for t in held.values()}
        derived = [(h, m) for h, m in derived
                   if h.tensor.untyped_storage().data_ptr() not in storages]  # type: ignore[union-attr]
        freed: dict[int, int] = {}
        for h, m in derived:
            t = h.tensor
            assert t is not None
            storage = t.untyped_storage()
            freed[storage.data_ptr()] = storage.nbytes()
            h.recipe = m
            if not verify:
                h.tensor = None
                m.call.pending += 1
        # Verifying, each handle keeps its tensor too and checks the recipe against it
        # when the backward asks for it (no count set: nothing is cached), so the check
        # holds what keep holds, no more.
        return sum(freed.values()), saved_bytes

    # -- unpack (step 4) ---------------------------------------------------------------

    def compute(self, m: _Made) -> torch.Tensor:
        if m.held is not None:
            _check_version(m.held, m.version)
            return m.held
        call = m.call
        values = call.values
        if values is None:
            args = tuple(self._argument(a) for a in call.args)
            kwargs = {k: self._argument(v) for k, v in call.kwargs.items()}
            with torch.no_grad(), _AutocastOff():
                out = call.func(*args, **kwargs)
            values = list(out) if isinstance(out, (tuple, list)) else [out]
            if call.pending > 0:
                call.values = values
        return values[m.index]

    def _argument(self, a: Any) -> Any:
        if isinstance(a, _Made):
            return self.compute(a)
        if isinstance(a, _Leaf):
            t = a.tensor
            assert t is not None
            _check_version(t, a.version)
            return t
        if isinstance(a, (list, tuple)) and any(isinstance(x, (_Made, _Leaf)) for x in a):
            return type(a)(self._argument(x) for x in a)
        return a


def _derivable(m: _Made, held: dict[_Key, torch.Tensor], seen: list[_Made]) -> bool:
    """Whether ``m``'s value can be made from ``held`` (binding it where it can)."""
    if m.ok is not None:
        return m.ok
    seen.append(m)
    t = held.get(m.key)
    if t is not None and t._version == m.version:
        m.ok, m.held = True, t
        return True
    m.ok = False  # while its arguments are looked at: a cycle cannot recurse forever
    ok = all(_derivable(s, held, seen) if isinstance(s, _Made) else _bind(s, held)
             for a in (*m.call.args, *m.call.kwargs.values()) for s in _each(a))
    m.ok = ok
    return ok


def _weight_cast(m: _Made, weights: set[_Key]) -> bool:
    """Whether ``m`` is a cast of a parameter or buffer (autocast's, and cached), or a
    view of one."""
    while (getattr(m.call.func, "overloadpacket", None) in _VIEWS and m.call.args
           and isinstance(m.call.args[0], _Made)):
        m = m.call.args[0]
    if getattr(m.call.func, "overloadpacket", None) is not _aten._to_copy:
        return False
    return any(isinstance(s, _Leaf) and s.key in weights for s in _each(m.call.args[0]))


def _new_calls(m: _Made, runs: set[int]) -> list[_Call]:
    """The calls remaking ``m`` runs that no recipe chosen before runs (``m`` derivable)."""
    out: list[_Call] = []
    seen: set[int] = set()
    stack = [m]
    while stack:
        x = stack.pop()
        if x.held is not None or id(x.call) in runs or id(x.call) in seen:
            continue
        seen.add(id(x.call))
        out.append(x.call)
        stack.extend(s for a in (*x.call.args, *x.call.kwargs.values())
                     for s in _each(a) if isinstance(s, _Made))
    return out


def _bind(leaf: _Leaf, held: dict[_Key, torch.Tensor]) -> bool:
    if leaf.tensor is not None:  # tiny (the recipe holds it), or bound before
        return leaf.tensor._version == leaf.version
    t = held.get(leaf.key) if leaf.key is not None else None
    if t is None or t._version != leaf.version:
        return False
    leaf.tensor = t
    return True


def _verify(m: _Made, original: torch.Tensor, recorder: _Recorder) -> None:
    value = recorder.compute(m)
    same = (value.dtype == original.dtype and value.shape == original.shape
            and value.stride() == original.stride()
            and torch.equal(value, original))
    if not same:
        raise DeriveMismatch(
            f"'derive' ran {m.call.func} again and got another value than the forward "
            f"({list(original.shape)} {original.dtype}): the op does not repeat its "
            "values here, so the unit cannot use 'derive'")


class _AutocastOff:
    """Autocast off (a recipe's ops run as they were dispatched, already cast)."""

    def __enter__(self) -> None:
        self._on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        self._ctx = [torch.autocast(d, enabled=False) for d in self._on]
        for c in self._ctx:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self._ctx):
            c.__exit__(*exc)


def forward_deriving(module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any], *, verify: bool = False,
                     saved: set[int] | None = None) -> Any:
    """``forward(*args, **kwargs)`` with the unit's saved tensors derived where they can
    be (module docstring). ``verify``: check every recipe against the tensor it replaces
    (:class:`DeriveMismatch` where one differs), as the profiler does once per unit.
    ``saved``: filled with ``id(t.untyped_storage())`` of every tensor autograd saved (the
    profiler's metered replay reads from it whether the unit holds its input)."""
    if outer_hooks_active() or torch.compiler.is_compiling():
        return forward(*args, **kwargs)
    recorder = _Recorder(module, saved)
    cast_cache = torch.is_autocast_cache_enabled() and any(
        torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, _Saved.unpack):
        with recorder:
            out = forward(*args, **kwargs)
    freed, saved_bytes = recorder.resolve(verify=verify, cast_cache=cast_cache)
    if verify and freed < WORTH_PROFILING * saved_bytes:
        raise DeriveFreesNothing(
            f"{type(module).__name__} saves {saved_bytes} bytes for backward, of which cheap "
            f"ops make {freed} again from the rest: under {WORTH_PROFILING:.0%}, 'derive' "
            "is not worth the profile's runs")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("derive: %s lets go of %d bytes", type(module).__name__, freed)
    return out

