"""The vision path as a Python script trains it: DecentralizedTrainer on an ImageClassifier with
the digits images (bundled, offline), 2 simulated nodes."""
import re

import pytest
import torch
from PIL import Image

from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments
from lp_decentral_nlp.vision import ImageClassifier, load_vision_dataset, vision_transform, with_vision_transforms

PREPROCESSING = {"labels": [str(i) for i in range(10)], "image_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3}


@pytest.fixture(scope="module")
def digits():
    return with_vision_transforms(load_vision_dataset("digits"), "digits")


def arguments(tmp_path, **fields):
    return DecentralizedTrainingArguments(output_dir=str(tmp_path), num_nodes=2, max_steps=2,
                                          per_device_train_batch_size=8, use_cpu=True, report_to=[], **fields)


def test_the_images_transform_needs_its_columns_kept(digits, tmp_path):
    """The default remove_unused_columns dropped the 'image' column the transform reads: a KeyError
    at the first batch of train(), after the model was quantized in place."""
    model = ImageClassifier("resnet20", 10, "range_evonorm")
    with pytest.raises(ValueError, match=r"^train_dataset makes its samples with a transform \(with_transform/"
                                         r"set_transform\), and remove_unused_columns=True would drop \['image'\] "
                                         r"before it runs \(ImageClassifier.forward does not take them\): pass "
                                         r"remove_unused_columns=False$"):
        DecentralizedTrainer(model=model, args=arguments(tmp_path), train_dataset=digits["train"])
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())  # refused before the surgery
    with pytest.raises(ValueError, match=r"^eval_dataset makes its samples with a transform"):
        DecentralizedTrainer(model=model, args=arguments(tmp_path), eval_dataset=digits["test"])


@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_images_without_a_transform_are_refused_at_construction(remove_unused_columns, tmp_path):
    """Images as loaded (PIL, no transform) trained until forward's TypeError ("missing 1 required
    positional argument: 'pixel_values'") at the first step; a collator that makes them passes."""
    raw = load_vision_dataset("digits")
    model = ImageClassifier("resnet20", 10)
    args = arguments(tmp_path, remove_unused_columns=remove_unused_columns)
    for what, given in (("train_dataset", {"train_dataset": raw["train"]}), ("eval_dataset", {"eval_dataset": raw["test"]})):
        with pytest.raises(ValueError, match=rf"^{what} has no column 'pixel_values', which ImageClassifier.forward "
                                             r"requires \(columns: \['image', 'label'\]\): make it with a transform"):
            DecentralizedTrainer(model=model, args=args, **given)
    if remove_unused_columns:
        return
    make = vision_transform("digits", train=True)  # the transform, as a collator

    def collate(rows):
        batch = make({"image": [row["image"] for row in rows], "label": [row["label"] for row in rows]})
        return {"pixel_values": batch["pixel_values"], "labels": batch["label"]}
    trainer = DecentralizedTrainer(model=model, args=args, train_dataset=raw["train"], data_collator=collate)
    trainer.train()
    assert trainer.state.global_step == 2


def test_labels_beyond_the_image_classifiers_classes_are_refused_at_construction(digits, tmp_path):
    """ImageClassifier(num_classes=5) on the 10 digits trained until torch's IndexError ('Target 8 is
    out of bounds')."""
    with pytest.raises(ValueError, match=r"^train_dataset: labels must be class ids 0..4 \(the model has "
                                         r"num_labels=5\), found \[5, 6, 7, 8, 9\]$"):
        DecentralizedTrainer(model=ImageClassifier("resnet20", 5), args=arguments(tmp_path, remove_unused_columns=False),
                             train_dataset=digits["train"])


def test_a_trained_image_classifier_reports_its_inputs_writes_a_card_and_predicts(digits, tmp_path):
    """create_model_card() was an AttributeError (no config); include_for_metrics=['inputs'] looked for
    'input_ids'; the preprocessing dict stayed the caller's object, so changing it changed the model."""
    preprocessing = {**PREPROCESSING, "labels": list(PREPROCESSING["labels"])}
    model = ImageClassifier("resnet20", 10, "range_evonorm", preprocessing=preprocessing)
    preprocessing["labels"][0] = "changed"
    assert model.vision_config["preprocessing"]["labels"][0] == "0"
    seen = []

    def metrics(prediction):
        seen.append(prediction.inputs.shape)
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    trainer = DecentralizedTrainer(model=model, args=arguments(tmp_path, remove_unused_columns=False,
                                                               include_for_metrics=["inputs"]),
                                   train_dataset=digits["train"], eval_dataset=digits["test"], compute_metrics=metrics)
    trainer.train()
    assert 0 <= trainer.evaluate()["eval_accuracy"] <= 1 and seen[-1] == (360, 3, 8, 8)
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "trained from scratch" in card and "num_nodes: 2" in card


def test_predict_feeds_a_float_model_in_its_own_float_type():
    """A float64 (or bfloat16) copy of a float model failed in predict(): 'expected scalar type Float
    but found Double'."""
    model = ImageClassifier("resnet20", 10, "evonorm", preprocessing=PREPROCESSING)
    images = [Image.new("RGB", (8, 8), (30 * i, 90, 200)) for i in range(3)]
    assert model.preprocess(images).dtype == torch.float32
    wide = model.to(torch.float64)
    assert wide.preprocess(images).dtype == torch.float64 and len(wide.predict(images)) == 3


def test_preprocessing_takes_numpy_numbers_and_refuses_nan_and_repeated_names():
    """NumPy numbers (a mean computed with numpy) were refused with the generic message, though numbers
    here as everywhere in the library; a NaN mean and two classes of one name were accepted."""
    import numpy as np

    spec = {"labels": ["a", "b"], "image_size": np.int64(8), "mean": list(np.full(3, 0.5, np.float32)),
            "std": [0.25] * 3}
    saved = ImageClassifier("resnet20", 2, preprocessing=spec).vision_config["preprocessing"]
    assert saved == {"labels": ["a", "b"], "image_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3}
    assert type(saved["image_size"]) is int and all(type(v) is float for v in saved["mean"])
    for bad in ({**spec, "labels": ["a", "a"]}, {**spec, "mean": [float("nan")] * 3}):
        with pytest.raises(ValueError, match=r"^preprocessing must be None or \{'labels': \[distinct class names\]"):
            ImageClassifier("resnet20", 2, preprocessing=bad)


def test_the_readmes_vision_script_runs(tmp_path, monkeypatch):
    """The README's Python example of the vision path, shortened to two steps."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    script, = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "ImageClassifier(" in block]
    assert "num_train_epochs=20" in script
    monkeypatch.chdir(tmp_path)  # its output_dir is relative
    namespace = {}
    exec(script.replace("num_train_epochs=20", "max_steps=2"), namespace)
    assert namespace["trainer"].state.global_step == 2 and (tmp_path / "runs" / "digits").is_dir()


def test_forward_names_pixel_values_it_cannot_take():
    """uint8 images, an (N, H, W, 3) array's layout and one-channel images failed in the first
    convolution with torch's messages."""
    model = ImageClassifier("resnet20", 10, "range_evonorm")
    for bad, got in ((torch.zeros(2, 3, 8, 8, dtype=torch.uint8), "torch.uint8 of shape (2, 3, 8, 8)"),
                     (torch.zeros(2, 8, 8, 3), "torch.float32 of shape (2, 8, 8, 3)"),
                     (torch.zeros(2, 1, 8, 8), "torch.float32 of shape (2, 1, 8, 8)")):
        with pytest.raises(ValueError, match=rf"^pixel_values must be a floating-point \(N, 3, H, W\) tensor \(RGB, as "
                                             rf"preprocess\(\) and VisionTransform make it\), got {re.escape(got)}$"):
            model(bad)
    assert model(torch.zeros(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)).logits.shape == (2, 10)


def test_counting_non_padding_tokens_of_images_is_refused_at_construction(digits, tmp_path):
    """It failed at the first training step (after the recipe had written its cost report and a
    "running" results.json), with a traceback from the vision recipe."""
    args = arguments(tmp_path, remove_unused_columns=False, include_num_input_tokens_seen="non_padding")
    with pytest.raises(ValueError, match=r"^include_num_input_tokens_seen='non_padding' counts the input tokens that "
                                         r"are not padding, and the model's main input pixel_values \(images\) has no "
                                         r"padding: use 'all'"):
        DecentralizedTrainer(model=ImageClassifier("resnet20", 10), args=args, train_dataset=digits["train"])
