"""Vision models of the paper's experiments with a pluggable normalisation (SPEC sections 5, 8).

Every model is built around :func:`norm_act`: where the usual definition has a BatchNorm2d
followed by a ReLU, it places the chosen normalisation-activation. For ``batchnorm``,
``groupnorm`` and ``range_batchnorm`` that is the norm followed by the activation; ``evonorm``
and ``range_evonorm`` fuse the activation into the norm, so one layer replaces both. A BatchNorm
with no activation after it (the second norm of a residual block, a projection shortcut, a
MobileNetV2 projection) becomes the chosen norm without activation (EvoNorm-style layers with
``apply_act=False``, as in Liu et al. 2020 and timm). Activations that are not part of a
norm+activation pair (the ReLU after a residual addition, the classifier's hidden ReLU) stay.

Note: the paper's published ResNet code instead keeps the fused activation in the second
EvoNorm of a block and in the shortcut, and drops the ReLU after the addition.

Architectures (``build_vision_model(arch, num_classes, norm)``):
- ``resnet20``, ``resnet54``: CIFAR ResNets, 3x3 stem with 16 channels, three stages of basic
  blocks with 16/32/64 channels and ``n = (depth - 2) // 6`` blocks each (3 and 8; for 54 this is
  the integer division of the reference code, 0.76M parameters as the paper reports), projection
  (1x1 conv + norm) shortcuts where the shape changes.
- ``resnet18``: ImageNet ResNet-18 (7x7/2 stem, 3x3/2 max-pool, [2, 2, 2, 2] basic blocks).
- ``vgg11``: VGG configuration "A" convolutions, each followed by the norm-activation, global
  average pooling, then Linear(512, 512) - ReLU - Linear(512, num_classes).
- ``mobilenetv2``: MobileNetV2 (width 1.0, ImageNet strides, ReLU6 for the non-fused norms,
  dropout 0.2 before the classifier).
Convolutions that feed a norm have no bias. Inputs are (N, 3, H, W) images, outputs
(N, num_classes) logits.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from ..checks import Number, check_field, check_number
from ..quant import QuantModule
from .norms import EvoNormS0, RangeBatchNorm2d, RangeEvoNorm2d

__all__ = [
    "NORMS",
    "DEFAULT_NORM",
    "ARCHS",
    "norm_act",
    "ResNet",
    "VGG",
    "MobileNetV2",
    "resnet20",
    "resnet54",
    "resnet18",
    "vgg11",
    "mobilenetv2",
    "build_vision_model",
]

NORMS = ("batchnorm", "groupnorm", "evonorm", "range_batchnorm", "range_evonorm")
#: the nets' norm unless told: BatchNorm, as torchvision's nets. SPEC 5 pairs Range EvoNorm with 8-bit
#: training and EvoNorm-S0 with fp32 (the recipes' --norm auto) because batch statistics fail under
#: strong label skew in the paper's CIFAR runs; on the bundled digits BatchNorm trained within a point
#: of them in fp32 (docs/benchmarks.md's norm comparison, one seed) and better in 8-bit at skew 0.8
#: (an audit's two seeds), so the nets keep the common default.
DEFAULT_NORM = "batchnorm"


#: the norms that normalise over groups of channels, and the group count they use by default
GROUPED_NORMS, DEFAULT_GROUPS = ("groupnorm", "evonorm", "range_evonorm"), 2
#: the norms with their own activation (EvoNorm-S0's x * sigmoid(v x), Range EvoNorm's hard sigmoid)
FUSED_NORMS = ("evonorm", "range_evonorm")


def _checked_groups(norm: str, groups) -> int:
    """``groups`` as an int; ValueError for a ``norm`` not in :data:`NORMS`, a ``groups`` that is not
    an integer >= 1, or a group count other than the default given to a norm without groups (it
    would be ignored)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}; got {norm!r}")
    groups = check_field("groups", groups)
    if norm not in GROUPED_NORMS and groups != DEFAULT_GROUPS:
        raise ValueError(f"groups={groups} is the group count of {', '.join(GROUPED_NORMS)}; norm={norm!r} has no "
                         f"groups: leave groups at {DEFAULT_GROUPS}")
    return groups


def norm_act(
    norm: str,
    num_channels: int,
    *,
    apply_act: bool = True,
    act_layer: type[nn.Module] = nn.ReLU,
    groups: int = DEFAULT_GROUPS,
) -> nn.Module:
    """The layer that replaces ``BatchNorm2d(num_channels)`` (+ ``act_layer`` if ``apply_act``).

    norm: one of :data:`NORMS`. ``groups`` is the group count of ``groupnorm``, ``evonorm`` and
    ``range_evonorm`` (the paper uses 2; another value with a batch norm is a ValueError).
    ``act_layer``: the activation class of a non-fused norm with ``apply_act`` (built with
    ``inplace=True`` where it takes that argument); another than the default is a ValueError for the
    fused norms (their activation is their own) and without ``apply_act``.
    Returns a module mapping (N, C, H, W) to (N, C, H, W); non-fused norms with an activation
    come as ``nn.Sequential(norm=..., act=...)``.
    """
    groups = _checked_groups(norm, groups)
    if act_layer is not nn.ReLU and (norm in FUSED_NORMS or not apply_act):
        why = (f"{norm} fuses its own activation (SPEC 5)" if norm in FUSED_NORMS else
               "apply_act=False builds the norm without one")
        raise ValueError(f"act_layer={getattr(act_layer, '__name__', act_layer)} is the activation after the norm, "
                         f"and {why}: leave act_layer at nn.ReLU")
    if norm == "evonorm":
        return EvoNormS0(num_channels, groups=groups, apply_act=apply_act)
    if norm == "range_evonorm":
        return RangeEvoNorm2d(num_channels, groups=groups, apply_act=apply_act)
    if norm == "batchnorm":
        layer = nn.BatchNorm2d(num_channels)
    elif norm == "groupnorm":
        layer = nn.GroupNorm(groups, num_channels)
    else:
        layer = RangeBatchNorm2d(num_channels)
    if not apply_act:
        return layer
    takes_inplace = "inplace" in inspect.signature(act_layer).parameters  # nn.GELU does not
    return nn.Sequential(OrderedDict(norm=layer, act=act_layer(inplace=True) if takes_inplace else act_layer()))


NormFactory = Callable[..., nn.Module]


def _conv_norm_act(cin: int, cout: int, kernel: int, stride: int, make_norm: NormFactory,
                   apply_act: bool = True, groups: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, groups=groups, bias=False)
    return nn.Sequential(OrderedDict(conv=conv, norm=make_norm(cout, apply_act=apply_act)))


def _init_weights(model: nn.Module) -> None:
    # Kaiming-normal (fan_out) convolutions, as torchvision; norm layers start at weight 1,
    # bias 0 (and v = 1) from their constructors.
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


class BasicBlock(nn.Module):
    """Residual basic block: conv3x3-norm_act-conv3x3-norm, + shortcut, then ReLU.

    Input (N, cin, H, W) -> output (N, cout, H/stride, W/stride).
    """

    def __init__(self, cin: int, cout: int, stride: int, make_norm: NormFactory):
        super().__init__()
        self.conv1 = _conv_norm_act(cin, cout, 3, stride, make_norm)
        self.conv2 = _conv_norm_act(cout, cout, 3, 1, make_norm, apply_act=False)
        self.shortcut = (
            _conv_norm_act(cin, cout, 1, stride, make_norm, apply_act=False)
            if stride != 1 or cin != cout
            else nn.Identity()
        )
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv2(self.conv1(x)) + self.shortcut(x))


def _as_8bit_convolutions_take_it(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The images as `net`'s convolutions run them fastest: channels last (``torch.channels_last``)
    when any is an 8-bit layer, so the 8-bit convolutions pass channels-last tensors along without
    copying their outputs back (an 8-bit layer keeps its input's layout, as ``nn.Conv2d``;
    ResNet-20's 8-bit step, batch 32: 0.59x fp32 from channels-last images, 0.74x from contiguous
    ones, docs/design.md); as they are in fp32, which channels last does not speed up."""
    quantized = any(isinstance(m, nn.Conv2d) and isinstance(m, QuantModule) for m in net.modules())
    return x.contiguous(memory_format=torch.channels_last) if quantized else x


class ResNet(nn.Module):
    """ResNet of basic blocks: stem, stages (``depths[i]`` blocks of ``widths[i]`` channels; the
    first block of every stage but the first has stride 2), global average pool, linear head
    ``classifier`` (the name ``quant.DEFAULT_SKIP`` keeps full precision, as in VGG/MobileNetV2).

    stem: ``"cifar"`` (3x3/1 conv) or ``"imagenet"`` (7x7/2 conv and 3x3/2 max-pool).
    """

    def __init__(self, depths: tuple[int, ...], widths: tuple[int, ...], stem: str,
                 num_classes: int, make_norm: NormFactory):
        super().__init__()
        if stem == "cifar":
            self.stem = _conv_norm_act(3, widths[0], 3, 1, make_norm)
        elif stem == "imagenet":
            self.stem = nn.Sequential(_conv_norm_act(3, widths[0], 7, 2, make_norm),
                                      nn.MaxPool2d(3, stride=2, padding=1))
        else:
            raise ValueError(f"stem must be 'cifar' or 'imagenet', got {stem!r}")
        stages, cin = [], widths[0]
        for i, (depth, width) in enumerate(zip(depths, widths)):
            blocks = []
            for j in range(depth):
                blocks.append(BasicBlock(cin, width, 2 if (i > 0 and j == 0) else 1, make_norm))
                cin = width
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _as_8bit_convolutions_take_it(self, x)
        return self.classifier(self.pool(self.stages(self.stem(x))).flatten(1))


_VGG11_CONFIG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    """VGG: ``config`` of conv widths and ``"M"`` (2x2 max-pool), each conv followed by the
    norm-activation; global average pool; ``hidden``: Linear(last, hidden) - ReLU; ``classifier``:
    Linear(hidden, classes), the head the 8-bit surgery keeps float by default (``DEFAULT_SKIP``).

    The input side must be at least ``2 ** (number of pools)`` (32 for VGG-11).
    """

    def __init__(self, config: tuple, num_classes: int, make_norm: NormFactory, hidden: int = 512):
        super().__init__()
        layers, cin = [], 3
        for item in config:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers.append(_conv_norm_act(cin, item, 3, 1, make_norm))
                cin = item
        self.features = nn.Sequential(*layers)
        self.min_size = 2 ** config.count("M")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.hidden = nn.Sequential(nn.Linear(cin, hidden), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(hidden, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) < self.min_size:
            raise ValueError(
                f"VGG needs images of at least {self.min_size}x{self.min_size}, got {tuple(x.shape)}"
            )
        x = _as_8bit_convolutions_take_it(self, x)
        return self.classifier(self.hidden(self.pool(self.features(x)).flatten(1)))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand (if ratio > 1) - 3x3 depthwise - 1x1 linear projection,
    with an identity shortcut when the stride is 1 and the width is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int, make_norm: NormFactory):
        super().__init__()
        hidden = cin * expand_ratio
        layers = [_conv_norm_act(cin, hidden, 1, 1, make_norm)] if expand_ratio != 1 else []
        layers += [
            _conv_norm_act(hidden, hidden, 3, stride, make_norm, groups=hidden),
            _conv_norm_act(hidden, cout, 1, 1, make_norm, apply_act=False),
        ]
        self.block = nn.Sequential(*layers)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.use_residual else out


# (expansion t, output channels c, repeats n, first stride s), Sandler et al. 2018 table 2.
_MOBILENETV2_CONFIG = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class MobileNetV2(nn.Module):
    """MobileNetV2 (width multiplier 1.0): 3x3/2 stem with 32 channels, the inverted-residual
    stages of Sandler et al. 2018, 1x1 conv to 1280, global average pool, dropout, linear."""

    def __init__(self, num_classes: int, make_norm: NormFactory, dropout: float = 0.2):
        super().__init__()
        layers, cin = [_conv_norm_act(3, 32, 3, 2, make_norm)], 32
        for t, c, n, s in _MOBILENETV2_CONFIG:
            for j in range(n):
                layers.append(InvertedResidual(cin, c, s if j == 0 else 1, t, make_norm))
                cin = c
        layers.append(_conv_norm_act(cin, 1280, 1, 1, make_norm))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(1280, num_classes))
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _as_8bit_convolutions_take_it(self, x)
        return self.classifier(self.pool(self.features(x)).flatten(1))


def _norm_factory(norm: str, groups: int, act_layer: type[nn.Module] = nn.ReLU) -> NormFactory:
    """``make_norm(num_channels, apply_act)``: :func:`norm_act` of ``norm`` with ``act_layer``
    where it applies (a non-fused norm with its activation; MobileNetV2's ReLU6)."""
    groups = _checked_groups(norm, groups)

    def make_norm(num_channels: int, apply_act: bool = True) -> nn.Module:
        act = act_layer if apply_act and norm not in FUSED_NORMS else nn.ReLU
        return norm_act(norm, num_channels, apply_act=apply_act, act_layer=act, groups=groups)

    return make_norm


def _checked_num_classes(num_classes: int) -> int:
    """``num_classes`` as an int >= 2: the nets are classifiers trained with cross-entropy (one class
    failed at the first step with "Target 1 is out of bounds")."""
    return check_number("num_classes", num_classes, Number(integer=True, low=2))


def resnet20(num_classes: int = 10, norm: str = DEFAULT_NORM, groups: int = DEFAULT_GROUPS) -> ResNet:
    """CIFAR ResNet-20: 3 stages x 3 basic blocks, 16/32/64 channels (0.27M parameters)."""
    num_classes = _checked_num_classes(num_classes)
    return ResNet((3, 3, 3), (16, 32, 64), "cifar", num_classes, _norm_factory(norm, groups))


def resnet54(num_classes: int = 10, norm: str = DEFAULT_NORM, groups: int = DEFAULT_GROUPS) -> ResNet:
    """CIFAR ResNet-54: 3 stages x 8 basic blocks (``(54 - 2) // 6``), 16/32/64 channels
    (0.76M parameters)."""
    num_classes = _checked_num_classes(num_classes)
    return ResNet((8, 8, 8), (16, 32, 64), "cifar", num_classes, _norm_factory(norm, groups))


def resnet18(num_classes: int = 10, norm: str = DEFAULT_NORM, groups: int = DEFAULT_GROUPS) -> ResNet:
    """ImageNet ResNet-18: [2, 2, 2, 2] basic blocks, 64/128/256/512 channels
    (11.18M parameters for 10 classes, 11.69M for 1000)."""
    num_classes = _checked_num_classes(num_classes)
    return ResNet((2, 2, 2, 2), (64, 128, 256, 512), "imagenet", num_classes,
                  _norm_factory(norm, groups))


def vgg11(num_classes: int = 10, norm: str = DEFAULT_NORM, groups: int = DEFAULT_GROUPS) -> VGG:
    """VGG-11 (configuration "A") with a 512-unit hidden linear layer (9.49M parameters for 10
    classes)."""
    num_classes = _checked_num_classes(num_classes)
    return VGG(_VGG11_CONFIG, num_classes, _norm_factory(norm, groups))


def mobilenetv2(num_classes: int = 10, norm: str = DEFAULT_NORM, groups: int = DEFAULT_GROUPS) -> MobileNetV2:
    """MobileNetV2 width 1.0 (2.24M parameters for 10 classes, 3.50M for 1000)."""
    num_classes = _checked_num_classes(num_classes)
    return MobileNetV2(num_classes, _norm_factory(norm, groups, act_layer=nn.ReLU6))


ARCHS: dict[str, Callable[..., nn.Module]] = {
    "resnet20": resnet20,
    "resnet54": resnet54,
    "resnet18": resnet18,
    "vgg11": vgg11,
    "mobilenetv2": mobilenetv2,
}


def image_size_problem(net: nn.Module, arch: str, image_size: int) -> str | None:
    """``"<arch> needs images of at least SxS, got <image_size>"`` when ``image_size`` (pixels) is
    below ``net``'s smallest input (``net.min_size``: VGG's pooling halves it five times), else None."""
    min_size = getattr(net, "min_size", 1)
    if image_size < min_size:
        return f"{arch} needs images of at least {min_size}x{min_size}, got {image_size}"
    return None


def build_vision_model(arch: str, num_classes: int = 10, norm: str = DEFAULT_NORM,
                       groups: int = DEFAULT_GROUPS) -> nn.Module:
    """Registry entry point for the recipes: ``arch`` in :data:`ARCHS`, ``norm`` in :data:`NORMS`
    (:data:`DEFAULT_NORM` unless told; SPEC 5's pairs: ``range_evonorm`` for 8-bit, ``evonorm`` for fp32)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    groups = _checked_groups(norm, groups)
    num_classes = _checked_num_classes(num_classes)  # before the try: its error is not a group count's
    try:
        return ARCHS[arch](num_classes=num_classes, norm=norm, groups=groups)
    except ValueError as err:
        if norm not in GROUPED_NORMS or groups == 1:  # not a group count that misfits a layer
            raise
        allowed = _group_counts(arch, norm)  # the layer said which of its channel counts failed
        raise ValueError(f"groups={groups} does not fit every norm layer of {arch} ({err}): {norm} on {arch} "
                         f"takes groups in {allowed}") from None


def _group_counts(arch: str, norm: str) -> list[int]:
    """The group counts ``norm`` (one of :data:`GROUPED_NORMS`) takes on every norm layer of
    ``arch``: the common divisors of their channel counts, leaving Range EvoNorm 2 channels or
    more per group."""
    net = ARCHS[arch](norm=norm, groups=1) if norm != "range_evonorm" else ARCHS[arch](norm="evonorm", groups=1)
    channels = {m.num_channels for m in net.modules() if isinstance(m, (nn.GroupNorm, EvoNormS0, RangeEvoNorm2d))}
    least = min(channels) // (2 if norm == "range_evonorm" else 1)
    return [g for g in range(1, least + 1) if all(c % g == 0 for c in channels)]
