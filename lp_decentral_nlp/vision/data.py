"""Image classification datasets and their torch transforms (SPEC section 8).

:func:`load_vision_dataset` returns a ``datasets.DatasetDict`` with splits ``"train"`` and
``"test"`` and exactly two columns: ``"image"`` (``datasets.Image``, decoded to PIL) and
``"label"`` (``datasets.ClassLabel``). Sources:

- ``cifar10`` / ``cifar100`` / ``imagenette`` from the Hugging Face hub (``uoft-cs/cifar10``,
  ``uoft-cs/cifar100``, the parquet export of ``frgfm/imagenette`` at 320 px), or from
  ``data_dir``: a folder written by ``DatasetDict.save_to_disk`` or an image folder tree
  (``train/<class>/*.png``, ``test/`` or ``val/<class>/...``; classes are the train folder
  names, sorted). Hub column names (``img``/``image``, ``label``/``fine_label``) are mapped to
  ``image``/``label``; a ``validation`` (``val``, ``dev``, ...) split serves as ``test`` when there
  is no ``test``, and it must list the train split's classes in the same order.
- ``digits``: scikit-learn's bundled 8x8 grey digits (1,797 images, 10 classes), offline, with a
  seeded stratified 80/20 train/test split. The default for quick runs.
- :data:`FOLDER` (``"folder"``): the user's own images in ``data_dir`` (either layout above), any
  number of classes; :func:`folder_spec` measures their image size and channel statistics.

:class:`VisionTransform` (for ``Dataset.set_transform`` / ``with_transform``) turns a batch of
those rows into ``{"pixel_values": (B, 3, S, S) float32, "label": (B,) int64}``: RGB, shorter
side resized to ``S`` and centre-cropped when the image is not ``S x S``, then (training only)
a random ``S x S`` crop of the zero-padded image and a random horizontal flip, then per-channel
normalisation. Randomness comes from torch's global RNG, which ``DecentralizedTrainer`` seeds per
batch (from seed, node, epoch and batch), in the main process and in dataloader workers alike.
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import datasets
from transformers.utils import logging

from ..checks import NONNEGATIVE_INT, POSITIVE_INT, check_field, check_flag, check_number
from ..data import load_saved_dataset

logger = logging.get_logger(__name__)

__all__ = [
    "FOLDER",
    "VisionDatasetSpec",
    "VISION_DATASETS",
    "folder_spec",
    "vision_dataset_spec",
    "load_vision_dataset",
    "VisionTransform",
    "vision_transform",
    "with_vision_transforms",
]


@dataclass(frozen=True)
class VisionDatasetSpec:
    """What a recipe needs to know about a dataset.

    hub_id/hub_kwargs: ``datasets.load_dataset(hub_id, **hub_kwargs)`` (None: not on the hub).
    image_size: side of the square images fed to the model (pixels); the training random crop
    pads by ``image_size // 8`` pixels per side (4 for 32x32, as the CIFAR convention).
    mean/std: per-channel normalisation of pixel values in [0, 1] (RGB).
    """

    num_classes: int
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    hub_id: str | None = None
    hub_kwargs: dict = field(default_factory=dict)


_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

VISION_DATASETS: dict[str, VisionDatasetSpec] = {
    # Channel statistics of the CIFAR training sets.
    "cifar10": VisionDatasetSpec(10, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
                                 hub_id="uoft-cs/cifar10"),
    "cifar100": VisionDatasetSpec(100, 32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
                                  hub_id="uoft-cs/cifar100"),
    # frgfm/imagenette's main branch holds a loading script, which datasets>=4 refuses; its
    # parquet export (folders <size>/train, <size>/validation) loads without it.
    "imagenette": VisionDatasetSpec(10, 224, _IMAGENET_MEAN, _IMAGENET_STD,
                                    hub_id="frgfm/imagenette",
                                    hub_kwargs={"revision": "refs/convert/parquet", "data_dir": "320px"}),
    # Mean/std of all 1,797 sklearn digits as stored here (uint8 = round(value * 255 / 16)).
    "digits": VisionDatasetSpec(10, 8, (0.3053,) * 3, (0.3759,) * 3),
}

#: the dataset name of the user's own images (``data_dir``): its classes, image size and
#: normalisation come from the data (:func:`folder_spec`)
FOLDER = "folder"

_IMAGE_COLUMNS = ("image", "img")
_LABEL_COLUMNS = ("label", "fine_label", "labels")


#: the datasets trained without augmentation by default: flipping a digit changes what it shows (with
#: the CIFAR augmentation a single-node fp32 ResNet-20 (EvoNorm) reaches 30% test accuracy on digits
#: after 5 epochs, 95% without it)
NO_AUGMENT_DATASETS = ("digits",)


def vision_dataset_spec(name: str, what: str = "name") -> VisionDatasetSpec:
    """The :class:`VisionDatasetSpec` of ``name`` (one of :data:`VISION_DATASETS`); ValueError
    naming the argument `what` and what it may be otherwise (your own images' spec is
    :func:`folder_spec`'s)."""
    if name not in VISION_DATASETS:
        hint = " (your own images: pass folder_spec(dsd))" if name == FOLDER else ""
        raise ValueError(f"{what} must be one of {', '.join(VISION_DATASETS)}; got {name!r}{hint}")
    return VISION_DATASETS[name]


def _load_digits(seed: int, test_fraction: float = 0.2) -> datasets.DatasetDict:
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # (1797, 8, 8), 0..16 -> 0..255
    features = datasets.Features({
        "image": datasets.Image(),
        "label": datasets.ClassLabel(names=[str(i) for i in range(10)]),
    })
    index = np.arange(len(pixels))
    train_idx, test_idx = train_test_split(
        index, test_size=test_fraction, stratify=digits.target, random_state=seed
    )

    def split(idx: np.ndarray) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {"image": [Image.fromarray(pixels[i]) for i in idx],
             "label": digits.target[idx].tolist()},
            features=features,
        )

    return datasets.DatasetDict(train=split(train_idx), test=split(test_idx))


# Folder names of an image folder tree (those `datasets` recognises), in order of preference; the
# test names are those of a saved DatasetDict's test split too.
_TRAIN_FOLDERS = ("train", "training")
_TEST_FOLDERS = ("test", "testing", "eval", "evaluation", "validation", "valid", "val", "dev")
_FOLDER_LAYOUT = "train/<class>/<image>, test/ or val/<class>/<image>"


def _test_split(names, where: str, labelled=lambda name: True) -> str | None:
    """The split of ``names`` evaluated on: the first of :data:`_TEST_FOLDERS` there that is
    ``labelled`` (an image folder tree's test/ of images without class folders, as Kaggle's, is
    not: a labelled val/ is evaluated instead), else the first found (None if none), with a
    warning naming the others found, which are not used."""
    found = [name for name in _TEST_FOLDERS if name in names]
    unlabelled = [name for name in found if not labelled(name)]
    chosen = next((name for name in found if name not in unlabelled), found[0] if found else None)
    if len(found) > 1:
        others = ", ".join(f"{name!r}{' (images without class folders: unlabelled)' if name in unlabelled else ''}"
                           for name in found if name != chosen)
        logger.warning(f"{where}: evaluating on {chosen!r}; {others} also found, not used "
                       f"(the first labelled one of {', '.join(_TEST_FOLDERS)} is the test split)")
    return chosen


def _load_source(spec: VisionDatasetSpec | None, name: str,
                 data_dir: str | os.PathLike | None) -> datasets.DatasetDict:
    """``name`` from the hub, a ``save_to_disk`` folder or an image folder tree, standardised.

    A local source is checked whole: every image of a folder tree and of a saved dataset must
    decode with PIL, with 8-bit values. Problems are ValueError/FileNotFoundError naming the folder
    or file.
    """
    if data_dir is None:
        return _standardise(datasets.load_dataset(spec.hub_id, **spec.hub_kwargs), name, spec)
    path = Path(data_dir)
    if not path.exists():
        raise FileNotFoundError(f"data_dir {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"data_dir {str(path)!r} is a file: expected a DatasetDict.save_to_disk folder or an image "
                         f"folder tree ({_FOLDER_LAYOUT})")
    if (path / "state.json").is_file() and not (path / "dataset_dict.json").exists():
        raise ValueError(f"data_dir {str(path)!r} holds a single saved Dataset: save a DatasetDict with 'train' and "
                         "'test' splits instead")
    if (path / "dataset_dict.json").exists():
        return _standardise(load_saved_dataset(path), name, spec, source=str(path), check_images=True)
    return _standardise(_read_image_folder(path), name, spec, source=str(path))



def _image_extensions() -> set[str]:
    from PIL import Image

    return {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}


#: PIL modes whose values the 8-bit RGB conversion of the transforms would clip, not rescale
_WIDE_MODES = {"I": "32-bit integer", "F": "32-bit float", "I;16": "16-bit", "I;16B": "16-bit", "I;16L": "16-bit",
               "I;16N": "16-bit"}


def _check_image(image: str | bytes, where: str) -> None:
    """Open ``image`` (a path, or the encoded bytes of ``where``) and decode it whole; ValueError if PIL
    cannot (``verify`` alone passes damaged pixel data whose chunks are intact) or if its values are
    not 8-bit (:data:`_WIDE_MODES`: the RGB conversion would clip them)."""
    import io

    from PIL import Image

    def opened():
        return Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)

    try:
        with opened() as im:
            im.verify()
        with opened() as im:
            im.load()
            mode = im.mode
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, struct.error... on a bad file
        message = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "from its bytes", str(err))  # no memory address
        raise ValueError(f"{where}: not a readable image ({err.__class__.__name__}: {message})") from None
    if mode in _WIDE_MODES:
        raise ValueError(f"{where}: {_wide_image(mode)}")


def _wide_image(mode: str) -> str:
    """Why an image of PIL mode ``mode`` (one of :data:`_WIDE_MODES`) is refused, and the fix."""
    return (f"a {_WIDE_MODES[mode]} image (PIL mode {mode}): the transforms take 8-bit images and would clip its "
            "values; convert it to 8 bits, scaling to 0-255")


def _check_utf8_name(path: Path) -> None:
    """ValueError when ``path``'s name is not UTF-8 (Arrow stores class names and paths as UTF-8)."""
    try:
        path.name.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path)
        raise ValueError(f"{shown!r}: the name is not UTF-8; rename it (class names and image paths are stored "
                         "as UTF-8 text)") from None


def _check_link(path: Path) -> None:
    """ValueError when ``path`` is a symbolic link to nothing (its target moved or was deleted)."""
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{path}: a broken link (to {os.readlink(path)!r}, which does not exist)")


def _system_file(name: str) -> bool:
    """Whether a file of an image folder tree is the system's, not the user's: hidden (``.DS_Store``),
    or left by a file manager (Windows' ``Thumbs.db``, ``desktop.ini``)."""
    return name.startswith(".") or name.lower() in ("thumbs.db", "desktop.ini")


def _read_image_folder(path: Path) -> datasets.DatasetDict:
    """An image folder tree as ``train``/``test`` with ``image`` (paths, decoded by ``datasets.Image``)
    and ``label`` (ClassLabel of the train class folders' names, sorted).

    Hidden files (``.DS_Store``...) and the files file managers leave (``Thumbs.db``,
    ``desktop.ini``) are skipped; any other file that is not an image, an image
    outside a class folder, a folder inside a class folder, an empty class folder, a name that is
    not UTF-8, an image PIL cannot open and a test class absent from ``train`` are ValueErrors
    naming the path.
    """
    folders = {p.name: p for p in path.iterdir() if p.is_dir()}
    train_name = next((f for f in _TRAIN_FOLDERS if f in folders), None)
    test_name = _test_split(folders, f"data_dir {str(path)!r}", labelled=lambda name: any(
        p.is_dir() for p in folders[name].iterdir() if not _system_file(p.name)))
    if train_name is None or test_name is None:
        what = "train" if train_name is None else "test"
        raise ValueError(f"data_dir {str(path)!r} has no {what} folder (found {sorted(folders) or 'none'}): expected "
                         f"a DatasetDict.save_to_disk folder or an image folder tree ({_FOLDER_LAYOUT})")
    extensions = _image_extensions()
    files = {}
    for split, folder in (("train", folders[train_name]), ("test", folders[test_name])):
        classes = {}
        for entry in sorted(folder.iterdir()):
            if _system_file(entry.name):
                continue
            _check_utf8_name(entry)
            _check_link(entry)
            if not entry.is_dir():
                raise ValueError(f"{entry}: a file outside a class folder; images go in {folder}/<class>/")
            images = []
            for item in sorted(entry.iterdir()):
                if _system_file(item.name):
                    continue
                _check_utf8_name(item)
                _check_link(item)
                if item.is_dir():
                    raise ValueError(f"{item}: a folder inside class folder {entry.name!r}; images go directly in "
                                     f"{entry}/")
                if item.suffix.lower() not in extensions:
                    raise ValueError(f"{item}: not an image file (extension {item.suffix or 'none'!r}); move it out "
                                     "of the image folder tree")
                _check_image(str(item), str(item))
                images.append(str(item))
            if not images:
                raise ValueError(f"{entry}: class folder holds no image")
            classes[entry.name] = images
        if not classes:
            raise ValueError(f"{folder}: holds no class folder ({_FOLDER_LAYOUT})")
        files[split] = classes
    names = sorted(files["train"])
    unknown = sorted(set(files["test"]) - set(names))
    if unknown:
        raise ValueError(f"{folders[test_name]}: class folder(s) {unknown} are not in {folders[train_name]} "
                         f"(train classes: {names})")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict(
            {"image": [f for c in names for f in classes.get(c, [])],
             "label": [i for i, c in enumerate(names) for _ in classes.get(c, [])]},
            features=features)
        for split, classes in files.items()})


def _pick(candidates: tuple[str, ...], available: list[str], what: str, where: str) -> str:
    for name in candidates:
        if name in available:
            return name
    raise ValueError(f"{where}: no {what} column found: expected one of {candidates}, got {available}")


def _standardise(raw: datasets.DatasetDict, name: str, spec: VisionDatasetSpec | None,
                 source: str | None = None, check_images: bool = False) -> datasets.DatasetDict:
    """``train``/``test`` with columns ``image``/``label`` from a hub, saved or folder DatasetDict.

    ``spec``: the named dataset whose class count the source must have (None: :data:`FOLDER`, any).
    ``source``: the local folder it came from, named in errors. ``check_images``: open every
    image with PIL (a saved dataset's; a hub dataset's are trusted, a folder's were checked).
    """
    where = name if source is None else f"{name} ({source})"
    splits = list(raw.keys())
    if "train" not in splits:
        raise ValueError(f"{where}: the source has no 'train' split (splits: {splits})")
    test_split = _test_split(splits, where)
    if test_split is None:
        raise ValueError(f"{where}: the source has no test split, expected one of {_TEST_FOLDERS} "
                         f"(splits: {splits})")
    out = {}
    train_names = None
    for target, split in (("train", "train"), ("test", test_split)):
        ds = raw[split]
        image_col = _pick(_IMAGE_COLUMNS, ds.column_names, "image", f"{where} [{split}]")
        label_col = _pick(_LABEL_COLUMNS, ds.column_names, "label", f"{where} [{split}]")
        ds = ds.select_columns([image_col, label_col])
        ds = ds.rename_columns({c: t for c, t in ((image_col, "image"), (label_col, "label")) if c != t})
        label = ds.features["label"]
        if not isinstance(label, datasets.ClassLabel):
            raise TypeError(f"{where}: the label column must be a datasets.ClassLabel, got {label}; "
                            "cast it with ds.cast_column('label', datasets.ClassLabel(...))")
        if label.num_classes < 2:
            raise ValueError(f"{where}: the {split!r} split has {label.num_classes} class ({label.names}): "
                             "classification needs at least 2")
        if spec is not None and label.num_classes != spec.num_classes:
            raise ValueError(f"{name} has {spec.num_classes} classes but the {split!r} split of the "
                             f"source{'' if source is None else ' ' + source} has {label.num_classes}: {label.names}")
        if train_names is not None and label.names != train_names:
            raise ValueError(f"{where}: the {split!r} split's classes {label.names} are not the 'train' split's "
                             f"{train_names} in the same order: its labels would be scored as other classes")
        train_names = label.names
        values = np.asarray(ds["label"], dtype=np.int64)
        bad = sorted(set(values[(values < 0) | (values >= label.num_classes)].tolist()))
        if bad:
            raise ValueError(f"{where}: the {split!r} split has labels {bad} outside its classes "
                             f"0-{label.num_classes - 1}")
        if not len(ds):
            raise ValueError(f"{where}: the {split!r} split has no rows")
        if check_images:
            _check_saved_images(ds, f"{source} [{split}]")
        if not isinstance(ds.features["image"], datasets.Image):
            ds = ds.cast_column("image", datasets.Image())
        out[target] = ds
    return datasets.DatasetDict(out)


def _check_saved_images(ds: datasets.Dataset, where: str) -> None:
    """Every row's image (encoded bytes or a path) opens with PIL; ValueError naming the row otherwise."""
    try:
        encoded = ds.cast_column("image", datasets.Image(decode=False))
    except (TypeError, ValueError, NotImplementedError) as err:
        raise ValueError(f"{where}: column 'image' holds {ds.features['image']}, not images "
                         f"({err.__class__.__name__})") from None
    for row, image in enumerate(encoded["image"]):
        if image is None or (image.get("bytes") is None and image.get("path") is None):
            raise ValueError(f"{where}: row {row} has no image")
        _check_image(image["bytes"] if image.get("bytes") is not None else image["path"], f"{where} row {row}")


def missing_vision_packages(name: str) -> str | None:
    """The one line naming the pip command when a package that loading dataset ``name`` needs is
    not installed (Pillow decodes every image; scikit-learn holds ``digits``), else None. Looked up
    without importing them."""
    needed = {"PIL": "Pillow", **({"sklearn": "scikit-learn"} if name == "digits" else {})}
    missing = [package for module, package in needed.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: the vision datasets need "
            'the [vision] extra (pip install "lp-decentral-nlp[vision]")')


def load_vision_dataset(
    name: str, data_dir: str | os.PathLike | None = None, seed: int = 0
) -> datasets.DatasetDict:
    """Load ``name`` (see :data:`VISION_DATASETS`) as a DatasetDict ``train``/``test`` with
    columns ``image`` (PIL) and ``label`` (ClassLabel).

    data_dir: a ``save_to_disk`` folder or an image folder tree to read instead of the hub
    (not allowed for ``digits``, which ships with scikit-learn; required for :data:`FOLDER`, the
    user's own images with any number of classes, :func:`folder_spec`). seed: the stratified split of
    ``digits`` (the other datasets come with their own test split).

    A local source is only read, never modified, and checked whole: FileNotFoundError when
    ``data_dir`` does not exist; ValueError naming the folder or file for a source that is not
    one of the two layouts, lacks a train or test split, image or label column, has the wrong
    number of classes or labels outside them, stray files, empty class folders, or an image PIL
    cannot open; TypeError for a label column that is not a ClassLabel; ImportError naming the
    pip command without the packages of the ``[vision]`` extra (:func:`missing_vision_packages`).
    """
    problem = missing_vision_packages(name)
    if problem:
        raise ImportError(problem)
    if name == FOLDER:
        seed = check_field("seed", seed)
        if data_dir is None:
            raise ValueError(f"{FOLDER}: the user's own images need data_dir: a DatasetDict.save_to_disk folder or an "
                             f"image folder tree ({_FOLDER_LAYOUT})")
        return _load_source(None, name, data_dir)
    spec = vision_dataset_spec(name)
    seed = check_field("seed", seed)
    if name == "digits":
        if data_dir is not None:
            raise ValueError("digits is bundled with scikit-learn: data_dir must be None")
        return _load_digits(seed)
    return _load_source(spec, name, data_dir)


def check_pil_images(images) -> list:
    """``images`` as a non-empty list of 8-bit PIL images (what :class:`VisionTransform` converts
    without loss), each turned upright as its EXIF orientation tag says (a phone photo), as
    ``datasets.Image`` decodes the training images: TypeError naming the first other object,
    ValueError for an empty list or a 16- or 32-bit image (:data:`_WIDE_MODES`: the RGB conversion
    would clip it, as the loaders say). The images given are not modified."""
    from PIL import Image, ImageOps

    images = [images] if isinstance(images, Image.Image) else list(images)
    if not images:
        raise ValueError("images is empty: give one PIL image or more")
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"images[{i}] is a {type(image).__name__}: PIL images expected (PIL.Image.open(path))")
        if image.mode in _WIDE_MODES:
            raise ValueError(f"images[{i}]: {_wide_image(image.mode)}")
    return [ImageOps.exif_transpose(image) if image.getexif().get(Image.ExifTags.Base.Orientation) is not None
            else image for image in images]


def _to_square_tensor(image, size: int) -> torch.Tensor:
    """PIL image -> (3, size, size) uint8: RGB; shorter side resized to ``size`` (bilinear,
    antialiased) and centre-cropped unless it already is ``size x size``."""
    x = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)
    h, w = x.shape[1:]
    if (h, w) == (size, size):
        return x
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    x = F.interpolate(x[None].float(), size=(new_h, new_w), mode="bilinear",
                      antialias=True, align_corners=False)[0]
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return x[:, top:top + size, left:left + size].round().clamp(0, 255).to(torch.uint8)


class VisionTransform:
    """Batch transform for ``Dataset.set_transform``.

    Input: a batch ``{"image": [PIL images], "label": [int]}``. Output:
    ``{"pixel_values": (B, 3, image_size, image_size) float32, "label": (B,) int64}`` (without
    ``label`` for a batch without one: images to predict).
    ``train=True`` adds the random crop (zero padding of ``padding`` pixels, applied to pixel
    values in [0, 1] before normalisation, as torchvision's RandomCrop) and the random
    horizontal flip (p = 0.5).
    """

    def __init__(self, image_size: int, mean, std, train: bool, padding: int = 0):
        image_size = check_number("image_size", image_size, POSITIVE_INT)
        padding = check_number("padding", padding, NONNEGATIVE_INT)
        train = check_flag("train", train)
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"mean and std must hold 3 values (RGB), std > 0; got {mean}, {std}")
        self.image_size, self.train, self.padding = image_size, train, padding
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def augment(self, x: torch.Tensor) -> torch.Tensor:
        """Random crop of the zero-padded batch and random horizontal flip; x: (B, 3, S, S) in [0, 1]."""
        b, _, s, _ = x.shape
        p = self.padding
        if p:
            padded = F.pad(x, (p, p, p, p))
            offsets = torch.randint(0, 2 * p + 1, (b, 2))
            x = torch.stack([padded[i, :, top:top + s, left:left + s]
                             for i, (top, left) in enumerate(offsets.tolist())])
        flip = torch.rand(b) < 0.5
        return torch.where(flip.view(b, 1, 1, 1), x.flip(-1), x)

    def __call__(self, batch: dict) -> dict:
        x = torch.stack([_to_square_tensor(im, self.image_size) for im in batch["image"]])
        x = x.float().div_(255.0)
        if self.train:
            x = self.augment(x)
        out = {"pixel_values": (x - self.mean) / self.std}
        if "label" in batch:
            out["label"] = torch.as_tensor(batch["label"], dtype=torch.long)
        return out


#: the largest image side (pixels) :func:`folder_spec` measures by default: ImageNet's input side,
#: which photos are resized to (a phone photo's 3000 px would cost a CNN 180 times the compute)
MAX_MEASURED_IMAGE_SIZE = 224


def folder_spec(dsd: datasets.DatasetDict, image_size: int | None = None, sample: int = 512) -> VisionDatasetSpec:
    """The :class:`VisionDatasetSpec` of the user's own images (:data:`FOLDER`), from the data:
    the train split's classes; ``image_size`` (default: the median shorter side of `sample`
    training images spread over the split, in pixels, at most :data:`MAX_MEASURED_IMAGE_SIZE`,
    with a warning when that is less than the median); the per-channel mean and std of those
    images in [0, 1] at that size (a std under 1e-3, a channel constant over the sample, counts
    1e-3)."""
    image_size = check_field("image_size", image_size)  # None: measured; 0 meant "measure" too, silently
    sample = check_number("sample", sample, POSITIVE_INT)
    _check_splits(dsd, ("train",), "dsd")
    train = dsd["train"].with_format(None)  # the stored images, also of data with_vision_transforms gave
    count = min(sample, len(train))
    indices = sorted({round(i * (len(train) - 1) / max(1, count - 1)) for i in range(count)})
    images = train.select(indices)["image"]
    size = image_size
    if size is None:
        size = int(np.median([min(im.size) for im in images]))
        if size > MAX_MEASURED_IMAGE_SIZE:
            logger.warning(f"the training images' median shorter side is {size} px: they are resized to "
                           f"{MAX_MEASURED_IMAGE_SIZE} px, the most image_size takes by default (give image_size, in "
                           "a recipe --image-size, for more)")
            size = MAX_MEASURED_IMAGE_SIZE
    # per-channel sums over the images one at a time (stacking them at a large image_size took GBs)
    total, squares = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for image in images:
        x = _to_square_tensor(image, size).double().div_(255.0)
        total += x.sum(dim=(1, 2))
        squares += x.square().sum(dim=(1, 2))
    n = len(images) * size * size
    mean = total / n
    std = ((squares - n * mean.square()).clamp(min=0) / max(n - 1, 1)).sqrt().clamp(min=1e-3)  # unbiased, as torch.std
    return VisionDatasetSpec(train.features["label"].num_classes, size, tuple(round(float(v), 4) for v in mean),
                             tuple(round(float(v), 4) for v in std))


def vision_transform(dataset: str | VisionDatasetSpec, train: bool, image_size: int | None = None) -> VisionTransform:
    """The :class:`VisionTransform` of ``dataset`` (a name of :data:`VISION_DATASETS`, or the
    :func:`folder_spec` of the user's images); ``image_size`` overrides its default. ``train``: the
    augmenting transform (random crop, padded by ``image_size // 8`` pixels, and flip)."""
    spec = _spec_of(dataset)
    size = spec.image_size if image_size is None else image_size
    return VisionTransform(size, spec.mean, spec.std, train=train, padding=size // 8)


def with_vision_transforms(dsd: datasets.DatasetDict, dataset: str | VisionDatasetSpec,
                           image_size: int | None = None, augment: bool | None = None) -> datasets.DatasetDict:
    """``dsd`` with ``dataset``'s (:func:`vision_transform`) transforms: on ``"train"`` the
    augmenting one if ``augment`` (default: except for :data:`NO_AUGMENT_DATASETS`, as the
    recipes train), else the evaluation one, which ``"test"`` and any other split get (TypeError
    unless ``dsd`` is a ``DatasetDict``; ValueError without those two splits)."""
    _check_splits(dsd, ("train", "test"), "dsd")
    spec = _spec_of(dataset)
    if augment is None:
        augment = not any(spec is VISION_DATASETS[name] for name in NO_AUGMENT_DATASETS)
    augment = check_flag("augment", augment)
    return datasets.DatasetDict({
        split: part.with_transform(vision_transform(spec, augment and split == "train", image_size))
        for split, part in dsd.items()
    })


def vision_preprocessing(dsd: datasets.DatasetDict, dataset: str | VisionDatasetSpec,
                         image_size: int | None = None) -> dict:
    """What :class:`~lp_decentral_nlp.vision.ImageClassifier` records as its ``preprocessing`` for
    data ``dsd`` (:func:`load_vision_dataset`'s) made by ``dataset``'s transforms
    (:func:`with_vision_transforms` with the same ``image_size``): the class names of its train
    split's ``label``, the image size and the normalisation, so that the saved model's
    :meth:`~lp_decentral_nlp.vision.ImageClassifier.predict` names classes."""
    _check_splits(dsd, ("train",), "dsd")
    spec = _spec_of(dataset)
    return {"labels": list(dsd["train"].features["label"].names),
            "image_size": spec.image_size if image_size is None else image_size,
            "mean": list(spec.mean), "std": list(spec.std)}


def _spec_of(dataset: str | VisionDatasetSpec) -> VisionDatasetSpec:
    """``dataset`` as a :class:`VisionDatasetSpec` (a name: :func:`vision_dataset_spec`'s)."""
    return dataset if isinstance(dataset, VisionDatasetSpec) else vision_dataset_spec(
        dataset, "dataset (a VisionDatasetSpec, or its name)")


def _check_splits(dsd, needed: tuple[str, ...], what: str) -> None:
    """TypeError unless ``dsd`` is a ``DatasetDict``; ValueError naming the splits it has when one
    of ``needed`` is missing."""
    if not isinstance(dsd, datasets.DatasetDict):
        raise TypeError(f"{what} must be a DatasetDict with the splits {list(needed)} (load_vision_dataset's), got "
                        f"{type(dsd).__name__}")
    missing = [split for split in needed if split not in dsd]
    if missing:
        raise ValueError(f"{what} has the splits {list(dsd)}, and {missing} missing: it needs {list(needed)}")
