"""No stale profile changes a result (:mod:`remat.tune.profile_cache`).

A change the cache's key sees (an attention kernel chosen in the config's private
attributes, a convolution's stride, torch's kernel flags, a buffer written in place, a
class's patched ``forward``, the profiling settings) measures anew, so the profile, the
estimate and the plan are a fresh call's. A change it cannot see (a global the forward
reads) is caught by ``solve``'s verification, which profiles once more. A profile given
to ``solve`` is read as ``head=`` asks, and a budget lowered by verification never
reaches an error message.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import types
from collections.abc import Callable, Iterator

import loop_models as lm
import pytest
import torch
from torch import nn

import remat
from remat.core.bytesize import format_bytes
from remat.core.errors import InfeasibleBudgetError, ProfileError
from remat.solver import min_peak_bytes
from remat.solver.head_choice import lowest_floor
from remat.solver.resolve import no_checkpoint_peak_bytes
from remat.solver.solve import solve_profile
from remat.tune.profile_cache import forget_profiles
from remat.tune.verify import PREDICTION_TOLERANCE, measure_plan, verified

WIDTH = 32


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.square().mean()


def _fatten(h: torch.Tensor) -> torch.Tensor:
    """``h``'s shape, holding eight times its bytes for backward (sigmoid saves its output)."""
    return torch.cat([h] * 8, -1).sigmoid().unflatten(-1, (8, -1)).sum(-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Flagged(Block):
    """Holds more where its buffer says so."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fat", torch.tensor(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return _fatten(h) if bool(self.fat) else h


GLOBAL = {"fat": False}


class ReadsGlobal(Block):
    """Holds more where a global says so: nothing the cache can key."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return _fatten(h) if GLOBAL["fat"] else h


class Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module], n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[block() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    forget_profiles()
    yield
    forget_profiles()
    GLOBAL["fat"] = False


def _peak(model: nn.Module, batch: object, **kw: object) -> int:
    """The no-checkpoint peak of the profile ``remat.profile`` gives (cached or not)."""
    return no_checkpoint_peak_bytes(remat.profile(model, batch, loss_fn=_loss, repeats=1, **kw))


def _fresh_peak(model: nn.Module, batch: object) -> int:
    forget_profiles()
    return _peak(model, batch)


def _assert_measured_anew(model: nn.Module, batch: object, change: Callable[[], None]) -> None:
    """After ``change``, the profile is a fresh one's, and the change did change it."""
    before = _peak(model, batch)
    change()
    after = _peak(model, batch)
    assert after == _fresh_peak(model, batch) != before


# --------------------------------------------------------------------- what the key sees
def _llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 128))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.transformers
def test_estimate_after_switching_the_attention_kernel_is_a_fresh_ones() -> None:
    model, batch = _llama()
    assert model.config._attn_implementation == "sdpa"
    sdpa = remat.estimate(model, batch)
    model.config._attn_implementation = "eager"  # a private attribute: not in to_json_string()
    budget = sdpa.no_checkpoint.bytes  # fits with sdpa, not with eager's attention weights
    eager = remat.estimate(model, batch, memory_budget=budget)
    forget_profiles()
    fresh = remat.estimate(model, batch, memory_budget=budget)
    assert eager.no_checkpoint.bytes == fresh.no_checkpoint.bytes > sdpa.no_checkpoint.bytes
    assert eager.verdict is not None and fresh.verdict is not None
    assert eager.verdict.status == fresh.verdict.status != "fits"


@pytest.mark.transformers
def test_a_plan_after_switching_the_attention_kernel_measures_as_predicted() -> None:
    model, batch = _llama()
    remat.solve(model, batch, "60%", verify=False)
    model.config._attn_implementation = "eager"
    plan = remat.solve(model, batch, "60%", verify=False)
    measured = measure_plan(model, batch, plan, loss_fn=None, optimizer=None, loop=None)
    predicted = plan.record.predicted_peak_bytes
    assert abs(measured.worst_peak_bytes - predicted) <= PREDICTION_TOLERANCE * predicted


def _convs() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack(lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()))
    return model, torch.randn(2, 8, 32, 32)


def test_a_convolutions_stride_changed_measures_anew() -> None:
    model, x = _convs()

    def stride_two() -> None:
        model.blocks[0][0].stride = (2, 2)  # a tuple attribute

    _assert_measured_anew(model, x, stride_two)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + attended.transpose(1, 2).flatten(2)


@pytest.fixture
def _flash_sdp() -> Iterator[None]:
    before = torch.backends.cuda.flash_sdp_enabled()
    yield
    torch.backends.cuda.enable_flash_sdp(before)


@pytest.fixture
def _mkldnn() -> Iterator[None]:
    before = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = before


@pytest.mark.usefixtures("_flash_sdp")
def test_the_attention_kernel_flags_measure_anew() -> None:
    torch.manual_seed(0)
    model = Stack(Attention)
    # On the CPU too: without the flash kernel, attention holds its weights.
    _assert_measured_anew(model, torch.randn(2, 128, WIDTH),
                          lambda: torch.backends.cuda.enable_flash_sdp(False))


@pytest.mark.usefixtures("_mkldnn")
def test_the_onednn_flag_measures_anew() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch was built without oneDNN")
    model, x = _convs()

    def without_onednn() -> None:
        torch.backends.mkldnn.enabled = False  # the native convolution unfolds its input

    _assert_measured_anew(model, x, without_onednn)


def test_a_buffer_written_in_place_measures_anew_and_verification_keeps_the_profile() -> None:
    torch.manual_seed(0)
    model, x = Stack(Flagged), torch.randn(64, WIDTH)
    profile = remat.profile(model, x, loss_fn=_loss)
    # Verification runs steps and restores the buffers (their counters move): still valid.
    remat.solve(model, x, 10**9, loss_fn=_loss)
    assert remat.profile(model, x, loss_fn=_loss) is profile

    def fatten() -> None:
        model.blocks[1].fat.fill_(True)

    _assert_measured_anew(model, x, fatten)


def test_a_class_forward_patched_measures_anew() -> None:
    class Patched(Block):
        pass

    torch.manual_seed(0)
    model = Stack(Patched)

    def patch() -> None:
        Patched.forward = lambda self, x: _fatten(Block.forward(self, x))  # type: ignore[method-assign]

    _assert_measured_anew(model, torch.randn(64, WIDTH), patch)


@pytest.mark.parametrize("setting", [{"warmup": 2}, {"tolerance": 0.2}, {"pool_twins": False}])
def test_every_profiling_setting_is_in_the_key(setting: dict[str, object]) -> None:
    model, x = Stack(Block), torch.randn(8, WIDTH)
    first = remat.profile(model, x, loss_fn=_loss, repeats=1)
    # The defaults given explicitly are the same settings.
    assert remat.profile(model, x, loss_fn=_loss, repeats=1, warmup=1, tolerance=0.05,
                         pool_twins=True) is first
    assert remat.profile(model, x, loss_fn=_loss, repeats=1, **setting) is not first


# --------------------------------------------------------------------- what it cannot see
def test_verification_drops_a_cached_profile_the_model_has_outgrown(
        caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, x = Stack(ReadsGlobal), torch.randn(64, WIDTH)
    budget = 10**9  # everything fits: only the prediction is wrong
    thin = remat.solve(model, x, budget, loss_fn=_loss)
    GLOBAL["fat"] = True
    with caplog.at_level(logging.WARNING, logger="remat"):
        plan = remat.solve(model, x, budget, loss_fn=_loss)
    assert sum("profiling it again" in r.getMessage() for r in caplog.records) == 1
    predicted = plan.record.predicted_peak_bytes
    assert plan.verification is not None
    assert predicted > thin.record.predicted_peak_bytes
    measured = plan.verification.measured_peak_bytes
    assert abs(measured - predicted) <= PREDICTION_TOLERANCE * predicted
    # The fresh profile is the cached one now: the next solve takes it, and measures it true.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat"):
        again = remat.solve(model, x, budget, loss_fn=_loss)
    assert not any("profiling it again" in r.getMessage() for r in caplog.records)
    assert again.record.predicted_peak_bytes == predicted


def test_a_budget_lowered_below_zero_is_never_the_users() -> None:
    torch.manual_seed(0)
    model, x = Stack(Block), torch.randn(64, WIDTH)
    profile = remat.profile(model, x, loss_fn=_loss, repeats=1)
    budget = no_checkpoint_peak_bytes(profile)
    measured = 3 * budget  # over by twice the budget: the lowered budget goes below zero

    def measure(_plan: remat.Plan) -> types.SimpleNamespace:
        return types.SimpleNamespace(worst_peak_bytes=measured, time_ms=1.0)

    with pytest.raises(InfeasibleBudgetError) as info:
        verified(solve_profile(profile, budget), budget, lambda t: solve_profile(profile, t),
                 measure)
    err = info.value
    assert err.budget_bytes == budget and err.min_feasible_bytes > budget
    text = str(err)
    assert format_bytes(budget) in text and format_bytes(measured) in text
    assert re.search(r"-\s*\d", text) is None, text


# --------------------------------------------------------------------- a profile given
@pytest.fixture(scope="module")
def head_profile() -> remat.Profile:
    case = lm.causal_lm_head_loss(batch=4)
    return remat.profile(case.model, case.batch, loss_fn=case.loss_fn,
                         loop=remat.Loop(keep_output=False), repeats=1)


def test_solving_a_profile_honours_head_none(head_profile: remat.Profile) -> None:
    assert head_profile.head is not None and head_profile.head.as_is
    chunks, lowest = lowest_floor(head_profile)
    assert chunks is not None and lowest < min_peak_bytes(head_profile)
    assert remat.solve(head_profile, lowest).head is not None  # "auto": chunked below
    with pytest.raises(InfeasibleBudgetError):
        remat.solve(head_profile, lowest, head="none")
    assert remat.solve(head_profile, "100%", head="none").head is None
    assert remat.estimate(head_profile, head="none").lowest_bytes == min_peak_bytes(head_profile)


def test_a_head_setting_a_profile_cannot_honour_is_refused(head_profile: remat.Profile) -> None:
    assert head_profile.head is not None
    only_chunked = dataclasses.replace(
        head_profile, head=dataclasses.replace(head_profile.head, as_is=False))
    with pytest.raises(ProfileError, match=r"head='none'.*head='auto'"):
        remat.solve(only_chunked, "100%", head="none")
    headless = dataclasses.replace(head_profile, head=None)
    with pytest.raises(ProfileError, match=r"head='chunked'.*profile with head='chunked'"):
        remat.solve(headless, "100%", head="chunked")


def test_the_worst_ranks_profile_chunks_a_head_only_where_every_rank_checked_it(
        head_profile: remat.Profile) -> None:
    from remat.tune.ranks import worst_profile

    refused = dataclasses.replace(head_profile, head=None, meta={
        **head_profile.meta, "head_not_chunked": "the loss changes with the head chunked"})
    for profiles in ([head_profile, refused], [refused, head_profile]):
        merged = worst_profile(profiles)
        assert merged.head is None
        assert merged.meta["head_not_chunked"].endswith("the loss changes with the head "
                                                        "chunked")
        assert remat.solve(merged, "100%").head is None
    assert worst_profile([head_profile, head_profile]).head == head_profile.head
    assert worst_profile([head_profile, refused]).meta["head_not_chunked"].startswith("rank 1:")
