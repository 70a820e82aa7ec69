"""The output head and its loss as a plan decision (:mod:`remat.execute.head`).

Chunked, the projection and the cross entropy run over slices of the tokens, their
gradients computed in forward: the loss and the gradients are the plain computation's
within float32 rounding (a weight tied to the input embedding too, with one gradient
buffer); a Hugging Face causal LM's own loss is recognised without help, a
model of one's own through ``remat.head_loss``; the solver chooses a chunk count only
where the budget needs it; a device too small for the head as it is is planned on
without running it; and a plan is refused on a model whose head or loss changed.
"""

from __future__ import annotations

import copy
import json
import pickle

import loop_models as lm
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.errors import ArgumentError, LoopError, PlanMismatchError, ProfileError
from remat.execute.head import chunked_cross_entropy
from remat.execute.lazy_logits import LazyLogits
from remat.measurement.simulated_device import SimulatedDevice
from remat.measurement.storage import resident_bytes
from remat.solver import min_peak_bytes
from remat.solver.head_choice import lowest_floor
from remat.solver.resolve import no_checkpoint_peak_bytes
from remat.tune.profile_cache import forget_profiles

DROP = remat.Loop(keep_output=False)
# float32: the chunked sum adds the same terms in another order.
RTOL, ATOL = 1e-5, 1e-6


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


# --------------------------------------------------------------------- numerics
@pytest.mark.parametrize("chunks", [2, 3, 7])
def test_the_chunked_loss_and_gradients_are_the_plain_ones(chunks: int) -> None:
    torch.manual_seed(0)
    head = nn.Linear(32, 500)
    hidden = torch.randn(4, 50, 32, requires_grad=True)
    target = torch.randint(0, 500, (4, 50))
    target[0, :7] = -100  # ignored tokens count neither in the sum nor in the mean
    plain = F.cross_entropy(head(hidden).float().flatten(0, 1), target.flatten())
    plain.backward()
    expected = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None

    loss = chunked_cross_entropy(hidden, head, target, chunks=chunks)
    loss.backward()
    torch.testing.assert_close(loss, plain, rtol=RTOL, atol=ATOL)
    for got, want in zip([hidden.grad, head.weight.grad, head.bias.grad], expected):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


class _TiedLM(nn.Module):
    """An embedding and a head sharing one weight, the loss through head_loss."""

    def __init__(self, vocab: int = 3000, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return remat.head_loss(self.head, torch.tanh(self.mix(self.embed(ids))), target)


def _tied_case() -> tuple[_TiedLM, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _TiedLM()
    ids = torch.randint(0, 3000, (4, 64))
    ids[:, :5] = 0  # the padding row gets no gradient from the embedding
    target = torch.randint(0, 3000, (4, 64))
    target[1, 3:9] = -100
    return model, ids, target


def test_a_head_tied_to_the_embedding_gives_the_plain_gradients_and_holds_one_copy() -> None:
    from remat.execute.head import HeadSite, install_head, remove_head
    from remat.measurement.meter import MemoryMeter

    model, ids, target = _tied_case()
    reference = copy.deepcopy(model)
    expected = reference(ids, target)
    expected.backward()
    site = HeadSite("head", "head_loss")
    install_head(model, site, 4)
    try:
        with MemoryMeter() as meter:
            loss = model(ids, target)
            after_forward = meter.mark("forward")
            loss.backward()
            during_backward = meter.mark("backward")
        copied = pickle.loads(pickle.dumps(model))  # a planned model still pickles
    finally:
        remove_head(model, site)
    assert "forward" not in model.embed.__dict__
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    for got, want in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # The head's weight gradient (made in forward) takes the embedding's rows in place:
    # backward adds less than one more weight's bytes (autograd's way: two more).
    weight_bytes = model.head.weight.numel() * model.head.weight.element_size()
    assert during_backward.peak_bytes - after_forward.live_bytes < weight_bytes
    copied.zero_grad()
    copied(ids, target).backward()
    for got, want in zip(_grads(copied), _grads(reference)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_a_chunked_head_tied_to_the_embedding_compiles_to_one_graph() -> None:
    from remat.execute.head import HeadSite, install_head, remove_head

    model, ids, target = _tied_case()
    reference = copy.deepcopy(model)
    reference(ids, target).backward()
    site = HeadSite("head", "head_loss")
    install_head(model, site, 4)
    try:
        explained = torch._dynamo.explain(model)(ids, target)
        torch._dynamo.reset()
        loss = torch.compile(model, backend="aot_eager")(ids, target)
        loss.backward()
    finally:
        remove_head(model, site)
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    for got, want in zip(_grads(model), _grads(reference)):  # traced: no handoff, same sums
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_a_chunked_loss_backpropagated_twice_is_refused() -> None:
    torch.manual_seed(0)
    head, hidden = nn.Linear(8, 50), torch.randn(40, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, head, torch.randint(0, 50, (40,)), chunks=2)
    loss.backward(retain_graph=True)
    with pytest.raises(LoopError, match="retain_graph.*head='none'"):
        loss.backward()


def test_under_autocast_the_chunked_head_computes_as_the_plain_one() -> None:
    torch.manual_seed(0)
    head = nn.Linear(32, 20000)
    hidden = torch.randn(256, 32, requires_grad=True)
    target = torch.randint(0, 20000, (256,))
    grads = []
    for chunked in (False, True):
        hidden.grad = head.weight.grad = head.bias.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (chunked_cross_entropy(hidden, head, target, chunks=4) if chunked else
                    F.cross_entropy(head(hidden).float(), target))
        loss.backward()
        grads.append((loss.detach(), hidden.grad, head.weight.grad, head.bias.grad))
    (plain, *want), (chunked, *got) = grads
    assert all(g.dtype == torch.float32 for g in got)  # the parameters' and input's dtype
    torch.testing.assert_close(chunked, plain, rtol=1e-2, atol=0)
    for g, w in zip(got, want):  # bfloat16 products: within 1% of the largest entry
        assert (g - w).abs().max() <= 1e-2 * w.abs().max()


def test_head_loss_is_the_plain_loss_until_a_plan_chunks_it() -> None:
    torch.manual_seed(0)
    head, hidden = nn.Linear(16, 100), torch.randn(2, 9, 16)
    target = torch.randint(0, 100, (2, 9))
    assert torch.equal(remat.head_loss(head, hidden, target),
                       F.cross_entropy(head(hidden).flatten(0, 1), target.flatten()))


@pytest.mark.transformers
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_causal_lm_with_a_chunked_head_trains_as_before(family: str) -> None:
    case = _hf(family)
    model, batch = case.model, case.batch
    reference = copy.deepcopy(model)
    plan = _solve_below_the_head(model, batch)
    assert plan.head is not None and plan.head.name == "lm_head"
    remat.apply_plan(model, plan)
    try:
        torch.manual_seed(1)
        out = model(**batch)
        out.loss.backward()
        # No full logits under a chunked head: they are computed only if read.
        assert isinstance(out.logits, LazyLogits) and out.logits._remat_real is None
        with torch.no_grad():
            assert model(**batch).logits is not None  # evaluation is as before
    finally:
        remat.remove_plan(model)
    assert "forward" not in model.__dict__
    torch.manual_seed(1)
    expected = reference(**batch)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=ATOL)
    for got, want in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # Read, they are the model's logits (computed then, outside the plan: said once).
    with pytest.warns(remat.RematWarning, match="whole logits"):
        torch.testing.assert_close(out.logits * 1, expected.logits, rtol=1e-5, atol=1e-6)


def _hf(family: str) -> lm.Case:
    pytest.importorskip("transformers")
    if family == "gpt2":
        return lm.hf_gpt2()
    from remat import models

    ref = models.build("hf-llama", size="tiny", seed=0, depth=3, width=64, heads=4,
                       seq_len=64, batch_size=4, vocab_size=4096)
    return lm.Case(ref.model, ref.batch, ref.loss_fn)


def _solve_below_the_head(model: nn.Module, batch, **kw) -> remat.Plan:
    """A plan at the smallest budget with a chunked head, below what the head as it is
    reaches (so the head must be chunked)."""
    profile = remat.profile(model, batch, loop=DROP, repeats=1, **kw)
    chunks, floor = lowest_floor(profile)
    assert chunks is not None and floor < min_peak_bytes(profile)
    return remat.solve(model, batch, floor, loop=DROP, **kw)


# --------------------------------------------------------------------- the decision
@pytest.fixture(scope="module")
def own_model():
    case = lm.causal_lm_head_loss()
    profile = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=DROP, repeats=1)
    return case, profile


def test_a_model_calling_head_loss_has_its_head_measured(own_model) -> None:
    _, profile = own_model
    assert profile.head is not None and profile.head.name == "head"
    assert profile.head.kind == "head_loss" and profile.head.as_is
    assert profile.head.chunk_counts == (4, 16)  # 504 tokens: 16 or more per chunk
    # Every chunk count lowers the head's peak.
    assert all(v.suffix.bwd_peak_bytes < profile.suffix.bwd_peak_bytes
               for v in profile.head.variants)


def test_a_chunked_head_is_chosen_only_where_the_budget_needs_it(own_model) -> None:
    _, profile = own_model
    base_floor = min_peak_bytes(profile)
    chunks, lowest = lowest_floor(profile)
    assert chunks is not None and lowest < base_floor
    # Where nothing need be recomputed, the head stays as it is; at the floor of the head
    # as it is, chunking it wins only by what it saves in the blocks' recomputation.
    assert remat.solve(profile, no_checkpoint_peak_bytes(profile)).head is None
    at_floor = remat.solve(profile, base_floor)
    as_is = _as_is(profile, base_floor)
    if at_floor.head is not None:
        assert at_floor.record.predicted_time_ms < as_is.record.predicted_time_ms
    else:
        assert at_floor.record.predicted_time_ms == as_is.record.predicted_time_ms
    plan = remat.solve(profile, (lowest + base_floor) // 2)
    assert plan.head is not None
    assert plan.record.predicted_peak_bytes <= (lowest + base_floor) // 2
    # The same decision as solving each variant apart and taking the fastest that fits.
    fastest = min(
        (remat.solve(profile.with_head(c), (lowest + base_floor) // 2)
         for c in profile.head.chunk_counts
         if min_peak_bytes(profile.with_head(c)) <= (lowest + base_floor) // 2),
        key=lambda p: p.record.predicted_time_ms)
    assert plan.record.predicted_time_ms == pytest.approx(fastest.record.predicted_time_ms)
    assert remat.simulate(profile, plan).peak_bytes == plan.record.predicted_peak_bytes


def _as_is(profile: remat.Profile, budget: int) -> remat.Plan:
    from dataclasses import replace

    return remat.solve(replace(profile, head=None), budget)


def test_below_every_head_the_error_names_the_chunked_floor(own_model) -> None:
    _, profile = own_model
    chunks, lowest = lowest_floor(profile)
    with pytest.raises(remat.InfeasibleBudgetError, match=f"over {chunks} chunks") as info:
        remat.solve(profile, lowest - 1)
    assert info.value.min_feasible_bytes == lowest


def test_the_frontier_goes_below_the_head_as_it_is(own_model) -> None:
    _, profile = own_model
    frame = remat.pareto(profile, points=6, baselines=False)
    assert frame["peak_bytes"].min() == lowest_floor(profile)[1]
    assert frame["plan"].str.contains("chunks").any()


def test_the_estimate_names_the_head_and_what_chunking_it_reaches(own_model) -> None:
    _, profile = own_model
    est = remat.estimate(profile)
    assert est.floor.startswith(("the head and the loss", "the recomputation"))
    chunked = {r.name: r for r in est.remedies}["chunked head"]
    assert chunked.peak_bytes == lowest_floor(profile)[1] < est.smallest.bytes
    assert est.lowest_bytes == chunked.peak_bytes
    assert "chunked head: smallest peak" in str(est)


def test_which_loops_measure_a_head(own_model) -> None:
    case, _ = own_model
    kw = {"loss_fn": case.loss_fn, "repeats": 1}
    keeps = remat.profile(case.model, case.batch, loop=remat.Loop(), **kw)
    assert keeps.head is None  # the loop may read the logits
    allowed = remat.profile(case.model, case.batch, loop=remat.Loop(), head="chunked", **kw)
    assert allowed.head is not None
    assert remat.profile(case.model, case.batch, loop=DROP, head="none", **kw).head is None


def test_plans_and_profiles_with_a_head_round_trip(own_model) -> None:
    _, profile = own_model
    again = remat.Profile.from_json(profile.to_json())
    assert again == profile
    plan = remat.solve(profile, lowest_floor(profile)[1])
    assert remat.Plan.from_json(plan.to_json()) == plan
    older = json.loads(profile.to_json())
    older["schema_version"] = 3
    del older["head"]
    assert remat.Profile.from_dict(older).head is None


# --------------------------------------------------------------------- a small device
@pytest.mark.transformers
@pytest.mark.slow
def test_a_device_too_small_for_the_head_as_it_is_is_planned_on() -> None:
    case = lm.hf_gpt2(batch=8)
    model, batch = case.model, case.batch
    profile = remat.profile(copy.deepcopy(model), batch, loop=DROP, repeats=1)
    chunks, lowest = lowest_floor(profile)
    budget = int(lowest * 1.05)
    assert chunks is not None and budget < min_peak_bytes(profile)
    forget_profiles()
    resident = resident_bytes(model, batch=batch, device=torch.device("cpu"))
    with SimulatedDevice(budget, resident_bytes=resident) as device:
        plan = remat.solve(model, batch, budget, loop=DROP)
    assert device.peak_bytes <= 1.01 * budget, (device.peak_bytes, budget)
    assert plan.head is not None
    assert plan.verification is not None and plan.verification.measured_peak_bytes <= budget
    # solve() measured the most frugal variant only (tests/test_head_variants.py): every
    # variant, measured on the same device, says what the head needs there.
    with SimulatedDevice(budget, resident_bytes=resident):
        on_device = remat.profile(model, batch, loop=DROP, repeats=1)
    assert on_device.head is not None and not on_device.head.as_is  # it did not fit there
    assert plan.head.chunks >= on_device.head.required_chunks


# --------------------------------------------------------------------- bad input
def test_a_head_asked_for_where_none_is_recognised_says_what_was_looked_for() -> None:
    case = lm.causal_lm()  # returns logits; the loss is the loop's
    with pytest.raises(ProfileError, match=r"lm_head.*remat\.head_loss") as info:
        remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=DROP,
                      head="chunked", repeats=1)
    assert "head='none'" in str(info.value)
    with pytest.raises(ArgumentError, match="'auto', 'chunked', 'none'"):
        remat.solve(case.model, case.batch, "1GB", head="chunks")


@pytest.mark.transformers
def test_a_plan_with_a_chunked_head_is_refused_where_the_head_changed() -> None:
    case = lm.hf_gpt2()
    plan = _solve_below_the_head(case.model, case.batch)
    assert plan.head is not None
    wider = lm.hf_gpt2()
    wider.model.resize_token_embeddings(4100)
    with pytest.raises(PlanMismatchError, match="another head"):
        remat.apply_plan(wider.model, plan)
    hooked = lm.hf_gpt2()
    hooked.model.lm_head.register_forward_hook(lambda *args: None)
    with pytest.raises(PlanMismatchError, match="forward hooks"):
        remat.apply_plan(hooked.model, plan)
    assert "forward" not in hooked.model.lm_head.__dict__
    without = remat.profile(case.model, case.batch, loop=DROP, head="none", repeats=1)
    with pytest.raises(PlanMismatchError, match="no chunked head"):
        remat.simulate(without, plan)
