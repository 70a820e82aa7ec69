"""The reference models written here: an MLP chain, a ResNet-style CNN and a GPT decoder.

Each has a frozen config (the fields :func:`remat.models.build` accepts as
overrides) and a builder ``build_<name>(config) -> ReferenceModel``; the registry
(:mod:`remat.models.registry`) seeds the RNG around the builder, which draws the
weights first and the batch second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remat.models.reference import ModelConfig, ReferenceModel, UnknownModelError, to_device

__all__ = [
    "CNN",
    "GPT",
    "BasicBlock",
    "CNNConfig",
    "CausalSelfAttention",
    "GPTBlock",
    "GPTConfig",
    "GPTOutput",
    "MLPConfig",
    "build_cnn",
    "build_gpt",
    "build_mlp",
]


# --------------------------------------------------------------------------- mlp
@dataclass(frozen=True)
class MLPConfig(ModelConfig):
    """A chain of ``depth`` blocks ``Linear(width, width) -> GELU``."""

    depth: int = 24
    width: int = 1024


def build_mlp(cfg: MLPConfig) -> ReferenceModel:
    """The MLP chain, a random input and a random regression target (MSE loss)."""
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.GELU()) for _ in range(cfg.depth)]
    )
    x = torch.randn(cfg.batch_size, cfg.width)
    target = torch.randn(cfg.batch_size, cfg.width)
    model, (x, target) = to_device(model, (x, target), cfg.device)

    def loss_fn(output: Tensor, batch: Any) -> Tensor:
        return F.mse_loss(output, target)

    return ReferenceModel(
        name="mlp",
        model=model,
        batch=x,
        loss_fn=loss_fn,
        description=(
            f"MLP chain: {cfg.depth} x (Linear({cfg.width},{cfg.width}) + GELU), "
            f"batch {cfg.batch_size}, MSE loss"
        ),
        config=cfg,
    )


# --------------------------------------------------------------------------- cnn
@dataclass(frozen=True)
class CNNConfig(ModelConfig):
    """A ResNet-style CNN: ``blocks_per_stage`` BasicBlocks for each width in ``widths``."""

    widths: tuple[int, ...] = (32, 64, 128, 256)
    blocks_per_stage: int = 2
    image_size: int = 32
    in_channels: int = 3
    num_classes: int = 10


class BasicBlock(nn.Module):
    """ResNet BasicBlock: conv-bn-relu-conv-bn plus a (downsampled) shortcut, then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        """Residual block forward."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class CNN(nn.Module):
    """ResNet-style image classifier; the residual blocks are the chain ``self.blocks``."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        w0 = cfg.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.in_channels, w0, 3, padding=1, bias=False),
            nn.BatchNorm2d(w0),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        c_in = w0
        for stage, width in enumerate(cfg.widths):
            for i in range(cfg.blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(c_in, width, stride))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, cfg.num_classes)

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        """Return the logits. ``labels`` is accepted (and ignored) so ``model(**batch)`` works."""
        x = self.stem(x)
        x = self.blocks(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def build_cnn(cfg: CNNConfig) -> ReferenceModel:
    """The CNN, random images and random labels (cross entropy)."""
    model = CNN(cfg)
    images = torch.randn(cfg.batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
    labels = torch.randint(0, cfg.num_classes, (cfg.batch_size,))
    model, (images, labels) = to_device(model, (images, labels), cfg.device)

    def loss_fn(output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(output, batch["labels"])

    n_blocks = cfg.blocks_per_stage * len(cfg.widths)
    return ReferenceModel(
        name="cnn",
        model=model,
        batch={"x": images, "labels": labels},
        loss_fn=loss_fn,
        description=(
            f"ResNet-style CNN: {n_blocks} BasicBlocks, widths {list(cfg.widths)}, "
            f"{cfg.image_size}x{cfg.image_size} images, batch {cfg.batch_size}, cross entropy"
        ),
        config=cfg,
    )


# --------------------------------------------------------------------------- gpt
@dataclass(frozen=True)
class GPTConfig(ModelConfig):
    """A GPT-style decoder (pre-LN, causal SDPA attention, tied lm head)."""

    depth: int = 6
    width: int = 256
    heads: int = 4
    seq_len: int = 128
    vocab_size: int = 2048
    dropout: float = 0.1
    mlp_ratio: int = 4


@dataclass(frozen=True)
class GPTOutput:
    """Output of :class:`GPT`: the logits and, when targets were given, the loss."""

    logits: Tensor
    loss: Tensor | None = None


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise UnknownModelError(f"width={width} is not divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over the sequence (causally) and project back to ``width``."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.proj(y))


class GPTBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg.width, cfg.heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        """One residual attention + MLP step."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT-style language model; its blocks form the chain ``self.blocks``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.depth))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> GPTOutput:
        """Logits for every position; next-token cross entropy when ``targets`` is given."""
        _, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return GPTOutput(logits=logits, loss=loss)


def build_gpt(cfg: GPTConfig) -> ReferenceModel:
    """The GPT and random tokens; the targets are the tokens shifted by one."""
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model, (idx, targets) = to_device(model, (idx, targets), cfg.device)
    return ReferenceModel(
        name="gpt",
        model=model,
        batch={"idx": idx, "targets": targets},
        loss_fn=None,
        description=(
            f"GPT decoder: {cfg.depth} layers, d={cfg.width}, {cfg.heads} heads, "
            f"seq {cfg.seq_len}, batch {cfg.batch_size}, vocab {cfg.vocab_size}, "
            f"dropout {cfg.dropout}"
        ),
        config=cfg,
    )
