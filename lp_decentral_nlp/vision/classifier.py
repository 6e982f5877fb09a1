"""`ImageClassifier`: a vision net behind the interface `transformers.Trainer` and
`DecentralizedTrainer` use (``forward(pixel_values, labels)`` -> ``.loss``/``.logits``), with a
save/load of its own (these nets are not Hugging Face models).

Saved folder: ``model.safetensors`` (the state dict: fp32 master weights and every buffer, the
8-bit layers' activation ranges included) and ``vision_config.json`` (``arch``, ``num_classes``,
``norm``, ``groups``, ``preprocessing`` and, for a model passed through ``quantize_model``, its
``QuantConfig`` and the names of its 8-bit layers, so that a model quantized in part reloads as it
was saved).
"""
from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput

from ..checks import plain_number
from ..quant import QuantConfig, QuantModule, quantize_model
from .models import DEFAULT_GROUPS, DEFAULT_NORM, build_vision_model

__all__ = ["ImageClassifier", "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME, WEIGHTS_NAME = "vision_config.json", "model.safetensors"


class ImageClassifier(nn.Module):
    """A :func:`build_vision_model` net returning ``ImageClassifierOutput(loss, logits)``.

    Args:
        arch, num_classes, norm, groups: as :func:`~lp_decentral_nlp.vision.build_vision_model`.
        preprocessing: how its inputs are made, saved with it so that the model says how to feed
            it: ``{"labels": [class names by index], "image_size": S, "mean": [3], "std": [3]}``
            (the recipes' :class:`~lp_decentral_nlp.vision.VisionTransform`: RGB, S x S, values in
            [0, 1] normalised per channel); None: not recorded.
    Attributes:
        net: the CNN (``pixel_values (N, 3, H, W)`` -> logits ``(N, num_classes)``).
        vision_config: the dict above, written by :meth:`save_pretrained`.
    """

    #: the forward's input, as transformers models name theirs (Trainer's ``include_for_metrics``)
    main_input_name = "pixel_values"

    def __init__(self, arch: str, num_classes: int = 10, norm: str = DEFAULT_NORM, groups: int = DEFAULT_GROUPS,
                 preprocessing: dict | None = None):
        preprocessing = _checked_preprocessing(preprocessing, num_classes)
        super().__init__()
        self.net = build_vision_model(arch, num_classes, norm, groups)  # checks them
        # as Python ints: a NumPy integer (np.max(labels) + 1) failed in json.dumps at the end of training
        self.vision_config = {"arch": arch, "num_classes": plain_number(num_classes), "norm": norm,
                              "groups": plain_number(groups), "preprocessing": preprocessing}

    @property
    def num_labels(self) -> int:
        """The classes the model predicts (``num_classes``), named as a transformers classifier's
        ``config.num_labels``: the trainer checks the labels against it."""
        return self.vision_config["num_classes"]

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> ImageClassifierOutput:
        """Logits ``(N, num_classes)``; with ``labels`` ``(N,)`` int64 also the mean cross-entropy.
        ValueError unless ``pixel_values`` is a floating-point ``(N, 3, H, W)`` tensor (what
        :meth:`preprocess` and :class:`~.data.VisionTransform` make: uint8, channels-last-shaped
        ``(N, H, W, 3)`` or one-channel images failed in the first convolution)."""
        if not (isinstance(pixel_values, torch.Tensor) and pixel_values.is_floating_point()
                and pixel_values.dim() == 4 and pixel_values.shape[1] == 3):
            got = (f"{pixel_values.dtype} of shape {tuple(pixel_values.shape)}" if isinstance(pixel_values, torch.Tensor)
                   else type(pixel_values).__name__)
            raise ValueError(f"pixel_values must be a floating-point (N, 3, H, W) tensor (RGB, as preprocess() and "
                             f"VisionTransform make it), got {got}")
        logits = self.net(pixel_values)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return ImageClassifierOutput(loss=loss, logits=logits)

    def preprocess(self, images) -> torch.Tensor:
        """``pixel_values`` ``(N, 3, S, S)`` float32 for a list of PIL images, made as the model's
        training inputs were (its ``preprocessing``: upright as the EXIF orientation says, RGB,
        shorter side to S and centre crop, values in [0, 1] normalised per channel). ValueError for
        a model without ``preprocessing`` or for images the conversion would clip (16- and 32-bit
        ones, which training refuses too); TypeError for anything but PIL images."""
        from .data import VisionTransform, check_pil_images

        spec = self.vision_config["preprocessing"]
        if spec is None:
            raise ValueError("this model records no preprocessing (built without it): make its inputs with "
                             "lp_decentral_nlp.vision.VisionTransform and the normalisation it was trained with")
        transform = VisionTransform(spec["image_size"], spec["mean"], spec["std"], train=False)
        weight = next(self.parameters())  # the model's device and float type (a float64 or bf16 copy too)
        return transform({"image": check_pil_images(images)})["pixel_values"].to(weight.device, weight.dtype)

    @torch.no_grad()
    def predict(self, images) -> list[str]:
        """The class name (``preprocessing["labels"]``) the model gives each PIL image of ``images``,
        in eval mode (the model's mode is restored)."""
        was_training = self.training
        try:
            logits = self.eval()(self.preprocess(images)).logits
        finally:
            self.train(was_training)
        names = self.vision_config["preprocessing"]["labels"]
        return [names[i] for i in logits.argmax(dim=-1).tolist()]

    def applied_quant_config(self) -> QuantConfig | None:
        """The ``QuantConfig`` of its 8-bit layers (None when it has none)."""
        return next((m.quant_config for m in self.modules() if isinstance(m, QuantModule)), None)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``vision_config.json`` and ``model.safetensors`` into ``save_directory``. ValueError
        when its 8-bit layers were made with different QuantConfigs (one is recorded)."""
        from safetensors.torch import save_file

        layers = {name: m.quant_config.to_dict() for name, m in self.named_modules() if isinstance(m, QuantModule)}
        if len({json.dumps(c, sort_keys=True) for c in layers.values()}) > 1:
            raise ValueError("its 8-bit layers were made with different QuantConfigs, and a saved ImageClassifier "
                             "records one: quantize it with one QuantConfig (select layers with its target)")
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        quant = self.applied_quant_config()
        config = {**self.vision_config, "quant_config": None if quant is None else quant.to_dict(),
                  "quantized_layers": list(layers) if layers else None}
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ImageClassifier":
        """Rebuild a model written by :meth:`save_pretrained` (re-applying its 8-bit surgery) and
        load its state dict strictly; in eval mode, as transformers' ``from_pretrained`` returns a
        model (a training-mode forward would update the norms' statistics and activation ranges)."""
        from safetensors.torch import load_file

        folder = Path(path)
        if not folder.exists():
            raise FileNotFoundError(f"{folder} does not exist")
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            run = " (a run's folder: its model is in model/)" if (folder / "model" / CONFIG_NAME).is_file() else ""
            raise FileNotFoundError(f"{folder} must hold {CONFIG_NAME} and {WEIGHTS_NAME} "
                                    f"(written by ImageClassifier.save_pretrained){run}")
        try:
            config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{folder / CONFIG_NAME} is not JSON ({err})") from None
        known = {"arch", "num_classes", "norm", "groups", "preprocessing", "quant_config", "quantized_layers"}
        if not isinstance(config, dict) or set(config) - known:
            raise ValueError(f"{folder / CONFIG_NAME} is not an ImageClassifier's config: expected the keys "
                             f"{sorted(known)}, got {sorted(config) if isinstance(config, dict) else type(config).__name__}")
        quant, layers = config.pop("quant_config", None), config.pop("quantized_layers", None)
        model = cls(**config)
        if quant is not None:  # exactly the saved 8-bit layers (a folder written before they were named: all)
            quant = QuantConfig.from_dict(quant)
            if layers is not None and quantize_model(model, quant, dry_run=True).quantized != layers:
                quant = QuantConfig.from_dict({**quant.to_dict(), "target": layers})  # quantized in part
            quantize_model(model, quant)
        state = load_file(str(folder / WEIGHTS_NAME))
        saved_float = [name for name, m in model.named_modules()
                       if isinstance(m, QuantModule) and hasattr(m, "act_running_min")
                       and f"{name}.act_running_min" not in state]
        if saved_float:  # a float layer's state would load into an 8-bit one as uncalibrated, silently
            raise ValueError(f"{folder}: layers {saved_float[:3]} were saved float but its quant_config makes them "
                             "8-bit: save the model again with this version (it records its 8-bit layers)")
        try:
            model.load_state_dict(state)
        except RuntimeError as err:  # torch lists every key and shape, over many lines
            raise ValueError(f"{folder / WEIGHTS_NAME} does not fit its {CONFIG_NAME} ("
                             f"{' '.join(str(err).split())[:300]})") from None
        return model.eval()


def _checked_preprocessing(preprocessing, num_classes) -> dict | None:
    """A copy of ``preprocessing`` (the caller's dict stays theirs), NumPy numbers as Python's;
    ValueError unless it is None or ``{"labels": [distinct str], "image_size": int >= 1, "mean":
    [3 finite numbers], "std": [3 finite numbers > 0]}`` (it is saved as JSON with the model), with
    a name for each of the `num_classes` classes."""
    if preprocessing is None:
        return None
    expected = ("None or {'labels': [distinct class names], 'image_size': int, 'mean': [3 finite numbers], "
                "'std': [3 finite numbers > 0]}")
    ok = isinstance(preprocessing, dict) and set(preprocessing) == {"labels", "image_size", "mean", "std"}
    if ok:
        labels, size, mean, std = (preprocessing[k] for k in ("labels", "image_size", "mean", "std"))
        triples = all(isinstance(t, (list, tuple)) and len(t) == 3 for t in (mean, std))
        values = [*mean, *std] if triples else []
        ok = (isinstance(labels, (list, tuple)) and all(isinstance(name, str) for name in labels)
              and len(set(labels)) == len(labels)
              and isinstance(size, numbers.Integral) and not isinstance(size, bool) and size >= 1
              and triples and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                                  for v in values)
              and all(v > 0 for v in values[3:]))
    if not ok:
        raise ValueError(f"preprocessing must be {expected}, got {preprocessing!r}")
    if len(preprocessing["labels"]) != num_classes:
        raise ValueError(f"preprocessing['labels'] names {len(preprocessing['labels'])} classes and num_classes="
                         f"{num_classes}: give one name per class")
    return {"labels": list(labels), "image_size": int(size), "mean": [plain_number(v) for v in mean],
            "std": [plain_number(v) for v in std]}
