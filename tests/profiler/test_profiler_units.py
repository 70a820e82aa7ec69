"""Unit discovery, ``units=`` forms, and the errors a user can run into."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.core.errors import LossNotFoundError, NoUnitsError, ProfileError
from remat.core.plan import Plan
from remat.profiler import discover_units, profile
from remat.profiler.units import longest_list
from remat.runtime import apply_plan


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class TwoLists(nn.Module):
    """A 2-long uniform list, a 3-long uniform list, and a 4-long mixed one."""

    def __init__(self) -> None:
        super().__init__()
        self.short = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.mixed = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.short:
            x = m(x)
        for b in self.blocks:
            x = b(x)
        return self.mixed(x)


def names(units: list[tuple[str, nn.Module]]) -> list[str]:
    return [n for n, _ in units]


def test_sequential_model_units_are_its_children() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert names(discover_units(model)) == ["0", "1", "2"]


def test_every_uniform_list_counts_and_mixed_lists_do_not() -> None:
    # Issue 13: the whole model, not only the longest list (which longest_list() keeps).
    assert names(discover_units(TwoLists())) == ["short.0", "short.1", "blocks.0", "blocks.1",
                                                 "blocks.2"]
    assert names(longest_list(TwoLists())) == ["blocks.0", "blocks.1", "blocks.2"]


def test_reference_models_units() -> None:
    assert names(discover_units(models.build("gpt", size="tiny").model)) == [
        "blocks.0", "blocks.1",
    ]
    assert names(discover_units(models.build("cnn", size="tiny").model)) == [
        "blocks.0", "blocks.1",
    ]


@pytest.mark.transformers
def test_hf_gpt2_units_are_transformer_h() -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=8,
                                     vocab_size=32)
    model = transformers.GPT2LMHeadModel(config)
    assert names(discover_units(model)) == [f"transformer.h.{i}" for i in range(3)]


def test_units_by_names() -> None:
    model = TwoLists()
    assert names(discover_units(model, ["short.1", "blocks.0"])) == ["short.1", "blocks.0"]


def test_units_by_class_outermost_only() -> None:
    model = TwoLists()
    # Linear also appears inside each Block: only the outermost matches count, and
    # those inside a matched Block are skipped.
    found = discover_units(model, (Block, nn.Linear))
    assert names(found) == ["short.0", "short.1", "blocks.0", "blocks.1", "blocks.2",
                            "mixed.0", "mixed.2"]
    assert names(discover_units(model, Block)) == ["blocks.0", "blocks.1", "blocks.2"]


def test_units_by_predicate() -> None:
    model = TwoLists()
    found = discover_units(model, lambda name, m: name.startswith("blocks."))
    assert names(found) == ["blocks.0", "blocks.1", "blocks.2"]  # not blocks.0.fc: inside


def test_units_by_container_name_means_its_children() -> None:
    assert names(discover_units(TwoLists(), "short")) == ["short.0", "short.1"]


@pytest.mark.parametrize(
    "units, match",
    [
        (["blocks", "blocks.1"], "contains"),
        (["blocks.1", "blocks.1.fc"], "contains"),
        (["blocks.1", "blocks.1"], "same module"),
        (["blocks.9"], "no submodule"),
        ([""], "model itself"),
    ],
)
def test_bad_unit_names(units: list[str], match: str) -> None:
    with pytest.raises(ProfileError, match=match):
        discover_units(TwoLists(), units)


def test_no_units_asks_for_units() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    with pytest.raises(NoUnitsError, match="units="):
        discover_units(Plain())
    with pytest.raises(NoUnitsError, match="units="):
        profile(Plain(), torch.randn(2, 4), loss_fn=lambda out, b: out.sum())
    with pytest.raises(NoUnitsError, match="units="):
        discover_units(Plain(), nn.Conv2d)  # nothing matches


def test_missing_loss_names_loss_fn() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(LossNotFoundError, match="loss_fn") as info:
        profile(model, torch.randn(2, 4))
    assert "fn(output, batch)" in str(info.value)  # the expected signature


def test_loss_from_output_attribute_and_key() -> None:
    class WithLoss(nn.Module):
        def __init__(self, as_dict: bool) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            self.as_dict = as_dict

        def forward(self, x: torch.Tensor) -> object:
            y = self.layers(x)
            loss = y.pow(2).mean()
            if self.as_dict:
                return {"logits": y, "loss": loss}
            return models.GPTOutput(logits=y, loss=loss)

    for as_dict in (False, True):
        p = profile(WithLoss(as_dict), torch.randn(2, 4), repeats=1, warmup=0)
        assert [u.name for u in p.units] == ["layers.0", "layers.1"]


def test_unit_that_never_runs_or_runs_twice(caplog: pytest.LogCaptureFixture) -> None:
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.unused = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)
            return self.blocks[1](self.blocks[0](x))

    def loss_fn(out: torch.Tensor, _batch: object) -> torch.Tensor:
        return out.sum()

    x = torch.randn(2, 8)
    with pytest.raises(ProfileError, match="more than once"):
        profile(Reuse(), x, loss_fn=loss_fn, units=["blocks.0", "blocks.1"])
    # Discovery measures first: it leaves the reused block out, and says so.
    with caplog.at_level(logging.WARNING, logger="remat"):
        p = profile(Reuse(), x, loss_fn=loss_fn, repeats=1, warmup=0)
    assert [u.name for u in p.units] == ["blocks.1"]
    assert "'blocks.0' runs 2 times" in caplog.text
    with pytest.raises(ProfileError, match="did not run"):
        profile(Reuse(), x, loss_fn=loss_fn, units=["blocks.1", "unused"])


def test_execution_order_not_registration_order() -> None:
    class Backwards(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in reversed(self.blocks):
                x = b(x)
            return x

    p = profile(Backwards(), torch.randn(2, 8), loss_fn=lambda o, b: o.sum(), repeats=1,
                warmup=0)
    assert [u.name for u in p.units] == ["blocks.2", "blocks.1", "blocks.0"]
    assert p.is_chain


def test_planned_model_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    apply_plan(model, Plan.checkpoint_all(["0", "1"]))
    with pytest.raises(ProfileError, match="remove_plan"):
        profile(model, torch.randn(2, 4), loss_fn=lambda o, b: o.sum())


def test_bad_arguments() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with pytest.raises(ProfileError, match="unknown option"):
        profile(model, x, loss_fn=lambda o, b: o.sum(), options=["keep", "nap"])
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError, match="offload"):
            profile(model, x, loss_fn=lambda o, b: o.sum(), options=["offload"])
    with pytest.raises(ProfileError, match="repeats"):
        profile(model, x, loss_fn=lambda o, b: o.sum(), repeats=0)


class HookedBlock(nn.Module):
    """Hooks the tensor it computes: valid with grad on, refused by torch without it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 64)
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.register_hook(lambda g: g * 2)  # changes the gradient: a dropped hook would show
        return self.out(y.relu()).tanh()


def test_a_unit_that_hooks_what_it_computes_is_planned() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(*(HookedBlock() for _ in range(6))), torch.randn(256, 16)
    reference = copy.deepcopy(model)

    def loss_fn(out: torch.Tensor, batch: object = None) -> torch.Tensor:
        return out.square().mean()

    plan = remat.solve(model, x, "60%", loss_fn=loss_fn)
    assert any(d["option"] != "keep" for d in plan.decisions())  # something is recomputed
    remat.apply_plan(model, plan)
    try:
        loss_fn(model(x)).backward()
    finally:
        remat.remove_plan(model)
    loss_fn(reference(x)).backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad)
