"""torchrun worker for tests/test_checkpoint_distributed.py (a helper script, not a test module).

    torchrun --standalone --nproc_per_node 4 tests/dist_trainer_worker.py die OUT_DIR
    torchrun --standalone --nproc_per_node 4 tests/dist_trainer_worker.py resume OUT_DIR CHECKPOINT
    torchrun --standalone --nproc_per_node 4 tests/dist_trainer_worker.py merge OUT_DIR
    torchrun --standalone --nproc_per_node 4 tests/dist_trainer_worker.py refused OUT_DIR CHECKPOINT
    torchrun --standalone --nproc_per_node 4 tests/dist_trainer_worker.py sigterm OUT_DIR
    torchrun --standalone --nproc_per_node 4 tests/dist_trainer_worker.py disagree OUT_DIR

``die``: trains with a checkpoint every 2 steps; rank :data:`DYING_RANK` exits at the start of
step 3 (with status 0, so that torchrun leaves the survivors running and the test sees what they
do). Every survivor writes the error it got to ``OUT_DIR/report-<rank>.json``.
``resume``: resumes from CHECKPOINT to :data:`STEPS` steps and saves each rank's node state to
``OUT_DIR/final-<rank>.pt`` (rank 0 also the evaluation metrics).
``merge``: trains :data:`STEPS` steps with ``final_merge`` (no checkpoints) and saves each rank's
node state to ``OUT_DIR/final-<rank>.pt``.
``refused``: resumes from CHECKPOINT, which is expected to be refused; every rank writes the error
it got, the step it reached and what ``OUT_DIR`` holds to ``OUT_DIR/report-<rank>.json``.
``sigterm``: trains with ``enable_jit_checkpoint`` and no save steps; rank :data:`DYING_RANK` alone
gets SIGTERM at the end of step 1; every rank writes the step it stopped at and whether it was
stopped by SIGTERM to ``OUT_DIR/report-<rank>.json``.
``disagree``: rank :data:`DYING_RANK` alone is given ``low_precision=False`` (its model has no 8-bit
buffers); every rank writes the error building the trainer gave to ``OUT_DIR/report-<rank>.json``.

:func:`make_trainer` builds the same run in the simulated backend for the test to compare.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, DistilBertConfig, DistilBertForSequenceClassification, TrainerCallback

from helpers import SigtermAt
from lp_decentral_nlp.data import load_task
from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments

STEPS = 4
DYING_RANK = 2
GOSSIP_TIMEOUT = 60.0  # seconds; a dead peer usually closes its connections at once
CONFIG = dict(num_nodes=4, algorithm="choco", compression=90.0, drop_prob=0.1, per_device_train_batch_size=8,
              per_device_eval_batch_size=40, learning_rate=2e-3, max_steps=STEPS, logging_steps=2,
              save_strategy="steps", save_steps=2, disable_tqdm=True, seed=1,
              gossip_timeout=GOSSIP_TIMEOUT, include_num_input_tokens_seen="non_padding")


def make_trainer(out_dir, backend: str, data_csv, minilm, **overrides) -> DecentralizedTrainer:
    """The test run: a tiny 8-bit DistilBERT with dropout, Choco top-10%, 10% of messages lost."""
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    data = load_task("ag_news", data_dir=data_csv, tokenizer=tokenizer, max_length=16, max_train_samples=96,
                     max_eval_samples=40, seed=0)
    torch.manual_seed(0)
    cfg = DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64,
                           dropout=0.1, attention_dropout=0.1, num_labels=4)
    config = {**CONFIG, **overrides}
    if config["save_strategy"] != "steps":  # (its interval would be refused as ignored)
        config.pop("save_steps")
    if backend == "simulated":  # no peer to wait for (refused there)
        config.pop("gossip_timeout")
        config["use_cpu"] = True
    # the distributed runs leave use_cpu out, as a user's script would: on a machine without an accelerator the
    # arguments make the process group with gloo (the merge run has them make it)
    args = DecentralizedTrainingArguments(output_dir=str(out_dir), backend=backend, **config)
    return DecentralizedTrainer(model=DistilBertForSequenceClassification(cfg), args=args, train_dataset=data["train"],
                                eval_dataset=data["test"], processing_class=tokenizer)


class _DieAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            sys.stdout.flush()
            os._exit(0)  # a crash the launcher does not notice: the survivors must find out themselves


def die(out_dir, data_csv, minilm):
    rank = dist.get_rank()
    trainer = make_trainer(out_dir, "distributed", data_csv, minilm)
    if rank == DYING_RANK:
        trainer.add_callback(_DieAtStep(3))
    start = time.monotonic()
    report = {}
    try:
        trainer.train()
        report["error"] = None
    except Exception as exc:  # noqa: BLE001 - the report is the point
        report = {"error": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
                  "message": str(exc), "peer": getattr(exc, "peer", None)}
    report["waited_s"] = time.monotonic() - start
    report["step"] = trainer.state.global_step
    with open(os.path.join(out_dir, f"report-{rank}.json"), "w") as fh:
        json.dump(report, fh)
    sys.stdout.flush()
    os._exit(0)  # skip the process group's teardown: it would wait for the dead peer


def resume(out_dir, data_csv, minilm, checkpoint):
    rank = dist.get_rank()
    trainer = make_trainer(out_dir, "distributed", data_csv, minilm)
    trainer.train(resume_from_checkpoint=checkpoint)
    metrics = trainer.evaluate()
    torch.save({"model": trainer.nodes[0].state_dict(), "bytes_sent": int(trainer.bytes_sent[0]),
                "weight": trainer.gossip.weights, "metrics": metrics, "step": trainer.state.global_step,
                "total_flos": trainer.state.total_flos},
               os.path.join(out_dir, f"final-{rank}.pt"))


def refused(out_dir, data_csv, minilm, checkpoint):
    trainer = make_trainer(out_dir, "distributed", data_csv, minilm)
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
        report = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the report is the point
        report = {"error": type(exc).__name__, "message": str(exc)}
    report.update(step=trainer.state.global_step, files=sorted(p for p in os.listdir(out_dir) if "report" not in p))
    with open(os.path.join(out_dir, f"report-{dist.get_rank()}.json"), "w") as fh:
        json.dump(report, fh)


def disagree(out_dir, data_csv, minilm):
    rank = dist.get_rank()
    try:
        make_trainer(out_dir, "distributed", data_csv, minilm, low_precision=rank != DYING_RANK)
        report = {"error": None}
    except ValueError as exc:
        report = {"error": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(out_dir, f"report-{rank}.json"), "w") as fh:
        json.dump(report, fh)


def sigterm(out_dir, data_csv, minilm):
    rank = dist.get_rank()
    trainer = make_trainer(out_dir, "distributed", data_csv, minilm, enable_jit_checkpoint=True, save_strategy="no")
    if rank == DYING_RANK:
        trainer.add_callback(SigtermAt(1))
    trainer.train()
    with open(os.path.join(out_dir, f"report-{rank}.json"), "w") as fh:
        json.dump({"step": trainer.state.global_step, "stopped": trainer.stopped_by_sigterm}, fh)


def merge(out_dir, data_csv, minilm):
    trainer = make_trainer(out_dir, "distributed", data_csv, minilm, final_merge=True, save_strategy="no")
    trainer.train()
    torch.save({"model": trainer.nodes[0].state_dict()}, os.path.join(out_dir, f"final-{dist.get_rank()}.pt"))


if __name__ == "__main__":
    mode, out, data_csv, minilm = sys.argv[1:5]
    torch.set_num_threads(1)
    if mode != "merge":  # the merge run leaves the process group to the arguments, as a user's script does
        dist.init_process_group("gloo")
    if mode == "die":
        die(out, data_csv, minilm)
    elif mode == "merge":
        merge(out, data_csv, minilm)
    elif mode == "refused":
        refused(out, data_csv, minilm, sys.argv[5])
    elif mode == "sigterm":
        sigterm(out, data_csv, minilm)
    elif mode == "disagree":
        disagree(out, data_csv, minilm)
    else:
        resume(out, data_csv, minilm, sys.argv[5])
    dist.destroy_process_group()
