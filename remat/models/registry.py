"""The registry of reference models: name -> config class, size presets and builder.

:func:`config_for` resolves a config (preset of the size, then overrides);
:func:`build` seeds the RNG around the builder, so the same
``(name, size, seed, overrides)`` gives bitwise the same weights and batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from remat.models.reference import ModelConfig, ReferenceModel, UnknownModelError
from remat.models.toy import CNNConfig, GPTConfig, MLPConfig, build_cnn, build_gpt, build_mlp
from remat.models.transformers_models import HF_MODELS, HFConfig, build_hf

__all__ = ["MODELS", "REGISTRY", "SIZES", "Entry", "build", "config_for"]

SIZES = ("tiny", "small")

Presets = Mapping[str, Mapping[str, Any]]  # size -> config fields


@dataclass(frozen=True)
class Entry:
    """One registered model: its config class, the fields of each size, its builder."""

    config_class: type[ModelConfig]
    presets: Presets
    builder: Callable[[Any], ReferenceModel]


# The transformers (the own GPT and the Hugging Face ones) share their sizes, so
# they compare directly.
TRANSFORMER_PRESETS: Presets = {
    "tiny": {"depth": 2, "width": 32, "heads": 2, "seq_len": 16, "batch_size": 2,
             "vocab_size": 128},
    "small": {"depth": 6, "width": 256, "heads": 4, "seq_len": 128, "batch_size": 16,
              "vocab_size": 2048},
}

MLP_PRESETS: Presets = {
    "tiny": {"depth": 6, "width": 64, "batch_size": 16},
    # Activations (8 MiB a block) dwarf the weights: there is something to plan.
    "small": {"depth": 16, "width": 256, "batch_size": 4096},
}

CNN_PRESETS: Presets = {
    "tiny": {"widths": (8, 16), "blocks_per_stage": 1, "image_size": 8, "batch_size": 4},
    "small": {"widths": (32, 64, 128, 256), "blocks_per_stage": 2, "image_size": 32,
              "batch_size": 96},
}

REGISTRY: dict[str, Entry] = {
    "mlp": Entry(MLPConfig, MLP_PRESETS, build_mlp),
    "cnn": Entry(CNNConfig, CNN_PRESETS, build_cnn),
    "gpt": Entry(GPTConfig, TRANSFORMER_PRESETS, build_gpt),
    **{name: Entry(HFConfig, TRANSFORMER_PRESETS, partial(build_hf, spec))
       for name, spec in HF_MODELS.items()},
}


def config_for(name: str, *, size: str = "small", **overrides: Any) -> ModelConfig:
    """The resolved config of model ``name`` at ``size`` with ``overrides`` applied."""
    if name not in REGISTRY:
        raise UnknownModelError(
            f"unknown model {name!r}; valid names: {', '.join(sorted(REGISTRY))}"
        )
    if size not in SIZES:
        raise UnknownModelError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    entry = REGISTRY[name]
    valid = {f.name for f in dataclasses.fields(entry.config_class)}
    bad = sorted(set(overrides) - valid)
    if bad:
        raise UnknownModelError(
            f"model {name!r} has no config field(s) {', '.join(bad)}; "
            f"valid fields: {', '.join(sorted(valid))}"
        )
    values = {**entry.presets[size], **overrides}
    if "widths" in values:
        values["widths"] = tuple(values["widths"])
    if "device" in values:
        values["device"] = str(values["device"])
    return entry.config_class(**values)


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
        ref = REGISTRY[name].builder(cfg)
    ref.model.train()
    return ref


def _make_entry(name: str) -> Callable[..., ReferenceModel]:
    def entry(*, size: str = "small", seed: int = 0, **overrides: Any) -> ReferenceModel:
        return build(name, size=size, seed=seed, **overrides)

    entry.__name__ = f"build_{name.replace('-', '_')}"
    entry.__doc__ = f"Build the {name!r} reference model (see :func:`build`)."
    return entry


MODELS: dict[str, Callable[..., ReferenceModel]] = {n: _make_entry(n) for n in REGISTRY}
"""Registry: model name -> builder taking ``size=``, ``seed=`` and config overrides."""
