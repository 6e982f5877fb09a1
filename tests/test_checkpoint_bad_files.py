"""Checkpoints that cannot be resumed (issue 24): truncated or corrupted files, another package
version, another model; each is a ValueError/FileNotFoundError naming the file and what is wrong
(no safetensors/json traceback), and the checkpoint is left as it was."""
import hashlib
import json
import shutil

import pytest
from helpers import agnews_sample, tiny_distilbert

from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments
from lp_decentral_nlp.trainer import checkpointing as ckpt


@pytest.fixture(scope="module")
def agnews(tokenizer):
    return agnews_sample(tokenizer, max_length=16, max_train_samples=32, max_eval_samples=8)


def targs(out, **kw):
    base = dict(output_dir=str(out), num_nodes=2, per_device_train_batch_size=8, learning_rate=1e-3, max_steps=2,
                save_strategy="steps", save_steps=2, use_cpu=True, disable_tqdm=True, seed=0, low_precision=False,
                report_to="none")
    base.update(kw)
    return DecentralizedTrainingArguments(**base)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, agnews, tokenizer):
    out = tmp_path_factory.mktemp("run")
    DecentralizedTrainer(model=tiny_distilbert(), args=targs(out), train_dataset=agnews["train"],
                         processing_class=tokenizer).train()
    return out / "checkpoint-2"


def damaged_copy(saved_run, tmp_path, damage):
    """A copy of the checkpoint with ``damage(copy_dir)`` applied; returns the copy."""
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(saved_run, copy)
    damage(copy)
    return copy


def digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def resume(checkpoint, agnews, tokenizer, model=None, **kw):
    trainer = DecentralizedTrainer(model=model or tiny_distilbert(), args=targs(checkpoint.parent / "again", **kw),
                                   train_dataset=agnews["train"], processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=checkpoint)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, error, message", [
    (lambda d: truncate(d / "node-1.safetensors"), ValueError,
     r"node-1\.safetensors is not a readable safetensors file \(truncated or corrupted\)"),
    (lambda d: (d / "node-0.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"), ValueError,
     r"node-0\.safetensors is not a readable safetensors file"),
    (lambda d: truncate(d / ckpt.MANIFEST), ValueError,
     r"decentralized_state\.json is not valid JSON \(truncated or corrupted\)"),
    (lambda d: truncate(d / "trainer_state.json"), ValueError,
     r"trainer_state\.json is not a readable TrainerState \(truncated or corrupted\)"),
    (lambda d: (d / ckpt.MANIFEST).write_text(json.dumps({**json.loads((d / ckpt.MANIFEST).read_text()),
                                                          "version": 99, "package_version": "9.9.9"})), ValueError,
     r"is not a version-1 .* manifest \(format=.*, version=99, written by lp_decentral_nlp 9\.9\.9; this is "),
    (lambda d: (d / ckpt.MANIFEST).write_text(json.dumps({k: v for k, v in json.loads(
        (d / ckpt.MANIFEST).read_text()).items() if k != "data"})), ValueError,
     r"decentralized_state\.json lacks data \(truncated or edited\)"),
])
def test_damaged_checkpoints_are_named_and_left_untouched(saved_run, tmp_path, agnews, tokenizer, damage, error,
                                                          message):
    checkpoint = damaged_copy(saved_run, tmp_path, damage)
    before = digest(checkpoint)
    with pytest.raises(error, match=message) as err:
        resume(checkpoint, agnews, tokenizer)
    assert str(checkpoint) in str(err.value) and "Traceback" not in str(err.value)
    assert digest(checkpoint) == before


def test_a_node_file_of_another_model_is_named(saved_run, tmp_path, agnews, tokenizer):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    checkpoint = damaged_copy(saved_run, tmp_path, lambda d: None)
    before = digest(checkpoint)
    wider = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=30522, dim=64, n_layers=1, n_heads=2,
                                                                 hidden_dim=64, num_labels=4))
    with pytest.raises(ValueError, match=r"node-0\.safetensors does not fit this model \(.*keys of another shape: "
                                         r"distilbert\.embeddings\.word_embeddings\.weight \(30522, 32\) saved, "
                                         r"\(30522, 64\) here, .*\): it was written for another model") as err:
        resume(checkpoint, agnews, tokenizer, model=wider)
    assert "\n" not in str(err.value) and len(str(err.value)) < 1000  # one line, a few names of each kind
    assert digest(checkpoint) == before


def test_state_files_that_are_not_there_or_not_ours_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"node-7\.safetensors: checkpoint state file not found"):
        ckpt.load_state_file(tmp_path / "node-7.safetensors")
    from safetensors.torch import save_file
    import torch

    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match=r"plain\.safetensors is not a checkpoint state file"):
        ckpt.load_state_file(tmp_path / "plain.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "skew.safetensors"), metadata={"state": '{"__tensor__": "gone"}'})
    with pytest.raises(ValueError, match=r"skew\.safetensors: its state skeleton is corrupted \(KeyError"):
        ckpt.load_state_file(tmp_path / "skew.safetensors")
