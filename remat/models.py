"""Reference models with random weights, shared by the demo, the tests and the benchmarks.

Nothing is downloaded: every model is built from a config and initialised from a
seed, so the same ``(name, size, seed, overrides)`` gives bitwise the same weights
and batch. Each builder returns a :class:`ReferenceModel`: the module (in train
mode, float32), one batch of inputs, and how to get a loss from the output.

Example::

    from remat.models import build

    ref = build("gpt", size="tiny")
    out = ref.model(**ref.batch)
    loss = ref.loss(out)
    loss.backward()

Sizes: ``"tiny"`` is for unit tests (a CPU training step far below 0.2 s on two
cores); ``"small"`` (the default) is for the demo and the benchmarks (a CPU
training step of roughly 0.3-2 s). Any config field can be overridden by keyword
(``build("mlp", depth=8, width=256)``); ``device=`` moves model and batch.

The Hugging Face models (``"hf-gpt2"``, ``"hf-bert"``, ``"hf-llama"``) need the
optional ``transformers`` package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from remat.errors import RematError

__all__ = [
    "MODELS",
    "SIZES",
    "CNN",
    "GPT",
    "GPTOutput",
    "ModelConfig",
    "ReferenceModel",
    "UnknownModelError",
    "build",
    "param_count",
]

SIZES = ("tiny", "small")


class UnknownModelError(RematError, ValueError):
    """A model name, size or config override that the registry does not know."""


@dataclass
class ReferenceModel:
    """A model with random weights, one batch of inputs and how to get its loss.

    Attributes:
        name: registry name (``"gpt"``, ``"hf-bert"``...).
        model: the module, in train mode.
        batch: a Tensor (call ``model(batch)``), a tuple of positional inputs
            (``model(*batch)``) or a dict of keyword inputs (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar Tensor``; ``None`` when the
            output carries its own ``.loss``.
        description: one line saying what the model is.
        config: the resolved config it was built from.
    """

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], Tensor] | None
    description: str
    config: Any = None

    def forward(self) -> Any:
        """Run the model on its batch and return the output."""
        if isinstance(self.batch, dict):
            return self.model(**self.batch)
        if isinstance(self.batch, tuple):
            return self.model(*self.batch)
        return self.model(self.batch)

    def loss(self, output: Any) -> Tensor:
        """The scalar loss of ``output`` (``loss_fn`` or the output's ``.loss``)."""
        if self.loss_fn is not None:
            return self.loss_fn(output, self.batch)
        return output.loss

    def step(self) -> Tensor:
        """One forward and backward pass (no optimizer); returns the detached loss."""
        loss = self.loss(self.forward())
        loss.backward()
        return loss.detach()


def param_count(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# --------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class ModelConfig:
    """Fields every reference model has. Subclasses add their own."""

    batch_size: int
    device: str = "cpu"


# --------------------------------------------------------------------------- mlp
@dataclass(frozen=True)
class MLPConfig(ModelConfig):
    """A chain of ``depth`` blocks ``Linear(width, width) -> GELU``."""

    depth: int = 24
    width: int = 1024


def _build_mlp(cfg: MLPConfig) -> ReferenceModel:
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.GELU()) for _ in range(cfg.depth)]
    )
    x = torch.randn(cfg.batch_size, cfg.width)
    target = torch.randn(cfg.batch_size, cfg.width)
    model, (x, target) = _to(model, (x, target), cfg.device)

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


def _build_cnn(cfg: CNNConfig) -> ReferenceModel:
    model = CNN(cfg)
    images = torch.randn(cfg.batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
    labels = torch.randint(0, cfg.num_classes, (cfg.batch_size,))
    model, (images, labels) = _to(model, (images, labels), cfg.device)

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


def _build_gpt(cfg: GPTConfig) -> ReferenceModel:
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model, (idx, targets) = _to(model, (idx, targets), cfg.device)
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


# --------------------------------------------------------------------------- Hugging Face
@dataclass(frozen=True)
class HFConfig(ModelConfig):
    """A Hugging Face transformer built from a config (random weights).

    ``extra`` holds further keyword arguments for the ``transformers`` config class.
    """

    depth: int = 4
    width: int = 256
    heads: int = 4
    seq_len: int = 128
    vocab_size: int = 2048
    dropout: float = 0.1
    extra: dict[str, Any] = field(default_factory=dict, hash=False)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise RematError(
            "the Hugging Face reference models need the 'transformers' package: "
            "pip install transformers"
        ) from exc
    return transformers


def _causal_lm_batch(cfg: HFConfig) -> dict[str, Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    return {"input_ids": ids, "labels": ids.clone()}  # HF shifts the labels itself


def _finish_hf(
    name: str, model: nn.Module, batch: dict[str, Tensor], cfg: HFConfig, description: str
) -> ReferenceModel:
    model.train()
    model, batch = _to(model, batch, cfg.device)
    return ReferenceModel(
        name=name, model=model, batch=batch, loss_fn=None, description=description, config=cfg
    )


def _build_hf_gpt2(cfg: HFConfig) -> ReferenceModel:
    tf = _transformers()
    config = tf.GPT2Config(
        n_layer=cfg.depth,
        n_embd=cfg.width,
        n_head=cfg.heads,
        n_positions=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        bos_token_id=cfg.vocab_size - 1,  # GPT-2's 50256 lies outside a small vocabulary
        eos_token_id=cfg.vocab_size - 1,
        # Training builds no KV cache (Hugging Face's own checkpointing turns it off too).
        **{"use_cache": False, **cfg.extra},
    )
    model = tf.GPT2LMHeadModel(config)
    if hasattr(model, "loss_type"):
        model.loss_type = "ForCausalLM"
    return _finish_hf(
        "hf-gpt2",
        model,
        _causal_lm_batch(cfg),
        cfg,
        f"transformers GPT2LMHeadModel: {cfg.depth} layers, d={cfg.width}, {cfg.heads} heads, "
        f"seq {cfg.seq_len}, batch {cfg.batch_size}, vocab {cfg.vocab_size}",
    )


def _build_hf_bert(cfg: HFConfig) -> ReferenceModel:
    tf = _transformers()
    config = tf.BertConfig(
        num_hidden_layers=cfg.depth,
        hidden_size=cfg.width,
        num_attention_heads=cfg.heads,
        intermediate_size=4 * cfg.width,
        max_position_embeddings=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        # Training builds no KV cache (Hugging Face's own checkpointing turns it off too).
        **{"use_cache": False, **cfg.extra},
    )
    model = tf.BertForMaskedLM(config)
    if hasattr(model, "loss_type"):
        model.loss_type = "ForMaskedLM"
    ids = torch.randint(5, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    # Mask 15% of the positions (at least one per row): the loss is taken there only.
    masked = torch.rand(cfg.batch_size, cfg.seq_len) < 0.15
    masked[:, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    mask_id = 4  # any fixed id stands in for [MASK]: the vocabulary is random anyway
    input_ids = torch.where(masked, torch.full_like(ids, mask_id), ids)
    attention_mask = torch.ones_like(ids)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return _finish_hf(
        "hf-bert",
        model,
        batch,
        cfg,
        f"transformers BertForMaskedLM: {cfg.depth} layers, d={cfg.width}, {cfg.heads} heads, "
        f"seq {cfg.seq_len}, batch {cfg.batch_size}, vocab {cfg.vocab_size}, 15% masked",
    )


def _build_hf_llama(cfg: HFConfig) -> ReferenceModel:
    tf = _transformers()
    config = tf.LlamaConfig(
        num_hidden_layers=cfg.depth,
        hidden_size=cfg.width,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        intermediate_size=(8 * cfg.width) // 3 // 8 * 8 or 8,
        max_position_embeddings=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        attention_dropout=cfg.dropout,
        # Training builds no KV cache (Hugging Face's own checkpointing turns it off too).
        **{"use_cache": False, **cfg.extra},
    )
    model = tf.LlamaForCausalLM(config)
    if hasattr(model, "loss_type"):
        model.loss_type = "ForCausalLM"
    return _finish_hf(
        "hf-llama",
        model,
        _causal_lm_batch(cfg),
        cfg,
        f"transformers LlamaForCausalLM: {cfg.depth} layers, d={cfg.width}, {cfg.heads} heads, "
        f"seq {cfg.seq_len}, batch {cfg.batch_size}, vocab {cfg.vocab_size}",
    )


# --------------------------------------------------------------------------- registry
_TRANSFORMER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "depth": 2,
        "width": 32,
        "heads": 2,
        "seq_len": 16,
        "batch_size": 2,
        "vocab_size": 128,
    },
    "small": {
        "depth": 6,
        "width": 256,
        "heads": 4,
        "seq_len": 128,
        "batch_size": 16,
        "vocab_size": 2048,
    },
}


_PRESETS: dict[str, tuple[type[ModelConfig], dict[str, dict[str, Any]]]] = {
    "mlp": (
        MLPConfig,
        {
            "tiny": {"depth": 6, "width": 64, "batch_size": 16},
            # Activations (8 MiB a block) dwarf the weights: there is something to plan.
            "small": {"depth": 16, "width": 256, "batch_size": 4096},
        },
    ),
    "cnn": (
        CNNConfig,
        {
            "tiny": {"widths": (8, 16), "blocks_per_stage": 1, "image_size": 8, "batch_size": 4},
            "small": {
                "widths": (32, 64, 128, 256),
                "blocks_per_stage": 2,
                "image_size": 32,
                "batch_size": 96,
            },
        },
    ),
    "gpt": (GPTConfig, _TRANSFORMER_PRESETS),
}
# The Hugging Face models take the same sizes as the own GPT, so they compare directly.
_HF_PRESETS = _TRANSFORMER_PRESETS
for _name in ("hf-gpt2", "hf-bert", "hf-llama"):
    _PRESETS[_name] = (HFConfig, _HF_PRESETS)

_BUILDERS: dict[str, Callable[[Any], ReferenceModel]] = {
    "mlp": _build_mlp,
    "cnn": _build_cnn,
    "gpt": _build_gpt,
    "hf-gpt2": _build_hf_gpt2,
    "hf-bert": _build_hf_bert,
    "hf-llama": _build_hf_llama,
}


def config_for(name: str, *, size: str = "small", **overrides: Any) -> ModelConfig:
    """The resolved config of model ``name`` at ``size`` with ``overrides`` applied."""
    if name not in _BUILDERS:
        raise UnknownModelError(
            f"unknown model {name!r}; valid names: {', '.join(sorted(_BUILDERS))}"
        )
    if size not in SIZES:
        raise UnknownModelError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    cls, presets = _PRESETS[name]
    valid = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(overrides) - valid)
    if bad:
        raise UnknownModelError(
            f"model {name!r} has no config field(s) {', '.join(bad)}; "
            f"valid fields: {', '.join(sorted(valid))}"
        )
    values = {**presets[size], **overrides}
    if "widths" in values:
        values["widths"] = tuple(values["widths"])
    if "device" in values:
        values["device"] = str(values["device"])
    return cls(**values)


def build(name: str, *, size: str = "small", seed: int = 0, **overrides: Any) -> ReferenceModel:
    """Build reference model ``name`` with random weights from ``seed``.

    Args:
        name: one of :data:`MODELS` (``"mlp"``, ``"cnn"``, ``"gpt"``, ``"hf-gpt2"``,
            ``"hf-bert"``, ``"hf-llama"``).
        size: ``"tiny"`` (unit tests) or ``"small"`` (demo, benchmarks).
        seed: seeds weights and batch; the global RNG state is left as it was.
        **overrides: config fields to change (``depth``, ``width``, ``batch_size``,
            ``seq_len``, ``dropout``, ``device``...; see the model's config class).

    Raises:
        UnknownModelError: an unknown name, size or override (lists the valid ones).
        RematError: a Hugging Face model without ``transformers`` installed.
    """
    cfg = config_for(name, size=size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref = _BUILDERS[name](cfg)
    ref.model.train()
    return ref


def _make_entry(name: str) -> Callable[..., ReferenceModel]:
    def entry(*, size: str = "small", seed: int = 0, **overrides: Any) -> ReferenceModel:
        return build(name, size=size, seed=seed, **overrides)

    entry.__name__ = f"build_{name.replace('-', '_')}"
    entry.__doc__ = f"Build the {name!r} reference model (see :func:`build`)."
    return entry


MODELS: dict[str, Callable[..., ReferenceModel]] = {n: _make_entry(n) for n in _BUILDERS}
"""Registry: model name -> builder taking ``size=``, ``seed=`` and config overrides."""


def _to(model: nn.Module, batch: Any, device: str) -> tuple[nn.Module, Any]:
    """Move a model and a (nested) batch to ``device``."""
    if device == "cpu":
        return model, batch
    moved = tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, batch)
    return model.to(device), moved
