"""The budget promise on models no test or preset of remat was written or tuned for.

Same procedure and table as ``prediction_accuracy.py`` (profile once; at five
budgets from the smallest feasible peak to no checkpointing solve, apply, measure
one optimizer step of the loop with both instruments, then run ``remat.solve``'s
verification), on models that appear nowhere else in the repository:

- ``qwen2-trainer``: ``transformers`` Qwen2 (grouped-query attention, RoPE, SwiGLU)
  in a Trainer-style loop: 2 micro-batches, bf16 autocast, AdamW, output dropped;
- ``bart``: ``transformers`` BART, an encoder-decoder whose decoder blocks all take
  the encoder's output, in a plain loop that keeps the output;
- ``hf-vit-adamw``: ``transformers`` ViT image classifier, with AdamW;
- ``mixtral-moe-trainer``: ``transformers`` Mixtral, a mixture of experts trained with its
  router's load-balancing loss (``output_router_logits=True``), Trainer-style loop (output
  dropped, AdamW);
- ``qwen2-lora``: ``peft`` LoRA (rank 8 on the attention projections) on ``transformers``
  Qwen2, output dropped, AdamW over the adapters;
- ``bart-drop-output``: BART in a loop that drops the output (its decoder head adds
  ``final_logits_bias`` to the logits before its loss);
- ``falcon``: ``transformers`` Falcon (parallel attention and MLP, ALiBi), whose blocks
  add the attention's output in place into the MLP's last projection
  (``mlp_output += attention_output``): a tensor ``selective`` keeps, which the profile
  now refuses as the runtime does (torch alone trains on);
- ``gemma2-bf16``: ``transformers`` Gemma 2 (sliding-window and global layers, logits
  soft-capped before the loss, so the head is no plain linear and cross entropy) under
  bf16 autocast, AdamW, output dropped;
- ``olmoe-moe``: ``transformers`` OLMoE, a mixture of experts with its router's loss;
- ``whisper``: ``transformers`` Whisper, a speech encoder-decoder (a convolution
  front end on log-mel features, the decoder's blocks taking the encoder's output);
- ``mamba``: ``transformers`` Mamba, a state-space model (no attention; the reference
  PyTorch scan, as without ``mamba_ssm``);
- ``deberta-v2-cls``: ``transformers`` DeBERTa-v2 (disentangled relative attention, the
  relative embeddings handed to every block) classifying sequences;
- ``hf-convnext-blocks``: ``transformers`` ConvNeXt-T image classifier with its 18 blocks
  as the units (``units=ConvNextLayer``): the downsampling layers between its stages are
  no units, so the units are not a chain;
- ``hf-swin-blocks``: ``transformers`` Swin-T with its 12 blocks as the units (patch
  merging between the stages);
- ``densenet``: a DenseNet written to torchvision's layout (``features`` with dense
  blocks whose layers each take the concatenation of every earlier layer's output,
  transitions between them; BatchNorm), cross entropy; ``densenet-auto``: the same
  with ``granularity="auto"``, which plans the dense layers and the transitions'
  modules instead of the seven blocks.

Prints a markdown table and writes it to benchmarks/results/unseen_models.md.

    .venv/bin/python benchmarks/unseen_models.py [--cases bart densenet] [--repeats 3]
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers_run.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from prediction_accuracy import Case, run_cli  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import remat  # noqa: E402


def _qwen2_trainer() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256, use_cache=False)
    model = transformers.Qwen2ForCausalLM(config).train()
    ids = torch.randint(0, 4096, (8, 128))
    loop = remat.Loop(keep_output=False, accumulation_steps=2, autocast="bfloat16")
    return Case(model, {"input_ids": ids, "labels": ids}, None, loop, adamw=True)


def _bart() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.BartConfig(
        d_model=256, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
        vocab_size=4096, max_position_embeddings=256, use_cache=False)
    model = transformers.BartForConditionalGeneration(config).train()
    src = torch.randint(4, 4096, (8, 128))
    labels = torch.randint(4, 4096, (8, 64))
    return Case(model, {"input_ids": src, "labels": labels}, None, remat.Loop())


def _hf_vit() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=1024,
        image_size=64, patch_size=8, num_labels=10)
    model = transformers.ViTForImageClassification(config).train()
    pixels = torch.randn(16, 3, 64, 64)
    labels = torch.randint(0, 10, (16,))
    return Case(model, {"pixel_values": pixels, "labels": labels}, None, remat.Loop(),
                adamw=True)


def _causal_lm(architecture: str, *, loop: remat.Loop | None = None, adamw: bool = True,
               batch: tuple[int, int] = (4, 128), **config: object) -> Case:
    """``transformers``' ``<architecture>ForCausalLM`` from a small config, random weights
    (seed 0), a batch of random token ids as their own labels; the loop drops the output
    unless ``loop`` says otherwise."""
    import transformers

    torch.manual_seed(0)
    made = getattr(transformers, f"{architecture}Config")(use_cache=False, **config)
    model = getattr(transformers, f"{architecture}ForCausalLM")(made).train()
    ids = torch.randint(0, made.vocab_size, batch)
    return Case(model, {"input_ids": ids, "labels": ids}, None,
                loop or remat.Loop(keep_output=False), adamw=adamw)


def _mixtral_moe_trainer() -> Case:
    return _causal_lm(
        "Mixtral", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=8192, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)


def _falcon() -> Case:
    return _causal_lm(
        "Falcon", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        vocab_size=4096, new_decoder_architecture=False, parallel_attn=True, alibi=True)


def _gemma2() -> Case:
    return _causal_lm(
        "Gemma2", loop=remat.Loop(keep_output=False, autocast="bfloat16"), hidden_size=256,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=64, vocab_size=4096,
        max_position_embeddings=256)


def _olmoe() -> Case:
    return _causal_lm(
        "Olmoe", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
        output_router_logits=True, vocab_size=4096, max_position_embeddings=256)


def _mamba() -> Case:
    return _causal_lm("Mamba", adamw=False, batch=(2, 64), hidden_size=128,
                      num_hidden_layers=4, vocab_size=4096, state_size=8)


def _qwen2_lora() -> Case:
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256, use_cache=False)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(config),
                                peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 8192, (4, 128))
    return Case(model.train(), {"input_ids": ids, "labels": ids}, None,
                remat.Loop(keep_output=False), adamw=True)


def _whisper() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        d_model=128, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=2048,
        num_mel_bins=80, max_source_positions=750, max_target_positions=128, use_cache=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = transformers.WhisperForConditionalGeneration(config).train()
    features = torch.randn(2, 80, 1500)
    labels = torch.randint(3, 2048, (2, 64))
    return Case(model, {"input_features": features, "labels": labels}, None, remat.Loop())


def _deberta() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        vocab_size=4096, relative_attention=True, pos_att_type=["p2c", "c2p"], num_labels=3)
    model = transformers.DebertaV2ForSequenceClassification(config).train()
    ids = torch.randint(0, 4096, (4, 128))
    return Case(model, {"input_ids": ids, "labels": torch.randint(0, 3, (4,))}, None,
                remat.Loop())


def _bart_drop_output() -> Case:
    case = _bart()
    case.loop = remat.Loop(keep_output=False)
    return case
def _hf_convnext_blocks() -> Case:
    import transformers
    from transformers.models.convnext.modeling_convnext import ConvNextLayer

    torch.manual_seed(0)
    config = transformers.ConvNextConfig(depths=[3, 3, 9, 3], hidden_sizes=[96, 192, 384, 768],
                                         num_labels=10)
    model = transformers.ConvNextForImageClassification(config).train()
    batch = {"pixel_values": torch.randn(2, 3, 224, 224), "labels": torch.randint(0, 10, (2,))}
    return Case(model, batch, None, remat.Loop(), profile_options={"units": ConvNextLayer})


def _hf_swin_blocks() -> Case:
    import transformers
    from transformers.models.swin.modeling_swin import SwinLayer

    torch.manual_seed(0)
    config = transformers.SwinConfig(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                                     image_size=224, window_size=7, num_labels=10)
    model = transformers.SwinForImageClassification(config).train()
    batch = {"pixel_values": torch.randn(2, 3, 224, 224), "labels": torch.randint(0, 10, (2,))}
    return Case(model, batch, None, remat.Loop(), profile_options={"units": SwinLayer})


class _DenseLayer(nn.Module):
    """torchvision's layout: BN-ReLU-1x1 conv to ``bn_size * growth``, BN-ReLU-3x3 conv."""

    def __init__(self, channels: int, growth: int, bn_size: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(channels, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class _DenseBlock(nn.ModuleDict):
    """Each layer takes every earlier output: the block is not a chain of its layers."""

    def __init__(self, layers: int, channels: int, growth: int) -> None:
        super().__init__()
        for i in range(layers):
            self[f"denselayer{i + 1}"] = _DenseLayer(channels + i * growth, growth)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, channels: int, out: int) -> None:
        super().__init__(OrderedDict(
            norm=nn.BatchNorm2d(channels), relu=nn.ReLU(inplace=True),
            conv=nn.Conv2d(channels, out, 1, bias=False), pool=nn.AvgPool2d(2, 2)))


class DenseNet(nn.Module):
    def __init__(self, growth: int = 16, blocks: tuple[int, ...] = (4, 6, 8, 4),
                 init_channels: int = 32, classes: int = 10) -> None:
        super().__init__()
        layers: OrderedDict[str, nn.Module] = OrderedDict(
            conv0=nn.Conv2d(3, init_channels, 3, padding=1, bias=False),
            norm0=nn.BatchNorm2d(init_channels), relu0=nn.ReLU(inplace=True))
        channels = init_channels
        for i, count in enumerate(blocks):
            layers[f"denseblock{i + 1}"] = _DenseBlock(count, channels, growth)
            channels += count * growth
            if i != len(blocks) - 1:
                layers[f"transition{i + 1}"] = _Transition(channels, channels // 2)
                channels //= 2
        layers["norm5"] = nn.BatchNorm2d(channels)
        self.features = nn.Sequential(layers)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.features(x), inplace=True)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _densenet() -> Case:
    torch.manual_seed(0)
    images = torch.randn(16, 3, 64, 64)
    labels = torch.randint(0, 10, (16,))
    return Case(DenseNet().train(), images, lambda out, _batch: F.cross_entropy(out, labels),
                remat.Loop())


def _densenet_children() -> Case:
    case = _densenet()
    case.profile_options["granularity"] = "auto"  # 7 blocks: their children compete
    return case


CASES: dict[str, Callable[[], Case]] = {
    "qwen2-trainer": _qwen2_trainer,
    "bart": _bart,
    "hf-vit-adamw": _hf_vit,
    "mixtral-moe-trainer": _mixtral_moe_trainer,
    "qwen2-lora": _qwen2_lora,
    "bart-drop-output": _bart_drop_output,
    "falcon": _falcon,
    "gemma2-bf16": _gemma2,
    "olmoe-moe": _olmoe,
    "whisper": _whisper,
    "mamba": _mamba,
    "deberta-v2-cls": _deberta,
    "hf-convnext-blocks": _hf_convnext_blocks,
    "hf-swin-blocks": _hf_swin_blocks,
    "densenet": _densenet,
    "densenet-auto": _densenet_children,
}


def main() -> None:
    run_cli(CASES, description=__doc__.split("\n\n")[0],
            title="The budget on models remat was not written for", script="unseen_models")


if __name__ == "__main__":
    main()
