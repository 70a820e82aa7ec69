"""Hugging Face transformers as reference models: one builder, one table row per model.

Each row (:class:`HFModel`) says which ``transformers`` config and model classes
to use, how :class:`HFConfig`'s fields map onto the config's keyword arguments,
how to make a batch and which loss the model computes. :func:`build_hf` does the
rest, the same way for every row: config, model (the weights draw from the RNG
first), batch, train mode, device. Needs the optional ``transformers`` package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from remat.core.errors import RematError
from remat.models.reference import ModelConfig, ReferenceModel, to_device

__all__ = ["HF_MODELS", "HFConfig", "HFModel", "build_hf"]


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


# A config keyword's value: the name of an HFConfig field, or a function of the config.
FieldSource = str | Callable[[HFConfig], Any]


@dataclass(frozen=True)
class HFModel:
    """One Hugging Face reference model: what :func:`build_hf` needs to build it.

    Attributes:
        name: registry name (``"hf-gpt2"``).
        config_class, model_class: class names in ``transformers``.
        fields: config keyword -> HFConfig field name, or a function of the HFConfig.
        batch: makes the batch (after the model, so the weights draw from the RNG first).
        loss_type: the model's ``loss_type`` (newer ``transformers`` warn when unset).
        note: appended to the description (what the batch does, e.g. masking).
    """

    name: str
    config_class: str
    model_class: str
    fields: Mapping[str, FieldSource]
    batch: Callable[[HFConfig], dict[str, Tensor]]
    loss_type: str
    note: str = ""

    def config_kwargs(self, cfg: HFConfig) -> dict[str, Any]:
        """The keyword arguments of the ``transformers`` config, ``cfg.extra`` excluded."""
        return {key: (getattr(cfg, src) if isinstance(src, str) else src(cfg))
                for key, src in self.fields.items()}


def causal_lm_batch(cfg: HFConfig) -> dict[str, Tensor]:
    """Random tokens as inputs and labels: Hugging Face shifts the labels itself."""
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    return {"input_ids": ids, "labels": ids.clone()}


MASK_ID = 4  # any fixed id stands in for [MASK]: the vocabulary is random anyway


def masked_lm_batch(cfg: HFConfig) -> dict[str, Tensor]:
    """Random tokens with 15% of the positions (at least one per row) masked; the
    loss is taken at the masked positions only (the others are labelled -100)."""
    ids = torch.randint(5, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    masked = torch.rand(cfg.batch_size, cfg.seq_len) < 0.15
    masked[:, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    input_ids = torch.where(masked, torch.full_like(ids, MASK_ID), ids)
    attention_mask = torch.ones_like(ids)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _llama_intermediate(cfg: HFConfig) -> int:
    """Llama's MLP width: about 8/3 of the model width, a multiple of 8 (at least 8)."""
    return (8 * cfg.width) // 3 // 8 * 8 or 8


HF_MODELS: dict[str, HFModel] = {
    m.name: m
    for m in (
        HFModel(
            name="hf-gpt2",
            config_class="GPT2Config",
            model_class="GPT2LMHeadModel",
            fields={
                "n_layer": "depth",
                "n_embd": "width",
                "n_head": "heads",
                "n_positions": "seq_len",
                "vocab_size": "vocab_size",
                "resid_pdrop": "dropout",
                "embd_pdrop": "dropout",
                "attn_pdrop": "dropout",
                # GPT-2's token 50256 lies outside a small vocabulary.
                "bos_token_id": lambda cfg: cfg.vocab_size - 1,
                "eos_token_id": lambda cfg: cfg.vocab_size - 1,
            },
            batch=causal_lm_batch,
            loss_type="ForCausalLM",
        ),
        HFModel(
            name="hf-bert",
            config_class="BertConfig",
            model_class="BertForMaskedLM",
            fields={
                "num_hidden_layers": "depth",
                "hidden_size": "width",
                "num_attention_heads": "heads",
                "intermediate_size": lambda cfg: 4 * cfg.width,
                "max_position_embeddings": "seq_len",
                "vocab_size": "vocab_size",
                "hidden_dropout_prob": "dropout",
                "attention_probs_dropout_prob": "dropout",
            },
            batch=masked_lm_batch,
            loss_type="ForMaskedLM",
            note=", 15% masked",
        ),
        HFModel(
            name="hf-llama",
            config_class="LlamaConfig",
            model_class="LlamaForCausalLM",
            fields={
                "num_hidden_layers": "depth",
                "hidden_size": "width",
                "num_attention_heads": "heads",
                "num_key_value_heads": "heads",
                "intermediate_size": _llama_intermediate,
                "max_position_embeddings": "seq_len",
                "vocab_size": "vocab_size",
                "attention_dropout": "dropout",
            },
            batch=causal_lm_batch,
            loss_type="ForCausalLM",
        ),
    )
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise RematError(
            "the Hugging Face reference models need the 'transformers' package: "
            "pip install transformers"
        ) from exc
    return transformers


def build_hf(spec: HFModel, cfg: HFConfig) -> ReferenceModel:
    """Build the model of table row ``spec`` from ``cfg``, with its batch (random weights)."""
    tf = _transformers()
    # Training builds no KV cache (Hugging Face's own checkpointing turns it off too);
    # `extra` may say otherwise. A key of `extra` that a field already sets is a
    # duplicate keyword: an error, not a silent override.
    config = getattr(tf, spec.config_class)(
        **spec.config_kwargs(cfg), **{"use_cache": False, **cfg.extra}
    )
    model = getattr(tf, spec.model_class)(config)
    if hasattr(model, "loss_type"):
        model.loss_type = spec.loss_type
    batch = spec.batch(cfg)
    model.train()
    model, batch = to_device(model, batch, cfg.device)
    return ReferenceModel(
        name=spec.name,
        model=model,
        batch=batch,
        loss_fn=None,
        description=(
            f"transformers {spec.model_class}: {cfg.depth} layers, d={cfg.width}, "
            f"{cfg.heads} heads, seq {cfg.seq_len}, batch {cfg.batch_size}, "
            f"vocab {cfg.vocab_size}{spec.note}"
        ),
        config=cfg,
    )
