"""``remat.solve`` on the FSDP2-sharded model itself, called on every rank (2 gloo ranks on CPU).

Every rank calls ``remat.solve(model, batch, memory_budget=..., optimizer=opt)`` on its
``fully_shard``-ed model (blocks, then the root): the ranks agree on the call, profile,
take the worst rank's figures and get one plan (:mod:`remat.tune.sharded`). The planned
sharded model then trains exactly as the unplanned sharded one, within the budget and the
prediction on every rank; ranks that call with another budget or batch shape get a
``RematError`` naming the rank, not a hang; a plan for 2 ranks is refused on 1.

Each multi-rank test runs under a deadline (:func:`_spawn`): a hang fails, it does not
block the suite, and each rank still running shortly before it prints every thread's
Python stack (``faulthandler``), so the failure says where the ranks waited.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api, "fully_shard") or not dist.is_available():
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

WORLD = 2
DEADLINE_S = 240.0
STACKS_BEFORE_DEADLINE_S = 20.0  # a rank's stacks printed this long before it is ended


def _spawn(check: Callable[[int], None], port: int) -> None:
    """Run ``check(rank)`` on ``WORLD`` gloo ranks; fail (and end them) past the deadline."""
    ctx = mp.start_processes(_worker, args=(port, check), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the ranks did not finish within {DEADLINE_S:.0f} s (a hang)")


def _worker(rank: int, port: int, check: Callable[[int], None]) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    faulthandler.dump_traceback_later(DEADLINE_S - STACKS_BEFORE_DEADLINE_S, exit=False)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        check(rank)
        dist.barrier()
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
    # As test_fsdp: leave without C++ static destructors (gloo threads at exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _sharded_gpt(seed: int = 0, reshard_after_forward: bool = True) -> tuple[torch.nn.Module,
                                                                               dict]:
    from torch.distributed.fsdp import fully_shard

    from remat.models import build

    ref = build("gpt", size="tiny", depth=4, width=64, seq_len=64, batch_size=8, dropout=0.0,
                seed=seed)
    for block in ref.model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(ref.model, reshard_after_forward=reshard_after_forward)
    return ref.model, ref.batch


def _sharded_llama() -> tuple[torch.nn.Module, dict]:
    """A Llama-style model from a ``transformers`` config, its decoder layers sharded: units
    whose gradients (0.35 MB) are large beside what a rank's replay holds."""
    from torch.distributed.fsdp import fully_shard

    from remat.models import build

    ref = build("hf-llama", depth=3, width=256, heads=4, seq_len=64, vocab_size=2048,
                batch_size=2, dropout=0.0, seed=0)
    for layer in ref.model.model.layers:
        fully_shard(layer)
    fully_shard(ref.model)
    return ref.model, ref.batch


def _floor_and_keep(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer
                    ) -> tuple[int, int]:
    import remat
    from remat.core.errors import InfeasibleBudgetError

    keep = remat.solve(model, batch, memory_budget=None, optimizer=opt, verify=False)
    try:
        remat.solve(model, batch, memory_budget=1, optimizer=opt, verify=False)
    except InfeasibleBudgetError as err:
        return err.min_feasible_bytes, keep.record.predicted_peak_bytes
    raise AssertionError("a budget of 1 byte should be infeasible")


def _check_plan_trains_within(rank: int, reshard_after_forward: bool) -> None:
    import remat
    from remat.integrations import fsdp
    from remat.measurement.simulated_device import SimulatedDevice
    from remat.measurement.storage import resident_bytes

    planned, batch = _sharded_gpt(reshard_after_forward=reshard_after_forward)
    unplanned, _ = _sharded_gpt(reshard_after_forward=reshard_after_forward)
    opts = [torch.optim.AdamW(m.parameters()) for m in (planned, unplanned)]
    floor, keep = _floor_and_keep(planned, batch, opts[0])
    # FSDP2 registers its state-dict hooks on its first forward (here, inside solve) and
    # marks that in its own state: what solve puts back leaves them (remat.measurement.state).
    assert any(m._state_dict_pre_hooks for m in planned.modules())
    budget = (floor + keep) // 2
    plan = remat.solve(planned, batch, memory_budget=budget, optimizer=opts[0])
    assert plan.target.world_size == WORLD
    assert set(plan.options) != {"keep"}, plan.summary()
    assert plan.verification is not None and plan.verification.measured_peak_bytes <= budget
    plans: list = [None] * WORLD
    dist.all_gather_object(plans, plan.to_json())
    assert all(p == plans[0] for p in plans), "every rank has the same plan"

    remat.apply_plan(planned, plan)
    for model in (planned, unplanned):
        model(**batch).loss.backward()
    for (name, p), q in zip(planned.named_parameters(), unplanned.parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), name
    for opt in opts:
        opt.step()
        opt.zero_grad()

    predicted = plan.record.predicted_peak_bytes
    measured = fsdp.measure_rank_step(planned, batch, optimizer=opts[0])
    # Inside a device of the budget: a byte over raises torch.OutOfMemoryError.
    with SimulatedDevice(budget, resident_bytes=resident_bytes(planned, opts[0])) as device:
        planned(**batch).loss.backward()
        opts[0].step()
        opts[0].zero_grad()
    assert measured <= predicted <= budget, (measured, predicted, budget)
    assert device.peak_bytes <= predicted, (device.peak_bytes, predicted)
    print(f"\nrank {rank} reshard_after_forward={reshard_after_forward}: budget {budget} B, "
          f"predicted {predicted} B, measured {measured} B (allocator), {device.peak_bytes} B "
          f"(live tensors)", flush=True)


def _check_raf_true(rank: int) -> None:
    _check_plan_trains_within(rank, True)


def _check_raf_false(rank: int) -> None:
    _check_plan_trains_within(rank, False)


@pytest.mark.slow
@pytest.mark.parametrize("check", [_check_raf_true, _check_raf_false],
                         ids=["reshard_after_forward", "kept_gathered"])
def test_solve_on_the_sharded_model_one_plan_within_budget_same_gradients(
        free_port: int, check: Callable[[int], None]) -> None:
    _spawn(check, free_port)


def _check_frozen_parameters_counted(rank: int) -> None:
    # FSDP2 all-gathers frozen parameters as it does trainable ones (a LoRA model's base
    # weights): a prediction that counted the trainable ones alone was 8 MiB of 50 short
    # of a peft LoRA Qwen2's step (2026-11-28). Here, as LoRA would, every weight but the
    # attention's query and value projections is frozen, the embeddings and head
    # included; the planned step runs inside a device of the predicted peak (a byte over
    # raises torch.OutOfMemoryError).
    import remat
    from remat.core.errors import InfeasibleBudgetError
    from remat.measurement.simulated_device import SimulatedDevice
    from remat.measurement.storage import resident_bytes

    model, batch = _sharded_llama()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("q_proj.weight", "v_proj.weight")))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    # One profile for the floor, the budget and the plan: each call of solve(model, ...)
    # profiles anew, and a CI run's third profile had a floor (35.51 MiB) above the
    # midpoint of the first two's (34.75 MiB), so that budget was refused.
    prof = remat.profile(model, batch, optimizer=opt)
    keep = remat.solve(prof, None).record.predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as refused:
        remat.solve(prof, 1)
    plan = remat.solve(prof, (refused.value.min_feasible_bytes + keep) // 2)
    remat.apply_plan(model, plan)
    for _ in range(2):  # the optimizer's state made
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    predicted = plan.record.predicted_peak_bytes
    with SimulatedDevice(predicted, resident_bytes=resident_bytes(model, opt)) as device:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert device.peak_bytes <= predicted, (rank, device.peak_bytes, predicted)


@pytest.mark.slow
def test_frozen_parameters_fsdp2_gathers_are_counted(free_port: int) -> None:
    pytest.importorskip("transformers")  # here: a skip inside a rank would fail the rank
    _spawn(_check_frozen_parameters_counted, free_port)


def _check_mixed_precision_figures(rank: int) -> None:
    # What FSDP2 gathers and reduce-scatters, in bytes, read off the model: a
    # MixedPrecisionPolicy gathers in param_dtype and reduces in reduce_dtype; frozen
    # parameters are gathered, not reduced. The in-flight buffers are sized by the larger.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from remat.execute.sharding import sharded_unit

    def block() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))

    n = sum(p.numel() for p in block().parameters())
    plain, mixed, frozen = block(), block(), block()
    fully_shard(plain)
    fully_shard(mixed, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32))
    frozen[0].requires_grad_(False)
    fully_shard(frozen)
    half = sum(p.numel() for p in frozen[1].parameters())
    figures = {name: sharded_unit(m) for name, m in
               (("plain", plain), ("mixed", mixed), ("frozen", frozen))}
    assert (figures["plain"].gathered_bytes, figures["plain"].grad_bytes) == (4 * n, 4 * n)
    assert (figures["mixed"].gathered_bytes, figures["mixed"].grad_bytes) == (2 * n, 4 * n)
    assert (figures["frozen"].gathered_bytes, figures["frozen"].grad_bytes) == (4 * n,
                                                                                4 * half)
    assert figures["frozen"].shard_bytes == 4 * half // WORLD
    # FSDP2's defaults: its post-backward reshards and reclaims before it reduces
    assert all(f.frees_before_reduce for f in figures.values())
    plain.set_reshard_after_backward(False)
    mixed.set_reduce_scatter_max_input_buffers(2)
    assert not sharded_unit(plain).frees_before_reduce
    assert not sharded_unit(mixed).frees_before_reduce
    assert sharded_unit(frozen).frees_before_reduce


def test_what_fsdp2_gathers_and_reduces_is_counted_in_its_dtypes(free_port: int) -> None:
    _spawn(_check_mixed_precision_figures, free_port)


def _check_every_gradient_shard_counted(rank: int) -> None:
    # The root's sharded gradients (embeddings, the head: in no unit) come out of its
    # reduce-scatter after the whole backward, where no measured figure sees them: once
    # left out, the optimizer step's event stood one root's shard below the real step.
    import remat

    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt)
    model(**batch).loss.backward()
    held = sum(p.grad.to_local().numel() * p.grad.to_local().element_size()
               for p in model.parameters() if p.grad is not None)
    units = sum(u.param_grad_bytes for u in prof.units)
    assert held > units, "the root has gradients of its own"
    assert prof.grad_bytes == held, (prof.grad_bytes, held)
    opt.zero_grad()


def test_every_gradient_shard_is_counted_the_roots_too(free_port: int) -> None:
    _spawn(_check_every_gradient_shard_counted, free_port)


def _check_root_gathers_counted_once(rank: int) -> None:
    # Where the root reshards after its forward, the outside step's prefix once measured
    # the root's all-gather (its output and its parameters, twice the root's size), which
    # the sharded profile counts too: 16 MiB twice on a Llama of vocabulary 8192. The
    # outside step now keeps the root gathered (remat.execute.sharding.root_kept_gathered),
    # so its figures are those of a root that keeps its parameters, and the root is put
    # back as it was.
    import remat
    from remat.execute.sharding import sharded_unit

    figures = {}
    for root_reshards in (True, False):
        model, batch = _sharded_gpt(reshard_after_forward=True)
        model.set_reshard_after_forward(root_reshards, recurse=False)
        opt = torch.optim.AdamW(model.parameters())
        prof = remat.profile(model, batch, optimizer=opt)
        assert sharded_unit(model).reshard_after_forward is root_reshards, "put back"
        model(**batch)  # the root's post-forward reshards it, or not, as before
        gathered = model._get_fsdp_state()._fsdp_param_group.is_unsharded
        assert gathered is not root_reshards, (root_reshards, gathered)
        figures[root_reshards] = (prof.prefix.fwd_peak_bytes, prof.suffix.bwd_peak_bytes,
                                  prof.meta["fsdp_root_gathered_bytes"])
    (fwd_t, bwd_t, root), (fwd_f, bwd_f, _) = figures[True], figures[False]
    assert abs(fwd_t - fwd_f) < root // 2, (fwd_t, fwd_f, root)
    assert abs(bwd_t - bwd_f) < root // 2, (bwd_t, bwd_f, root)


def test_the_roots_all_gathers_are_counted_once(free_port: int) -> None:
    _spawn(_check_root_gathers_counted_once, free_port)


def _check_suffix_counts_the_last_gather_once(rank: int) -> None:
    # FSDP2 keeps the last unit's all-gather output to the root's post-forward, which runs
    # inside the suffix's forward where the model computes its loss (transformers'): the
    # outside step measured it dying there, and the sharded profile counts it as a buffer
    # in flight too, so the suffix's forward stood a unit above its real phase on every
    # Llama-style model (2026-11-29). The outside step now leaves it to the sharded
    # profile: its suffix is the unsharded model's, plus the buffers in flight.
    import remat
    from remat.execute.sharding import all_gather_output_kept, sharded_unit
    from remat.models import build
    from remat.profiler.sharded import IN_FLIGHT, IN_FLIGHT_BACKWARD, _gathers_in_flight

    model, batch = _sharded_llama()
    layers = list(model.model.layers)
    kept: list[int] = []

    def after_last(*_: object) -> None:
        out = all_gather_output_kept(model)
        kept.append(-1 if out is None else out.numel() * out.element_size())

    handle = layers[-1].register_forward_hook(after_last)
    model(**batch).loss.backward()
    handle.remove()
    model.zero_grad(set_to_none=True)
    unit = sharded_unit(layers[-1]).gathered_bytes
    assert kept == [unit], (kept, unit)  # alive after the last unit's post-forward
    assert all_gather_output_kept(model) is None  # the root's post-forward let it go
    plain = build("hf-llama", depth=3, width=256, heads=4, seq_len=64, vocab_size=2048,
                  batch_size=2, dropout=0.0, seed=0)
    figures = [sharded_unit(layer) for layer in layers]
    forward_only = _gathers_in_flight(figures, IN_FLIGHT - IN_FLIGHT_BACKWARD)
    sharded = remat.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
    alone = remat.profile(plain.model, plain.batch,
                          optimizer=torch.optim.AdamW(plain.model.parameters()))
    own = sharded.suffix.fwd_peak_bytes - forward_only
    assert abs(own - alone.suffix.fwd_peak_bytes) < unit // 4, (own, alone.suffix, unit)
    # The prefix's forward, as measured (before the per-rank model adds FSDP2's buffers),
    # is the unsharded model's: its window ends before FSDP2's pre-forward of the first
    # unit, and the root is gathered before it starts, whatever its setting (FSDP2's
    # default here: kept gathered after the forward). Until 2026-11-29 it held the first
    # unit's all-gather output and parameters and the root's: 14.15 MiB against 0.20 on
    # a Llama of 4 ranks.
    measured = _as_measured(model, batch)
    assert abs(measured.prefix.fwd_peak_bytes - alone.prefix.fwd_peak_bytes) < unit // 4, (
        measured.prefix, alone.prefix, unit)



def _as_measured(model: torch.nn.Module, batch: dict) -> object:
    """``remat.profile`` of the sharded ``model`` as its passes measured it, before the
    per-rank model (:func:`remat.profiler.sharded.sharded_profile`) adds FSDP2's buffers."""
    import remat
    import remat.profiler.sharded as sharded  # looked up at each call by remat.tune

    seen = []
    per_rank = sharded.sharded_profile

    def keep(profile: object, m: torch.nn.Module) -> object:
        seen.append(profile)
        return per_rank(profile, m)

    sharded.sharded_profile = keep
    try:
        remat.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
    finally:
        sharded.sharded_profile = per_rank
    return seen[-1]


def test_the_suffix_forward_counts_the_last_all_gather_once(free_port: int) -> None:
    _spawn(_check_suffix_counts_the_last_gather_once, free_port)


def _check_root_left_gathered(rank: int) -> None:
    # An evaluation forward before solve (no backward) leaves FSDP2's root gathered, its
    # unsharded tensors standing as its parameters: the profile's optimizer step then
    # crashed the rank (a segmentation fault, 2026-11-29). The profile reshards it first,
    # as a backward would have, and the model trains as an untouched one does.
    from torch.distributed.tensor import DTensor

    import remat
    from remat.core.errors import RematError
    from remat.execute.sharding import resharded_at_rest, root_kept_gathered, sharded_unit
    from remat.measurement.meter import MemoryMeter

    model, batch = _sharded_llama()  # the root keeps its gather (FSDP2's default)
    twin, _ = _sharded_llama()
    opt = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model(**batch)
    assert not all(isinstance(p, DTensor) for p in model.parameters())  # the root gathered
    # An optimizer built now holds the root's unsharded tensors, which the reshard frees:
    # refused on every rank, with the fix.
    with pytest.raises(RematError, match=r"rank 0: 3 of the optimizer's parameters have no "
                                         r"storage.*after fully_shard and outside a step"):
        remat.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
    with torch.no_grad():
        model(**batch)
    # The outside step gathers the root afresh inside its meter's region, so that the
    # meter sees the root's post-backward free its parameters in the prefix's backward: a
    # root gathered before the region holds storages whose free no view subtracts (the
    # prefix's backward stood its size high, 16 MiB on a Llama of vocabulary 8192).
    root = sharded_unit(model).gathered_bytes - sum(
        sharded_unit(layer).gathered_bytes for layer in model.model.layers)
    with MemoryMeter() as meter:
        before = meter.live_bytes
        with root_kept_gathered(model):
            # Its parameters at least (gloo's work can hold the all-gather output a while).
            assert meter.live_bytes - before >= root, (meter.live_bytes - before, root)
    assert resharded_at_rest(model) == [""]  # no backward ran: the root is put back
    with torch.no_grad():
        model(**batch)
    remat.profile(model, batch, optimizer=opt)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    losses = []
    for m, o in ((model, opt), (twin, torch.optim.AdamW(twin.parameters()))):
        loss = m(**batch).loss
        loss.backward()
        o.step()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())


def test_a_root_left_gathered_by_an_evaluation_is_resharded_first(free_port: int) -> None:
    _spawn(_check_root_left_gathered, free_port)


def _check_unreduced_root_grads_counted(rank: int) -> None:
    # The head's gradient, made in the suffix's backward (or, as here, by the head made a
    # unit), waits unsharded for the root's reduce-scatter at the end of the backward:
    # alive through every unit's backward after it,
    # where no figure had it (8 MiB on a Llama of vocabulary 8192, which the buffers
    # counted in flight hid to within 0.98 MiB of a kept unit's real backward).
    import remat
    from remat.execute.sharding import unreduced_grad_bytes

    model, batch = _sharded_llama()
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt)
    seen: list[int] = []

    def at_backward(module: torch.nn.Module, args: tuple, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda grad: seen.append(unreduced_grad_bytes(model)))

    for layer in model.model.layers:
        layer.register_forward_hook(at_backward)
    model(**batch).loss.backward()
    head = model.lm_head.weight
    assert prof.unreduced_grad_bytes >= head.numel() * head.element_size(), prof
    assert seen and max(seen) == prof.unreduced_grad_bytes, (seen, prof.unreduced_grad_bytes)
    assert prof.extra_grad_in_flight_bytes >= prof.unreduced_grad_bytes


def test_the_roots_unsharded_gradients_are_counted_through_the_backward(
        free_port: int) -> None:
    _spawn(_check_unreduced_root_grads_counted, free_port)


def _check_ranks_agree_on_one_more_step(rank: int) -> None:
    # A measured step runs one more whole step where something outlived the loop's
    # variables, a decision each rank took on its own: rank 1 here keeps an activation
    # (as a hook that caches would), rank 0 does not. Before the ranks agreed on it,
    # rank 1's extra step waited in its all-gather for rank 0, which had gone on (a hang,
    # in a CI run of test_solve_on_the_sharded_model_one_plan_within_budget_same_gradients).
    # Measured as verification measures a plan's step (remat.tune.verify.measure_plan).
    from remat.measurement.step import measure_step

    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    kept: list = []
    if rank == 1:
        model.blocks[0].register_forward_hook(
            lambda module, args, output: kept.append(output))
    measured = measure_step(model, batch, optimizer=opt, warmup=0, repeats=0,
                            allocator=True, held=False)
    assert measured.worst_peak_bytes > 0


def test_the_ranks_agree_on_one_more_measured_step(free_port: int) -> None:
    _spawn(_check_ranks_agree_on_one_more_step, free_port)


def backward_out_of_memory(model: torch.nn.Module, block: torch.nn.Module, batch: dict) -> None:
    """One step of ``model`` whose backward runs out of memory at ``block``'s output (as a
    device of the budget would), the error caught as remat catches it."""
    def out_of_memory(grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("a device of the budget (the test's)")

    def failing(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(out_of_memory)

    hook = block.register_forward_hook(failing)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            model(**batch).loss.backward()
    finally:
        hook.remove()


def _check_failed_backward_recovered(rank: int) -> None:
    # Profiling catches a device running out of memory in a step's backward (the head as
    # written, on a device sized for a plan) and goes on. FSDP2 marks its end-of-backward
    # callback queued and a backward that raises never runs it: no later backward queued
    # it again, every unit stayed gathered in the next forwards, the root's gradients were
    # never reduce-scattered, and the user's gradients came out unsharded after solve
    # returned (a Mixtral planned inside a device of its floor budget). ModelState puts
    # FSDP2's iteration state back (remat.measurement.recovery.recover_fsdp).
    from remat.measurement.state import training_session

    model, batch = _sharded_gpt()
    untouched, _ = _sharded_gpt()

    with training_session(model) as state:
        backward_out_of_memory(model, model.blocks[1], batch)
        state.between_passes()  # as profiling does after catching it
        model(**batch).loss.backward()  # the next pass
    with training_session(model):
        backward_out_of_memory(model, model.blocks[1], batch)  # one that ends the session
    for m in (model, untouched):
        m(**batch).loss.backward()
    for (name, p), q in zip(model.named_parameters(), untouched.parameters(), strict=True):
        assert type(p.grad) is type(q.grad), name  # a DTensor: the shard, reduce-scattered
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), name


def test_fsdp2_is_put_back_after_a_backward_that_ran_out_of_memory(free_port: int) -> None:
    _spawn(_check_failed_backward_recovered, free_port)


def _check_twins_decided_apart(rank: int) -> None:
    # Whether the second of a group of twins matches the first is each rank's own decision,
    # on bytes FSDP2's and gloo's buffers make vary by rank. Rank 1 here decides that every
    # block differs (so replays each one), rank 0 pools them: the ranks' passes must still
    # issue the same collectives. Before replays cleared the gathered parameters'
    # gradients, rank 1's next backward reduce-scattered two more blocks and both hung.
    import remat
    import remat.profiler.unit_figures as unit_figures

    if rank == 1:  # each side of the comparison gets its own marker: never equal
        alike = unit_figures._bytes_only
        unit_figures._bytes_only = lambda figures: {**alike(figures), "differ": object()}
    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt)
    profiles: list = [None] * WORLD
    dist.all_gather_object(profiles, prof.to_json())
    assert all(p == profiles[0] for p in profiles), "every rank has the worst rank's profile"


@pytest.mark.slow
def test_ranks_that_pool_twins_apart_run_the_same_collectives(free_port: int) -> None:
    _spawn(_check_twins_decided_apart, free_port)


def _check_composed_on_a_rank(rank: int) -> None:
    # Inside FSDP2's window of a unit's gathered parameters, checkpoint's backward composed
    # of keep's (remat.profiler.recomputed) against its full replay at the same call: never
    # below, and above by no more than tests/profiler/test_profiler_recomputed.py allows
    # (equal when measured, 2026-11-28; 3.5-13 MB above while replays left gradients on
    # the gathered parameters, which the full replay then added into in place).
    import remat
    import remat.profiler.unit_figures as unit_figures
    from remat.profiler.replay import measure_option

    full: list = []
    pairs: list = []
    measure_forward, compose = unit_figures.measure_forward, unit_figures.checkpoint_figures

    def spy(call, option, runner):  # noqa: ANN001, ANN202
        full.append((call.name, measure_option(call, option, runner)))
        return measure_forward(call, option, runner)

    def composing(forward, keep, *, stash_bytes):  # noqa: ANN001, ANN202
        figures = compose(forward, keep, stash_bytes=stash_bytes)
        pairs.append((*full[-1], figures, stash_bytes))
        return figures

    unit_figures.measure_forward, unit_figures.checkpoint_figures = spy, composing
    model, batch = _sharded_llama()
    remat.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
    # Of the decoder layers, the first alone: its twins matched it (a gradient left by the
    # first layer's replays made the second's bytes differ, so each was measured alone).
    layers = [name for name, *_ in pairs if name.startswith("model.layers.")]
    assert layers == ["model.layers.0"], f"rank {rank}: {layers} composed"
    for _, metered, ckpt, stash in pairs:
        assert (ckpt.held_bytes, ckpt.fwd_peak_bytes) == (metered.held_bytes,
                                                         metered.fwd_peak_bytes)
        spared = stash + ckpt.fwd_peak_bytes // 500
        assert 0 <= ckpt.bwd_peak_bytes - metered.bwd_peak_bytes <= spared, (rank, metered,
                                                                             ckpt)


@pytest.mark.slow
def test_checkpoint_composed_on_a_rank_as_its_full_replay(free_port: int) -> None:
    pytest.importorskip("transformers")  # here: a skip inside a rank would fail the rank
    _spawn(_check_composed_on_a_rank, free_port)


def _check_reduce_scatter_clones_released(rank: int) -> None:
    from torch._C._profiler import _EventType

    from remat.measurement.allocator import (
        _walk_allocations,
        peak_of,
        unrecorded_frees_closed,
    )
    from remat.measurement.collective_buffers import collective_releases
    from remat.measurement.deaths import recording
    from remat.measurement.torch_profiler import memory_profile

    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(**batch).logits.sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    with memory_profile() as prof, recording() as deaths:
        step()
    roots = list(prof.profiler.kineto_results.experimental_event_tree())
    # gloo's clone of each reduce-scatter's input, made inside the caller's c10d call
    calls, works, stack = [], [], [(root, False) for root in roots]
    clones = []
    while stack:
        event, inside = stack.pop()
        if event.tag == _EventType.Allocation:
            if inside and event.extra_fields.alloc_size > 0:
                clones.append(event)
            continue
        if event.name.startswith("gloo:"):
            works.append(event)
        outermost = event.name.startswith("c10d::") and not inside
        if outermost:
            calls.append(event)
        stack.extend((child, inside or (outermost and "reduce_scatter" in event.name))
                     for child in event.children)
    assert clones and len(calls) == len(works), (len(clones), len(calls), len(works))
    releases = {(r.ptr, r.allocated_ns): r.time_ns for r in collective_releases(roots)}
    ends = {work.end_time_ns for work in works}
    for clone in clones:
        released = releases[(clone.extra_fields.ptr, clone.start_time_ns)]
        assert released in ends and released > clone.start_time_ns
    events = sorted(_walk_allocations(roots), key=lambda e: e.time_ns)
    closed = unrecorded_frees_closed(events, deaths, collective_releases(roots))
    recorded = {(e.ptr, e.time_ns) for e in events if e.nbytes < 0}
    for clone in clones:  # a recorded free stands (the caller held the work); else the release
        ptr, born = clone.extra_fields.ptr, clone.start_time_ns
        free = min(e.time_ns for e in closed if e.ptr == ptr and e.nbytes < 0
                   and e.time_ns > born)
        assert (ptr, free) in recorded or free <= releases[(ptr, born)]
    assert peak_of(closed) <= peak_of(unrecorded_frees_closed(events, deaths))


def test_gloos_reduce_scatter_clones_leave_the_allocators_view_with_their_work(
        free_port: int) -> None:
    _spawn(_check_reduce_scatter_clones_released, free_port)


def _check_disagreeing_ranks(rank: int) -> None:
    import remat
    from remat.core.errors import RematError

    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    budget = "8MB" if rank == 0 else "9MB"
    with pytest.raises(RematError, match=r"rank 1 differs from rank 0 in memory_budget"):
        remat.solve(model, batch, memory_budget=budget, optimizer=opt, verify=False)
    shorter = {k: v[:, :32] if rank == 1 else v for k, v in batch.items()}
    with pytest.raises(RematError, match=r"rank 1 differs from rank 0 in batch shapes"):
        remat.solve(model, shorter, memory_budget="8MB", optimizer=opt, verify=False)


@pytest.mark.slow
def test_ranks_that_disagree_get_an_error_naming_the_rank(free_port: int) -> None:
    _spawn(_check_disagreeing_ranks, free_port)


def test_the_buffers_in_flight_are_units_and_the_root_only_in_its_phases() -> None:
    # Each buffer in flight is an all-gather output or a reduce-scatter input, sized by
    # the larger of a unit's two: IN_FLIGHT_BACKWARD held from the prefix on; the rest of
    # IN_FLIGHT, a peak of each forward phase, all-gather outputs (the forward reduces
    # nothing), sized by a unit's gathered bytes. The root's buffer, where it outweighs a
    # unit's, is counted by the difference in the root's own phases only: the prefix's
    # forward and backward and the first unit's forward (profiler/sharded.py).
    import dataclasses

    from remat.core.profile import OptionCost, OutsideCost
    from remat.execute.sharding import ShardedUnit
    from remat.profiler.sharded import (
        IN_FLIGHT,
        IN_FLIGHT_BACKWARD,
        _gathers_in_flight,
        _holding,
        _in_flight,
        _root_over_unit,
        _root_phases,
        _with_fsdp,
    )

    units = [ShardedUnit(300, 300, 150), ShardedUnit(200, 400, 200)]  # reduced in fp32
    assert IN_FLIGHT > IN_FLIGHT_BACKWARD >= 1
    assert _in_flight(units, IN_FLIGHT) == IN_FLIGHT * 400
    assert _in_flight(units, IN_FLIGHT_BACKWARD) == IN_FLIGHT_BACKWARD * 400
    assert _in_flight([], IN_FLIGHT) == 0
    assert _gathers_in_flight(units, IN_FLIGHT - IN_FLIGHT_BACKWARD) == (
        IN_FLIGHT - IN_FLIGHT_BACKWARD) * 300  # gathered, not the fp32 reduce input
    assert _holding(OutsideCost(held_bytes=7, fwd_peak_bytes=10, bwd_peak_bytes=20),
                    400, 400) == OutsideCost(held_bytes=407, fwd_peak_bytes=810,
                                             bwd_peak_bytes=20)
    assert _root_over_unit(units, root_buffer=100) == 0
    assert _root_over_unit(units, root_buffer=1000) == 600
    part = OutsideCost(held_bytes=7, fwd_peak_bytes=10, bwd_peak_bytes=20,
                       stepped_bwd_peak_bytes=30)
    # The root's buffer over a unit's; in the backward, the first unit's reduce-scatter
    # input where that is larger (the two are not alive together).
    assert _root_phases(part, 600, 300) == dataclasses.replace(
        part, fwd_peak_bytes=610, bwd_peak_bytes=620, stepped_bwd_peak_bytes=630)
    assert _root_phases(part, 0, 300) == dataclasses.replace(
        part, bwd_peak_bytes=320, stepped_bwd_peak_bytes=330)
    cost = OptionCost(held_bytes=0, holds_input=True, holds_output=False, fwd_peak_bytes=10,
                      bwd_peak_bytes=20)
    first, second = (_with_fsdp(cost, units, i, 600 if i == 0 else 0) for i in (0, 1))
    assert first.fwd_peak_bytes == 10 + 300 + 600  # its parameters, the root's over a unit's
    assert second.fwd_peak_bytes == 10 + 200
    # Gathered again beside the next unit's reduce-scatter input (its compute), or its
    # own reduce-scatter input (its post-backward), not both; the second unit's with the
    # first's prefetch.
    assert first.bwd_peak_bytes == 20 + max(300 + 400, 300)
    assert second.bwd_peak_bytes == 20 + 300 + max(200 + 200, 400)
    # The last unit's compute holds its own all-gather output once more (the root's
    # prefetch, which gloo's worker can keep): in place of a next unit's buffer.
    light = [units[0], ShardedUnit(200, 100, 50)]
    assert _with_fsdp(cost, light, 1).bwd_peak_bytes == 20 + 300 + 200 + 200
    # All three together where FSDP2's post-backward does not free before it reduces
    summed = [dataclasses.replace(u, frees_before_reduce=False) for u in units]
    assert _with_fsdp(cost, summed, 0).bwd_peak_bytes == 20 + 300 + 300 + 400
    # Kept gathered: its post-backward reshards them (held, so freed there) before it
    # makes its own input; the last unit's forward all-gather output can linger.
    kept = [dataclasses.replace(u, reshard_after_forward=False) for u in units]
    assert _with_fsdp(cost, kept, 0).bwd_peak_bytes == 20 + max(400, 300 - 300)
    assert _with_fsdp(cost, kept, 0).held_bytes == 300
    assert _with_fsdp(cost, kept, 1).bwd_peak_bytes == 20 + max(200, 400 - 200)


def test_a_plan_for_two_ranks_is_refused_on_one() -> None:
    import dataclasses

    import remat
    from remat.core.errors import PlanMismatchError
    from remat.models import build

    ref = build("gpt", size="tiny", depth=2, width=32, seq_len=16, batch_size=2)
    names = [f"blocks.{i}" for i in range(2)]
    plan = remat.Plan.keep_all(names)
    plan = plan.with_(target=dataclasses.replace(plan.target, world_size=2))
    assert remat.Plan.from_json(plan.to_json()).target.world_size == 2
    assert "world_size" not in remat.Plan.keep_all(names).to_dict()["target"]
    with pytest.raises(PlanMismatchError, match="sharded over 2 rank"):
        remat.apply_plan(ref.model, plan)


@pytest.mark.parametrize("block_sharded", [True, False], ids=["inside-a-sharded-block",
                                                                  "block-not-sharded"])
def test_a_unit_holding_a_module_sharded_apart_is_refused_by_name(monkeypatch,
                                                                   block_sharded: bool) -> None:
    # A replay of the block would run the inner module on its shards (a DTensor error from
    # deep inside a replay, 2026-11-28) and issue its collectives: refused, on every rank
    # at the same unit. FSDP2's class stood in for by a marker, so no process group.
    import remat.execute.sharding as sharding
    from remat.core.errors import ProfileError
    from remat.models import build
    from remat.profiler import profile_levels

    class Sharded(torch.nn.Module):  # what fully_shard makes a module an instance of
        pass

    ref = build("gpt", size="tiny", depth=2, width=32, seq_len=16, batch_size=2)
    apart = [ref.model.blocks[1].mlp, *(ref.model.blocks if block_sharded else [])]
    made: dict[type, type] = {}  # one class per class, as fully_shard makes (blocks alike)
    for module in apart:
        cls = type(module)
        module.__class__ = made.setdefault(cls, type(f"Sharded{cls.__name__}", (cls, Sharded),
                                                     {}))
    monkeypatch.setattr(sharding, "_fsdp_module_class", lambda: Sharded)
    assert sharding.sharded_inside(ref.model.blocks[1]) == ["mlp"]
    with pytest.raises(ProfileError, match=r"unit 'blocks.1' holds 'blocks.1.mlp', which "
                                           r"FSDP2 shards on its own"):
        profile_levels(ref.model, ref.batch, progress=False)


def test_the_ranks_compare_every_profiling_setting() -> None:
    # Read from the fields: a setting added to ProfilingSettings is compared across ranks
    # without a change to remat.tune.sharded (ranks timing with other warmup, repeats or
    # tolerance would run other numbers of steps, so other collectives, and hang).
    import dataclasses

    from remat.core.settings import ProfilingSettings
    from remat.tune.ranks import describe_settings
    from tests.test_settings import OTHER_VALUES

    base = ProfilingSettings()
    for f in dataclasses.fields(ProfilingSettings):
        changed = base.replace(**{f.name: OTHER_VALUES[f.name]})
        if f.name == "progress":  # a terminal on one rank only; this route draws none
            assert describe_settings(changed) == describe_settings(base)
        else:
            assert describe_settings(changed)[f.name] != describe_settings(base)[f.name], f.name
    # Equal settings describe equally in another process: no addresses in the text.
    assert "0x" not in repr(describe_settings(base.replace(**{
        k: v for k, v in OTHER_VALUES.items() if k != "progress"})))


def _check_estimate_and_pareto(rank: int) -> None:
    import remat
    from remat.core.errors import RematError
    from remat.execute.sharding import sharded_unit
    from remat.profiler.sharded import IN_FLIGHT

    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt)
    est = remat.estimate(model, batch, optimizer=opt, memory_budget=prof.persistent_bytes)
    frontier = remat.pareto(model, batch, optimizer=opt, points=4, baselines=False)
    # FSDP2's hooks run between the blocks: no chain, so no plan spans blocks (segments).
    assert not prof.is_chain
    # The sharded profile's figures: this rank's shard of the parameters, not all of them.
    assert est.parameters == prof.param_bytes < sum(p.numel() * 4 for p in model.parameters())
    assert est.verdict is not None and est.verdict.status == "does not fit"
    answers: list = [None] * WORLD
    dist.all_gather_object(answers, (str(est), frontier.drop(columns="plan").to_json()))
    assert all(a == answers[0] for a in answers), "the same estimate and frontier on every rank"
    # Each call profiles the sharded step anew, and two profiles of it differ by whole
    # units' gathered parameters (frees on gloo's worker threads, which the predictions
    # cover with IN_FLIGHT units: profiler/sharded.py; CI once saw 30 KB of 12 MB). So
    # the frontier's ends are the estimate's extremes within that envelope, not exactly.
    envelope = IN_FLIGHT * max(sharded_unit(b).gathered_bytes for b in model.blocks)
    peaks = list(frontier["peak_bytes"])
    assert len(peaks) and peaks == sorted(peaks), peaks
    assert abs(peaks[0] - est.lowest_bytes) <= envelope, (peaks, est.lowest_bytes)
    assert abs(peaks[-1] - est.no_checkpoint.bytes) <= envelope, (peaks, est.no_checkpoint)
    # Ranks that would time with other settings run other numbers of steps: refused.
    with pytest.raises(RematError, match=r"rank 1 differs from rank 0 in repeats"):
        remat.profile(model, batch, optimizer=opt, repeats=3 + 2 * rank)


@pytest.mark.slow
def test_estimate_and_pareto_on_the_sharded_model_agree_on_every_rank(free_port: int) -> None:
    _spawn(_check_estimate_and_pareto, free_port)
