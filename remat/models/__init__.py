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

Modules: :mod:`~remat.models.reference` (what a reference model is),
:mod:`~remat.models.toy` (mlp, cnn, gpt), :mod:`~remat.models.transformers_models` (the Hugging
Face table and its one builder), :mod:`~remat.models.registry` (names, sizes,
``build``), :mod:`~remat.models.load` (``--model`` specs) and
:mod:`~remat.cli.demo` (``python -m remat demo``; not imported here).
"""

from remat.models.load import load_model
from remat.models.reference import ModelConfig, ReferenceModel, UnknownModelError, param_count
from remat.models.registry import MODELS, SIZES, build, config_for
from remat.models.toy import (
    CNN,
    GPT,
    BasicBlock,
    CausalSelfAttention,
    CNNConfig,
    GPTBlock,
    GPTConfig,
    GPTOutput,
    MLPConfig,
)
from remat.models.transformers_models import HFConfig

__all__ = [
    "MODELS",
    "SIZES",
    "CNN",
    "GPT",
    "BasicBlock",
    "CausalSelfAttention",
    "CNNConfig",
    "GPTBlock",
    "GPTConfig",
    "GPTOutput",
    "HFConfig",
    "MLPConfig",
    "ModelConfig",
    "ReferenceModel",
    "UnknownModelError",
    "build",
    "config_for",
    "load_model",
    "param_count",
]
