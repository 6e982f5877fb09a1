"""Vision path (SPEC sections 4, 5 and 8): sample-statistics norm layers and their 8-bit versions
(registered with the quantization surgery on import), the paper's CNNs with a pluggable
norm-activation, the ``ImageClassifier`` wrapper the trainers use, and image datasets with torch
transforms."""
from .classifier import ImageClassifier
from .data import (
    FOLDER,
    MAX_MEASURED_IMAGE_SIZE,
    NO_AUGMENT_DATASETS,
    VISION_DATASETS,
    VisionDatasetSpec,
    VisionTransform,
    folder_spec,
    load_vision_dataset,
    vision_dataset_spec,
    vision_preprocessing,
    vision_transform,
    with_vision_transforms,
)
from .models import ARCHS, DEFAULT_NORM, NORMS, build_vision_model, image_size_problem, mobilenetv2, norm_act, resnet18, resnet20, resnet54, vgg11
from .norms import (
    EvoNormS0,
    RangeBatchNorm2d,
    RangeEvoNorm2d,
    RangeEvoNormFunction,
    evonorm_s0,
    range_batch_norm2d,
    range_evonorm2d,
    range_scale_constant,
)
from .quant_norms import QuantEvoNormS0, QuantNormLayer, QuantRangeBatchNorm2d, QuantRangeEvoNorm2d

__all__ = [
    "ARCHS", "NORMS", "DEFAULT_NORM", "VISION_DATASETS", "FOLDER", "MAX_MEASURED_IMAGE_SIZE", "NO_AUGMENT_DATASETS",
    "EvoNormS0", "RangeEvoNorm2d", "RangeEvoNormFunction", "RangeBatchNorm2d",
    "evonorm_s0", "range_evonorm2d", "range_batch_norm2d", "range_scale_constant",
    "QuantNormLayer", "QuantEvoNormS0", "QuantRangeEvoNorm2d", "QuantRangeBatchNorm2d", "ImageClassifier",
    "build_vision_model", "image_size_problem", "norm_act", "resnet20", "resnet54", "resnet18", "vgg11", "mobilenetv2",
    "VisionDatasetSpec", "VisionTransform", "folder_spec", "load_vision_dataset", "vision_dataset_spec",
    "vision_preprocessing", "vision_transform", "with_vision_transforms",
]
