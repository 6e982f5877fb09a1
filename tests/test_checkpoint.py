"""Checkpoints of the whole decentralized state: atomic safetensors directories, and resuming gives
bit-identical results to a run that never stopped (simulated backend; the distributed backend is
in tests/test_checkpoint_distributed.py)."""
import collections
import csv
import json
import logging
import math
import os
import signal

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, TrainerCallback

from lp_decentral_nlp.trainer import checkpointing as ckpt
from lp_decentral_nlp.trainer import (
    DecentralizedTrainer, DecentralizedTrainingArguments, MetricsCSVCallback, check_resumable,
)
from helpers import SigtermAt, agnews_sample, tiny_distilbert


def tiny_model(seed=0, dropout=0.1):
    return tiny_distilbert(seed, dropout)


@pytest.fixture(scope="module")
def agnews(tokenizer):
    # 96 training rows: 24 per node, 3 steps per epoch at batch 8, so 8 steps cross two epoch ends
    return agnews_sample(tokenizer, max_length=16, max_train_samples=96, max_eval_samples=40)


def targs(out, **kw):
    base = dict(output_dir=str(out), num_nodes=4, per_device_train_batch_size=8, per_device_eval_batch_size=40,
                learning_rate=2e-3, max_steps=8, logging_steps=3, eval_strategy="steps", eval_steps=5,
                save_strategy="steps", save_steps=4, use_cpu=True, disable_tqdm=True, seed=3)
    base.update(kw)
    for steps, strategy in (("eval_steps", "eval_strategy"), ("save_steps", "save_strategy")):
        if base[strategy] != "steps" and steps not in kw:  # (an interval its strategy ignores is refused)
            base.pop(steps)
    return DecentralizedTrainingArguments(**base)


CONFIGS = {
    # 8-bit, Choco top-10% with 8-bit values, QGM with AdamW (QuasiGlobalAdam: m, v and step count per
    # node), dropout, lost messages and a node away over the checkpoint, messages relative to the initial model
    "choco-8bit-qgm-faults": dict(algorithm="choco", compression=90.0, qgm=True, drop_prob=0.2, absences=["1:3:6"],
                                  gossip_reference="initial"),
    # fp32 Deep-Squeeze random-k (stochastic compressor) on the time-varying exponential graph, multi-step LR
    # (a MultiStepLR with a Counter in its state), gradient clipping, skew
    "deepsqueeze-randomk-exponential": dict(algorithm="deepsqueeze", compression=80.0, compressor="randomk",
                                            topology="exponential", low_precision=False, lr_scheduler_type="constant",
                                            lr_milestones=[1.0, 2.0], max_grad_norm=0.5, skew=0.5),
    # 2 micro-batches of 4 per optimizer step: the checkpoint's data position counts optimizer steps
    "dpsgd-accumulated": dict(algorithm="dpsgd", low_precision=False, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2),
    # QGM with SGD: the momentum buffer added to the gradient (QuasiGlobalMomentum)
    "dpsgd-sgd-qgm": dict(algorithm="dpsgd", low_precision=False, optim="sgd", qgm=True, learning_rate=0.05),
    # 8-bit layers among bfloat16 autocast (the heads, attention's matmuls), Choco top-10%
    "choco-8bit-bf16": dict(algorithm="choco", compression=90.0, bf16=True),
    # float16 autocast with a loss scaler per node (its scale and count of clean steps), Deep-Squeeze,
    # QGM with AdamW stepping on the unscaled gradients
    "deepsqueeze-8bit-fp16-qgm": dict(algorithm="deepsqueeze", compression=90.0, fp16=True, qgm=True),
    # NEFTune noise on the input embeddings, drawn in each node's RNG stream
    "dpsgd-neftune": dict(algorithm="dpsgd", low_precision=False, neftune_noise_alpha=5.0),
}


def run(out, data, tokenizer, resume=None, **kw):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(out, **kw), train_dataset=data["train"],
                                   eval_dataset=data["test"], processing_class=tokenizer,
                                   callbacks=[MetricsCSVCallback(str(out / "metrics.csv"))])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {k: v for k, v in trainer.evaluate().items() if not wall_clock(k)}


def wall_clock(key: str) -> bool:
    """A metric measuring time (``train_runtime``, ``eval_samples_per_second``, ...), not results."""
    return key.endswith(("_runtime", "_per_second"))


def without_runtime(history):
    return [{k: v for k, v in h.items() if not wall_clock(k)} for h in history]


def same(a, b):
    """Bitwise equality of nested state (tensors compared with torch.equal, NaN == NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resumed_run_is_bit_identical_to_the_uninterrupted_run(name, tmp_path, agnews, tokenizer):
    kw = CONFIGS[name]
    straight, m_straight = run(tmp_path / "straight", agnews, tokenizer, **kw)
    assert (tmp_path / "straight" / "checkpoint-4").is_dir()  # mid-epoch: epoch 1, batch 1 of 3
    resumed, m_resumed = run(tmp_path / "resumed", agnews, tokenizer, resume=str(tmp_path / "straight" / "checkpoint-4"),
                             **kw)
    assert resumed.state.global_step == 8
    for a, b in zip(straight.nodes, resumed.nodes):
        assert same(a.state_dict(), b.state_dict())  # weights and 8-bit activation ranges
    assert same(straight.gossip.state_dict(), resumed.gossip.state_dict())
    assert torch.equal(straight.bytes_sent, resumed.bytes_sent) and straight.bytes_sent.sum() > 0
    assert m_straight == m_resumed  # accuracy, loss, per-node accuracy, consensus distance, bytes
    assert same(without_runtime(straight.state.log_history), without_runtime(resumed.state.log_history))
    # the final checkpoints of both runs hold the same state, file by file
    for i in range(4):
        a = ckpt.load_state_file(tmp_path / "straight" / "checkpoint-8" / ckpt.node_file(i))
        b = ckpt.load_state_file(tmp_path / "resumed" / "checkpoint-8" / ckpt.node_file(i))
        assert same(a, b), f"node {i}"
    a, b = (csv_rows(tmp_path / d / "metrics.csv") for d in ("straight", "resumed"))
    assert len(a) == len(straight.state.log_history) and a == b


def csv_rows(path):
    """metrics.csv rows as dicts, wall-clock columns left out."""
    with open(path) as fh:
        return [{k: v for k, v in row.items() if not wall_clock(k)} for row in csv.DictReader(fh)]


def test_checkpoint_layout_holds_every_part_of_the_state(tmp_path, agnews, tokenizer):
    trainer, _ = run(tmp_path, agnews, tokenizer, max_steps=4, algorithm="choco", compression=90.0, qgm=True)
    path = tmp_path / "checkpoint-4"
    names = sorted(p.name for p in path.iterdir())
    assert {"node-0.safetensors", "node-3.safetensors", "config.json", "model.safetensors", "trainer_state.json",
            ckpt.MANIFEST} <= set(names)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert manifest["global_step"] == 4 and manifest["data"] == {"epoch": 1, "batches_done": 1, "steps_per_epoch": 3}
    assert manifest["config"]["num_nodes"] == 4 and manifest["config"]["algorithm"] == "choco"
    with safe_open(str(path / "node-2.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert any(k.startswith("/model/") and k.endswith("act_running_min") for k in keys)  # 8-bit activation ranges
    # QGM with AdamW: QuasiGlobalAdam holds the moments, the optimizer only the LR and groups
    assert not any(k.startswith("/optimizer/state/") for k in keys)
    assert {"/rng/cpu", "/gossip/weights", "/gossip/public", "/gossip/public_nodes", "/qgm/exp_avg/0",
            "/qgm/exp_avg_sq/0"} <= keys
    state = ckpt.load_state_file(path / "node-2.safetensors")
    assert state["node"] == 2 and state["gossip"]["public_nodes"].tolist() == [1, 2]  # own copy + in-neighbour's
    torch.testing.assert_close(state["gossip"]["public"][1], trainer.gossip.state_dict()["public"][2])
    assert state["counters"]["bytes_sent"] == int(trainer.bytes_sent[2])
    assert state["qgm"]["steps"] == 4 and torch.equal(state["qgm"]["exp_avg_sq"][0], trainer.qgm.exp_avg_sq[2][0])


def test_crash_while_writing_leaves_the_previous_checkpoint_usable(tmp_path, agnews, tokenizer, monkeypatch):
    kw = dict(algorithm="deepsqueeze", compression=90.0, save_steps=2, max_steps=4, eval_strategy="no")
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **kw), train_dataset=agnews["train"],
                                   processing_class=tokenizer)
    real = ckpt.save_state_file

    def crash_on_step_4(path, obj):
        if "checkpoint-4" in str(path) and path.name == "node-2.safetensors":
            raise KeyboardInterrupt("power cut")  # dies half-way through the node files
        real(path, obj)

    monkeypatch.setattr(ckpt, "save_state_file", crash_on_step_4)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert (tmp_path / "checkpoint-4.partial").is_dir() and not (tmp_path / "checkpoint-4").exists()
    assert ckpt.resolve_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    monkeypatch.setattr(ckpt, "save_state_file", real)
    resumed, _ = run(tmp_path / "again", agnews, tokenizer, resume=str(tmp_path), **kw)
    straight, _ = run(tmp_path / "straight", agnews, tokenizer, **kw)
    for a, b in zip(straight.nodes, resumed.nodes):
        assert same(a.state_dict(), b.state_dict())
    # resumed in its own folder, into a shorter run: the next checkpoint written there removes the
    # crashed save's folder (it stayed for good when the run never saved at step 4 again)
    run(tmp_path, agnews, tokenizer, resume=True, **{**kw, "max_steps": 3, "save_steps": 3})
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_a_save_at_an_existing_step_replaces_it_and_rotation_keeps_the_newest(tmp_path):
    for step in (2, 4, 6):
        staging = ckpt.prepare_staging(tmp_path, step)
        ckpt.save_state_file(staging / "node-0.safetensors", {"x": torch.full((3,), float(step))})
        ckpt.write_json(staging / ckpt.MANIFEST, {"format": ckpt.FORMAT, "version": ckpt.VERSION,
                                                  "files": ["node-0.safetensors"]})
        ckpt.commit(tmp_path, step)
    staging = ckpt.prepare_staging(tmp_path, 4)
    ckpt.save_state_file(staging / "node-0.safetensors", {"x": torch.full((3,), 40.0)})
    with pytest.raises(RuntimeError, match="not complete"):
        ckpt.commit(tmp_path, 4)  # no manifest yet: never published
    ckpt.write_json(staging / ckpt.MANIFEST, {"format": ckpt.FORMAT, "version": ckpt.VERSION,
                                              "files": ["node-0.safetensors"]})
    ckpt.commit(tmp_path, 4)
    assert ckpt.load_state_file(tmp_path / "checkpoint-4" / "node-0.safetensors")["x"].tolist() == [40.0] * 3
    assert [p.name for p in ckpt.rotate(tmp_path, 2)] == ["checkpoint-2"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6"]


def _commit_steps(root, steps):
    for step in steps:
        staging = ckpt.prepare_staging(root, step)
        ckpt.save_state_file(staging / "node-0.safetensors", {"x": torch.full((3,), float(step))})
        ckpt.write_json(staging / ckpt.MANIFEST, {"format": ckpt.FORMAT, "version": ckpt.VERSION,
                                                  "files": ["node-0.safetensors"]})
        ckpt.commit(root, step)


def test_rotation_keeps_the_best_and_the_newest_checkpoint_as_trainer_does(tmp_path):
    # save_total_limit=1 with the best model at step 2: the newest checkpoint is what an interrupted
    # run resumes from, so it stays too (Trainer's rotate_checkpoints); only 4 goes
    _commit_steps(tmp_path, (2, 4, 6))
    best = str(tmp_path / "checkpoint-2")
    assert [p.name for p in ckpt.rotate(tmp_path, 1, best=best)] == ["checkpoint-4"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 6]
    # the best one is the newest: it alone stays
    _commit_steps(tmp_path, (8,))
    assert [p.name for p in ckpt.rotate(tmp_path, 1, best=str(tmp_path / "checkpoint-8"))] == [
        "checkpoint-2", "checkpoint-6"]
    # the end of a run with save_total_limit=1: only the best one stays
    _commit_steps(tmp_path, (10,))
    assert [p.name for p in ckpt.rotate(tmp_path, 1, best=str(tmp_path / "checkpoint-8"), keep_newest=False)] == [
        "checkpoint-10"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [8]


def test_resolving_a_checkpoint_says_why_none_is_complete(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'afile'} is a file, not a checkpoint folder$"):
        ckpt.resolve_checkpoint(tmp_path / "afile")
    run = tmp_path / "run"
    _commit_steps(run, (2, 4))
    (run / "checkpoint-4" / ckpt.MANIFEST).write_text('{"format": ')  # truncated
    assert ckpt.resolve_checkpoint(run) == run / "checkpoint-2"  # the newest complete one
    (run / "checkpoint-2" / "node-0.safetensors").unlink()
    with pytest.raises(ValueError, match=rf"^no complete checkpoint-<step> directory in {run} \({run / 'checkpoint-4'}"
                                         rf"/{ckpt.MANIFEST} is not valid JSON \(truncated or corrupted\)"):
        ckpt.resolve_checkpoint(run)
    (run / "checkpoint-4" / ckpt.MANIFEST).unlink()
    with pytest.raises(ValueError, match=rf"^no complete checkpoint-<step> directory in {run} \(checkpoint-4 lacks "
                                         rf"{ckpt.MANIFEST}\)$"):
        ckpt.resolve_checkpoint(run)


def test_nested_state_round_trips_through_safetensors(tmp_path):
    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
                           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}]},
             "scheduler": {"milestones": collections.Counter({6: 1, 9: 1}), "last_epoch": 4, "_last_lr": [0.1]},
             "rng": {"cpu": torch.get_rng_state(), "cuda": None}, "loss": float("nan"),
             "tied": None, "__odd": 1}
    w = torch.randn(4)
    state["tied"] = [w, w, w[:2]]  # shared memory is stored once per key
    ckpt.save_state_file(tmp_path / "s.safetensors", state)
    back = ckpt.load_state_file(tmp_path / "s.safetensors")
    assert same(back, state)
    assert isinstance(back["scheduler"]["milestones"], collections.Counter)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(back["optimizer"]["state"]) == [0]
    with pytest.raises(TypeError, match="/bad: unsupported type object"):
        ckpt.encode_state({"bad": object()})


def test_cli_save_steps_and_resume_from_checkpoint(tmp_path, minilm_path, ag_news_csv):
    from test_recipes import tiny_flags

    from lp_decentral_nlp.commands import main

    model_dir = tmp_path / "model"
    tiny_model(dropout=0.0).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(model_dir)
    flags = ["--comp", "90", "--drop-prob", "0.1", "--leave", "3:1:3", "--straggler", "0:0.01", "--skip-nonfinite",
             "--max-steps", "4", "--save-steps", "2"]
    straight = main("ag_news", "choco", tiny_flags(model_dir, ag_news_csv, tmp_path / "a", *flags))
    first = tmp_path / "a" / "checkpoint-2"
    resumed = main("ag_news", "choco", tiny_flags(model_dir, ag_news_csv, tmp_path / "b", *flags,
                                                  "--resume-from-checkpoint", str(first)))
    for key in ("accuracy", "node_accuracy", "bytes_sent_per_node", "consensus_distance", "steps",
                "lost_messages_per_node", "absent_steps_per_node", "nonfinite_skips_per_node"):
        assert straight[key] == resumed[key], key
    assert straight["bytes_sent_per_node"][3] < straight["bytes_sent_per_node"][0]  # node 3 was away for 2 steps
    assert straight["absent_steps_per_node"] == [0, 0, 0, 2] and straight["lost_messages_per_node"][2] >= 2
    # which checkpoint the resumed run continued from (it recorded only the flag as typed)
    assert resumed["resumed_from"] == {"checkpoint": str(first), "step": 2} and "resumed_from" not in straight
    assert straight["config"]["absences"] == ["3:1:3"] and straight["config"]["skip_nonfinite"]
    a, b = csv_rows(tmp_path / "a" / "metrics.csv"), csv_rows(tmp_path / "b" / "metrics.csv")
    assert len(a) > 2 and a == b and list(a[0]) == list(b[0])  # the same columns in the same order


def test_a_refused_resume_leaves_the_finished_runs_files_as_they_were(tmp_path, minilm_path, ag_news_csv, capsys):
    from test_recipes import tiny_flags

    from lp_decentral_nlp.commands import main

    model_dir = tmp_path / "model"
    tiny_model(dropout=0.0).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(model_dir)
    run = tmp_path / "run"
    main("ag_news", "choco", tiny_flags(model_dir, ag_news_csv, run, "--max-steps", "2", "--save-steps", "1"))
    before = {name: (run / name).read_bytes() for name in ("results.json", "cost_report.json", "metrics.csv")}
    capsys.readouterr()
    # the checkpoint was written for 256 training rows of 16 tokens: this run has 128, or others of
    # 32 tokens, which train() finds; the error names the flag as it was typed
    for changed, difference, flag in ((("--max-train-samples", "128"), "train_samples=256 (this run: 128), other "
                                       "training rows (another data file, tokenizer or max length)",
                                       "--resume-from-checkpoint"),
                                      (("--max-length", "32"), "other training rows (another data file, tokenizer "
                                       "or max length)", "--resume_from_checkpoint")):
        flags = tiny_flags(model_dir, ag_news_csv, run, "--max-steps", "3", flag, str(run / "checkpoint-2"), *changed)
        with pytest.raises(SystemExit) as exc:
            main("ag_news", "choco", flags)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1].split(": error: ")[1] == (
            f"argument {flag}: cannot resume from {run}/checkpoint-2: it was written with "
            f"{difference}; resume with the arguments of the interrupted run")
        assert {name: (run / name).read_bytes() for name in before} == before


WORKERS = ["--dataloader-num-workers", "2", "--dataloader-persistent-workers", "true"]


@pytest.mark.parametrize("workers", [[], WORKERS], ids=["main process", "2 persistent workers"])
def test_vision_recipe_resume_with_random_augmentation_is_exact(tmp_path, capsys, workers):
    """The vision CLI shares the flags: random crops/flips are drawn under each batch's own seed
    (a function of seed, node, epoch and batch), so a resumed run repeats them, and dataloader
    workers draw what the main process draws (ResNet-20, 8-bit, Range EvoNorm, digits). Workers
    used to start their streams afresh on a resume."""
    from safetensors.torch import load_file

    from lp_decentral_nlp.vision.recipe import main

    flags = ["--nodes", "2", "--comp", "90", "--augment", "--max-steps", "4", "--batch-size", "8", "--save-steps", "2",
             "--logging-steps", "1", *workers]
    straight = main("choco", [*flags, "--output-dir", str(tmp_path / "a")])
    resumed = main("choco", [*flags, "--output-dir", str(tmp_path / "b"),
                             "--resume-from-checkpoint", str(tmp_path / "a" / "checkpoint-2")])
    for key in ("accuracy", "node_accuracy", "bytes_sent_per_node", "consensus_distance", "steps"):
        assert straight[key] == resumed[key], key
    a, b = load_file(tmp_path / "a" / "model" / "model.safetensors"), load_file(tmp_path / "b" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if workers:  # the same run in the main process
        main("choco", [*flags[:-len(workers)], "--output-dir", str(tmp_path / "main")])
        in_main_process = load_file(tmp_path / "main" / "model" / "model.safetensors")
        assert all(torch.equal(a[k], in_main_process[k]) for k in a)
    # the default milestones are 50% and 75% of the --max-steps run: a longer run has others, which
    # train() finds once the trainer knows its steps per epoch
    with pytest.raises(SystemExit) as exc:
        main("choco", [*flags[:flags.index("--max-steps")], "--max-steps", "8", *flags[flags.index("--max-steps") + 2:],
                       "--output-dir", str(tmp_path / "c"), "--resume-from-checkpoint", str(tmp_path / "a" / "checkpoint-2")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].split(": error: ")[1].startswith(
        f"argument --resume-from-checkpoint: cannot resume from {tmp_path / 'a' / 'checkpoint-2'}: it was written with "
        "lr_milestones=")
    assert not (tmp_path / "c").exists()


class StepLRs(TrainerCallback):
    """The LR each node's optimizer holds when each optimizer step begins, by global step."""

    def __init__(self):
        self.trainer, self.lrs = None, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.lrs[state.global_step + 1] = [opt.param_groups[0]["lr"] for opt in self.trainer.node_optimizers]


@pytest.mark.parametrize("schedule, warned", [("linear", True), ("constant", False)])
def test_resuming_with_more_steps_continues_on_the_schedule_over_the_new_total(
        schedule, warned, tmp_path, agnews, tokenizer, caplog):
    out = tmp_path / "run"
    run(out, agnews, tokenizer, lr_scheduler_type=schedule)  # 8 steps (a linear schedule reaches 0), checkpoint-8
    lrs = StepLRs()
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(out, max_steps=12, lr_scheduler_type=schedule),
                                   train_dataset=agnews["train"], eval_dataset=agnews["test"],
                                   processing_class=tokenizer, callbacks=[lrs])
    lrs.trainer = trainer
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-8"))
    # every step after the checkpoint trains with the schedule over 12 steps, the first one too
    expected = {step: 2e-3 * ((12 - step + 1) / 12 if schedule == "linear" else 1.0) for step in range(9, 13)}
    assert lrs.lrs == {step: [pytest.approx(lr)] * 4 for step, lr in expected.items()}
    messages = [r.getMessage() for r in caplog.records if "learning-rate schedule" in r.getMessage()]
    if warned:
        assert messages == ["resuming at step 8 a run of 8 steps with 12 steps in all: the linear learning-rate "
                            "schedule is recomputed over 12 steps and the LR continues from 0.000667, where the "
                            "interrupted run's schedule was at 0. To continue that run as it was, resume with its "
                            "max_steps or num_train_epochs"]
    else:
        assert messages == []


def test_a_resume_with_other_8bit_settings_is_refused_but_another_kernel_is_not(tmp_path, agnews, tokenizer):
    """A checkpoint of 8-bit training resumed with QuantConfig(grad_bits=4) went on silently with
    4-bit layer gradients: a run that was neither the interrupted one nor a fresh one. The kernel
    may change (the same products up to fp32 rounding)."""
    from lp_decentral_nlp.quant import QuantConfig

    out = tmp_path / "run"
    DecentralizedTrainer(model=tiny_model(), args=targs(out, max_steps=4, eval_strategy="no"),
                         train_dataset=agnews["train"]).train()

    def resume(config):
        return DecentralizedTrainer(model=tiny_model(), args=targs(out, max_steps=5, eval_strategy="no"),
                                    train_dataset=agnews["train"], quant_config=config).train(
            resume_from_checkpoint=str(out / "checkpoint-4"))

    with pytest.raises(ValueError, match=r"quant_config=\{.*'grad_bits': 8.*\} \(this run: \{.*'grad_bits': 4"):
        resume(QuantConfig(grad_bits=4))
    assert resume(QuantConfig(kernel="simulated")).global_step == 5


PRECISION_FLAGS = {"no": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}


@pytest.mark.parametrize("saved, now", [("bf16", "no"), ("no", "fp16"), ("fp16", "bf16")])
def test_a_resume_in_another_mixed_precision_is_refused(tmp_path, agnews, tokenizer, saved, now):
    """Mixed precision changes every step's forward: a run resumed with another one would be neither
    the interrupted one nor a fresh one."""
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=4, eval_strategy="no",
                                                        **PRECISION_FLAGS[saved]), train_dataset=agnews["train"]).train()
    resumed = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=5, eval_strategy="no",
                                                                  **PRECISION_FLAGS[now]), train_dataset=agnews["train"])
    with pytest.raises(ValueError, match=rf"mixed_precision='{saved}' \(this run: '{now}'; bf16=True / fp16=True, or "
                                         r"accelerate launch --mixed_precision, sets it\)"):  # (the launcher's too)
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))


def test_save_only_model_writes_the_nodes_models_alone_and_refuses_to_resume_from_them(tmp_path, agnews, tokenizer):
    """Trainer's save_only_model: a checkpoint to load (the averaged model, each node's model; the
    best one at the end), not to resume; the full one holds optimizer, schedule, RNG and gossip."""
    full, _ = run(tmp_path / "full", agnews, tokenizer, max_steps=4, algorithm="choco", compression=90.0)
    lean, _ = run(tmp_path / "lean", agnews, tokenizer, max_steps=4, algorithm="choco", compression=90.0,
                  save_only_model=True)
    for i in range(4):
        full_state = ckpt.load_state_file(tmp_path / "full" / "checkpoint-4" / ckpt.node_file(i))
        lean_state = ckpt.load_state_file(tmp_path / "lean" / "checkpoint-4" / ckpt.node_file(i))
        assert set(lean_state) == {"node", "model"} and {"optimizer", "gossip", "rng"} <= set(full_state)
        assert same(lean_state["model"], full_state["model"]) and same(lean_state["model"], lean.nodes[i].state_dict())
    sizes = [(tmp_path / d / "checkpoint-4" / ckpt.node_file(0)).stat().st_size for d in ("full", "lean")]
    assert sizes[1] < 0.21 * sizes[0]  # the weights, without AdamW's two moments and Choco's two copies
    again = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path / "lean", max_steps=6, eval_strategy="no",
                                                                   save_only_model=True),
                                 train_dataset=agnews["train"])
    with pytest.raises(ValueError, match=r"^resume_from_checkpoint: cannot resume from .*checkpoint-4: it was written with "
                                         r"save_only_model=True and holds the nodes' models only"):
        again.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match=r"written with save_only_model=True"):
        check_resumable(tmp_path / "lean", targs(tmp_path / "lean"))


def test_save_only_model_still_loads_the_best_model_at_end(tmp_path, agnews, tokenizer):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(
        tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, metric_for_best_model="loss", learning_rate=5e-3, save_only_model=True),
        train_dataset=agnews["train"], eval_dataset=agnews["test"])
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best_step = min(evals, key=evals.get)
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best_step}")
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[best_step], rel=1e-5)


@pytest.mark.parametrize("save_steps", [4, 3], ids=["checkpoint-written-on-sigterm", "save-step-already-wrote-it"])
def test_sigterm_with_enable_jit_checkpoint_checkpoints_the_step_and_stops_resumably(tmp_path, agnews, tokenizer,
                                                                                     save_steps, caplog):
    """SIGTERM no longer ends the process mid-step: the step ends, a checkpoint is written (or the
    save steps' one at that step kept), training stops, and the run resumes from it to the result
    of a run never stopped; the previous SIGTERM handler is back afterwards."""
    kw = dict(algorithm="choco", compression=90.0, save_steps=save_steps, enable_jit_checkpoint=True)
    before = signal.getsignal(signal.SIGTERM)
    stopped = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path / "stopped", **kw),
                                   train_dataset=agnews["train"], eval_dataset=agnews["test"],
                                   callbacks=[SigtermAt(3)])
    # Trainer's own JIT checkpointing (a handler from construction on, a checkpoint mid-step) is not used
    assert signal.getsignal(signal.SIGTERM) is before
    assert not [cb for cb in stopped.callback_handler.callbacks if type(cb).__name__ == "JITCheckpointCallback"]
    stopped.train()
    assert stopped.stopped_by_sigterm and stopped.state.global_step == 3
    assert f"stopped at step 3 on SIGTERM; resume from {tmp_path / 'stopped' / 'checkpoint-3'}" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path / "stopped")] == [3]
    straight, m_straight = run(tmp_path / "straight", agnews, tokenizer, **kw)
    resumed, m_resumed = run(tmp_path / "stopped", agnews, tokenizer, resume=True, **kw)
    assert not straight.stopped_by_sigterm and resumed.state.global_step == 8
    for a, b in zip(straight.nodes, resumed.nodes):
        assert same(a.state_dict(), b.state_dict())
    assert m_straight == m_resumed


def test_an_adam_setting_the_optimizer_does_not_read_does_not_block_a_resume(tmp_path, agnews, tokenizer):
    """A recipe's SGD run recorded the SPEC 8 adam_beta2=0.9 before the recipes left it at the
    default where unread: resuming needed adam_beta2=0.9, which is now refused as unread."""
    import json

    sgd = dict(max_steps=4, eval_strategy="no", optim="sgd")
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **sgd), train_dataset=agnews["train"]).train()
    manifest = tmp_path / "checkpoint-4" / ckpt.MANIFEST
    saved = json.loads(manifest.read_text())
    saved["config"]["adam_beta2"] = 0.9  # as such a run wrote it
    manifest.write_text(json.dumps(saved))
    assert check_resumable(tmp_path / "checkpoint-4", targs(tmp_path, **{**sgd, "max_steps": 5})) is not None
    with pytest.raises(ValueError, match=r"optim='sgd' \(this run: 'adamw_torch'\)"):  # a read setting still counts
        check_resumable(tmp_path / "checkpoint-4", targs(tmp_path, max_steps=5, eval_strategy="no",
                                                         optim="adamw_torch"))


def test_a_resume_with_another_optimizer_cls_and_kwargs_is_refused_naming_it(tmp_path, agnews, tokenizer):
    """The manifest recorded the arguments' optim and learning_rate for a run whose optimizer the
    pair built: a resume with another momentum or LR was accepted, and the checkpoint's parameter
    groups silently replaced them."""
    run = dict(max_steps=4, eval_strategy="no", learning_rate=2e-3)
    sgd = (torch.optim.SGD, {"lr": 2e-3, "momentum": 0.9})
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **run), train_dataset=agnews["train"],
                         optimizer_cls_and_kwargs=sgd).train()
    saved = json.loads((tmp_path / "checkpoint-4" / ckpt.MANIFEST).read_text())["config"]["optimizer"]
    assert saved == {"class": "torch.optim.sgd.SGD", "kwargs": {"lr": 2e-3, "momentum": 0.9}}
    # a value JSON cannot hold is recorded by name, not by a repr holding its address (no resume would match)
    assert ckpt.optimizer_settings((torch.optim.SGD, {"fn": len}))["kwargs"] == {"fn": "<builtins.len>"}
    later = targs(tmp_path, **{**run, "max_steps": 5})
    assert check_resumable(tmp_path / "checkpoint-4", later, optimizer_cls_and_kwargs=sgd) is not None
    with pytest.raises(ValueError, match=r"optimizer=\{'class': 'torch\.optim\.sgd\.SGD', 'kwargs': \{'lr': 0\.002, "
                                         r"'momentum': 0\.9\}\} \(this run: \{'class': 'torch\.optim\.sgd\.SGD', "
                                         r"'kwargs': \{'lr': 0\.002, 'momentum': 0\.0\}\}\)"):
        DecentralizedTrainer(model=tiny_model(), args=later, train_dataset=agnews["train"],
                             optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 2e-3, "momentum": 0.0})).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    with pytest.raises(ValueError, match=r"optimizer=\{'class': 'torch\.optim\.sgd\.SGD'.* \(this run: None\)"):
        check_resumable(tmp_path / "checkpoint-4", later)  # the arguments' AdamW


def test_a_checkpoint_of_qsgd_with_one_norm_per_tensor_says_no_argument_continues_it(tmp_path, agnews, tokenizer):
    """QSGD now rounds in buckets: a checkpoint written before (repr without bucket_size) was refused
    as "compressor=... (this run: ...)" and "resume with the arguments of the interrupted run",
    which no argument can match."""
    run = dict(max_steps=2, eval_strategy="no", compressor="qsgd", save_steps=2)
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **run), train_dataset=agnews["train"]).train()
    manifest = tmp_path / "checkpoint-2" / ckpt.MANIFEST
    saved = json.loads(manifest.read_text())
    saved["config"]["compressor"] = "QSGD(levels=16, scaled=True)"
    manifest.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"compressor='QSGD\(levels=16, scaled=True\)', one norm per tensor \(this "
                                         r"version rounds QSGD in buckets of 1024 entries, .*start afresh\)"):
        check_resumable(tmp_path / "checkpoint-2", targs(tmp_path, **{**run, "max_steps": 3}))


def test_a_resume_with_another_gossip_reference_is_refused(tmp_path, agnews, tokenizer):
    """Its public copies and error memories hold offsets from the reference: resumed under the
    other rule they would be read as models."""
    run = dict(max_steps=4, eval_strategy="no", compression=90.0, gossip_reference="initial")
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **run), train_dataset=agnews["train"]).train()
    later = {**run, "max_steps": 5}
    assert check_resumable(tmp_path / "checkpoint-4", targs(tmp_path, **later)) is not None
    with pytest.raises(ValueError, match=r"gossip_reference='initial' \(this run: 'zero'\)"):
        check_resumable(tmp_path / "checkpoint-4", targs(tmp_path, **{**later, "gossip_reference": "zero"}))
    # a trainer built from another model (the trained one, say) is refused before anything is restored: the
    # engine's state checks failed only after every node's weights had been loaded
    other = DecentralizedTrainer(model=tiny_model(seed=5), args=targs(tmp_path, **later), train_dataset=agnews["train"])
    before = [p.clone() for p in other.nodes[0].parameters()]
    with pytest.raises(ValueError, match=r"it was written with another initial model \(gossip_reference='initial' "
                                         r"gossips the offsets from it: build the trainer from the model the run "
                                         r"started from"):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert all(torch.equal(a, b) for a, b in zip(before, other.nodes[0].parameters()))


def test_a_resume_with_another_graph_in_the_same_file_is_refused(tmp_path, agnews, tokenizer):
    """A graph of one's own is recorded by its matrices too: the file may change between runs."""
    import numpy as np

    from lp_decentral_nlp.gossip import make_topology

    graph_file = tmp_path / "graph.npy"
    np.save(graph_file, make_topology("ring", 4).mixing_matrix().numpy())
    run = dict(max_steps=4, eval_strategy="no", topology=str(graph_file), save_steps=2)
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **run), train_dataset=agnews["train"])
    graph_file.unlink()  # read once: the run's checkpoints do not read it again (it failed at the first one)
    trainer.train()
    np.save(tmp_path / "renamed.npy", make_topology("ring", 4).mixing_matrix().numpy())
    renamed = {**run, "max_steps": 5, "topology": str(tmp_path / "renamed.npy")}
    # a renamed file resumes (the engine's state named the file, and refused it)
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **renamed), train_dataset=agnews["train"]).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    np.save(tmp_path / "renamed.npy", make_topology("complete", 4).mixing_matrix().numpy())
    with pytest.raises(ValueError, match=r"another graph: 'mixing matrices #[0-9a-f]+' \(this run's file "
                                         r".*renamed\.npy holds 'mixing matrices #[0-9a-f]+'; a file is recorded by "
                                         r"its matrices\)"):
        check_resumable(tmp_path / "checkpoint-4", targs(tmp_path, **renamed))


def test_fault_counts_of_a_checkpoint_survive_a_resume_without_faults(tmp_path, agnews, tokenizer):
    """A run may resume under other faults; its counts were restored and then left out of the
    report (results.json) as not "in use": a node that had been away read as never away."""
    run = dict(max_steps=4, eval_strategy="no", absences=["1:0:3"])
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **run), train_dataset=agnews["train"]).train()
    resumed = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=5, eval_strategy="no"),
                                   train_dataset=agnews["train"])
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    counts = resumed.fault_counts()
    assert counts["absent_steps"] == [0, 3, 0, 0] and counts["lost_messages"][0] > 0


def test_a_resume_with_another_data_seed_is_refused(tmp_path, agnews, tokenizer):
    """data_seed draws the shards and data order: another one would resume into other batches."""
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=4, eval_strategy="no"),
                         train_dataset=agnews["train"]).train()
    resumed = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=5, eval_strategy="no", data_seed=7),
                                   train_dataset=agnews["train"])
    with pytest.raises(ValueError, match=r"data_seed=None \(this run: 7\)"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))


@pytest.mark.parametrize("saved_bf16", [True, False])
def test_a_checkpoint_recording_bf16_as_a_flag_still_resumes_and_refuses(tmp_path, agnews, tokenizer, saved_bf16):
    """Checkpoints written before fp16 was supported record ``"bf16": true/false`` in place of
    ``"mixed_precision"``: read as "bf16" / "no"."""
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=4, eval_strategy="no",
                                                        **PRECISION_FLAGS["bf16" if saved_bf16 else "no"]),
                         train_dataset=agnews["train"]).train()
    manifest_path = tmp_path / "checkpoint-4" / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["bf16"] = manifest["config"].pop("mixed_precision") == "bf16"
    manifest_path.write_text(json.dumps(manifest))
    same_precision = DecentralizedTrainer(model=tiny_model(), args=targs(
        tmp_path, max_steps=5, eval_strategy="no", **PRECISION_FLAGS["bf16" if saved_bf16 else "no"]),
        train_dataset=agnews["train"])
    assert same_precision.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4")).global_step == 5
    other = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=6, eval_strategy="no",
                                                                **PRECISION_FLAGS["fp16"]), train_dataset=agnews["train"])
    with pytest.raises(ValueError, match=rf"mixed_precision='{'bf16' if saved_bf16 else 'no'}' \(this run: 'fp16';"):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))


def test_metrics_csv_appends_rows_and_widens_its_header_when_a_column_arrives(tmp_path):
    """The file was written whole at every log (a long run's logging grew quadratically); rows
    are appended now, and a new column (an evaluation's) rewrites it once with every row."""
    from transformers import TrainerState

    path = tmp_path / "metrics.csv"
    callback, state = MetricsCSVCallback(str(path)), TrainerState()
    logs = [{"loss": 1.0}, {"loss": 0.5}, {"eval_loss": 0.7}, {"loss": 0.25}, {"eval_loss": 0.6, "loss": 0.2}]
    for step, entry in enumerate(logs, 1):
        state.global_step = step
        callback.on_log(None, state, None, logs=entry)
    with open(path) as fh:
        assert list(csv.reader(fh)) == [["step", "eval_loss", "loss"], ["1", "", "1.0"], ["2", "", "0.5"],
                                        ["3", "0.7", ""], ["4", "", "0.25"], ["5", "0.6", "0.2"]]


def test_a_resumed_run_keeps_no_checkpoint_file_mapped(tmp_path, agnews, tokenizer):
    """The optimizer state of a resume was read as a memory map of each node file, which
    load_state_dict keeps: once save_total_limit deleted that checkpoint its files (five times the
    model per node) held their disk until the process ended."""
    DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=4, eval_strategy="no"),
                         train_dataset=agnews["train"]).train()
    resumed = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=8, eval_strategy="no",
                                                                  save_total_limit=1),
                                   train_dataset=agnews["train"])
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-8"]
    with open("/proc/self/maps") as maps:
        assert str(tmp_path) not in maps.read()
    assert resumed.node_optimizers[0].state  # the resumed state is still held, in memory


class InterruptBeforeTheUpdate(TrainerCallback):
    """Ctrl-C between a node's backward and its update at one step: that node's gradient is left."""

    def __init__(self, step):
        self.step = step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.step = None
            raise KeyboardInterrupt


def test_train_after_a_stop_mid_step_starts_from_clean_gradients_and_counters(tmp_path, agnews, tokenizer):
    """A notebook's Ctrl-C mid-step left a node's gradient, which the next train() of the same trainer
    added into its first step (a resume then differed from the run that never stopped), a second
    train() logged the first one's bytes on top of its own, and its gossip steps went on from the
    first one's (a node away at step 3 was present in the gossip at step 11)."""
    kw = dict(algorithm="choco", compression=90.0, drop_prob=0.2, absences=["1:3:6"])
    straight, _ = run(tmp_path / "straight", agnews, tokenizer, **kw)
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path / "stopped", **kw),
                                   train_dataset=agnews["train"], eval_dataset=agnews["test"],
                                   processing_class=tokenizer, callbacks=[InterruptBeforeTheUpdate(5)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert any(p.grad is not None for node in trainer.nodes for p in node.parameters())
    trainer.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))
    for a, b in zip(straight.nodes, trainer.nodes):
        assert same(a.state_dict(), b.state_dict())
    assert same(straight.gossip.state_dict(), trainer.gossip.state_dict())
    assert torch.equal(trainer.bytes_sent, straight.bytes_sent)
    counts = trainer.fault_counts()
    trainer.train()  # a second run from the trained nodes: its own traffic, faults and gossip steps
    assert torch.equal(trainer.bytes_sent, straight.bytes_sent) and trainer.fault_counts() == counts
    assert trainer.gossip.num_steps == trainer.state.global_step == 8
