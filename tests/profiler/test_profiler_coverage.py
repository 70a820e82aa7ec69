"""Issue 13: default discovery plans the whole model, reports its coverage, links stages
into one chain, and options that cannot run on a unit are dropped, not raised.

The models (``tests/zoo.py``) mirror common layouts at tiny sizes: ResNet-50/18 stages,
ConvNeXt (a downsample between stages), Hugging Face T5, EfficientNet (squeeze-excite,
an in-place activation after a convolution), a U-Net (skips) and a ViT.
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.errors import NoUnitsError, ProfileError
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.execute.options import forward_with_option
from remat.measurement.runner import call_model, compute_loss
from remat.profiler import check_chain, find_units, profile
from remat.runtime import apply_plan
from remat.solver import min_peak_bytes, min_peak_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo  # noqa: E402  (tests/zoo.py: the models)

MODELS = ["resnet50", "resnet18", "convnext", "t5", "efficientnet", "unet", "vit"]
FAST = {"repeats": 1, "warmup": 0, "progress": False}


def _marks(name: str) -> list[Any]:
    return [pytest.mark.transformers] if name == "t5" else []


def _params(names: list[str]) -> list[Any]:
    return [pytest.param(n, marks=_marks(n)) for n in names]


# ------------------------------------------------------------------ discovery, coverage
EXPECTED_BLOCKS = {  # what discovery must include: every stage, encoder and decoder
    "resnet50": [f"layer{k}.{i}" for k, n in zip(range(1, 5), [3, 4, 6, 3]) for i in range(n)],
    "resnet18": [f"layer{k}.{i}" for k in range(1, 5) for i in range(2)],
    "convnext": [f"features.{s}.{i}" for s, n in zip([1, 3, 5, 7], [3, 3, 9, 3])
                 for i in range(n)],
    "t5": [f"{part}.block.{i}" for part in ("encoder", "decoder") for i in range(3)],
    "efficientnet": [f"features.{s}.{i}" for s, n in zip(range(1, 6), [1, 2, 2, 3, 1])
                     for i in range(n)],
    "unet": [f"downs.{i}" for i in range(3)] + [f"ups.{i}" for i in range(3)],
    "vit": [f"blocks.{i}" for i in range(6)],
}


@pytest.mark.parametrize("name", _params(MODELS))
def test_discovery_covers_the_whole_model(name: str) -> None:
    z = zoo.build(name)
    choice = find_units(z.model, z.batch, loss_fn=z.loss_fn)
    assert set(EXPECTED_BLOCKS[name]) <= set(choice.names)
    assert choice.coverage.fraction >= 0.9
    # The longest list alone covered far less (the ViT's one list is the whole trunk).
    before = find_units(z.model, z.batch, loss_fn=z.loss_fn, units=z.longest_list)
    assert before.coverage.fraction < (0.98 if name == "vit" else 0.4)


def test_convnext_downsample_layers_link_the_stages_into_one_chain() -> None:
    z = zoo.build("convnext")
    choice = find_units(z.model, z.batch, loss_fn=z.loss_fn)
    assert {"features.2", "features.4", "features.6"} <= set(choice.names)
    assert choice.discovery is not None and choice.discovery.joined["features.2"] == "chain"
    assert check_chain(z.model, z.batch, loss_fn=z.loss_fn).is_chain
    # The blocks alone are not a chain: a downsample layer runs between the stages.
    blocks = EXPECTED_BLOCKS["convnext"]
    assert not check_chain(z.model, z.batch, units=blocks).is_chain


def test_stem_joins_a_chain_when_the_blocks_miss_it() -> None:
    z = zoo.build("resnet18")
    choice = find_units(z.model, z.batch, loss_fn=z.loss_fn)
    assert choice.names[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert choice.discovery is not None and choice.discovery.is_chain


def test_blocks_kept_as_attributes_are_found_by_their_repeated_class() -> None:
    class Down(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv = nn.Conv2d(c, 2 * c, 3, padding=1)
            self.pool = nn.MaxPool2d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pool(torch.relu(self.conv(x)))

    class Attributes(nn.Module):  # no ModuleList / Sequential anywhere
        def __init__(self) -> None:
            super().__init__()
            self.down1, self.down2, self.down3 = Down(3), Down(6), Down(12)
            self.head = nn.Linear(24, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.down3(self.down2(self.down1(x)))
            return self.head(x.mean((2, 3)))

    choice = find_units(Attributes(), torch.randn(2, 3, 16, 16), loss_fn=lambda o, b: o.sum())
    assert choice.names == ["down1", "down2", "down3"]
    assert choice.coverage.fraction >= 0.9


def test_no_block_at_all_still_asks_for_units() -> None:
    class Plain(nn.Module):  # two Linear layers: nothing repeated to plan
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    with pytest.raises(NoUnitsError, match="units="):
        find_units(Plain(), torch.randn(2, 4), loss_fn=lambda o, b: o.sum())


# ------------------------------------------------------------------ profiles, gradients
def _grads(model: nn.Module, z: zoo.ZooModel) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    compute_loss(call_model(model, z.batch), z.batch, z.loss_fn).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _segment_plan(p: Profile) -> Plan:
    """Checkpoint every unit that offers it; on a chain, one segment per run of them."""
    options = ["checkpoint" if "checkpoint" in u.options else "keep" for u in p.units]
    segments = []
    if p.is_chain:
        start = None
        for i, o in enumerate([*options, "keep"]):
            if o == "checkpoint" and start is None:
                start = i
            elif o != "checkpoint" and start is not None:
                if i - 1 > start:
                    segments.append((start, i - 1))
                start = None
    return Plan([u.name for u in p.units], options, segments)


@pytest.mark.parametrize("name", _params(MODELS))
def test_whole_model_plans_lower_the_smallest_peak_and_keep_gradients(name: str) -> None:
    z = zoo.build(name)
    after = profile(z.model, z.batch, loss_fn=z.loss_fn, **FAST)
    before = profile(z.model, z.batch, loss_fn=z.loss_fn, units=z.longest_list, **FAST)
    assert after.coverage is not None and after.coverage >= 0.9
    if name == "vit":  # its longest list is already the whole trunk
        assert min_peak_bytes(after) <= min_peak_bytes(before)
    else:
        assert min_peak_bytes(after) < min_peak_bytes(before)
    expected_chain = name != "t5"  # an encoder-decoder is two chains, not one
    assert after.is_chain == expected_chain
    reference = copy.deepcopy(z.model)
    expected = _grads(reference, z)
    for plan in (min_peak_plan(after), _segment_plan(after)):
        apply_plan(z.model, plan)
        got = _grads(z.model, z)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), plan.summary()
    if expected_chain:
        assert _segment_plan(after).segments  # segments span stages


def test_unet_skips_are_shared_tensors() -> None:
    z = zoo.build("unet")
    p = profile(z.model, z.batch, loss_fn=z.loss_fn, **FAST)
    ups = [i for i, u in enumerate(p.units) if u.name.startswith("ups.")]
    assert {t.first_user for t in p.shared} >= set(ups)  # each up block gets a skip


# ------------------------------------------------------------------ coverage in the profile
def test_profile_records_coverage_and_warns_when_low(caplog: pytest.LogCaptureFixture) -> None:
    z = zoo.build("resnet18")
    with caplog.at_level(logging.WARNING, logger="remat"):
        p = profile(z.model, z.batch, loss_fn=z.loss_fn, units=z.longest_list, **FAST)
    assert p.coverage is not None and p.coverage < 0.5
    assert p.meta["activation_bytes"] > p.meta["covered_bytes"] > 0
    uncovered = [name for name, _ in p.meta["uncovered"]]
    assert uncovered[0] == "layer2"  # the largest holder outside layer1
    assert "hold 29% of ResNet's activation memory" in caplog.text and "layer2" in caplog.text
    frame = p.to_frame()
    assert frame.attrs["coverage"] == p.coverage
    assert frame["activation_share"].sum() == pytest.approx(p.coverage)
    assert Profile.from_json(p.to_json()) == p


def test_coverage_field_defaults_and_checks() -> None:
    z = zoo.build("vit")
    p = profile(z.model, z.batch, loss_fn=z.loss_fn, units=["blocks.0", "blocks.1"], **FAST)
    d = p.to_dict()
    del d["coverage"]  # a profile written before coverage existed
    assert Profile.from_dict(d).coverage is None
    with pytest.raises(ProfileError, match="coverage"):
        Profile.from_dict({**p.to_dict(), "coverage": 1.5})


# ------------------------------------------------------------------ options that fail
def test_selective_on_in_place_ops_is_dropped_with_a_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    z = zoo.build("efficientnet")
    units = ["features.4.0", "features.4.1"]
    with caplog.at_level(logging.WARNING, logger="remat"):
        p = profile(z.model, z.batch, loss_fn=z.loss_fn, units=units, **FAST)
    for u in p.units:  # derive recomputes no forward: the writes are autograd's to check
        assert set(u.options) == {"keep", "checkpoint", "derive"}
    assert p.meta["dropped_options"] == {n: ["selective"] for n in units}
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 2 and "'features.4.0'" in lines[0] and "'selective'" in lines[0]
    assert "writes in place (aten.relu_" in lines[0] and "aten.convolution" in lines[0]


class _AddsIntoItsOutput(nn.Module):
    """Falcon's parallel block: ``out += attention`` into a Linear's output. Nothing in
    backward reads that output, so torch's selective checkpoint stops its recomputation
    before it and trains without a word: only the probe says that selective keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.up = nn.Linear(8, 8), nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention = self.attn(x)
        out = self.down(torch.tanh(self.up(x)))
        out += attention
        return out + x


def test_selective_writing_into_a_kept_output_torch_does_not_notice_is_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_AddsIntoItsOutput(), _AddsIntoItsOutput(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    # torch alone accepts it: the replay trains.
    y = forward_with_option(model[0], "selective", model[0].forward, (x,), {})
    y.sum().backward()
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.WARNING, logger="remat"):
        p = profile(model, x, loss_fn=lambda o, b: o.square().mean(), units=["0", "1"],
                    **FAST)
    assert p.meta["dropped_options"] == {"0": ["selective"], "1": ["selective"]}
    assert "writes in place (aten.add_" in caplog.text and "aten.mm" in caplog.text
    # So no plan takes it, and the runtime, which refuses it, never meets it.
    plan = remat.solve(model, x, min_peak_bytes(p), loss_fn=lambda o, b: o.square().mean(),
                       units=["0", "1"])
    assert "selective" not in plan.options


class _MutatesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # fine when nothing else holds x; a recomputation would read it changed
        return self.fc(x)


class _Mutating(nn.Module):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_MutatesInput(), _MutatesInput()])
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("the model's own error")
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_every_option_failing_everywhere_is_a_remat_error() -> None:
    with pytest.raises(ProfileError, match="every option but keep failed on every unit") as info:
        profile(_Mutating(), torch.randn(4, 8), loss_fn=lambda o, b: o.sum(),
                units=["blocks.0", "blocks.1"], options=["checkpoint", "selective"], **FAST)
    assert "checkpoint: RuntimeError" in str(info.value)
    # derive recomputes no forward, so a unit that writes its input runs it
    p = profile(_Mutating(), torch.randn(4, 8), loss_fn=lambda o, b: o.sum(),
                units=["blocks.0", "blocks.1"], **FAST)
    assert all(set(u.options) == {"keep", "derive"} for u in p.units)
    # keep alone is not a failure
    p = profile(_Mutating(), torch.randn(4, 8), loss_fn=lambda o, b: o.sum(),
                units=["blocks.0", "blocks.1"], options=["keep"], **FAST)
    assert all(set(u.options) == {"keep"} for u in p.units)


def test_the_models_own_errors_still_raise() -> None:
    with pytest.raises(ValueError, match="the model's own error"):
        profile(_Mutating(fail=True), torch.randn(4, 8), loss_fn=lambda o, b: o.sum(), **FAST)


# ------------------------------------------------------------------ granularity
def test_children_level_and_auto_granularity() -> None:
    torch.manual_seed(0)
    model = zoo.VisionTransformer(depth=2)
    batch, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))

    def loss_fn(out: torch.Tensor, _b: object) -> torch.Tensor:
        return nn.functional.cross_entropy(out, labels)

    blocks = find_units(model, batch, loss_fn=loss_fn, granularity="auto")
    assert blocks.children is not None  # two blocks are few
    children = find_units(model, batch, loss_fn=loss_fn, granularity="children")
    assert children.level == "children"
    assert children.names[:4] == ["blocks.0.norm1", "blocks.0.attn", "blocks.0.norm2",
                                  "blocks.0.mlp"]
    p = remat.profile(model, batch, loss_fn=loss_fn, granularity="auto", **FAST)
    compared = p.meta["granularity_compared"]
    assert set(compared) == {"blocks", "children"}
    children_win = compared["children"]["score"] < compared["blocks"]["score"] - 0.01
    assert p.meta["granularity"] == ("children" if children_win else "blocks")
    assert p.n == compared[p.meta["granularity"]]["units"]
    with pytest.raises(ProfileError, match="granularity"):
        profile(model, batch, loss_fn=loss_fn, granularity="layers", **FAST)
    with pytest.raises(ProfileError, match="remat.profile"):  # comparing levels takes the solver
        profile(model, batch, loss_fn=loss_fn, granularity="auto", **FAST)


@pytest.mark.transformers
def test_hugging_face_layers_are_the_blocks_and_what_they_hold_is_not() -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    from remat.profiler.blocks import block_names

    class Layer(GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # uniform, inside

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(sum(h(x) for h in self.heads))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer(), Layer()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    assert block_names(Model()) == ["layers.0", "layers.1", "layers.2"]
    choice = find_units(Model(), torch.randn(2, 8), loss_fn=lambda o, b: o.sum())
    assert choice.names == ["layers.0", "layers.1", "layers.2"]


def test_falcon_plans_without_selective_and_trains_on_its_loss_bitwise() -> None:
    # The model the bug was found on (transformers' Falcon, parallel attention): its
    # blocks write `mlp_output += attention_output`. Planned at its smallest peak, the
    # plan runs (the runtime refused the selective plan before) and gives the loss and
    # gradients of the model as written.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=256,
        parallel_attn=True, new_decoder_architecture=False, use_cache=False)
    base = transformers.FalconForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    planned = copy.deepcopy(base)
    loop = remat.Loop(keep_output=False)
    p = profile(planned, batch, loop=loop, head="none", **FAST)
    blocks = [u for u in p.units if u.name.startswith("transformer.h.")]
    assert len(blocks) == 3 and all("selective" not in u.options for u in blocks)
    assert set(p.meta["dropped_options"]) == {u.name for u in blocks}
    plan = remat.solve(p, min_peak_bytes(p))
    assert plan.options != ("keep",) * plan.n
    apply_plan(planned, plan)
    grads = []
    for model in (base, planned):
        torch.manual_seed(1)
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), [q.grad for q in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))
