"""Per-unit bytes against counts made by hand (float32: 4 bytes an element).

The stack ``Linear, ReLU, Linear, LayerNorm, Linear`` on a (B, D) batch, with

    A  = B*D*4   one activation         W = D*D*4   one weight (and its gradient)
    Db = D*4     one bias / LN weight   S = B*4     LayerNorm's per-row mean or rstd

What autograd saves: Linear (addmm) its input and weight; ReLU its *output*
(``threshold_backward`` reads the result); LayerNorm its input, weight, mean and rstd.
Parameters and the batch are allocated before the measured region and never count.
A ``keep`` replay's backward starts with the output's gradient (A) live: the figures
below are above that. ``checkpoint`` holds the input (and the RNG state) only and
recomputes in backward, stopping as soon as the tensors backward needs exist
(non-reentrant early stop), so a Linear's recomputation never re-runs the matmul.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.measurement.step import measure_step
from remat.profiler import profile
from remat.solver import simulate

B, D = 8, 16
A, W, Db, S = B * D * 4, D * D * 4, D * 4, B * 4
# checkpoint and selective stash the CPU RNG state until backward (a tensor made
# outside the dispatcher, which the meter counts), and fork it around the recompute.
RNG = torch.get_rng_state().untyped_storage().nbytes()


def at_least(value: int, hand_count: int) -> bool:
    """Peaks are the higher of the dispatch-level count and the allocator's view, which
    also sees kernels' scratch buffers (oneDNN's, a LayerNorm backward's): the hand
    count of the tensors is a floor, reached where a kernel has no scratch."""
    return value >= hand_count
KEEP, CKPT, SEL = "keep", "checkpoint", "selective"


UNPLANNED = {}  # the fixture's model's unplanned step, measured


@pytest.fixture(scope="module")
def stack_profile():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D)
    )
    x = torch.randn(B, D)
    target = torch.randn(B, D)

    def loss_fn(out: torch.Tensor, _b: object) -> torch.Tensor:
        return (out * target).sum()

    # (out * target).sum(): mul saves only ``target`` (made outside), sum saves nothing.
    # The hand counts below are of a loop that drops the output once the loss is taken.
    loop = Loop(keep_output=False)
    prof = profile(model, x, loss_fn=loss_fn, repeats=1, warmup=0, loop=loop)
    # The unplanned step profile() predicts (it never runs it): measured here.
    UNPLANNED["step"] = measure_step(model, x, loss_fn=loss_fn, loop=loop, repeats=1)
    return prof


def test_linear_on_the_batch(stack_profile) -> None:
    u = stack_profile.units[0]
    # Its input is the batch: allocated before the step, alive all along, not counted.
    assert (u.input_bytes, u.output_bytes, u.input_grad_bytes) == (0, A, 0)
    assert u.param_grad_bytes == W + Db
    k = u.keep
    assert (k.held_bytes, k.holds_input, k.holds_output) == (0, True, False)
    assert at_least(k.fwd_peak_bytes, A)  # the output
    assert at_least(k.bwd_peak_bytes, W + Db)  # weight and bias gradients; no input gradient


def test_relu_keeps_its_output(stack_profile) -> None:
    u = stack_profile.units[1]
    assert (u.input_bytes, u.output_bytes, u.input_grad_bytes, u.param_grad_bytes) == (
        A, A, A, 0,
    )
    k = u.keep
    assert (k.held_bytes, k.holds_input, k.holds_output) == (0, False, True)
    assert at_least(k.fwd_peak_bytes, A) and at_least(k.bwd_peak_bytes, A)  # output; grad
    c = u.options[CKPT]
    assert (c.held_bytes, c.holds_input, c.holds_output) == (RNG, True, False)
    # the forked RNG state beside the recomputed output; then that output + input gradient
    assert at_least(c.bwd_peak_bytes, max(2 * A, RNG + A))


@pytest.mark.parametrize("i", [2, 4])
def test_linear_keeps_its_input(stack_profile, i: int) -> None:
    u = stack_profile.units[i]
    assert (u.input_bytes, u.output_bytes, u.input_grad_bytes) == (A, A, A)
    assert u.param_grad_bytes == W + Db
    k = u.keep
    assert (k.held_bytes, k.holds_input, k.holds_output) == (0, True, False)
    assert at_least(k.fwd_peak_bytes, A) and at_least(k.bwd_peak_bytes, A + W + Db)
    c = u.options[CKPT]
    assert (c.held_bytes, c.holds_input, c.holds_output) == (RNG, True, False)
    # early stop: nothing of the matmul recomputed (the forked RNG state aside)
    assert at_least(c.bwd_peak_bytes, max(A + W + Db, RNG))
    s = u.options[SEL]
    # selective saves matmul outputs: the addmm result, which is the unit's output.
    assert (s.held_bytes, s.holds_input, s.holds_output) == (RNG, True, True)


def test_layernorm_keeps_input_mean_and_rstd(stack_profile) -> None:
    u = stack_profile.units[3]
    assert u.param_grad_bytes == 2 * Db
    k = u.keep
    assert (k.held_bytes, k.holds_input, k.holds_output) == (2 * S, True, False)
    assert at_least(k.fwd_peak_bytes, A + 2 * S)
    assert at_least(k.bwd_peak_bytes, A + 2 * Db)  # input gradient, weight and bias gradients
    c = u.options[CKPT]
    assert (c.held_bytes, c.holds_input, c.holds_output) == (RNG, True, False)
    assert at_least(c.bwd_peak_bytes, A + 2 * Db + 2 * S)  # plus the recomputed mean and rstd


def test_outside_figures(stack_profile) -> None:
    p = stack_profile
    assert p.is_chain
    assert (p.prefix.held_bytes, p.prefix.fwd_peak_bytes, p.prefix.param_grad_bytes) == (0, 0, 0)
    s = p.suffix
    assert s.held_bytes == 4  # the loss
    assert s.fwd_peak_bytes == A + 4  # out * target, then the loss
    assert s.bwd_peak_bytes == A + 4  # the seed gradient, then grad * target
    assert s.param_grad_bytes == 0
    assert not p.units[-1].output_held_outside
    assert p.param_bytes == 3 * (W + Db) + 2 * Db
    assert p.grad_bytes == p.param_bytes


def test_whole_step_matches_a_hand_count(stack_profile) -> None:
    p = stack_profile
    sim = simulate(p, Plan.keep_all([u.name for u in p.units]))
    # After the forward: ReLU's output (= Linear 2's input), LN's input (Linear 2's
    # output), LN's mean and rstd, Linear 4's input (LN's output), and the loss.
    assert sim.held_after_forward_bytes == 3 * A + 2 * S + 4
    measured = UNPLANNED["step"]
    assert measured.held_after_forward_bytes == sim.held_after_forward_bytes
    # The 4-byte loss and 4-byte seed gradient stay alive through the whole backward.
    assert p.loss_bytes == 8
    assert measured.allocator_peak_bytes == sim.peak_bytes


def test_conv_stack() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    x = torch.randn(2, 3, 8, 8)
    p = profile(model, x, loss_fn=lambda out, _b: out.pow(2).mean(), repeats=1, warmup=0)
    act = 2 * 4 * 8 * 8 * 4  # one (2, 4, 8, 8) activation
    w0, w2, bias = 4 * 3 * 9 * 4, 4 * 4 * 9 * 4, 4 * 4
    c0, relu, c2 = p.units
    # Convolution saves its input and weight: nothing of its own.
    assert (c0.keep.held_bytes, c0.keep.holds_input, c0.keep.holds_output) == (0, True, False)
    assert at_least(c0.keep.fwd_peak_bytes, act) and at_least(c0.keep.bwd_peak_bytes, w0 + bias)
    assert (relu.keep.holds_input, relu.keep.holds_output) == (False, True)
    assert at_least(c2.keep.fwd_peak_bytes, act)
    assert at_least(c2.keep.bwd_peak_bytes, act + w2 + bias)
    assert c2.param_grad_bytes == w2 + bias
    assert c2.options[CKPT].held_bytes == RNG and c2.options[CKPT].holds_input
    assert c2.output_held_outside  # pow saves its input: the suffix holds the last output


def test_tied_weight_gradient_counts_where_it_first_appears() -> None:
    """An embedding (prefix) tied to the output head (suffix): the head's backward runs
    first and allocates the weight-sized gradient, so the suffix is charged for it."""

    class Tied(nn.Module):
        def __init__(self, vocab: int = 32, d: int = 8) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d))
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.emb(idx)))

    model = Tied()
    idx = torch.randint(0, 32, (4, 6))
    # The blocks only: discovery would make the head a unit too (it holds the blocks'
    # output), and this is about the suffix.
    p = profile(model, idx, loss_fn=lambda out, _b: out.logsumexp(-1).mean(), repeats=1,
                warmup=0, units=["blocks.0", "blocks.1"])
    emb_bytes = 32 * 8 * 4
    assert p.suffix.param_grad_bytes == emb_bytes
    assert p.prefix.param_grad_bytes == 0
    assert p.grad_bytes == p.param_bytes
