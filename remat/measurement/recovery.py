"""Distributed wrappers put back after a step that an error ended mid-way.

remat catches a device running out of memory where it may go on: profiling lets the head
as written run out of a device sized for a chunked head, and verification solves again
below a plan whose step ran out. The step it ended had begun FSDP2's or DDP's iteration:
left so, the wrapper breaks every step after, remat's and the user's (FSDP2 trains with
unsharded gradients, DDP refuses the next forward). :class:`remat.measurement.state.ModelState`
calls these between passes and when it puts a model back; each does nothing where the
wrapper finished its iteration.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["ddp_wrappers", "fsdp_roots", "recover_ddp", "recover_fsdp"]


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """``model``'s outermost FSDP2 modules (FSDP2's roots: the modules ``fully_shard``
    was applied to last), in the order of ``model.modules()``."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is None:
        return []
    roots: list[nn.Module] = []
    inner: set[int] = set()
    for module in model.modules():
        if id(module) in inner or not isinstance(module, fsdp):
            continue
        roots.append(module)
        inner.update(id(m) for m in module.modules())
    return roots


def recover_fsdp(roots: list[nn.Module]) -> None:
    """FSDP2's per-iteration state put back where a step ended mid-way by an error (a
    device out of memory, which profiling and verification catch and go on from); a
    no-op after a step that completed.

    Why: FSDP2 queues its end-of-backward callback once per iteration and marks it
    queued; a backward that raises never runs it, so the mark stays and no later
    backward queues it again. Every FSDP state then stays in its backward state: later
    forwards keep every unit's parameters gathered (FSDP2 gathers them there for a
    recomputation), the root's gradients are never reduce-scattered, and every gradient
    comes out unsharded ((4096, 128) where the shard is (2048, 128)), in remat's next
    passes and in the user's training after ``solve`` returned. Found 2026-11-29: a
    Mixtral under FSDP2 planned inside a device of its floor budget, where the head as
    written ran out of memory in its backward, as profiling lets it.

    FSDP2's own recovery, ``FSDPModule.reset_iter_state()`` on the root, waits for
    collectives in flight, reshards every group and clears the iteration's state. The
    gradients the failed backward left on gathered parameters go too: the next backward
    would add to them. The price: reading FSDP2's state once per pass (private
    attributes, read defensively: where they are missing nothing is done)."""
    for root in roots:
        state = getattr(root, "_get_fsdp_state", lambda: None)()
        ctx = getattr(state, "_state_ctx", None)
        if ctx is None or not _fsdp_mid_iteration(ctx):
            continue
        reset = getattr(root, "reset_iter_state", None)
        if reset is not None:
            reset()
        for each in getattr(ctx, "all_states", ()):
            for group in getattr(each, "_fsdp_param_groups", ()):
                for fsdp_param in getattr(group, "fsdp_params", ()):
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
                    if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                        fsdp_param.unsharded_accumulated_grad = None


def ddp_wrappers(model: nn.Module) -> list[nn.Module]:
    """The ``DistributedDataParallel`` wrappers among ``model``'s modules, and the one a
    trainer's step replicates through (``replicated_by``, not a submodule:
    :class:`remat.tune.replicated.ReplicatedStep`)."""
    ddp = nn.parallel.DistributedDataParallel
    found = [m for m in model.modules() if isinstance(m, ddp)]
    outer = model.__dict__.get("replicated_by")
    if isinstance(outer, ddp) and all(outer is not m for m in found):
        found.append(outer)
    return found


def recover_ddp(wrappers: list[nn.Module]) -> None:
    """DDP's Reducer put back where a backward through it raised (a device out of memory
    in a verified round, which verification catches and solves again from); a no-op
    after a backward that completed.

    Why: the Reducer expects the reduction it began to finish; after a backward that
    raised, the next forward through the wrapper fails with "Expected to have finished
    reduction in the prior iteration", so the next round could not be measured. The
    Reducer's own reset (``_reset_state``, what torch uses when it swaps the process
    group) runs only where its check (``_check_reducer_finalized``) says the reduction
    is unfinished. The price: one check per pass; private methods, read defensively."""
    for wrapper in wrappers:
        reducer = getattr(wrapper, "reducer", None)
        check = getattr(reducer, "_check_reducer_finalized", None)
        reset = getattr(reducer, "_reset_state", None)
        if check is None or reset is None:
            continue
        try:
            check()
        except RuntimeError:
            reset()


def _fsdp_mid_iteration(ctx: Any) -> bool:
    """Whether FSDP2's shared state ``ctx`` is inside an iteration: its end-of-backward
    callback queued, or a state not idle."""
    if getattr(ctx, "post_backward_final_callback_queued", False):
        return True
    return any(getattr(getattr(s, "_training_state", None), "name", "IDLE") != "IDLE"
               for s in getattr(ctx, "all_states", ()))
