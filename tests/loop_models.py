"""Small models written for the training-loop tests, each with what makes its step hard
to predict: a position bias shared by every block, logits the loop keeps, code between
stages. Random weights, CPU, a training step of a few milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import remat


@dataclass
class Case:
    """A model, one batch and its loss (``loss_fn(output, batch)``)."""

    model: nn.Module
    batch: Any
    loss_fn: Any


# --------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Multi-head attention with an additive bias (T5's relative positions, a causal mask)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: Tensor, bias: Tensor, memory: Tensor | None = None) -> Tensor:
        b, s, d = x.shape
        kv = x if memory is None else memory

        def split(t: Tensor) -> Tensor:
            return t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(kv)), split(self.v(kv))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias
        out = scores.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class EncoderBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.n1(x), bias))
        return x + self.drop(self.ff(self.n2(x)))


class DecoderBlock(EncoderBlock):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__(d, heads)
        self.n3 = nn.LayerNorm(d)
        self.cross = Attention(d, heads)

    def forward(self, x: Tensor, bias: Tensor, memory: Tensor) -> Tensor:  # type: ignore[override]
        x = x + self.drop(self.attn(self.n1(x), bias))
        x = x + self.drop(self.cross(self.n3(x), torch.zeros((), device=x.device), memory))
        return x + self.drop(self.ff(self.n2(x)))


class RelativeBias(nn.Module):
    """T5's learned relative position bias: computed once, handed to every block."""

    def __init__(self, heads: int, buckets: int = 32, causal: bool = False) -> None:
        super().__init__()
        self.table = nn.Embedding(buckets, heads)
        self.buckets, self.causal = buckets, causal

    def forward(self, s: int) -> Tensor:
        pos = torch.arange(s, device=self.table.weight.device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.buckets // 2, self.buckets // 2 - 1)
        bias = self.table(rel + self.buckets // 2).permute(2, 0, 1)[None]  # (1, heads, s, s)
        if self.causal:
            bias = bias.masked_fill(torch.ones(s, s, dtype=torch.bool,
                                               device=bias.device).triu(1), float("-inf"))
        return bias


class EncoderDecoder(nn.Module):
    """T5-style: the encoder's blocks share one position bias, the decoder's another, and
    every decoder block takes the encoder's output. Without ``enc_norm`` (BART-style)
    that output is the last encoder block's own."""

    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, depth: int = 3,
                 enc_norm: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.enc_bias, self.dec_bias = RelativeBias(heads), RelativeBias(heads, causal=True)
        self.encoder = nn.ModuleList(EncoderBlock(d, heads) for _ in range(depth))
        self.enc_norm = nn.LayerNorm(d) if enc_norm else nn.Identity()
        self.decoder = nn.ModuleList(DecoderBlock(d, heads) for _ in range(depth))
        self.dec_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        x, bias = self.embed(src), self.enc_bias(src.shape[1])
        for block in self.encoder:
            x = block(x, bias)
        memory = self.enc_norm(x)
        y, bias = self.embed(tgt), self.dec_bias(tgt.shape[1])
        for block in self.decoder:
            y = block(y, bias, memory)
        return self.head(self.dec_norm(y))


def encoder_decoder(batch: int = 8, src: int = 64, tgt: int = 48, enc_norm: bool = True
                    ) -> Case:
    torch.manual_seed(0)
    model = EncoderDecoder(enc_norm=enc_norm)
    inputs = {"src": torch.randint(0, 256, (batch, src)),
              "tgt": torch.randint(0, 256, (batch, tgt))}
    labels = torch.randint(0, 256, (batch, tgt))
    return Case(model, inputs, lambda logits, _b: F.cross_entropy(logits.flatten(0, 1),
                                                                  labels.flatten()))


# --------------------------------------------------------------------- causal LM
class CausalLM(nn.Module):
    """A decoder-only LM that returns its logits (the loop computes the loss)."""

    def __init__(self, vocab: int = 512, d: int = 64, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(EncoderBlock(d, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's

    def forward(self, ids: Tensor) -> Tensor:
        s = ids.shape[1]
        mask = torch.full((s, s), float("-inf"), device=ids.device).triu(1)
        x = self.embed(ids) + self.pos(torch.arange(s, device=ids.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def causal_lm(batch: int = 8, seq: int = 64) -> Case:
    torch.manual_seed(0)
    model = CausalLM()
    ids = torch.randint(0, 512, (batch, seq))
    return Case(model, ids, lambda logits, b: F.cross_entropy(
        logits[:, :-1].flatten(0, 1), b[:, 1:].flatten()))


class CausalLMWithLoss(CausalLM):
    """The causal LM computing its own loss through ``remat.head_loss`` (so remat can
    plan its head), untied, with a vocabulary large enough for the head to set the floor."""

    def __init__(self, vocab: int = 2048) -> None:
        super().__init__(vocab=vocab)
        self.head = nn.Linear(self.head.in_features, vocab, bias=False)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:  # type: ignore[override]
        s = ids.shape[1]
        mask = torch.full((s, s), float("-inf"), device=ids.device).triu(1)
        x = self.embed(ids) + self.pos(torch.arange(s, device=ids.device))
        for block in self.blocks:
            x = block(x, mask)
        return remat.head_loss(self.head, self.norm(x)[:, :-1], labels[:, 1:])


def causal_lm_head_loss(batch: int = 8, seq: int = 64) -> Case:
    torch.manual_seed(0)
    model = CausalLMWithLoss()
    ids = torch.randint(0, 2048, (batch, seq))
    return Case(model, (ids, ids), lambda loss, _b: loss)


def hf_gpt2(batch: int = 4, seq: int = 64) -> Case:
    """Hugging Face's GPT-2 (random weights), trained on ``labels``: its own loss."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=4096,
                                     n_positions=seq, use_cache=False, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 4096, (batch, seq))
    return Case(model, {"input_ids": ids, "labels": ids}, None)


# --------------------------------------------------------------------- CNN
class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(c), nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class StagedCNN(nn.Module):
    """Stages of residual blocks with a strided convolution between stages, run by the
    model's own code: the blocks are not a chain."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32), per_stage: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1)
        self.blocks = nn.ModuleList(Block(w) for w in widths for _ in range(per_stage))
        self.down = nn.ModuleList(nn.Conv2d(a, b, 3, stride=2, padding=1)
                                  for a, b in zip(widths, widths[1:]))
        self.per_stage = per_stage
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            if i and i % self.per_stage == 0:
                x = F.relu(self.down[i // self.per_stage - 1](x))
            x = block(x)
        return self.head(x.mean((2, 3)))


def staged_cnn(batch: int = 8, size: int = 32) -> Case:
    torch.manual_seed(0)
    model = StagedCNN()
    images, labels = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    return Case(model, images, lambda logits, _b: F.cross_entropy(logits, labels))
