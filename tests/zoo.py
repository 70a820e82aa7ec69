"""Small models of common layouts, for unit discovery and coverage tests and benchmarks.

Each mirrors the module tree of a well-known model family (torchvision / timm /
Hugging Face names and nesting), at tiny sizes with random weights:

* ``resnet50``: bottleneck blocks in four stage ``Sequential`` s, a shared in-place
  ReLU per block, a stem of separate modules (torchvision's ResNet);
* ``resnet18``: the same with basic blocks;
* ``convnext``: ``features`` alternating stage ``Sequential`` s and downsample layers
  (torchvision's ConvNeXt), so a module runs between the stages;
* ``t5``: Hugging Face T5 (encoder and decoder block lists of one length);
* ``efficientnet``: MBConv blocks with squeeze-excite, an in-place activation right
  after a convolution (selective checkpointing cannot run it), single-block stages;
* ``unet``: down and up blocks in two ``ModuleList`` s, skip connections consumed
  by the up blocks (tensors reused far later);
* ``vit``: a vision transformer (timm's layout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ZOO", "ZooModel", "build"]


@dataclass
class ZooModel:
    """A model, one batch, its loss, and the units the longest-list discovery chose."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], Tensor] | None
    longest_list: list[str]  # what discovery chose before it measured the whole model


def _ce(labels: Tensor) -> Callable[[Any, Any], Tensor]:
    def loss_fn(output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output, labels)

    return loss_fn


# ------------------------------------------------------------------ ResNet (torchvision)
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)  # one module, called three times
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = None
        if stride != 1 or c_in != width:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, width, 1, stride, bias=False),
                                            nn.BatchNorm2d(width))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, block: type, layers: list[int], width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = width
        for k, n in enumerate(layers):
            w = width * 2**k
            blocks = []
            for i in range(n):
                blocks.append(block(c_in, w, 2 if k > 0 and i == 0 else 1))
                c_in = w * block.expansion
            setattr(self, f"layer{k + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resnet(name: str, block: type, layers: list[int], longest: str) -> ZooModel:
    model = ResNet(block, layers)
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    n = dict(zip(["layer1", "layer2", "layer3", "layer4"], layers))[longest]
    return ZooModel(name, model, x, _ce(y), [f"{longest}.{i}" for i in range(n)])


# ------------------------------------------------------------------ ConvNeXt (torchvision)
class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: Tensor) -> Tensor:
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim), Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.1))

    def forward(self, x: Tensor) -> Tensor:
        return self.layer_scale * self.block(x) + x


class Conv2dNormActivation(nn.Sequential):
    """torchvision's stem type: a ``Sequential`` subclass, so ``features`` mixes types."""


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 16, 24, 32),
                 depths: tuple[int, ...] = (3, 3, 9, 3), classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            Conv2dNormActivation(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0]))]
        for k, (dim, depth) in enumerate(zip(dims, depths)):
            layers.append(nn.Sequential(*[CNBlock(dim) for _ in range(depth)]))
            if k + 1 < len(dims):
                layers.append(nn.Sequential(LayerNorm2d(dim), nn.Conv2d(dim, dims[k + 1], 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(dims[-1]), nn.Flatten(1),
                                        nn.Linear(dims[-1], classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.features(x)))


def _convnext() -> ZooModel:
    model = ConvNeXt()
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    return ZooModel("convnext", model, x, _ce(y), [f"features.5.{i}" for i in range(9)])


# ------------------------------------------------------------------ EfficientNet-style
class SqueezeExcite(nn.Module):
    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.act = nn.ReLU(inplace=True)  # in place, right after a convolution
        self.fc2 = nn.Conv2d(squeeze, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = torch.sigmoid(self.fc2(self.act(self.fc1(self.avgpool(x)))))
        return scale * x


class MBConv(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        mid = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        self.block = nn.Sequential(
            Conv2dNormActivation(nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid),
                                 nn.SiLU(inplace=True)),
            Conv2dNormActivation(nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False),
                                 nn.BatchNorm2d(mid), nn.SiLU(inplace=True)),
            SqueezeExcite(mid, max(1, c_in // 4)),
            Conv2dNormActivation(nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out)),
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out + x if self.use_res else out


class EfficientNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        stages = [(8, 1, 1), (12, 2, 2), (16, 2, 2), (24, 3, 2), (32, 1, 1)]  # (c, n, stride)
        layers: list[nn.Module] = [Conv2dNormActivation(
            nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.SiLU(inplace=True))]
        c_in = 8
        for c, n, stride in stages:
            layers.append(nn.Sequential(*[MBConv(c_in if i == 0 else c, c, stride if i == 0 else 1)
                                          for i in range(n)]))
            c_in = c
        layers.append(Conv2dNormActivation(nn.Conv2d(c_in, 64, 1, bias=False),
                                           nn.BatchNorm2d(64), nn.SiLU(inplace=True)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _efficientnet() -> ZooModel:
    model = EfficientNet()
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    # The Conv2dNormActivation of the stem is the longest uniform Sequential (3
    # layers... of different types, so no); stage 3 (index 4) has three MBConvs.
    return ZooModel("efficientnet", model, x, _ce(y), [f"features.4.{i}" for i in range(3)])


# ------------------------------------------------------------------ U-Net
class DoubleConv(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.double_conv = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.double_conv(x)


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(c_in, c_out))

    def forward(self, x: Tensor) -> Tensor:
        return self.maxpool_conv(x)


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_in // 2, 2, stride=2)
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        x = self.up(x)
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    """Down and up blocks in ``ModuleList`` s; each up block takes a skip from far back."""

    def __init__(self, base: int = 8, depth: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.inc = DoubleConv(3, base)
        self.downs = nn.ModuleList([Down(base * 2**k, base * 2 ** (k + 1)) for k in range(depth)])
        self.ups = nn.ModuleList([Up(base * 2 ** (k + 1), base * 2**k)
                                  for k in reversed(range(depth))])
        self.outc = nn.Conv2d(base, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)


def _unet() -> ZooModel:
    model = UNet()
    x = torch.randn(2, 3, 32, 32)
    target = torch.randint(0, 3, (2, 32, 32))
    return ZooModel("unet", model, x, _ce(target), [f"downs.{i}" for i in range(3)])


# ------------------------------------------------------------------ ViT (timm)
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, dim: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 6, heads: int = 2, patch: int = 4,
                 image: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(dim, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.pos_drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(self.pos_drop(x)))
        return self.head(x[:, 0])


def _vit() -> ZooModel:
    model = VisionTransformer()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return ZooModel("vit", model, x, _ce(y), [f"blocks.{i}" for i in range(6)])


# ------------------------------------------------------------------ T5 (Hugging Face)
def _t5() -> ZooModel:
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=3,
                                   num_decoder_layers=3, num_heads=2, dropout_rate=0.1,
                                   decoder_start_token_id=0, pad_token_id=0)
    config.use_cache = False
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(1, 64, (2, 16))
    labels = torch.randint(1, 64, (2, 16))
    return ZooModel("t5", model, {"input_ids": ids, "labels": labels}, None,
                    [f"encoder.block.{i}" for i in range(3)])


ZOO: dict[str, Callable[[], ZooModel]] = {
    "resnet50": lambda: _resnet("resnet50", Bottleneck, [3, 4, 6, 3], "layer3"),
    "resnet18": lambda: _resnet("resnet18", BasicBlock, [2, 2, 2, 2], "layer1"),
    "convnext": _convnext,
    "t5": _t5,
    "efficientnet": _efficientnet,
    "unet": _unet,
    "vit": _vit,
}


def build(name: str, seed: int = 0) -> ZooModel:
    """The zoo model ``name`` with weights and batch drawn from ``seed``, in train mode."""
    torch.manual_seed(seed)
    zoo = ZOO[name]()
    zoo.model.train()
    return zoo
