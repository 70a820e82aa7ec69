"""Chain detection: unit i+1's first input *is* unit i's output and nothing runs between."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat import models
from remat.profiler import check_chain, profile


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Stack(nn.Module):
    """``how`` says what runs between the blocks."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "parallel":  # every block reads the same input
            return sum(b(x) for b in self.blocks)
        for b in self.blocks:
            x = b(x)
            if self.how == "scale":
                x = x * 2
            elif self.how == "tuple":  # indexing a tuple runs no op
                x = (x, None)[0]
        return x


def test_sequential_is_a_chain() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert check_chain(model, torch.randn(2, 4)).is_chain


@pytest.mark.parametrize("name", ["gpt", "cnn", "mlp"])
def test_reference_models_are_chains(name: str) -> None:
    ref = models.build(name, size="tiny")
    assert check_chain(ref.model, ref.batch).is_chain


@pytest.mark.transformers
def test_hf_gpt2_transformer_h_is_a_chain() -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=8,
                                     vocab_size=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 8))
    assert check_chain(model, {"input_ids": ids, "labels": ids}).is_chain


def test_no_op_between_units_keeps_the_chain() -> None:
    assert check_chain(Stack("tuple"), torch.randn(2, 8)).is_chain


def test_compute_between_units_breaks_the_chain() -> None:
    result = check_chain(Stack("scale"), torch.randn(2, 8))
    assert not result.is_chain
    assert any("op(s) run between" in b for b in result.breaks)
    assert any("is not" in b for b in result.breaks)  # the input is x * 2, not the output


def test_units_sharing_an_input_are_not_a_chain() -> None:
    result = check_chain(Stack("parallel"), torch.randn(2, 8))
    assert not result.is_chain


def test_profile_records_the_chain_flag() -> None:
    def loss_fn(out: torch.Tensor, _b: object) -> torch.Tensor:
        return out.pow(2).mean()

    x = torch.randn(2, 8)
    assert profile(Stack("plain"), x, loss_fn=loss_fn, repeats=1, warmup=0).is_chain
    off = profile(Stack("scale"), x, loss_fn=loss_fn, repeats=1, warmup=0)
    assert not off.is_chain
    assert off.meta["chain_breaks"]
