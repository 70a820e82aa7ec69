"""apply_plan / remove_plan / planned: bitwise equality with an unplanned model.

Pattern: copy the model, apply the plan to one copy, run one step from the same RNG
state on both, and compare loss, every gradient and every buffer bitwise
(CPU float32). Recomputation is observed through forward pre-hooks on the units'
first children, which fire again when a unit is recomputed.
"""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any

import pytest
import rt_helpers as h
import torch
from torch import nn

from remat.core.errors import PlanMismatchError, RematError
from remat.core.plan import Plan, PlanTarget
from remat.execute.planned import STATE_ATTR
from remat.runtime import apply_plan, planned, remove_plan

MODELS = ["mlp", "cnn", "gpt", "hf-gpt2", "hf-bert"]
PLANS = ["checkpoint", "selective", "mixed", "chain"]


Segments = tuple[tuple[int, int], ...]


def _plan_options(kind: str, names: list[str]) -> tuple[dict[str, str], Segments]:
    """Options and segments of a plan kind, for units ``names``."""
    n = len(names)
    if kind in ("checkpoint", "selective"):
        return dict.fromkeys(names, kind), ()
    if kind == "chain":
        return dict.fromkeys(names, "checkpoint"), ((0, n - 1),)
    # mixed: keep, a 2-unit segment, then checkpoint / selective / keep in turn.
    rest = ["checkpoint", "selective", "keep"]
    options = {names[0]: "keep", names[1]: "checkpoint", names[2]: "checkpoint"}
    options.update({name: rest[i % 3] for i, name in enumerate(names[3:])})
    return options, ((1, 2),)


def _no_hooks_left() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# --------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("kind", PLANS)
@pytest.mark.parametrize("name", MODELS)
def test_plan_matches_unplanned_bitwise(name: str, kind: str) -> None:
    ref = h.build_model(name)
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names(name, model)
    options, segments = _plan_options(kind, names)
    plan = h.make_plan(model, names, options, segments)

    assert apply_plan(model, plan) is model
    counters = h.count_first_children(model, names)
    loss = h.train_step(ref, model)
    ref_loss = h.train_step(ref, reference)

    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)
    # Kept units run once; every other unit is run again in backward.
    expected = [1 if plan.options[i] == "keep" else 2 for i in range(len(names))]
    assert [c.calls for c in counters] == expected
    assert _no_hooks_left()


def test_segment_holds_only_its_first_input() -> None:
    """Count tensors saved outside checkpoint regions: one per region's input."""
    ref = h.build_model("mlp")
    names = h.unit_names("mlp", ref.model)
    n = len(names)

    def saved_outside(plan: Plan) -> int:
        model = h.twin(ref.model)
        apply_plan(model, plan)
        packed = []
        # Checkpoint regions push their own hooks, so this outer pair only sees what
        # is saved outside them: the regions' inputs and the loss.
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
            h.train_step(ref, model)
        return len(packed)

    per_unit = saved_outside(Plan.checkpoint_all(names))
    chain = saved_outside(Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                                            segments=[(0, n - 1)]))
    two = saved_outside(Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                                          segments=[(0, 1), (3, 5)]))
    keep = saved_outside(Plan.keep_all(names))
    assert per_unit - chain == n - 1  # n regions vs one
    assert per_unit - two == 3  # (0,1) and (3,5) replace 5 regions by 2
    assert keep > per_unit


def test_segment_memory_measured() -> None:
    """Bytes held after the forward (memory meter): a segment holds only its input."""
    from remat.measurement.meter import MemoryMeter

    ref = h.build_model("mlp")
    names = h.unit_names("mlp", ref.model)
    n = len(names)
    act = ref.batch.numel() * ref.batch.element_size()  # every activation has this size

    def held(plan: Plan) -> int:
        model = h.twin(ref.model)
        apply_plan(model, plan)
        with MemoryMeter() as meter:
            loss = ref.loss_fn(model(ref.batch), ref.batch)
            live = meter.live_bytes
        loss.backward()
        return live

    all_ckpt = dict.fromkeys(names, "checkpoint")
    per_unit = held(Plan.checkpoint_all(names))
    # Unit 0's input is the batch, allocated before the meter: n - 1 inputs differ. Each
    # checkpoint region also stashes the RNG state, once per segment.
    rng = torch.get_rng_state().untyped_storage().nbytes()
    assert per_unit - held(Plan.from_options(names, all_ckpt, segments=[(0, n - 1)])) == (
        (n - 1) * (act + rng)
    )
    assert per_unit - held(Plan.from_options(names, all_ckpt, segments=[(0, 1), (3, 5)])) == (
        3 * (act + rng)
    )


# --------------------------------------------------------------------------- call styles
@pytest.mark.parametrize("output", ["tensor", "tuple", "dict", "dataclass"])
@pytest.mark.parametrize("segments", [((0, 1),), ((0, 3),), ((1, 2),)])
def test_kwargs_and_structured_outputs(output: str, segments: tuple[tuple[int, int], ...]) -> None:
    model = h.LoopModel(output=output)
    reference = h.twin(model)
    names = [f"blocks.{i}" for i in range(4)]
    options = dict.fromkeys(names, "checkpoint")
    options["blocks.3"] = "selective" if segments[0][1] < 3 else "checkpoint"
    apply_plan(model, h.make_plan(model, names, options, segments))
    x, scale = h.loop_batch()
    scale.requires_grad_(True)  # a keyword-side input that needs its gradient too
    ref_scale = scale.detach().clone().requires_grad_(True)

    loss = h.loop_step(model, x, scale)
    ref_loss = h.loop_step(reference, x, ref_scale)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)
    torch.testing.assert_close(scale.grad, ref_scale.grad, rtol=0, atol=0)


@pytest.mark.parametrize("segments", [((0, 3),), ((1, 2),)])
def test_chained_tensor_passed_by_keyword(segments: tuple[tuple[int, int], ...]) -> None:
    model = h.LoopModel(glue="keywords")
    reference = h.twin(model)
    names = [f"blocks.{i}" for i in range(4)]
    apply_plan(model, Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                                        segments=segments))
    x, scale = h.loop_batch()
    scale.requires_grad_(True)
    ref_scale = scale.detach().clone().requires_grad_(True)
    torch.testing.assert_close(h.loop_step(model, x, scale),
                               h.loop_step(reference, x, ref_scale), rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)
    torch.testing.assert_close(scale.grad, ref_scale.grad, rtol=0, atol=0)


class _DenseLayer(nn.Module):
    """torchvision's DenseNet layer: takes the list of every earlier feature map; it
    also records its output in a list its caller passes (a collector)."""

    def __init__(self, channels: int, growth: int = 4) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, growth, 3, padding=1)

    def forward(self, features: list[torch.Tensor], seen: dict[str, list]) -> torch.Tensor:
        out = self.conv(torch.relu(self.norm(torch.cat(features, 1))))
        seen["calls"].append(out.shape[1])
        return out


class _DenseBlock(nn.Module):
    def __init__(self, layers: int = 4, channels: int = 4, growth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DenseLayer(channels + i * growth, growth)
                                    for i in range(layers))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        features, seen = [x], {"calls": []}
        for layer in self.layers:
            features.append(layer(features, seen))  # the list grows after each call
        return torch.cat(features, 1), len(seen["calls"])


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_containers_the_caller_changes_after_the_call(option: str) -> None:
    """Recomputation sees each list as it was at the call (it grew since); what the unit
    does to its caller's containers in the forward is seen by the caller."""
    torch.manual_seed(0)
    model = _DenseBlock().train()
    reference = h.twin(model)
    names = [f"layers.{i}" for i in range(4)]
    apply_plan(model, h.make_plan(model, names, dict.fromkeys(names, option)))
    x = torch.randn(2, 4, 8, 8)
    (out, calls), (ref_out, ref_calls) = model(x), reference(x)
    assert calls == ref_calls == 4
    out.square().mean().backward()
    ref_out.square().mean().backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)


def test_random_numbers_drawn_between_segment_units() -> None:
    """LayerDrop-style draws between units must not shift dropout masks in replay."""
    model = h.LoopModel(glue="rand")
    reference = h.twin(model)
    names = [f"blocks.{i}" for i in range(4)]
    apply_plan(model, Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                                        segments=[(0, 3)]))
    x, scale = h.loop_batch()
    torch.testing.assert_close(h.loop_step(model, x, scale), h.loop_step(reference, x, scale),
                               rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)


class Adapted(nn.Module):
    """A frozen linear layer plus a trainable low-rank adapter."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("segments", [((0, 1),), ((0, 3),)])
def test_frozen_base_with_adapters_and_frozen_embeddings(
    segments: tuple[tuple[int, int], ...],
) -> None:
    """Units whose input does not require grad (frozen embeddings, frozen base)."""
    ref = h.build_model("gpt")
    model = ref.model
    model.requires_grad_(False)
    for block in model.blocks:
        block.mlp[0] = Adapted(block.mlp[0])
    reference = h.twin(model)
    names = h.unit_names("gpt", model)
    options = dict.fromkeys(names, "checkpoint")
    options[names[-1]] = "selective" if segments[0][1] < 3 else "checkpoint"
    apply_plan(model, h.make_plan(model, names, options, segments))

    loss = h.train_step(ref, model)
    torch.testing.assert_close(loss, h.train_step(ref, reference), rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)
    assert model.wte.weight.grad is None
    assert all(b.mlp[0].down.weight.grad is not None for b in model.blocks)


# --------------------------------------------------------------------------- free modes
def _gpt_with_segments() -> tuple[Any, nn.Module, list[str], Plan]:
    ref = h.build_model("gpt")
    names = h.unit_names("gpt", ref.model)
    plan = h.make_plan(ref.model, names,
                       {names[0]: "checkpoint", names[1]: "checkpoint",
                        names[2]: "selective", names[3]: "checkpoint"}, ((0, 1),))
    return ref, h.twin(ref.model), names, plan


def test_no_grad_is_plain_forward() -> None:
    ref, reference, names, plan = _gpt_with_segments()
    model = ref.model
    apply_plan(model, plan)
    counters = h.count_first_children(model, names)
    with torch.no_grad():
        torch.manual_seed(0)
        out = h.run_forward(ref, model)
        torch.manual_seed(0)
        expected = h.run_forward(ref, reference)
    torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=0)
    assert [c.calls for c in counters] == [1] * len(names)
    assert not model.__dict__[STATE_ATTR].runner.is_open
    assert _no_hooks_left()


def test_eval_mode_is_plain_forward_and_backward_recomputes_nothing() -> None:
    ref, reference, names, plan = _gpt_with_segments()
    model = ref.model
    apply_plan(model, plan)
    model.eval()
    reference.eval()
    counters = h.count_first_children(model, names)
    loss = h.train_step(ref, model)  # grad enabled, eval mode
    torch.testing.assert_close(loss, h.train_step(ref, reference), rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)
    assert [c.calls for c in counters] == [1] * len(names)


def test_cpu_bfloat16_autocast() -> None:
    ref, reference, names, plan = _gpt_with_segments()
    model = ref.model
    apply_plan(model, plan)
    counters = h.count_first_children(model, names)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        loss = model(**ref.batch).loss
        torch.manual_seed(0)
        ref_loss = reference(**ref.batch).loss
    loss.backward()
    ref_loss.backward()
    assert [c.calls for c in counters] == [2] * len(names)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-3, msg=n)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_two_optimizer_steps(name: str) -> None:
    ref = h.build_model(name)
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names(name, model)
    options = dict.fromkeys(names, "checkpoint")
    options[names[-1]] = "selective"
    segments = ((0, 1), (2, len(names) - 2)) if len(names) >= 5 else ((0, 1),)
    apply_plan(model, h.make_plan(model, names, options, segments))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for step in range(2):
        for m, opt in zip((model, reference), opts):
            opt.zero_grad()
            h.train_step(ref, m, seed=step)
            opt.step()
        h.assert_bitwise_same(model, reference)


# --------------------------------------------------------------------------- remove / replace
def test_remove_plan_restores_the_model_exactly() -> None:
    ref = h.build_model("gpt")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("gpt", model)
    before = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    hooks_before = dict(model._forward_hooks)
    apply_plan(model, Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                                        segments=[(0, 3)]))
    h.train_step(ref, model)  # run it planned once
    model.zero_grad(set_to_none=True)
    assert remove_plan(model) is model

    assert planned(model) is None
    assert STATE_ATTR not in model.__dict__
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == before
    assert dict(model._forward_hooks) == hooks_before
    counters = h.count_first_children(model, names)
    loss = h.train_step(ref, model, seed=3)
    torch.testing.assert_close(loss, h.train_step(ref, reference, seed=3), rtol=0, atol=0)
    h.assert_bitwise_same(model, reference)
    assert [c.calls for c in counters] == [1] * len(names)
    assert remove_plan(model) is model  # a no-op now


def test_remove_plan_on_unplanned_model_is_a_noop() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    assert remove_plan(model) is model
    assert planned(model) is None


def test_second_plan_replaces_the_first() -> None:
    ref = h.build_model("mlp")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("mlp", model)
    first = Plan.from_options(names, dict.fromkeys(names, "checkpoint"), segments=[(0, 5)])
    second = Plan.from_options(names, {names[0]: "checkpoint"})
    apply_plan(model, first)
    apply_plan(model, second)
    assert planned(model) == second
    wrapper = model[0].__dict__["forward"]
    assert model.__dict__[STATE_ATTR].saved_forwards == [None] * len(names)  # not stacked
    assert wrapper._remat_state.plan == second
    assert not model._forward_hooks  # the first plan's segment guard is gone
    counters = h.count_first_children(model, names)
    h.train_step(ref, model)
    h.train_step(ref, reference)
    h.assert_bitwise_same(model, reference)
    assert [c.calls for c in counters] == [2] + [1] * (len(names) - 1)
    remove_plan(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


# --------------------------------------------------------------------------- mismatches
def _untouched(model: nn.Module) -> bool:
    return STATE_ATTR not in model.__dict__ and all(
        "forward" not in m.__dict__ for m in model.modules()
    )


def test_missing_units_are_named() -> None:
    model = h.LoopModel()
    plan = Plan.checkpoint_all(["blocks.0", "blocks.7", "block.1"])
    with pytest.raises(PlanMismatchError) as info:
        apply_plan(model, plan)
    text = str(info.value)
    assert "'blocks.7'" in text and "'block.1'" in text and "'blocks.0'" not in text.split(":")[1]
    assert "remat.solve" in text and "did you mean 'blocks.1'" in text
    assert _untouched(model)


def test_wrong_unit_types_are_named() -> None:
    model = h.LoopModel()
    plan = Plan.checkpoint_all(["blocks.0", "blocks.1"],
                               target=PlanTarget(unit_types=("Block", "GPT2Block")))
    with pytest.raises(PlanMismatchError, match=r"'blocks.1' is a Block in the model but a "
                                                r"GPT2Block in the plan"):
        apply_plan(model, plan)
    assert _untouched(model)


def test_wrong_device_is_named() -> None:
    model = h.LoopModel()
    plan = Plan.checkpoint_all(["blocks.0"], target=PlanTarget(device="cuda"))
    with pytest.raises(PlanMismatchError, match=r"device 'cuda' but the model is on \['cpu'\]"):
        apply_plan(model, plan)
    assert _untouched(model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_offload_without_cuda_is_refused() -> None:
    model = h.LoopModel()
    with pytest.raises(PlanMismatchError, match="'offload' needs CUDA"):
        apply_plan(model, Plan.from_options(["blocks.0"], {"blocks.0": "offload"}))
    assert _untouched(model)


def test_nested_and_shared_units_are_refused() -> None:
    model = h.LoopModel()
    with pytest.raises(PlanMismatchError, match="lies inside unit 'blocks.0'"):
        apply_plan(model, Plan.checkpoint_all(["blocks.0", "blocks.0.lin"]))
    model.blocks[1] = model.blocks[0]
    with pytest.raises(PlanMismatchError, match="same module"):
        apply_plan(model, Plan.checkpoint_all(["blocks.0", "blocks.1"]))
    assert _untouched(model)


def test_failed_apply_keeps_the_previous_plan() -> None:
    model = h.LoopModel()
    good = Plan.checkpoint_all(["blocks.0", "blocks.1"])
    apply_plan(model, good)
    with pytest.raises(PlanMismatchError):
        apply_plan(model, Plan.checkpoint_all(["blocks.9"]))
    assert planned(model) == good
    assert isinstance(model.blocks[0].__dict__["forward"], type(model.blocks[1].forward))


# --------------------------------------------------------------------------- segment errors
def _segment_plan(depth: int = 4) -> Plan:
    names = [f"blocks.{i}" for i in range(depth)]
    return Plan.from_options(names, dict.fromkeys(names, "checkpoint"), segments=[(0, depth - 1)])


def test_segment_on_units_that_are_not_a_chain() -> None:
    model = h.LoopModel(glue="double")
    apply_plan(model, _segment_plan())
    x, scale = h.loop_batch()
    with pytest.raises(RematError, match="'blocks.0' and 'blocks.1' of segment 0-3 are not a "
                                         "chain: no argument of 'blocks.1' is the output"):
        model(x, scale)
    assert _no_hooks_left()
    # Per-unit checkpointing is fine for such a model.
    reference = h.twin(model)
    remove_plan(reference)
    apply_plan(model, Plan.checkpoint_all([f"blocks.{i}" for i in range(4)]))
    h.loop_step(model, x, scale)
    h.loop_step(reference, x, scale)
    h.assert_bitwise_same(model, reference)


def test_segment_with_saves_between_units() -> None:
    model = h.LoopModel(glue="save")
    apply_plan(model, _segment_plan())
    with pytest.raises(RematError, match="after unit 'blocks.0' of segment 0-3 saved a tensor"):
        model(*h.loop_batch())
    assert _no_hooks_left()


@pytest.mark.parametrize("where", ["unit", "loop"])
def test_errors_inside_a_segment_leave_nothing_behind(where: str) -> None:
    model = h.LoopModel(glue="raise" if where == "loop" else "none")
    reference = h.twin(model)
    apply_plan(model, _segment_plan())
    x, scale = h.loop_batch()
    model.blocks[2].fail = where == "unit"
    with pytest.raises(ValueError if where == "unit" else KeyError):
        model(x, scale)
    assert _no_hooks_left()
    assert not model.__dict__[STATE_ATTR].runner.is_open
    # The model trains normally afterwards.
    model.blocks[2].fail = False
    model.glue = reference.glue = "none"
    h.loop_step(model, x, scale)
    h.loop_step(reference, x, scale)
    h.assert_bitwise_same(model, reference)


def test_segment_left_open_when_the_model_skips_its_last_unit() -> None:
    """The model's loop stops early: the forward errors clearly and leaks no hooks."""

    class Skipping(h.LoopModel):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            for block in self.blocks[:2]:
                x = block(x, scale)
            return x.sum()  # saves nothing: the open segment is closed by the guard

    model = Skipping()
    reference = h.twin(model)
    apply_plan(model, _segment_plan())
    x, scale = h.loop_batch()
    h.loop_step(model, x, scale)
    h.loop_step(reference, x, scale)
    h.assert_bitwise_same(model, reference)
    assert _no_hooks_left()


# --------------------------------------------------------------------------- module plumbing
def test_planned_model_keeps_its_identity() -> None:
    """Hooks, signatures, state_dict, module tree, pickling and deepcopy are unaffected."""
    ref = h.build_model("gpt")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("gpt", model)
    signature = inspect.signature(model.blocks[0].forward)
    plan = h.make_plan(model, names, dict.fromkeys(names, "checkpoint"), ((1, 3),))
    apply_plan(model, plan)

    assert model.state_dict().keys() == reference.state_dict().keys()
    assert [n for n, _ in model.named_modules()] == [n for n, _ in reference.named_modules()]
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    assert inspect.signature(model.blocks[0].forward) == signature
    assert planned(model) == plan

    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert planned(clone) == plan
        wrapper = clone.blocks[0].__dict__["forward"]
        assert wrapper._remat_state is clone.__dict__[STATE_ATTR]
        assert wrapper._remat_state.modules[0] is clone.blocks[0]
        fresh = h.twin(reference)
        clone.zero_grad(set_to_none=True)
        h.train_step(ref, clone, seed=5)
        h.train_step(ref, fresh, seed=5)
        h.assert_bitwise_same(clone, fresh)

    calls: list[str] = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    model.blocks[1].register_forward_hook(lambda m, a, o: calls.append("post"))
    h.train_step(ref, model)
    assert calls == ["pre", "post"]  # hooks run once: not again in recomputation


def test_apply_through_wrappers_and_type_errors() -> None:
    model = h.LoopModel()
    compiled_like = torch.compile(model)  # compiling is lazy: nothing runs here
    apply_plan(compiled_like, Plan.checkpoint_all(["blocks.0"]))
    assert planned(model) is not None and planned(compiled_like) == planned(model)
    remove_plan(compiled_like)
    assert planned(model) is None
    with pytest.raises(TypeError):
        apply_plan(model, {"blocks.0": "checkpoint"})  # type: ignore[arg-type]
    with pytest.raises(RematError, match="DataParallel"):
        apply_plan(nn.DataParallel(model), Plan.checkpoint_all(["blocks.0"]))


@pytest.mark.parametrize("segments", [(), ((0, 2),)])
def test_hf_kv_cache_is_not_written_twice(segments: tuple[tuple[int, int], ...]) -> None:
    """Recomputed layers run without the KV cache in training; inference keeps it."""
    ref = h.build_model("hf-gpt2")
    model = ref.model
    names = h.unit_names("hf-gpt2", model)
    apply_plan(model, Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                                        segments=segments))
    seq = ref.batch["input_ids"].shape[1]
    out = model(**ref.batch)
    out.loss.backward()  # recomputes every block
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ref.batch["input_ids"], use_cache=True)
    assert out.past_key_values.get_seq_length() == seq
