"""Vision recipes (SPEC 8): flags, the multi-step LR schedule of the trainer, an end-to-end digits run."""
import collections
import csv
import json
import os
import pathlib
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch

from lp_decentral_nlp.gossip import make_topology
from lp_decentral_nlp.quant import QuantModule, kernel_report
from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments
from lp_decentral_nlp.vision import ImageClassifier, QuantRangeEvoNorm2d, load_vision_dataset, vision_transform
from lp_decentral_nlp.vision.recipe import parse_vision_args

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- the trainer's multi-step LR schedule ---------------------------------------------------------


def tiny_image_set(n=16):
    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_dict({
        "pixel_values": torch.randn(n, 3, 8, 8, generator=g).tolist(),
        "label": [i % 4 for i in range(n)],
    }).with_format("torch")


def lr_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), num_nodes=2, low_precision=False, learning_rate=0.1, optim="sgd",
                optim_args="momentum=0.9,nesterov=True", lr_scheduler_type="constant", per_device_train_batch_size=4,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                remove_unused_columns=False)
    return DecentralizedTrainingArguments(**{**base, **kw})


def test_label_smoothing_smooths_a_model_without_a_config(tmp_path):
    """transformers' Trainer reads ``model.config`` to set up label smoothing: an ImageClassifier
    (no config) failed with an AttributeError. Its loss is the smoothed cross-entropy, and the
    model is left as given."""
    from lp_decentral_nlp.vision import ImageClassifier

    torch.manual_seed(0)
    model = ImageClassifier("resnet20", 4, "evonorm")
    trainer = DecentralizedTrainer(model=model, args=lr_args(tmp_path, label_smoothing_factor=0.1, max_steps=1),
                                   train_dataset=tiny_image_set())
    assert not hasattr(model, "config") and not hasattr(trainer.nodes[0], "config")
    batch = {"pixel_values": torch.randn(4, 3, 8, 8), "labels": torch.tensor([0, 1, 2, 3])}
    node = trainer.nodes[0].eval()
    with torch.no_grad():
        logits = node(batch["pixel_values"]).logits
        loss = trainer.compute_loss(node, dict(batch))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=0.1))
    trainer.train()


def test_lr_milestones_multiply_the_lr_at_epoch_boundaries(tmp_path):
    # 16 samples, 2 nodes, batch 4: 2 steps per epoch, so milestones at epochs 1 and 2 are steps 2 and 4
    args = lr_args(tmp_path, lr_milestones=[1, 2], lr_decay=0.5, max_steps=5)
    trainer = DecentralizedTrainer(model=ImageClassifier("resnet20", 4, "evonorm"), args=args,
                                   train_dataset=tiny_image_set())
    trainer.train()
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    # each step's log carries the LR it ran at (as Trainer's): the decay follows steps 2 and 4
    assert logged == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    assert len(trainer.node_optimizers) == 2
    for sgd in trainer.node_optimizers:
        assert isinstance(sgd, torch.optim.SGD)
        assert all(g["momentum"] == 0.9 and g["nesterov"] for g in sgd.param_groups)
        assert sorted(g["weight_decay"] for g in sgd.param_groups) == [0.0, 0.0]  # weight_decay defaults to 0
        assert [g["lr"] for g in sgd.param_groups] == pytest.approx([0.025, 0.025])  # after both milestones


def test_steps_per_epoch_is_what_one_epoch_of_training_takes(tmp_path):
    # 16 samples, 2 nodes of 8, batch 3: 2 full batches per node and epoch
    def trainer(**kw):
        return DecentralizedTrainer(model=ImageClassifier("resnet20", 4, "evonorm"),
                                    args=lr_args(tmp_path, per_device_train_batch_size=3, **kw),
                                    train_dataset=tiny_image_set())

    assert trainer().steps_per_epoch() == 2
    assert trainer(gradient_accumulation_steps=2).steps_per_epoch() == 1
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 exceeds the batches per epoch of the "
                                         r"smallest shard \(2\)"):
        trainer(gradient_accumulation_steps=3).steps_per_epoch()
    one_epoch = trainer(num_train_epochs=1)
    one_epoch.train()
    assert one_epoch.state.global_step == one_epoch.steps_per_epoch() == 2


@pytest.mark.parametrize("kw, match", [
    ({"lr_milestones": [2, 1]}, "strictly increasing"),
    ({"lr_milestones": [0, 1]}, "epochs > 0"),
    ({"lr_milestones": []}, "non-empty"),
    ({"lr_milestones": [1], "lr_scheduler_type": "linear"}, "needs lr_scheduler_type='constant'"),
    ({"lr_decay": 0.0}, r"lr_decay must be a number in \(0, 1\]"),
])
def test_lr_milestone_arguments_are_checked(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        lr_args(tmp_path, **kw)


# -- flags ------------------------------------------------------------------------------------------


def test_defaults_resolve_per_precision_and_dataset():
    a = parse_vision_args("choco", [])
    r, t = a.recipe, a.training
    assert (r.dataset, r.arch, r.norm, r.image_size, r.num_classes) == ("digits", "resnet20", "range_evonorm", 8, 10)
    assert t.learning_rate == 0.1 and t.weight_decay == 1e-4 and r.augment is False and t.optim == "sgd"
    assert t.lr_milestones == [2.5, 3.75]  # 50% and 75% of the 5 default epochs
    b = parse_vision_args("deepsqueeze", ["--full-precision", "--epochs", "200", "--dataset", "cifar10"])
    assert (b.recipe.norm, b.training.algorithm, b.recipe.image_size, b.recipe.augment) == (
        "evonorm", "deepsqueeze", 32, True)
    assert b.training.lr_milestones == [100, 150]  # SPEC 8
    c = parse_vision_args("choco", ["--lr-milestones", "--norm", "batchnorm", "--augment", "false",
                                    "--dataset", "cifar100"])
    assert c.training.lr_milestones is None and c.recipe.norm == "batchnorm" and c.recipe.augment is False
    assert c.recipe.num_classes == 100
    d = parse_vision_args("choco", ["--lr_scheduler_type", "cosine"])  # another schedule: no default milestones
    assert d.training.lr_milestones is None and d.training.lr_scheduler_type == "cosine"
    assert t.optim_args == "momentum=0.9,nesterov=True"  # SGD's, for --optim sgd only (AdamW was refused them)
    assert parse_vision_args("choco", ["--optim", "adamw_torch"]).training.optim_args is None
    assert parse_vision_args("choco", ["--qgm"]).training.optim_args is None  # QGM is the momentum
    assert parse_vision_args("choco", ["--optim_args", "momentum=0.5"]).training.optim_args == "momentum=0.5"


@pytest.mark.parametrize("argv, message", [
    (["--norm", "layernorm"], "argument --norm: norm must be one of"),
    (["--arch", "resnet50"], "argument --arch: arch must be one of"),
    (["--dataset", "mnist"], "argument --dataset: dataset must be one of"),
    (["--lr", "0"], "argument --lr: learning_rate must be a number in (0, 10000], got 0.0"),
    (["--skew", "1.5"], "argument --skew: skew must be a number in [0, 1], got 1.5"),
    (["--lr-milestones", "3", "2"], "argument --lr-milestones: lr_milestones must be a non-empty, strictly increasing"),
    (["--lr-milestones", "0"], "argument --lr-milestones: lr_milestones must be a non-empty, strictly increasing list "
                               "of epochs > 0"),
    (["--lr-milestones", "nan"], "expected a finite number, got 'nan'"),
    (["--data-dir", "."], "argument --data-dir: digits is bundled with scikit-learn and takes no data_dir (your own "
                          "images: add --dataset folder)"),
    (["--arch", "vgg11"], "argument --image-size: vgg11 needs images of at least 32x32, got 8, the size of the digits "
                          "images (pass --image-size 32)"),
    (["--arch", "vgg11", "--image-size", "16"], "argument --image-size: vgg11 needs images of at least 32x32, got 16 "
                                                "(pass --image-size 32)"),
    (["--groups", "3"], "argument --groups/--norm: groups=3 does not fit every norm layer of resnet20 (num_channels=16 "
                        "must be divisible by groups=3): range_evonorm on resnet20 takes groups in [1, 2, 4, 8]"),
    (["--groups", "16"], "needs at least 2 channels per group"),
    (["--groups", "0"], "argument --groups: groups must be an integer >= 1, got 0"),
    (["--remove_unused_columns", "true"], "argument --remove_unused_columns: the image transform reads each sample's "
                                          "'image' column"),
    (["--lr_scheduler_type", "linear", "--lr_decay", "0.5"], "argument --lr_decay: lr_decay=0.5 is the factor at each "
                                                             "of lr_milestones, and lr_milestones=None"),
])
def test_bad_flags_exit_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_vision_args("choco", argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


# -- end to end -------------------------------------------------------------------------------------


def test_log_level_info_prints_the_run_summary_once_on_stderr(tmp_path):
    """The package's info lines never printed on a command line (Python's last resort prints
    warnings only); they print once, without the probes' transformers lines about output_dir."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "vision_choco.py"), "--nodes", "2", "--max-steps", "1",
         "--batch-size", "8", "--log_level", "info", "--disable_tqdm", "--output-dir", str(tmp_path / "run")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("***** Running decentralized training *****") == 1
    assert "  Total optimization steps = 1 (from step 0)" in proc.stderr
    assert "No output directory specified" not in proc.stderr


def test_digits_recipe_end_to_end(tmp_path):
    """A few 8-bit Choco steps on digits in a subprocess: results.json contract, metrics, the model."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "vision_choco.py"), "--nodes", "2", "--skew", "0.4", "--comp", "90",
         "--max-steps", "4", "--batch-size", "8", "--logging-steps", "1", "--output-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "done" and results["steps"] == 4
    assert summary["accuracy"] == results["accuracy"] and 0.0 <= results["accuracy"] <= 1.0
    assert summary["loss"] == results["loss"] and summary["results"] == str(out / "results.json")
    assert len(results["node_accuracy"]) == 2 and all(b > 0 for b in results["bytes_sent_per_node"])
    assert results["config"]["norm"] == "range_evonorm" and results["config"]["algorithm"] == "choco"
    assert results["config"]["consensus_lr_used"] == 0.2  # default_consensus_lr at --comp 90 on 2 nodes
    assert results["config"]["threads"] == 1  # no --threads: OMP_NUM_THREADS, the count the run used
    assert results["model_used"] == "resnet20 (range_evonorm, 10 classes, random init)"
    assert results["cost"]["precision"] == "int8" and results["cost"]["input_shape"] == [3, 8, 8]
    assert results["cost"]["communication"]["spectral_gap"] == results["spectral_gap"] == pytest.approx(
        make_topology("directed_ring", 2).period_spectral_gap())  # spec 1: each graph's gap is reported
    rows = (out / "metrics.csv").read_text(encoding="utf-8").splitlines()
    assert rows[0].startswith("step,") and len(rows) >= 5
    # the default milestones are 50% and 75% of the --max-steps run (steps 2 and 3), not of the default
    # --epochs it overrides; each row's learning_rate is the one its step ran at
    lrs = [float(r["learning_rate"]) for r in csv.DictReader(rows) if r["learning_rate"]]
    assert lrs == pytest.approx([0.1, 0.1, 0.01, 0.001])
    assert results["config"]["lr_milestone_fractions"] == [0.5, 0.75]

    # the saved averaged model is the 8-bit model that was evaluated, with a card (there was none)
    card = (out / "model" / "README.md").read_text()
    assert "This model was trained from scratch on the digits dataset." in card and "- image-classification\n" in card
    assert "in 8-bit: weights, activations and layer gradients" in card
    assert "\nlibrary_name: lp_decentral_nlp\n" in card  # not transformers, which cannot load it
    assert "`lp_decentral_nlp.vision.ImageClassifier.from_pretrained(path)` loads it." in card
    model = ImageClassifier.from_pretrained(out / "model")
    assert not model.training  # as transformers' from_pretrained: a forward leaves ranges and statistics alone
    preprocessing = model.vision_config["preprocessing"]
    assert (len(preprocessing["labels"]), preprocessing["image_size"], preprocessing["mean"]) == (10, 8, [0.3053] * 3)
    assert isinstance(model.net.stem.norm, QuantRangeEvoNorm2d)
    assert not any(isinstance(m, QuantModule) for m in model.net.classifier.modules())
    test = load_vision_dataset("digits")["test"].with_transform(vision_transform("digits", train=False))
    # kernels.json: what the layers ran in training. Under "auto" a convolution picks its kernel
    # per call from its size (int8 needs 2**26 multiply-adds where the CPU has an int8 GEMM); one
    # forward at the training batch size picks what training did
    model.eval()
    with torch.no_grad():
        model(torch.stack([test[i]["pixel_values"] for i in range(8)]))
    trained_with = kernel_report(model)
    assert json.loads((out / "kernels.json").read_text()) == trained_with and len(trained_with) == 21
    assert results["kernels"] == dict(collections.Counter(trained_with.values()))
    loader = torch.utils.data.DataLoader(test, batch_size=32)  # the recipe's evaluation batch size
    model.eval()
    with torch.no_grad():
        correct = sum((model(b["pixel_values"]).logits.argmax(-1) == b["label"]).sum().item() for b in loader)
    assert correct / len(test) == pytest.approx(results["accuracy"])

    # the int8 inference export (SPEC 4): every quantized layer's weight as int8 codes, which load back
    # into the model as the weights its forward used
    from safetensors.torch import load_file

    from lp_decentral_nlp.quant import QuantGemmLayer, load_int8_export
    exported = load_file(out / "model" / "int8.safetensors")
    quantized = [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, QuantGemmLayer)]
    assert quantized and all(exported[key].dtype == torch.int8 for key in quantized)
    before = model(torch.stack([test[i]["pixel_values"] for i in range(8)])).logits
    model.load_state_dict(load_int8_export(out / "model" / "int8.safetensors"))
    with torch.no_grad():
        after = model(torch.stack([test[i]["pixel_values"] for i in range(8)])).logits
    torch.testing.assert_close(after, before.detach(), atol=5e-2, rtol=0)


def test_an_evaluation_at_the_last_step_is_the_final_one(tmp_path):
    """--eval_steps dividing --max-steps: the evaluation training ends with is the one results.json
    reports; the test set is not evaluated again (nor its row repeated in metrics.csv)."""
    from lp_decentral_nlp.vision.recipe import main

    out = tmp_path / "run"
    results = main("choco", ["--nodes", "2", "--max-steps", "4", "--batch-size", "8", "--eval_steps", "2",
                             "--disable_tqdm", "true", "--output-dir", str(out)])
    rows = [r for r in csv.DictReader((out / "metrics.csv").read_text().splitlines()) if r["eval_accuracy"]]
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert float(rows[-1]["eval_accuracy"]) == pytest.approx(results["accuracy"])
    assert float(rows[-1]["eval_consensus_distance"]) == pytest.approx(results["consensus_distance"])


def test_overwrite_output_dir_removes_the_previous_runs_checkpoints(tmp_path, capsys):
    """--overwrite_output_dir runs anew: the previous run's checkpoints go (a later resume would find
    its newest one), files that are not a run's stay; resuming from a checkpoint of the folder keeps
    them, and so does a run refused for its checkpoint."""
    import shutil

    from lp_decentral_nlp.vision.recipe import main

    out = tmp_path / "run"
    flags = ["--nodes", "2", "--batch-size", "8", "--disable_tqdm", "true", "--output-dir", str(out)]
    main("choco", [*flags, "--max-steps", "4", "--save_steps", "2"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    (out / "notes.txt").write_text("mine")
    damaged = shutil.copytree(out / "checkpoint-2", tmp_path / "elsewhere" / "checkpoint-2")
    (damaged / "node-0.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit):
        main("choco", [*flags, "--max-steps", "4", "--resume_from_checkpoint", str(damaged), "--overwrite_output_dir"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    capsys.readouterr()
    main("choco", [*flags, "--max-steps", "4", "--save_steps", "2", "--resume_from_checkpoint",
                   str(out / "checkpoint-2"), "--overwrite_output_dir"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    results = main("choco", [*flags, "--max-steps", "1", "--full-precision", "--overwrite_output_dir"])
    assert "removed the previous run's checkpoint-2, checkpoint-4, cost_report.json" in capsys.readouterr().err
    assert results["steps"] == 1 and not list(out.glob("checkpoint-*")) and (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "results.json").read_text())["config"]["low_precision"] is False


def test_a_run_larger_than_the_memory_names_the_image_size_flag(tmp_path, capsys, monkeypatch):
    """It said "lower --nodes, --batch-size or --max-length", a flag the vision recipes do not have."""
    from lp_decentral_nlp.commands import run
    from lp_decentral_nlp.vision.recipe import main

    monkeypatch.setattr(run, "available_memory_mb", lambda device: 1.0)
    with pytest.raises(SystemExit) as exc:
        main("choco", ["--nodes", "2", "--batch-size", "8", "--image_size", "16", "--output-dir", str(tmp_path / "run")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "available on cpu: lower --nodes, --batch-size or --image_size, or run one node per process (--backend "
        "distributed)")


@pytest.mark.parametrize("argv", [["--arch", "resnet18", "--norm", "batchnorm", "--full-precision", "--batch-size", "1"],
                                  ["--norm", "range_batchnorm", "--batch-size", "1", "--image-size", "1"]])
def test_a_batch_the_model_cannot_train_on_is_one_line(argv, tmp_path, capsys):
    """A BatchNorm given one value per channel failed in the memory check with a traceback."""
    from lp_decentral_nlp.vision.recipe import main

    with pytest.raises(SystemExit) as exc:
        main("choco", ["--nodes", "2", "--max_steps", "1", "--output-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert "error: argument --batch-size: ImageClassifier cannot train on a batch of 1 x (3, " in err
    assert "more than 1 value per channel when training" in err and err.rstrip().endswith(
        "; raise --batch-size or --image-size")


def test_a_diverging_run_stops_with_one_line(tmp_path, capsys):
    """The NonFiniteError named node and step under a 24-line traceback."""
    from lp_decentral_nlp.vision.recipe import main

    with pytest.raises(SystemExit) as exc:
        main("choco", ["--nodes", "2", "--max_steps", "10", "--lr", "10000", "--full-precision", "--norm", "batchnorm",
                       "--disable_tqdm", "true", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert exc.value.code == 1 and "Traceback" not in err, err
    assert ": error: NonFiniteError: node " in last and "--skip-nonfinite" in last, err
    results = json.loads((tmp_path / "run" / "results.json").read_text())  # not left "running"
    assert results["status"] == "failed" and results["next"] == last.split(": error: ", 1)[1]


def test_ctrl_c_says_how_to_continue_instead_of_a_traceback(tmp_path, capsys, monkeypatch):
    """Ctrl-C during training: one line naming the step and the checkpoint to resume from, exit
    status 130 (SIGINT's); results.json says "interrupted", the step and the same advice."""
    from lp_decentral_nlp.trainer import MetricsCSVCallback
    from lp_decentral_nlp.vision.recipe import main

    log = MetricsCSVCallback.on_log

    def interrupted_at_step_3(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise KeyboardInterrupt
        return log(self, args, state, control, **kwargs)

    monkeypatch.setattr(MetricsCSVCallback, "on_log", interrupted_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main("choco", ["--nodes", "2", "--batch-size", "8", "--max-steps", "4", "--save_steps", "2", "--logging_steps",
                       "1", "--disable_tqdm", "true", "--output-dir", str(out)])
    assert exc.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1].split(": ", 1)[1] == (  # after the program name
        f"interrupted at step 3: resume from its last checkpoint with --resume-from-checkpoint {out / 'checkpoint-2'}")
    results = json.loads((out / "results.json").read_text())
    assert (results["status"], results["step"]) == ("interrupted", 3)
    assert results["next"] == f"resume from its last checkpoint with --resume-from-checkpoint {out / 'checkpoint-2'}"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main("choco", ["--nodes", "2", "--batch-size", "8", "--max-steps", "4", "--logging_steps", "1",
                       "--disable_tqdm", "true", "--output-dir", str(tmp_path / "unsaved")])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "interrupted at step 3: no checkpoint was written (--save-steps N writes them): run it again with "
        "--overwrite-output-dir")


def test_own_images_train_with_their_classes_size_and_statistics(tmp_path, capsys):
    """--dataset folder: any number of classes; the image size is the images' (median shorter side)
    and the normalisation their per-channel mean and std, all recorded in results.json."""
    from PIL import Image

    from lp_decentral_nlp.vision.recipe import main

    rng = np.random.default_rng(0)
    tree, arrays = tmp_path / "tree", []
    for split, count in (("train", 12), ("test", 4)):
        for name in ("ant", "bee", "cat"):
            (tree / split / name).mkdir(parents=True)
            for k in range(count):
                pixels = rng.integers(0, 256, (12, 14, 3), dtype=np.uint8)  # 12 high, 14 wide
                Image.fromarray(pixels).save(tree / split / name / f"{k}.png")
                if split == "train":
                    arrays.append(pixels[:, 1:13])  # the centre 12 x 12 the transform keeps
    out = tmp_path / "run"
    results = main("choco", ["--dataset", "folder", "--data-dir", str(tree), "--nodes", "2", "--batch-size", "4",
                             "--max-steps", "2", "--disable_tqdm", "true", "--output-dir", str(out)])
    config = results["config"]
    assert (config["num_classes"], config["classes"], config["image_size"]) == (3, ["ant", "bee", "cat"], 12)
    pixels = np.stack(arrays).astype(np.float64) / 255
    assert config["mean"] == pytest.approx(pixels.mean(axis=(0, 1, 2)), abs=1e-4)
    assert config["std"] == pytest.approx(pixels.std(axis=(0, 1, 2), ddof=1), abs=1e-4)
    model = ImageClassifier.from_pretrained(out / "model")
    assert model(torch.zeros(1, 3, 12, 12)).logits.shape == (1, 3)
    assert model.vision_config["preprocessing"] == {  # the saved model says how to feed it
        "labels": ["ant", "bee", "cat"], "image_size": 12, "mean": config["mean"], "std": config["std"]}
    # a network the measured size is too small for: one line naming the flag that fixes it
    with pytest.raises(SystemExit) as exc:
        main("choco", ["--dataset", "folder", "--data-dir", str(tree), "--arch", "vgg11", "--nodes", "2",
                       "--batch-size", "4", "--output-dir", str(tmp_path / "vgg")])
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
        "argument --image-size: vgg11 needs images of at least 32x32, got 12, the median shorter side of the "
        "training images (pass --image-size 32)")
    assert not (tmp_path / "vgg").exists()


def test_own_images_need_their_folder(capsys):
    from lp_decentral_nlp.vision.recipe import build_vision_parser

    with pytest.raises(SystemExit):
        build_vision_parser("choco").parse(["--dataset", "folder"])
    assert capsys.readouterr().err.endswith(  # the flag as the docs spell it, once (it said "--data_dir: data_dir:")
        "error: argument --data-dir: --dataset folder trains your own images: give their folder with --data-dir\n")


@pytest.mark.parametrize("absent, named", [({"PIL"}, "Pillow is"), ({"PIL", "sklearn"}, "Pillow and scikit-learn are")])
def test_without_the_vision_extra_the_data_and_the_recipe_name_the_pip_command(absent, named, tmp_path, capsys,
                                                                               monkeypatch):
    """Without Pillow the recipe stopped with an import traceback when it loaded the digits."""
    import importlib.util

    from lp_decentral_nlp.vision.recipe import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else find_spec(name, *a))
    line = f'{named} not installed: the vision datasets need the [vision] extra (pip install "lp-decentral-nlp[vision]")'
    with pytest.raises(ImportError) as err:
        load_vision_dataset("digits")
    assert str(err.value) == line
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main("choco", ["--max_steps", "1", "--output-dir", str(out)])
    [printed] = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and printed.endswith(f": error: {line}")
    assert not out.exists()
