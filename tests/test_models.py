"""Tests of the reference models in :mod:`remat.models` (tiny sizes only, CPU)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import Tensor, nn

from remat.core.errors import RematError
from remat.models import (
    MODELS,
    SIZES,
    GPTOutput,
    ReferenceModel,
    UnknownModelError,
    build,
    config_for,
    param_count,
)

HF_NAMES = ("hf-gpt2", "hf-bert", "hf-llama")
ALL_NAMES = ("mlp", "cnn", "gpt", *HF_NAMES)


def _tiny(name: str, **kw: object) -> ReferenceModel:
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    return build(name, size="tiny", **kw)


def _tensors(batch: object) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [batch[k] for k in sorted(batch)]
    return list(batch)


def test_registry_names() -> None:
    assert set(MODELS) == set(ALL_NAMES)
    assert SIZES == ("tiny", "small")


@pytest.mark.parametrize("name", ALL_NAMES)
def test_step_gives_finite_loss_and_all_grads(name: str) -> None:
    ref = _tiny(name)
    assert ref.name == name and ref.description
    assert ref.model.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in ref.model.parameters())
    for t in _tensors(ref.batch):
        assert not t.requires_grad
    out = ref.forward()
    loss = ref.loss(out)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for pname, p in ref.model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: no gradient for {pname}"
            assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"


@pytest.mark.parametrize("name", ALL_NAMES)
def test_same_seed_same_weights_and_batch(name: str) -> None:
    a, b, c = _tiny(name, seed=3), _tiny(name, seed=3), _tiny(name, seed=4)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for x, y in zip(_tensors(a.batch), _tensors(b.batch), strict=True):
        assert torch.equal(x, y)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_build_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    build("gpt", size="tiny", seed=123)
    assert torch.equal(state, torch.random.get_rng_state())


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(RematError) as info:
        build("resnet9000")
    assert isinstance(info.value, ValueError)
    for name in ALL_NAMES:
        assert name in str(info.value)


def test_unknown_size_and_override() -> None:
    with pytest.raises(UnknownModelError, match="tiny"):
        build("mlp", size="huge")
    with pytest.raises(UnknownModelError, match="depth"):
        build("mlp", size="tiny", detph=3)


def test_overrides_change_the_config() -> None:
    ref = build("mlp", size="tiny", depth=3, width=8, batch_size=5)
    assert len(ref.model) == 3
    assert ref.batch.shape == (5, 8)
    cfg = config_for("gpt", size="tiny", dropout=0.0, seq_len=8)
    assert cfg.dropout == 0.0 and cfg.seq_len == 8


def test_small_presets_resolve() -> None:
    for name in ALL_NAMES:
        cfg = config_for(name, size="small")
        assert cfg.batch_size > 0


def test_mlp_is_a_sequential_of_linear_gelu_blocks() -> None:
    ref = build("mlp", size="tiny")
    assert isinstance(ref.model, nn.Sequential)
    for block in ref.model.children():
        assert isinstance(block, nn.Sequential)
        assert [type(m) for m in block] == [nn.Linear, nn.GELU]
    assert isinstance(ref.batch, Tensor) and ref.batch.dtype == torch.float32


def test_cnn_structure_and_batch() -> None:
    ref = build("cnn", size="tiny", widths=(4, 8, 16), blocks_per_stage=2)
    assert isinstance(ref.model.blocks, nn.Sequential) and len(ref.model.blocks) == 6
    strided = [b for b in ref.model.blocks if b.downsample is not None]
    assert len(strided) == 2  # the first block of each later stage
    assert set(ref.batch) == {"x", "labels"}
    logits = ref.model(**ref.batch)
    assert logits.shape == (ref.batch["x"].shape[0], 10)


def test_gpt_output_and_tied_head() -> None:
    ref = build("gpt", size="tiny")
    model = ref.model
    assert model.lm_head.weight is model.wte.weight
    out = model(ref.batch["idx"])
    assert isinstance(out, GPTOutput) and out.loss is None
    assert out.logits.shape == (*ref.batch["idx"].shape, model.config.vocab_size)
    assert ref.loss_fn is None and ref.forward().loss is not None
    assert param_count(model) == sum(p.numel() for p in model.parameters())


def test_gpt_blocks_are_called_in_order_as_a_chain() -> None:
    ref = build("gpt", size="tiny", depth=4)
    calls: list[tuple[int, Tensor, Tensor]] = []
    handles = [
        block.register_forward_hook(lambda _m, args, out, i=i: calls.append((i, args[0], out)))
        for i, block in enumerate(ref.model.blocks)
    ]
    try:
        ref.forward()
    finally:
        for h in handles:
            h.remove()
    assert [i for i, _, _ in calls] == [0, 1, 2, 3]
    for (_, _, out), (_, nxt_in, _) in zip(calls, calls[1:]):
        assert nxt_in is out


def test_gpt_dropout_is_on_by_default() -> None:
    assert config_for("gpt").dropout == pytest.approx(0.1)
    ref = build("gpt", size="tiny")
    torch.manual_seed(0)
    a = ref.forward().loss
    torch.manual_seed(1)
    b = ref.forward().loss
    assert not torch.equal(a, b)  # train mode + dropout: different masks


def test_device_override() -> None:
    ref = build("mlp", size="tiny", device="cpu")
    assert ref.batch.device.type == "cpu"
    assert config_for("mlp", device=torch.device("cpu")).device == "cpu"


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_models_without_transformers_raise_a_clear_error(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(RematError, match="pip install transformers"):
        build(name, size="tiny")


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_batches(name: str) -> None:
    ref = _tiny(name)
    assert "input_ids" in ref.batch and "labels" in ref.batch
    out = ref.forward()
    assert out.loss is not None and out.logits.shape[:2] == ref.batch["input_ids"].shape
    if name == "hf-bert":
        assert "attention_mask" in ref.batch
        assert ((ref.batch["labels"] != -100).sum(dim=1) >= 1).all()


# Fingerprints of every built-in model at size tiny, seed 0, computed with the code
# before remat.models became a package (torch 2.13.0, transformers 5.23.0): the
# refactor must not change a single weight or input. (weights, batch): position-weighted
# sums (see _checksum), so that moved or swapped values show too. The Hugging Face ones
# also depend on how transformers initialises its models.
FINGERPRINTS = {
    "mlp": (251.0305756032467, -2315.8992232992314),
    "cnn": (601.3910097630178, -178.63914985908195),
    "gpt": (2556.815903558294, 72094.0),
    "hf-gpt2": (2763.0185873772316, 58040.0),
    "hf-bert": (3534.3991384963742, -5626.0),
    "hf-llama": (2769.7689325620827, 73906.0),
}


def _checksum(t: Tensor) -> float:
    flat = t.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), dtype=torch.float64) % 97 + 1
    return float((flat * weights).sum())


@pytest.mark.parametrize("name", ALL_NAMES)
def test_weights_and_batch_match_the_recorded_fingerprint(name: str) -> None:
    ref = _tiny(name)
    weights = sum(_checksum(v) for _, v in sorted(ref.model.state_dict().items()))
    batch = sum(_checksum(t) for t in _tensors(ref.batch))
    assert (weights, batch) == pytest.approx(FINGERPRINTS[name], rel=1e-9)
