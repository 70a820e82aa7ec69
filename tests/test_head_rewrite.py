"""The chunked head on the models people train: the loss as written, or no chunked head.

Stock ``transformers`` (and ``peft``) models built from configs with random weights. A
chunked head is offered only where remat ran the step both ways on one example and found
the same loss and gradients (:mod:`remat.profiler.head_check`); where it is offered, the
planned model trains on the loss as written (an MoE router's auxiliary loss included);
where it is not, the profile says why and the plan keeps the head as written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.solver import min_peak_bytes
from remat.solver.head_choice import lowest_floor
from remat.tune.profile_cache import forget_profiles

transformers = pytest.importorskip("transformers")

DROP = remat.Loop(keep_output=False)
VOCAB, SEQ = 2048, 64


@pytest.fixture(autouse=True)
def _fresh_cache():
    forget_profiles()
    yield
    forget_profiles()


def _ids(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def _mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.5, use_cache=False)
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=48, shared_expert_intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.5, use_cache=False)
    return transformers.Qwen2MoeForCausalLM(config)


def _qwen2() -> nn.Module:
    config = transformers.Qwen2Config(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(config)


def _lora() -> nn.Module:
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_qwen2(), peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                              "v_proj"]))


def _t5() -> nn.Module:
    config = transformers.T5Config(num_layers=3, num_decoder_layers=3, d_model=64, d_ff=128,
                                   num_heads=4, d_kv=16, vocab_size=VOCAB,
                                   decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> nn.Module:
    config = transformers.BartConfig(
        encoder_layers=3, decoder_layers=3, d_model=64, encoder_ffn_dim=128,
        decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4,
        vocab_size=VOCAB, pad_token_id=1, decoder_start_token_id=2, use_cache=False)
    return transformers.BartForConditionalGeneration(config)


class _ZLossLM(transformers.Qwen2ForCausalLM):
    """A causal LM whose forward adds a z-loss on its logits to the model's own loss."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * torch.logsumexp(out.logits.float(), -1).pow(2).mean()
        return out


def _z_loss() -> nn.Module:
    return _ZLossLM(_qwen2().config)


def _build(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make()


def _step(model: nn.Module, batch: dict, loss_fn: Any) -> tuple[torch.Tensor, list]:
    """One training step's loss and gradients (fresh .grad), with dropout seeded."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(**batch)
    loss = loss_fn(out, batch) if loss_fn is not None else out.loss
    del out  # the loop drops the output (Loop(keep_output=False))
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone()
                           for p in model.parameters()]


def _assert_same_step(model: nn.Module, reference: nn.Module, batch: dict, loss_fn: Any,
                      *, exact: bool) -> None:
    loss, grads = _step(model, batch, loss_fn)
    want, expected = _step(reference, batch, loss_fn)
    if exact:
        assert torch.equal(loss, want)
    else:
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for (name, _), got, ref in zip(model.named_parameters(), grads, expected):
        if ref is None:
            assert got is None, name
            continue
        scale = ref.abs().max().clamp_min(1e-6)
        assert (got - ref).abs().max() <= (0 if exact else 1e-4) * scale, name


CHUNKABLE = {
    "mixtral-router-loss": _mixtral,
    "qwen2-moe-router-loss": _qwen2_moe,
    "peft-lora-qwen2": _lora,
    "t5": _t5,
    "bart": _bart,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHUNKABLE))
def test_below_the_head_the_plan_chunks_it_and_trains_on_the_loss_as_written(name: str) -> None:
    make = CHUNKABLE[name]
    model, reference = _build(make), _build(make)
    ids = _ids()
    batch = {"input_ids": ids, "labels": ids}
    profile = remat.profile(model, batch, loop=DROP, repeats=1)
    assert profile.head is not None, profile.meta.get("head_not_chunked")
    chunks, floor = lowest_floor(profile)
    assert chunks is not None and floor < min_peak_bytes(profile)  # only the head gets there
    budget = int(floor * 1.02)
    plan = remat.solve(model, batch, budget, loop=DROP)
    assert plan.head is not None and "head as written" in plan.summary()
    assert plan.verification is not None and plan.verification.measured_peak_bytes <= budget
    remat.apply_plan(model, plan)
    try:
        _assert_same_step(model, reference, batch, None, exact=False)
    finally:
        remat.remove_plan(model)
    if "lora" in name:  # peft's own forward is still the one that runs
        assert "forward" not in model.get_submodule("base_model.model").__dict__


@pytest.mark.slow
def test_an_mixture_of_experts_plan_keeps_the_router_loss() -> None:
    """The reported case: Mixtral's loss with its load-balancing term, and the router's
    gradient, under the plan (before: the term was dropped, 9.31 -> 8.31)."""
    model, reference = _build(_mixtral), _build(_mixtral)
    ids = _ids()
    batch = {"input_ids": ids, "labels": ids}
    plan = remat.solve(model, batch, "40%", loop=DROP, head="chunked")
    assert plan.head is not None
    remat.apply_plan(model, plan)
    try:
        torch.manual_seed(1)
        out = model(**batch)
        assert out.aux_loss is not None and out.aux_loss > 0
        torch.manual_seed(1)
        want = reference(**batch)
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    finally:
        remat.remove_plan(model)


def _reads_logits(out: Any, batch: dict) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                           label_smoothing=0.1)


NOT_CHUNKED = {
    # make, loss_fn, what the refusal says
    "z-loss subclass": (_z_loss, None, "logsumexp"),
    "loss_fn reads out.logits": (_qwen2, _reads_logits, "getitem"),
}


@pytest.mark.parametrize("name", list(NOT_CHUNKED))
def test_where_the_rewrite_would_change_the_loss_the_head_is_not_chunked(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    make, loss_fn, why = NOT_CHUNKED[name]
    model, reference = _build(make), _build(make)
    ids = _ids(2)
    batch = {"input_ids": ids, "labels": ids}
    with caplog.at_level("INFO", logger="remat"):
        profile = remat.profile(model, batch, loop=DROP, loss_fn=loss_fn, repeats=1)
    assert profile.head is None
    assert why in profile.meta["head_not_chunked"]
    assert "is not chunked" in caplog.text
    said = str(remat.estimate(model, batch, loop=DROP, loss_fn=loss_fn))  # the cached profile
    assert "chunked head" in said and why in said
    plan = remat.solve(model, batch, int(min_peak_bytes(profile) * 1.02), loop=DROP,
                       loss_fn=loss_fn)
    assert plan.head is None and plan.options != ("keep",) * plan.n
    remat.apply_plan(model, plan)
    try:
        _assert_same_step(model, reference, batch, loss_fn, exact=True)
    finally:
        remat.remove_plan(model)
    with pytest.raises(remat.RematError, match=why):
        remat.profile(model, batch, loop=DROP, loss_fn=loss_fn, repeats=1, head="chunked")


def test_where_the_budget_allows_the_head_as_written_the_plan_keeps_it_bitwise() -> None:
    """Exact by default: above the head as written's smallest peak no plan chunks it,
    even where a chunked head would be predicted faster, and the step is bitwise the
    model's."""
    model, reference = _build(_qwen2), _build(_qwen2)
    ids = _ids(2)
    batch = {"input_ids": ids, "labels": ids}
    profile = remat.profile(model, batch, loop=DROP, repeats=1)
    assert profile.head is not None
    exact_floor = min_peak_bytes(profile)
    for budget in (exact_floor, (exact_floor + remat.solver.resolve.no_checkpoint_peak_bytes(
            profile)) // 2):
        assert remat.solve(profile, budget).head is None
    fastest = [remat.solve(profile, budget, head="chunked") for budget in (exact_floor,)]
    assert all(p.record.predicted_peak_bytes <= exact_floor for p in fastest)
    plan = remat.solve(model, batch, exact_floor, loop=DROP)
    assert plan.head is None
    remat.apply_plan(model, plan)
    try:
        _assert_same_step(model, reference, batch, None, exact=True)
    finally:
        remat.remove_plan(model)
