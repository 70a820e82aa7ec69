"""``derive``: saved tensors that cheap ops make again from other saved ones are let go.

The step stays the unplanned one bit for bit (loss, gradients, RNG, BatchNorm
statistics), on a stock ``transformers`` GPT-2 block and on a block with every awkward
thing in it (dropout in place and not, an out-of-place Bernoulli, in-place arithmetic,
keyword arguments, a tuple output, BatchNorm); it holds less than ``keep``; a saved
tensor written in place raises autograd's own error; a retained graph backpropagates
twice; other saved-tensor hooks take precedence; and a recipe that does not repeat its
value is caught by the profiler's check.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from remat import apply_plan
from remat.core.plan import Plan
from remat.execute import derive
from remat.execute.derive import DeriveMismatch, forward_deriving
from remat.execute.options import forward_with_option
from remat.measurement.meter import MemoryMeter


class _Block(nn.Module):
    """Dropout in place and not, an out-of-place Bernoulli, in-place arithmetic, a
    BatchNorm, keyword arguments and a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.norm = nn.LayerNorm(64)
        self.bn = nn.BatchNorm1d(64)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
        h = self.fc1(x)
        g = 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * h.pow(3))))
        g = self.drop(self.bn(self.norm(g)))
        gate = torch.bernoulli(torch.full_like(g, 0.7))
        g = (g * gate).mul_(scale)
        g = torch.nn.functional.dropout(g, 0.2, inplace=True) + g.sigmoid()
        return self.fc2(g), g.detach()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, _ = block(x, scale=1.5)
        return self.head(x)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(7)
    loss = model(x).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = [b.clone() for b in model.buffers()]
    return loss.detach(), *grads, *stats, torch.get_rng_state()


def test_derive_gives_the_unplanned_step_bitwise() -> None:
    torch.manual_seed(0)
    base = _Model().train()
    planned = apply_plan(copy.deepcopy(base),
                         Plan.from_options(["blocks.0", "blocks.1", "head"],
                                           {"blocks.0": "derive", "blocks.1": "derive"}))
    x = torch.randn(32, 16, requires_grad=True)
    want = _step(base, x)
    x.grad = None
    got = _step(planned, x)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_an_input_without_grad_and_eval_mode_run_as_without_a_plan() -> None:
    torch.manual_seed(0)
    block = _Block().train()
    x = torch.randn(32, 16)  # no requires_grad: only the parameters need gradients
    torch.manual_seed(3)
    want = block(x, scale=2.0)[0].sum()
    want.backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    got = forward_with_option(block, "derive", block.forward, (x,), {"scale": 2.0})[0].sum()
    got.backward()
    assert torch.equal(want, got)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, block.parameters()))
    block.eval()
    with torch.no_grad():
        torch.manual_seed(4)  # the block draws a gate in eval mode too
        plain = block(x)[0]
        torch.manual_seed(4)
        assert torch.equal(plain, forward_with_option(block, "derive", block.forward,
                                                      (x,), {})[0])


def _gpt2_block() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=128, n_head=4)
    config._attn_implementation = "sdpa"
    return GPT2Block(config).train()


def _held_after_forward(block: nn.Module, x: torch.Tensor, option: str) -> int:
    with MemoryMeter() as meter:
        base = meter.live_bytes
        out = forward_with_option(block, option, block.forward, (x,), {})[0]
        held = meter.live_bytes - base - out.untyped_storage().nbytes()
        out.sum().backward()
    return held


def test_gpt2_block_bitwise_and_holding_less_than_keep() -> None:
    block = _gpt2_block()
    x = torch.randn(2, 64, 128, requires_grad=True)
    results = {}
    for option in ("keep", "derive"):
        torch.manual_seed(1)
        out = forward_with_option(block, option, block.forward, (x,), {})[0]
        out.backward(torch.ones_like(out))
        results[option] = (out.detach(), x.grad.clone(),
                           [p.grad.clone() for p in block.parameters()])
        x.grad = None
        block.zero_grad(set_to_none=True)
    (o1, g1, p1), (o2, g2, p2) = results["keep"], results["derive"]
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    torch.manual_seed(1)
    keep = _held_after_forward(block, x, "keep")
    torch.manual_seed(1)
    held = _held_after_forward(block, x, "derive")
    # Dropout's outputs, the GELU's products and the norms' outputs are let go, the
    # float dropout masks held as bool: well under keep (the tanh and softmax stay).
    assert held < 0.75 * keep, (held, keep)


def test_a_graph_dropped_without_backward_lets_go_of_everything() -> None:
    # The handles hold detached aliases: a saved output that held its node would be a
    # cycle through autograd's graph, alive until the cycle collector ran (an
    # evaluation's forward with grad on, the measured step's next forward).
    block = _gpt2_block()
    x = torch.randn(2, 64, 128, requires_grad=True)
    with MemoryMeter() as meter:
        start = meter.live_bytes
        out = forward_with_option(block, "derive", block.forward, (x,), {})[0]
        assert meter.live_bytes > start
        del out
        assert meter.live_bytes == start


def test_autocasts_cached_weight_casts_stay_held() -> None:
    # The profile counts autocast's cache once per unit for every option; a cast it
    # caches is held as keep holds it.
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        recorder = derive._Recorder(lin)
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, derive._Saved.unpack):
            with recorder:
                lin(x)
        handles = list(recorder.handles)
        recorder.resolve(verify=True, cast_cache=True)
    assert all(h.tensor is not None for h in handles)


def test_a_saved_tensor_written_in_place_raises_autograds_error() -> None:
    lin = nn.Linear(8, 8)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return lin(x).exp()

    x = torch.randn(4, 8, requires_grad=True)
    y = forward_deriving(lin, forward, (x,), {})
    y.add_(1)  # exp saved its output
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_retained_graph_backpropagates_twice() -> None:
    block = _gpt2_block()
    x = torch.randn(2, 32, 128, requires_grad=True)
    torch.manual_seed(1)
    out = forward_with_option(block, "derive", block.forward, (x,), {})[0].square().sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    assert torch.equal(x.grad, 2 * first)


def test_other_saved_tensor_hooks_decide_what_is_saved() -> None:
    block = _gpt2_block()
    x = torch.randn(2, 32, 128, requires_grad=True)
    seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert derive.outer_hooks_active()
        forward_with_option(block, "derive", block.forward, (x,), {})[0].sum().backward()
    assert seen  # the outer hooks got every saved tensor: derive stood aside


def test_a_recipe_that_does_not_repeat_its_value_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    block = _gpt2_block()
    x = torch.randn(2, 32, 128, requires_grad=True)
    real = derive._Recorder.compute

    def off_by_one(self: derive._Recorder, m: derive._Made) -> torch.Tensor:
        return real(self, m) + 1

    monkeypatch.setattr(derive._Recorder, "compute", off_by_one)
    out = forward_with_option(block, "derive", block.forward, (x,), {}, verify=True)[0]
    with pytest.raises(DeriveMismatch, match="cannot use 'derive'"):
        out.sum().backward()


def test_the_profiler_drops_derive_where_a_recipe_does_not_repeat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import remat

    real = derive._Recorder.compute
    monkeypatch.setattr(derive._Recorder, "compute",
                        lambda self, m: real(self, m) + 1)
    torch.manual_seed(0)
    model = _Model().train()
    x = torch.randn(32, 16)
    prof = remat.profile(model, x, loss_fn=lambda out, batch: out.square().mean(),
                         units=["blocks.0", "blocks.1"])
    for unit in prof.units:
        assert "derive" not in unit.options and "selective" in unit.options


def test_under_autocast_the_step_is_bitwise() -> None:
    block = _gpt2_block()
    x = torch.randn(2, 32, 128, requires_grad=True)
    results = []
    for option in ("keep", "derive"):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward_with_option(block, option, block.forward, (x,), {})[0]
        out.float().square().sum().backward()
        results.append((out.detach(), x.grad.clone(),
                        [p.grad.clone() for p in block.parameters()]))
        x.grad = None
        block.zero_grad(set_to_none=True)
    (o1, g1, p1), (o2, g2, p2) = results
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
