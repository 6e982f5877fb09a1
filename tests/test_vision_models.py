"""Vision architectures: sizes against the usual definitions, norm replacement, shapes, errors."""
import pytest
import torch
from torch import nn

from lp_decentral_nlp.vision import (
    ARCHS,
    NORMS,
    EvoNormS0,
    ImageClassifier,
    RangeBatchNorm2d,
    RangeEvoNorm2d,
    build_vision_model,
    norm_act,
)

# Smallest convenient input side per architecture (VGG-11 pools 5 times, ResNet-18 and
# MobileNetV2 downsample 32x; the CIFAR ResNets run on 8x8 digits).
INPUT_SIDE = {"resnet20": 8, "resnet54": 8, "resnet18": 32, "vgg11": 32, "mobilenetv2": 32}


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch, num_classes, expected, rel", [
    ("resnet20", 10, 0.27e6, 0.02),        # He et al. 2016, table 6
    ("resnet54", 10, 0.76e6, 0.02),        # the paper's count
    ("vgg11", 10, 9.5e6, 0.02),            # the paper's count (512 hidden units)
    ("resnet18", 1000, 11_689_512, 0.0),   # torchvision resnet18
    ("resnet18", 10, 11.2e6, 0.02),        # the paper's Imagenette model
    ("mobilenetv2", 1000, 3_504_872, 0.0), # torchvision mobilenet_v2
])
def test_parameter_counts_match_usual_definitions(arch, num_classes, expected, rel):
    count = n_params(build_vision_model(arch, num_classes, "batchnorm"))
    assert abs(count - expected) <= rel * expected, count


@pytest.mark.parametrize("arch", list(ARCHS))
def test_norms_change_only_the_norm_parameters(arch):
    base = build_vision_model(arch, 10, "batchnorm")
    n_bn = sum(1 for m in base.modules() if isinstance(m, nn.BatchNorm2d))
    bn_act = sum(1 for m in base.modules()
                 if isinstance(m, nn.Sequential) and isinstance(getattr(m, "norm", None), nn.BatchNorm2d)
                 and hasattr(m, "act"))
    for norm in ("groupnorm", "range_batchnorm"):
        assert n_params(build_vision_model(arch, 10, norm)) == n_params(base)
    for norm, cls in (("evonorm", EvoNormS0), ("range_evonorm", RangeEvoNorm2d)):
        model = build_vision_model(arch, 10, norm)
        layers = [m for m in model.modules() if isinstance(m, cls)]
        # Every BN+act pair became one fused layer with v; every lone BN a layer without it.
        assert len(layers) == n_bn
        assert sum(m.apply_act for m in layers) == bn_act
        assert n_params(model) == n_params(base) + sum(m.v.numel() for m in layers if m.apply_act)
        assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_activations_outside_norm_pairs_remain(arch):
    def lone_acts(model):
        paired = {id(m.act) for m in model.modules() if isinstance(m, nn.Sequential) and hasattr(m, "act")}
        return sum(1 for m in model.modules()
                   if isinstance(m, (nn.ReLU, nn.ReLU6)) and id(m) not in paired)

    base = build_vision_model(arch, 10, "batchnorm")
    evo = build_vision_model(arch, 10, "range_evonorm")
    assert lone_acts(evo) == lone_acts(base)
    assert sum(isinstance(m, (nn.ReLU, nn.ReLU6)) for m in evo.modules()) == lone_acts(base)


def test_mobilenetv2_keeps_relu6_and_resnet_relu():
    assert any(isinstance(m, nn.ReLU6) for m in build_vision_model("mobilenetv2", 10, "batchnorm").modules())
    assert not any(isinstance(m, nn.ReLU6) for m in build_vision_model("resnet20", 10, "batchnorm").modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_every_builder_and_the_classifier_take_one_default_norm(arch):
    """The builders, build_vision_model and ImageClassifier share vision.DEFAULT_NORM (BatchNorm)."""
    for net in (build_vision_model(arch), ARCHS[arch](), ImageClassifier(arch).net):
        kinds = {type(m) for m in net.modules()}
        assert nn.BatchNorm2d in kinds and not kinds & {RangeEvoNorm2d, nn.GroupNorm, EvoNormS0}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_forward_backward_shapes(arch, norm):
    model = build_vision_model(arch, num_classes=7, norm=norm)
    side = INPUT_SIDE[arch]
    logits = model(torch.randn(2, 3, side, side))
    assert logits.shape == (2, 7)
    logits.logsumexp(1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, side, side)).shape == (1, 7)


@pytest.mark.parametrize("norm", NORMS)
def test_resnet20_fits_a_small_batch(norm):
    torch.manual_seed(0)
    model = build_vision_model("resnet20", 4, norm)
    x, y = torch.randn(16, 3, 8, 8), torch.arange(16) % 4
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first


def test_norm_act_kinds():
    assert isinstance(norm_act("range_batchnorm", 8, apply_act=False), RangeBatchNorm2d)
    pair = norm_act("groupnorm", 8, act_layer=nn.ReLU6, groups=4)
    assert isinstance(pair.norm, nn.GroupNorm) and pair.norm.num_groups == 4 and isinstance(pair.act, nn.ReLU6)
    assert norm_act("evonorm", 8, apply_act=False).v is None
    assert isinstance(norm_act("batchnorm", 8, act_layer=nn.GELU).act, nn.GELU)  # it takes no inplace argument


@pytest.mark.parametrize("kwargs, why", [(dict(norm="evonorm"), r"evonorm fuses its own activation \(SPEC 5\)"),
                                         (dict(norm="range_evonorm"), r"range_evonorm fuses its own activation \(SPEC 5\)"),
                                         (dict(norm="batchnorm", apply_act=False), "apply_act=False builds the norm "
                                                                                   "without one")])
def test_an_activation_that_would_not_run_is_refused(kwargs, why):
    """The fused norms dropped act_layer=nn.GELU without a word."""
    with pytest.raises(ValueError, match=rf"^act_layer=GELU is the activation after the norm, and {why}: leave "
                                         r"act_layer at nn.ReLU"):
        norm_act(num_channels=8, act_layer=nn.GELU, **kwargs)


def test_the_image_classifier_takes_numpy_counts_and_refuses_one_class(tmp_path):
    """np.max(labels) + 1 for num_classes failed in json.dumps when the trained model was saved, and
    one class failed at the first step with "Target 1 is out of bounds"."""
    import numpy as np

    from lp_decentral_nlp.vision import ImageClassifier

    model = ImageClassifier("resnet20", num_classes=np.int64(3), norm="range_evonorm", groups=np.int64(4))
    model.save_pretrained(tmp_path)
    assert ImageClassifier.from_pretrained(tmp_path).vision_config == {
        "arch": "resnet20", "num_classes": 3, "norm": "range_evonorm", "groups": 4, "preprocessing": None}
    with pytest.raises(ValueError, match=r"^num_classes must be an integer >= 2, got 1"):
        ImageClassifier("resnet20", num_classes=1)
    with pytest.raises(FileNotFoundError, match=r"nothing-here does not exist$"):
        ImageClassifier.from_pretrained(tmp_path / "nothing-here")


def test_invalid_arguments():
    with pytest.raises(ValueError, match="norm must be one of batchnorm, groupnorm, evonorm"):
        build_vision_model("resnet20", 10, "layernorm")
    with pytest.raises(ValueError, match="arch must be one of resnet20, resnet54, resnet18, vgg11, mobilenetv2"):
        build_vision_model("resnet50", 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_vision_model("vgg11", 0)
    with pytest.raises(ValueError, match="at least 2 channels per group"):
        build_vision_model("resnet20", 10, "range_evonorm", groups=16)
    with pytest.raises(ValueError, match="at least 32x32"):
        build_vision_model("vgg11", 10)(torch.randn(1, 3, 16, 16))
    for norm in ("batchnorm", "groupnorm"):
        with pytest.raises(ValueError, match=r"^groups must be an integer >= 1, got 0"):
            build_vision_model("resnet20", 10, norm, groups=0)
    with pytest.raises(ValueError, match=r"^groups=4 is the group count of groupnorm, evonorm, range_evonorm; "
                                         r"norm='range_batchnorm' has no groups"):
        build_vision_model("resnet20", 10, "range_batchnorm", groups=4)
