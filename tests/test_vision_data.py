"""Vision datasets (offline paths: digits, image folders, saved dirs, hub column mapping) and transforms."""
import collections
import logging
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import datasets
from lp_decentral_nlp.vision import data as vdata
from lp_decentral_nlp.vision import (
    VisionTransform,
    load_vision_dataset,
    vision_dataset_spec,
    vision_transform,
    with_vision_transforms,
)


@pytest.fixture(scope="module")
def digits():
    return load_vision_dataset("digits", seed=0)


@pytest.fixture(autouse=True)
def _datasets_cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _label_counts(ds):
    return collections.Counter(ds["label"])


def test_digits_split_is_stratified_complete_and_seeded(digits):
    from sklearn.datasets import load_digits

    target = load_digits().target
    assert (digits["train"].num_rows, digits["test"].num_rows) == (1437, 360)
    assert set(digits["train"].column_names) == {"image", "label"}
    total = _label_counts(digits["train"]) + _label_counts(digits["test"])
    assert total == collections.Counter(target.tolist())
    for label, count in collections.Counter(target.tolist()).items():
        assert abs(_label_counts(digits["test"])[label] - 0.2 * count) <= 1
    same = load_vision_dataset("digits", seed=0)
    other = load_vision_dataset("digits", seed=1)
    assert same["test"]["label"] == digits["test"]["label"]
    assert other["test"]["label"] != digits["test"]["label"]
    image = digits["train"][0]["image"]
    assert image.size == (8, 8)


def test_digits_normalisation_constants_are_measured(digits):
    pixels = np.concatenate([np.stack([np.asarray(im, dtype=np.float64) for im in digits[s]["image"]])
                             for s in ("train", "test")]) / 255.0
    spec = vision_dataset_spec("digits")
    assert pixels.shape == (1797, 8, 8)
    assert spec.mean[0] == pytest.approx(pixels.mean(), abs=1e-4)
    assert spec.std[0] == pytest.approx(pixels.std(), abs=1e-4)


def test_eval_transform_is_exact_normalisation(digits):
    batch = digits["test"][:5]
    out = vision_transform("digits", train=False)(batch)
    assert out["pixel_values"].shape == (5, 3, 8, 8) and out["pixel_values"].dtype == torch.float32
    assert out["label"].dtype == torch.int64 and out["label"].tolist() == batch["label"]
    spec = vision_dataset_spec("digits")
    grey = torch.tensor(np.stack([np.asarray(im) for im in batch["image"]]), dtype=torch.float32) / 255.0
    expected = ((grey - spec.mean[0]) / spec.std[0]).unsqueeze(1).expand(-1, 3, -1, -1)
    torch.testing.assert_close(out["pixel_values"], expected)


def test_train_transform_is_a_padded_crop_or_its_mirror():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    image = Image.fromarray(array)
    transform = VisionTransform(8, (0.0,) * 3, (1.0,) * 3, train=True, padding=2)
    out = transform({"image": [image] * 64, "label": [3] * 64})["pixel_values"]
    padded = torch.nn.functional.pad(torch.tensor(array).permute(2, 0, 1).float() / 255.0, (2, 2, 2, 2))
    windows = {(t, l, f): (padded[:, t:t + 8, l:l + 8].flip(-1) if f else padded[:, t:t + 8, l:l + 8])
               for t in range(5) for l in range(5) for f in (False, True)}
    seen = set()
    for x in out:
        match = [k for k, w in windows.items() if torch.equal(x, w)]
        assert match, "augmented image is not a crop of the zero-padded image"
        seen.add(match[0])
    assert {k[2] for k in seen} == {False, True}
    assert len({k[:2] for k in seen}) > 5
    evaluated = VisionTransform(8, (0.0,) * 3, (1.0,) * 3, train=False, padding=2)({"image": [image], "label": [0]})
    torch.testing.assert_close(evaluated["pixel_values"][0], windows[(2, 2, False)])


def test_resize_takes_shorter_side_and_centre_crop():
    array = np.arange(32 * 40 * 3, dtype=np.uint32).reshape(32, 40, 3) % 251
    image = Image.fromarray(array.astype(np.uint8))
    out = VisionTransform(32, (0.0,) * 3, (1.0,) * 3, train=False)({"image": [image], "label": [0]})
    expected = torch.tensor(array[:, 4:36].astype(np.float32) / 255.0).permute(2, 0, 1)
    torch.testing.assert_close(out["pixel_values"][0], expected)
    big = Image.fromarray(np.full((64, 80, 3), 200, dtype=np.uint8))
    out = VisionTransform(32, (0.0,) * 3, (1.0,) * 3, train=False)({"image": [big], "label": [0]})
    torch.testing.assert_close(out["pixel_values"], torch.full((1, 3, 32, 32), 200 / 255.0))


def test_with_vision_transforms_feeds_a_dataloader(digits):
    ready = with_vision_transforms(digits, "digits", image_size=16)
    loader = torch.utils.data.DataLoader(ready["train"], batch_size=32, shuffle=True)
    batch = next(iter(loader))
    assert batch["pixel_values"].shape == (32, 3, 16, 16) and batch["label"].shape == (32,)
    assert ready["test"][0]["pixel_values"].shape == (3, 16, 16)
    # The raw dataset is untouched.
    assert set(digits["train"][0]) == {"image", "label"}


def test_digits_train_without_augmentation_by_default_and_others_with_it(digits):
    """The recipes train digits unaugmented (a flipped digit is another one); from Python every
    dataset was augmented, with no way to turn it off."""
    from lp_decentral_nlp.vision import vision_preprocessing

    def first_batch(ready):
        torch.manual_seed(0)
        return ready["train"][:8]["pixel_values"]

    evaluation = digits["train"].with_transform(vision_transform("digits", False))[:8]["pixel_values"]
    assert torch.equal(first_batch(with_vision_transforms(digits, "digits")), evaluation)
    assert not torch.equal(first_batch(with_vision_transforms(digits, "digits", augment=True)), evaluation)
    spec = vdata.VisionDatasetSpec(10, 8, (0.5,) * 3, (0.25,) * 3)  # a spec of one's own images: augmented
    assert not torch.equal(first_batch(with_vision_transforms(digits, spec)),
                           first_batch(with_vision_transforms(digits, spec, augment=False)))
    with pytest.raises(ValueError, match=r"^augment must be True or False"):
        with_vision_transforms(digits, "digits", augment="yes")
    assert vision_preprocessing(digits, "digits") == {
        "labels": [str(d) for d in range(10)], "image_size": 8, "mean": list(vision_dataset_spec("digits").mean),
        "std": list(vision_dataset_spec("digits").std)}


def test_a_dataset_name_for_ones_own_images_points_to_folder_spec():
    with pytest.raises(ValueError, match=r"^dataset \(a VisionDatasetSpec, or its name\) must be one of cifar10, "
                                         r"cifar100, imagenette, digits; got 'folder' \(your own images: pass "
                                         r"folder_spec\(dsd\)\)"):
        vision_transform("folder", True)


def test_folder_spec_reads_the_stored_images_one_at_a_time():
    """Of data with transforms it failed with KeyError 'image'; it stacked every sampled image at
    image_size (GBs at a large one). Its statistics are those of the stacked images."""
    from lp_decentral_nlp.vision import folder_spec

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (14, 12, 3), dtype=np.uint8)) for _ in range(6)]
    dsd = datasets.DatasetDict(train=datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1] * 3},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})),
        test=datasets.Dataset.from_dict(
        {"image": images[:2], "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})))
    spec = folder_spec(dsd)
    unnormalised = VisionTransform(12, mean=(0, 0, 0), std=(1, 1, 1), train=False)  # values in [0, 1]
    stacked = unnormalised({"image": images})["pixel_values"]
    assert spec.mean == tuple(round(float(v), 4) for v in stacked.mean(dim=(0, 2, 3)))
    assert spec.std == tuple(round(float(v), 4) for v in stacked.std(dim=(0, 2, 3)))
    assert folder_spec(with_vision_transforms(dsd, spec)) == spec


def _write_image_folder(root, splits, classes, size=(40, 36)):
    rng = np.random.default_rng(0)
    for split, per_class in splits.items():
        for c in classes:
            folder = root / split / c
            folder.mkdir(parents=True)
            for k in range(per_class):
                Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / f"{k}.png")


CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def test_image_folder_source(tmp_path):
    _write_image_folder(tmp_path / "cifar", {"train": 2, "test": 1}, CIFAR10_CLASSES)
    dsd = load_vision_dataset("cifar10", data_dir=tmp_path / "cifar")
    assert (dsd["train"].num_rows, dsd["test"].num_rows) == (20, 10)
    assert dsd["train"].features["label"].names == CIFAR10_CLASSES
    assert set(dsd["train"].column_names) == {"image", "label"}
    out = with_vision_transforms(dsd, "cifar10")["train"][:4]
    assert out["pixel_values"].shape == (4, 3, 32, 32)


def test_image_folder_val_split_becomes_test(tmp_path):
    _write_image_folder(tmp_path / "nette", {"train": 1, "val": 1}, [f"n0{i}" for i in range(10)])
    dsd = load_vision_dataset("imagenette", data_dir=tmp_path / "nette")
    assert list(dsd) == ["train", "test"] and dsd["test"].num_rows == 10


def test_several_test_splits_warn_which_one_is_used(tmp_path, caplog):
    """An image folder tree with test/ and val/ (or a saved dataset with test and validation)
    evaluated on test/ and said nothing about val/."""
    classes = [f"n0{i}" for i in range(10)]
    _write_image_folder(tmp_path / "nette", {"train": 1, "val": 1, "test": 2}, classes)
    with caplog.at_level(logging.WARNING):
        dsd = load_vision_dataset("imagenette", data_dir=tmp_path / "nette")
    assert dsd["test"].num_rows == 20
    assert [r.getMessage() for r in caplog.records] == [
        f"data_dir {str(tmp_path / 'nette')!r}: evaluating on 'test'; 'val' also found, not used (the first labelled "
        "one of test, testing, eval, evaluation, validation, valid, val, dev is the test split)"]
    source = _hub_like_cifar100()
    datasets.DatasetDict(train=source["train"], validation=source["test"], dev=source["test"]).save_to_disk(
        tmp_path / "saved")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_vision_dataset("cifar100", data_dir=tmp_path / "saved")
    assert [r.getMessage().split(" (the first")[0] for r in caplog.records] == [
        f"cifar100 ({tmp_path / 'saved'}): evaluating on 'validation'; 'dev' also found, not used"]


def test_an_unlabelled_test_folder_leaves_the_evaluation_to_a_labelled_val_folder(tmp_path, caplog):
    """Kaggle's layout: train/<class>/, val/<class>/ and test/ of images without labels. The run was
    refused ('a file outside a class folder'): the user's test/ had to be moved away."""
    _write_image_folder(tmp_path / "kaggle", {"train": 2, "val": 1}, ["cat", "dog"])
    (tmp_path / "kaggle" / "test").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "kaggle" / "test" / "img_001.png")
    with caplog.at_level(logging.WARNING):
        dsd = load_vision_dataset("folder", data_dir=tmp_path / "kaggle")
    assert dsd["test"].num_rows == 2 and dsd["test"].features["label"].names == ["cat", "dog"]
    assert [r.getMessage() for r in caplog.records] == [
        f"data_dir {str(tmp_path / 'kaggle')!r}: evaluating on 'val'; 'test' (images without class folders: "
        "unlabelled) also found, not used (the first labelled one of test, testing, eval, evaluation, validation, "
        "valid, val, dev is the test split)"]
    shutil.rmtree(tmp_path / "kaggle" / "val")  # no labelled split to evaluate on: the unlabelled one is refused
    with pytest.raises(ValueError, match=r"img_001.png: a file outside a class folder"):
        load_vision_dataset("folder", data_dir=tmp_path / "kaggle")


def test_a_broken_link_in_an_image_folder_is_named_as_one(tmp_path):
    """A class folder linked to a folder that was moved was 'a file outside a class folder'."""
    _write_image_folder(tmp_path / "pets", {"train": 2, "test": 1}, ["cat", "dog"])
    (tmp_path / "pets" / "train" / "bird").symlink_to(tmp_path / "moved")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'pets' / 'train' / 'bird'}: a broken link \(to "
                                         rf"'{tmp_path / 'moved'}', which does not exist\)$"):
        load_vision_dataset("folder", data_dir=tmp_path / "pets")
    (tmp_path / "pets" / "train" / "bird").unlink()
    (tmp_path / "pets" / "train" / "cat" / "gone.png").symlink_to(tmp_path / "gone.png")
    with pytest.raises(ValueError, match=r"cat/gone.png: a broken link"):
        load_vision_dataset("folder", data_dir=tmp_path / "pets")


def test_image_folder_with_wrong_class_count(tmp_path):
    _write_image_folder(tmp_path / "two", {"train": 1, "test": 1}, ["a", "b"])
    with pytest.raises(ValueError, match="cifar10 has 10 classes but"):
        load_vision_dataset("cifar10", data_dir=tmp_path / "two")


def test_an_image_folder_of_one_class_is_refused(tmp_path):
    """It trained, and the recipe failed after training (KeyError 'eval_accuracy': one logit per image)."""
    _write_image_folder(tmp_path / "one", {"train": 2, "test": 1}, ["cat"])
    with pytest.raises(ValueError, match=r"the 'train' split has 1 class \(\['cat'\]\): classification needs at least 2$"):
        load_vision_dataset("folder", data_dir=tmp_path / "one")


def _hub_like_cifar100(rows=6):
    rng = np.random.default_rng(1)
    features = datasets.Features({
        "img": datasets.Image(),
        "fine_label": datasets.ClassLabel(num_classes=100),
        "coarse_label": datasets.ClassLabel(num_classes=20),
    })
    images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(rows)]
    split = datasets.Dataset.from_dict(
        {"img": images, "fine_label": list(range(50, 50 + rows)), "coarse_label": [1] * rows},
        features=features)
    return datasets.DatasetDict(train=split, test=split)


def test_saved_dataset_dir_with_hub_column_names(tmp_path):
    _hub_like_cifar100().save_to_disk(tmp_path / "saved")
    dsd = load_vision_dataset("cifar100", data_dir=tmp_path / "saved")
    assert set(dsd["test"].column_names) == {"image", "label"}
    assert dsd["train"]["label"] == list(range(50, 56))
    assert dsd["train"][0]["image"].size == (32, 32)


def test_own_images_need_a_folder_and_keep_their_classes(tmp_path):
    with pytest.raises(ValueError, match="^folder: the user's own images need data_dir"):
        load_vision_dataset("folder")
    source = _hub_like_cifar100()  # 100 classes: any count is the user's own
    source.save_to_disk(tmp_path / "saved")
    dsd = load_vision_dataset("folder", data_dir=tmp_path / "saved")
    assert dsd["train"].features["label"].num_classes == 100


def test_saved_dataset_test_split_takes_the_names_of_a_test_folder(tmp_path):
    """A saved DatasetDict's test split may be named as an image folder tree's (val, valid, dev, ...)."""
    source = _hub_like_cifar100()
    datasets.DatasetDict(train=source["train"], val=source["test"]).save_to_disk(tmp_path / "saved")
    assert load_vision_dataset("cifar100", data_dir=tmp_path / "saved")["test"].num_rows == 6


def test_hub_request_and_column_mapping(monkeypatch):
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        raw = _hub_like_cifar100()
        if path == "frgfm/imagenette":
            features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
            split = datasets.Dataset.from_dict({"image": raw["train"]["img"], "label": [0] * 6}, features=features)
            return datasets.DatasetDict(train=split, validation=split)
        return raw

    monkeypatch.setattr(vdata.datasets, "load_dataset", fake_load_dataset)
    assert load_vision_dataset("cifar100")["train"]["label"] == list(range(50, 56))
    nette = load_vision_dataset("imagenette")
    assert list(nette) == ["train", "test"] and set(nette["test"].column_names) == {"image", "label"}
    assert calls == [("uoft-cs/cifar100", {}),
                     ("frgfm/imagenette", {"revision": "refs/convert/parquet", "data_dir": "320px"})]


def test_invalid_arguments(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="name must be one of cifar10, cifar100, imagenette, digits"):
        load_vision_dataset("mnist")
    with pytest.raises(ValueError, match="data_dir must be None"):
        load_vision_dataset("digits", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_vision_dataset("cifar10", data_dir=tmp_path / "missing")
    only_train = _hub_like_cifar100()
    monkeypatch.setattr(vdata.datasets, "load_dataset",
                        lambda path, **kw: datasets.DatasetDict(train=only_train["train"]))
    with pytest.raises(ValueError, match="no test split"):
        load_vision_dataset("cifar100")
    no_label = datasets.DatasetDict(train=only_train["train"].remove_columns(["fine_label"]),
                                    test=only_train["test"])
    monkeypatch.setattr(vdata.datasets, "load_dataset", lambda path, **kw: no_label)
    with pytest.raises(ValueError, match="no label column"):
        load_vision_dataset("cifar100")
    int_label = only_train.cast_column("fine_label", datasets.Value("int64"))
    monkeypatch.setattr(vdata.datasets, "load_dataset", lambda path, **kw: int_label)
    with pytest.raises(TypeError, match="ClassLabel"):
        load_vision_dataset("cifar100")
    with pytest.raises(ValueError, match="image_size"):
        VisionTransform(0, (0.0,) * 3, (1.0,) * 3, train=True)
    with pytest.raises(ValueError, match="padding"):
        VisionTransform(8, (0.0,) * 3, (1.0,) * 3, train=True, padding=-1)
    with pytest.raises(ValueError, match="std"):
        VisionTransform(8, (0.0,) * 3, (0.0, 1.0, 1.0), train=True)


@pytest.mark.parametrize("image_size, message", [(-3, r"^image_size must be an integer >= 1, got -3"),
                                                 (0, r"^image_size must be an integer >= 1, got 0"),
                                                 (2.5, r"^image_size must be an integer")])
def test_folder_spec_refuses_an_image_size_that_is_no_size(image_size, message):
    """-3 was a raw torch RuntimeError, 0 silently meant "measure it"."""
    from lp_decentral_nlp.vision import folder_spec

    images = [Image.new("RGB", (12, 10), (i * 40, 0, 0)) for i in range(4)]
    dsd = datasets.DatasetDict(train=datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})))
    assert folder_spec(dsd).image_size == 10 and folder_spec(dsd, 6).image_size == 6
    with pytest.raises(ValueError, match=message):
        folder_spec(dsd, image_size)


def test_folder_spec_measures_photos_at_most_at_imagenet_size(caplog):
    """Photos trained at their median shorter side: 1500 px phone photos made a ResNet-20 run hundreds
    of times slower than at ImageNet's 224, without a word."""
    from lp_decentral_nlp.vision import MAX_MEASURED_IMAGE_SIZE, folder_spec

    images = [Image.new("RGB", (300, 260), (i * 40, 90, 0)) for i in range(4)]
    dsd = datasets.DatasetDict(train=datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})))
    with caplog.at_level(logging.WARNING):
        assert folder_spec(dsd).image_size == MAX_MEASURED_IMAGE_SIZE == 224
    assert [r.getMessage() for r in caplog.records] == [
        "the training images' median shorter side is 260 px: they are resized to 224 px, the most image_size takes "
        "by default (give image_size, in a recipe --image-size, for more)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert folder_spec(dsd, 260).image_size == 260  # asked for: no cap, no warning
    assert not caplog.records


def test_the_data_helpers_name_a_wrong_argument():
    """with_vision_transforms(dsd['train']) and folder_spec(dsd['train']) said "Column 'train' doesn't
    exist", a DatasetDict without 'test' was a KeyError, its other splits were dropped in silence, and
    folder_spec(sample=0) was 'cannot convert float NaN to integer'."""
    from lp_decentral_nlp.vision import folder_spec

    dsd = load_vision_dataset("digits")
    with pytest.raises(TypeError, match=r"^dsd must be a DatasetDict with the splits \['train', 'test'\] "
                                        r"\(load_vision_dataset's\), got Dataset$"):
        with_vision_transforms(dsd["train"], "digits")
    with pytest.raises(TypeError, match=r"^dsd must be a DatasetDict with the splits \['train'\]"):
        folder_spec(dsd["train"])
    with pytest.raises(ValueError, match=r"^dsd has the splits \['train', 'validation'\], and \['test'\] missing"):
        with_vision_transforms(datasets.DatasetDict(train=dsd["train"], validation=dsd["test"]), "digits")
    kept = with_vision_transforms(datasets.DatasetDict(train=dsd["train"], test=dsd["test"], validation=dsd["test"]),
                                  "digits")
    assert list(kept) == ["train", "test", "validation"]
    assert torch.equal(kept["validation"][:2]["pixel_values"], kept["test"][:2]["pixel_values"])  # evaluation's
    with pytest.raises(ValueError, match=r"^sample must be an integer >= 1, got 0"):
        folder_spec(dsd, sample=0)
