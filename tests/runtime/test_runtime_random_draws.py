"""``selective`` replays the forward's dropout masks in backward instead of drawing them.

The masks are kept as ``bool`` (a Bernoulli draw is 0 or 1), copied back in the
recomputation: the step's loss, gradients and RNG state stay bitwise those of the
unplanned model, no Bernoulli op runs in backward, a retained graph's second backward
replays them again, and an ordinary backward lets them go.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from remat import apply_plan
from remat.core.plan import Plan
from remat.execute.options import forward_with_option, selective_policy
from remat.execute.random_draws import DrawReplay, Draws, recording_policy
from remat.measurement import OpCounter


class _Block(nn.Module):
    """Dropout in place and not (``F.dropout`` on CPU: ``bernoulli_``), and an
    out-of-place ``torch.bernoulli``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.fc1(x)))
        gate = torch.bernoulli(torch.full_like(h, 0.7))
        return self.fc2(torch.nn.functional.dropout(h * gate, 0.2, inplace=True) + h)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block(), nn.Linear(16, 4)).train()


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor],
                                                       torch.Tensor]:
    torch.manual_seed(7)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], torch.get_rng_state()


def test_selective_gives_the_unplanned_step_bitwise_and_draws_nothing_in_backward() -> None:
    base = _model()
    planned = apply_plan(copy.deepcopy(base),
                         Plan.from_options(["0", "1", "2"],
                                           {"0": "selective", "1": "selective"}))
    x = torch.randn(8, 16, requires_grad=True)
    want = _step(base, x)
    torch.manual_seed(7)
    loss = planned(x).square().mean()
    with OpCounter() as counter:
        loss.backward()
    got = (loss.detach(), [p.grad.clone() for p in planned.parameters()],
           torch.get_rng_state())
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert torch.equal(got[2], want[2])
    assert counter.ops["aten.bernoulli_"] == 0 and counter.ops["aten.bernoulli"] == 0
    assert counter.ops["aten.mm"] > 0  # the counter saw the backward


def test_a_retained_graph_replays_the_masks_in_its_second_backward() -> None:
    torch.manual_seed(0)
    block = _Block().train()
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(3)
    keep = forward_with_option(block, "keep", block.forward, (x,), {})
    keep.sum().backward()
    want = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    y = forward_with_option(block, "selective", block.forward, (x,), {})
    assert torch.equal(y, keep)
    for _ in range(2):
        block.zero_grad(set_to_none=True)
        y.sum().backward(retain_graph=True)
        assert all(torch.equal(p.grad, w) for p, w in zip(block.parameters(), want))


def _recording(draws: Draws) -> object:
    """The forward's context of a selective region that records into ``draws``."""
    return create_selective_checkpoint_contexts(recording_policy(selective_policy, draws))[0]


@pytest.mark.parametrize("kept", [True, False])
def test_the_masks_are_bool_and_go_after_a_backward_that_does_not_keep_its_graph(
        kept: bool) -> None:
    draws = Draws()
    with _recording(draws):
        drawn = torch.empty(4, 5).bernoulli_(0.5)
        out_of_place = torch.bernoulli(torch.full((3,), 0.5, dtype=torch.float64))
    assert [m.dtype for m in draws.masks] == [torch.bool, torch.bool]
    with DrawReplay(draws, lambda: kept):
        again = torch.empty(4, 5).bernoulli_(0.5)
        again_out = torch.bernoulli(torch.full((3,), 0.5, dtype=torch.float64))
    assert torch.equal(again, drawn)
    assert torch.equal(again_out, out_of_place) and again_out.dtype == torch.float64
    assert len(draws.masks) == (2 if kept else 0)


def test_a_draw_the_forward_did_not_make_is_drawn() -> None:
    draws = Draws()
    with _recording(draws):
        torch.empty(4).bernoulli_(0.5)
    with DrawReplay(draws, lambda: False):
        torch.manual_seed(1)
        other = torch.empty(6).bernoulli_(0.5)  # another shape: the forward took another path
        extra = torch.empty(4).bernoulli_(0.5)  # one more than the forward made
    torch.manual_seed(1)
    assert torch.equal(other, torch.empty(6).bernoulli_(0.5))
    assert extra.shape == (4,)


def test_a_region_that_draws_nothing_runs_its_recomputation_without_the_replay_mode() -> None:
    draws = Draws()
    with _recording(draws):
        torch.ones(3).mul(2)
    replay = DrawReplay(draws, lambda: False)
    with replay:
        assert not torch._C._len_torch_dispatch_stack()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_mask_replays_bitwise_in_every_floating_dtype_and_layout(dtype: torch.dtype) -> None:
    # The mask is cast from the draw (a copy into a new bool tensor) and copied back from its
    # bytes: exact for any 0/1 draw, whatever the dtype and the strides of the target.
    draws = Draws()
    with _recording(draws):
        torch.manual_seed(5)
        drawn = torch.empty(6, 4, dtype=dtype).t().bernoulli_(0.5)  # not contiguous
        out_of_place = torch.bernoulli(torch.full((5,), 0.5, dtype=dtype))
    with DrawReplay(draws, lambda: False):
        again = torch.empty(6, 4, dtype=dtype).t().bernoulli_(0.5)
        again_out = torch.bernoulli(torch.full((5,), 0.5, dtype=dtype))
    assert torch.equal(again, drawn) and again.stride() == drawn.stride()
    assert torch.equal(again_out, out_of_place) and again_out.dtype == dtype
    assert {v.item() for v in drawn.flatten()} == {0.0, 1.0}  # both values were replayed


def test_the_kept_mask_is_counted_by_a_meter_below_the_policy() -> None:
    # A meter under the selective region sees the bool copy allocated (one byte an element):
    # the profiler's figure for ``selective`` includes the masks it keeps.
    from remat.measurement.meter import MemoryMeter

    draws = Draws()
    drawn = torch.empty(1000)
    with MemoryMeter() as meter, _recording(draws):
        drawn.bernoulli_(0.5)
    assert draws.masks[0] is not None and draws.masks[0].dtype == torch.bool
    assert meter.live_bytes == 1000
