"""Every row of docs/bad_inputs.md: the wrong input and the exact message the user gets. Command-line
rows exit with status 2 and one line on stderr (``<prog>: error: <message>``); library rows raise
ValueError/TypeError with the message. :data:`ROWS` is the table: the tests assert its messages and
``test_docs_table_is_this_table`` that docs/bad_inputs.md shows exactly these rows."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from torch import nn
from datasets import Value
from helpers import agnews_sample, saved_encoder_decoder_model
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DistilBertConfig,
                          DistilBertForSequenceClassification, TrainingArguments)

from lp_decentral_nlp.quant import QuantConfig, QuantModule, quantize_model
from lp_decentral_nlp.commands import build_nlp_parser, main
from lp_decentral_nlp.commands.nlp import NLP_DEFAULTS, SPEC_ADAM_BETA2
from lp_decentral_nlp.trainer import CheckpointError, DecentralizedTrainer, DecentralizedTrainingArguments

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_model(num_labels=4, dim=32):
    torch.manual_seed(0)
    return DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=30522, dim=dim, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=64, num_labels=num_labels))


def targs(out, **kw):
    """The recipes' optimizer settings (a checkpoint written with them resumes from the command line)."""
    optimizer = {key: NLP_DEFAULTS[key] for key in ("learning_rate", "adam_beta1", "weight_decay")}
    optimizer["adam_beta2"] = SPEC_ADAM_BETA2
    base = dict(output_dir=str(out), num_nodes=4, per_device_train_batch_size=8, max_steps=2, save_strategy="no",
                use_cpu=True, disable_tqdm=True, report_to="none", seed=0, **optimizer)
    base.update(kw)
    return DecentralizedTrainingArguments(**base)


@pytest.fixture(scope="module")
def data(tokenizer):
    return agnews_sample(tokenizer, max_length=16, max_train_samples=96, max_eval_samples=16)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data):
    """A finished 2-step run with the recipes' defaults (4 nodes, Choco, 8-bit) and ``checkpoint-2``."""
    out = tmp_path_factory.mktemp("run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    DecentralizedTrainer(model=tiny_model(), args=targs(out, save_strategy="steps", save_steps=2),
                         train_dataset=data["train"]).train()
    torch.set_num_threads(threads)
    return out


def cli_error(argv, capsys, env=None, monkeypatch=None, algorithm="choco"):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        build_nlp_parser("ag_news", algorithm).parse(argv)
    return one_line_error(exc, capsys)


def one_line_error(exc, capsys):
    """The message of a command-line exit: status 2, one line ``<prog>: error: <message>``, no traceback
    (after the data loader's progress bars, for the rows that read data)."""
    err = capsys.readouterr().err
    last = err.rstrip("\n").rsplit("\n", 1)[-1].rsplit("\r", 1)[-1]
    assert exc.value.code == 2 and err.count(": error: ") == 1 and "Traceback" not in err, err
    return last.split(": error: ", 1)[1]


class Row(NamedTuple):
    """One row of docs/bad_inputs.md: the wrong input (Markdown), what the user gets (``exit 2`` for
    the command line, else the exception, e.g. ``ValueError at train()``) and the message. In a
    message, DIR stands for the folder the test writes in and `...` for text that depends on it."""

    wrong_input: str
    gives: str
    message: str

    def expected(self, folder="DIR") -> str:
        return self.message.replace("DIR", str(folder))

    def matches(self, message: str, folder="DIR") -> bool:
        """``message`` is this row's, `...` matching any text."""
        pattern = ".*".join(re.escape(part) for part in self.expected(folder).split("..."))
        return re.fullmatch(pattern, message, flags=re.DOTALL) is not None


def cli(argv, message, note=""):
    return Row(f"`{' '.join(argv)}`{note}", "exit 2", message)


DATA_LAYOUTS = ("expected a DatasetDict.save_to_disk folder or an image folder tree (train/<class>/<image>, test/ or "
                "val/<class>/<image>)")
ENOUGH_ROWS = "give more data, or lower the batch size or the number of nodes"
# Rows 1-17, 35-42, 43 and 47: the command line (every recipe, NLP and vision, shares these flags; a value
# the dataclasses refuse is their message behind the flag the user typed); 18-23 too, with a launcher
# or a run folder; 24-34 and 44: the library (DecentralizedTrainingArguments / DecentralizedTrainer).
ROWS = {
    1: cli(["--nodes", "0"], "argument --nodes: num_nodes must be an integer in [1, 65536], got 0"),
    2: cli(["--skew", "1.5"], "argument --skew: skew must be a number in [0, 1], got 1.5"),
    3: cli(["--comp", "100"],
           "argument --comp: compression must be a percentage in [0, 100), got 100.0"),
    4: cli(["--topology", "star"], "argument --topology: topology must be one of ('directed_ring', 'ring', 'torus', "
                                   "'exponential', 'complete') or a .npy or .json file of mixing matrices (a graph "
                                   "of your own), got 'star'"),
    5: cli(["--lr", "abc"], "argument --lr: expected a number, got 'abc'"),
    6: cli(["--data-dir", "/no/such/dir"], "argument --data-dir: path '/no/such/dir' does not exist"),
    7: cli(["--seed", "-1"], "argument --seed: seed must be an integer in [0, 4294967295], got -1"),
    8: cli(["--drop-prob", "1"], "argument --drop-prob: drop_prob must be a probability in [0, 1), got 1.0"),
    9: cli(["--straggler", "2"], "argument --straggler: stragglers: expected NODE:SECONDS (e.g. 2:0.5), got '2'"),
    10: cli(["--straggler", "7:0.5"], "argument --straggler: node 7 does not exist (nodes are 0..3)",
            " with 4 nodes"),
    11: cli(["--leave", "1:50:20"], "argument --leave: absences: expected NODE:START:END with NODE >= 0 and 0 <= START "
                                    "< END, got '1:50:20'"),
    12: cli(["--topology", "torus", "--torus-rows", "3"], "argument --torus-rows: torus_rows must divide num_nodes=4 "
            "and needs topology='torus', got torus_rows=3 with topology='torus'", " with 4 nodes"),
    13: cli(["--torus-rows", "2"], "argument --torus-rows: torus_rows must divide num_nodes=4 and needs "
            "topology='torus', got torus_rows=2 with topology='directed_ring'", " without torus"),
    14: cli(["--topology", "exponential"], "argument --topology: topology='exponential' changes every step "
            "(period 2), but algorithm='choco' needs a static graph: use algorithm='deepsqueeze' (or 'dpsgd' with "
            "low_precision=False) or a static topology", " in a Choco recipe"),
    15: cli(["--save-total-limit", "2"], "argument --save-total-limit: save_total_limit=2 is how many checkpoints are "
            "kept, and save_strategy='no' writes none: set save_strategy, or leave save_total_limit at None",
            " without `--save-steps`"),
    16: cli(["--resume-from-checkpoint", "/no/such/run"],
            "argument --resume-from-checkpoint: path '/no/such/run' does not exist"),
    17: cli(["--frobnicate"], "unrecognized arguments: --frobnicate"),
    18: Row("`--backend distributed` without a launcher", "exit 2",
            "argument --backend: 'distributed' runs one process per node, but WORLD_SIZE is not set: launch with "
            "torchrun --nproc_per_node 4 (or use --backend simulated)"),
    19: Row("`torchrun --nproc_per_node 2 recipes/agnews_choco.py --backend distributed --nodes 4`",
            "printed once (the first process exits 2; torchrun stops the others and exits 1)",
            "argument --nodes: 4 nodes, but the launcher started 2 processes (WORLD_SIZE=2): launch one process per "
            "node (torchrun --nproc_per_node 4)"),
    20: Row("`--backend distributed --straggler 1:400` (timeout 300)", "exit 2",
            "argument --straggler: node 1 sleeps 400 s per step, not less than gossip_timeout=300 s: its "
            "peers would give up on it"),
    21: Row("`--resume-from-checkpoint DIR`, no checkpoint in DIR", "exit 2",
            "argument --resume-from-checkpoint: no complete checkpoint-<step> directory in DIR"),
    22: Row("a checkpoint missing a node file", "exit 2",
            "argument --resume-from-checkpoint: DIR/checkpoint-2 is incomplete, it lacks node-3.safetensors"),
    23: Row("resume a 4-node run with `--nodes 2`", "exit 2",
            "argument --resume-from-checkpoint: cannot resume from DIR/checkpoint-2: it was written with num_nodes=4 "
            "(this run: 2); resume with the arguments of the interrupted run"),
    24: Row("`skew=0.5` and a training set without a `label` column", "ValueError",
            "skew=0.5 needs a column of class ids to skew the shards on, and train_dataset has no 'label' or 'labels' "
            "column (columns: ['target', 'input_ids', 'token_type_ids', 'attention_mask']): name one with "
            "shard_column, or use skew=0"),
    25: Row("labels the model cannot predict", "ValueError",
            "train_dataset: labels must be class ids 0..1 (the model has num_labels=2), found [2, 3]"),
    26: Row("8-bit training of a model with no quantizable layer", "ValueError",
            "low_precision=True (its default) trains every node in 8-bit, and quantize_model finds no layer to "
            "quantize (supported types: Linear, Conv1D, Conv2d...: pass low_precision=False to train in full "
            "precision"),
    27: Row("`torus_rows=3`, `num_nodes=4`", "ValueError",
            "torus_rows must divide num_nodes=4 and needs topology='torus', got torus_rows=3 with topology='torus'"),
    28: Row('`algorithm="choco"`, `topology="exponential"`', "ValueError",
            "topology='exponential' changes every step (period 2), but algorithm='choco' needs a static graph: use "
            "algorithm='deepsqueeze' (or 'dpsgd' with low_precision=False) or a static topology"),
    29: Row("batch larger than a node's shard", "ValueError at `train()`",
            "per_device_train_batch_size=64 exceeds the smallest shard (24 samples): lower the batch size or the "
            "number of nodes"),
    30: Row("plain `TrainingArguments`", "TypeError",
            "args must be DecentralizedTrainingArguments, got TrainingArguments: it takes TrainingArguments' fields and "
            "the decentralized ones (num_nodes, skew, algorithm ...)"),
    31: Row('`stragglers=["9:1.0"]` with 4 nodes', "ValueError", "stragglers: node 9 does not exist (nodes are 0..3)"),
    32: Row("resume a Choco checkpoint as Deep-Squeeze", "ValueError at `train()`",
            "resume_from_checkpoint: cannot resume from DIR/checkpoint-2: it was written with algorithm='choco' (this "
            "run: 'deepsqueeze'); resume with the arguments of the interrupted run"),
    33: Row("resume into a different model", "ValueError at `train()`",
            "DIR/checkpoint-2/node-0.safetensors does not fit this model (22 keys of another shape: "
            "distilbert.embeddings.word_embeddings.weight (30522, 32) saved, (30522, 16) here, ...): it was written "
            "for another model"),
    34: Row("`gossip_timeout=0`", "ValueError", "gossip_timeout must be a number of seconds > 0, got 0"),
    35: Row("`--data-dir` an empty file", "exit 2", "argument --data-dir: DIR/data.csv: the file is empty"),
    36: Row("`--data-dir` a CSV with a header line only", "exit 2",
            "argument --data-dir: DIR/data.csv: has a header line but no data rows"),
    37: Row("`--data-dir` a CSV with other columns", "exit 2",
            "argument --data-dir: DIR/data.csv: expected columns label,title,description (labels 1-4) or text,label "
            "(labels 0-3), found ['a', 'b']"),
    38: Row("`--data-dir` a CSV with a label outside 1-4", "exit 2",
            "argument --data-dir: DIR/data.csv:3: label 7 is not a class; labels must be 1-4"),
    39: Row("`--data-dir` a CSV that is not UTF-8 (Latin-1)", "exit 2",
            "argument --data-dir: DIR/data.csv: not UTF-8 text (line 2, byte 29: b'\\xe9'); re-save the file as UTF-8"),
    40: Row("`--data-dir` 80 rows (64 for training) with `--nodes 4 --batch-size 17 --skew 0.5`", "exit 2",
            "argument --data-dir: DIR/data.csv: 64 training rows cannot give each of 4 nodes one batch of 17: at least "
            f"68 rows are needed; {ENOUGH_ROWS}"),
    41: Row("`--max-train-samples 60` with `--nodes 4 --batch-size 16 --skew 0.5`", "exit 2",
            "argument --max-train-samples: DIR/data.csv cut to 60 rows: 60 training rows cannot give each of 4 nodes one "
            f"batch of 16: at least 64 rows are needed; {ENOUGH_ROWS}"),
    42: Row("vision recipe, `--dataset cifar10 --data-dir` a file", "exit 2",
            f"argument --data-dir: data_dir 'DIR/data.csv' is a file: {DATA_LAYOUTS}"),
    43: cli(["--full-precision", "--kernel", "int8"], "argument --kernel: quant_kernel='int8' chooses the GEMM kernel "
            "of 8-bit training, and low_precision=False trains in full precision: drop one of them"),
    44: Row("`quant_config` given with `low_precision=False`", "ValueError",
            "quant_config is the 8-bit surgery, and low_precision=False trains in full precision: drop "
            "quant_config or set low_precision=True"),
    45: Row("`--full-precision --model DIR`, DIR an 8-bit model", "exit 2",
            "argument --model: DIR: model has 8-bit layers (quantize_model or an 8-bit checkpoint), and "
            "low_precision=False trains in full precision: give the float model (dequantize_model) or train in 8-bit"),
    46: Row("an 8-bit model and a `quant_config`", "ValueError",
            "quant_config: model already has 8-bit layers (quantize_model or an 8-bit checkpoint), which keep the "
            "QuantConfig they were made with: drop quant_config or pass the float model"),
    47: cli(["--lr_scheduler_type", "constant", "--warmup_steps", "10"], "argument --warmup_steps: warmup_steps=10.0 "
            "has no effect with lr_scheduler_type='constant': use lr_scheduler_type='constant_with_warmup' for a "
            "warm-up, or warmup_steps=0"),
    48: Row("`--max-length 200` for a model of 128 positions", "exit 2",
            "argument --max-length: 200 exceeds the 128 positions of DIR (max_position_embeddings): use at most 128"),
    49: Row("`--model DIR`, DIR's `config.json` not JSON", "exit 2",
            "argument --model: DIR: cannot load its config or tokenizer (OSError: It looks like the config file at "
            "'DIR/config.json' is not a valid JSON file.)"),
    50: Row("`--model DIR`, DIR's `model.safetensors` truncated", "exit 2",
            "argument --model: DIR: cannot load its weights (SafetensorError: ...)"),
    51: Row("a run larger than the memory", "exit 2",
            "the run needs at least ... MB (4 nodes in this process x ... MB each of weights and optimizer state; ... "
            "MB of one node's gradients and saved activations; ... MB of gossip buffers and the initial model) but 1 "
            "MB are available on cpu: lower --nodes, --batch-size or --max-length, or run one node per process "
            "(--backend distributed)"),
    52: Row("`--output-dir DIR/afile/run`, `afile` a file", "exit 2",
            "argument --output-dir: DIR/afile/run cannot be created (DIR/afile is a file)"),
    53: Row('`--output-dir ""`', "exit 2", "argument --output-dir: the folder name is empty"),
    54: Row("`--output-dir /proc/run` (a folder no one can create)", "exit 2",
            "argument --output-dir: /proc/run cannot be created (FileNotFoundError: No such file or directory)"),
    55: cli(["--report_to", "foo"], "argument --report_to: 'foo' is not a logging integration; choose from "
            "['azure_ml', 'clearml', 'codecarbon', 'comet_ml', 'dagshub', 'dvclive', 'flyte', 'kubeflow', 'mlflow', "
            "'neptune', 'swanlab', 'tensorboard', 'trackio', 'wandb'], 'all' or 'none' (several, apart: --report_to "
            "tensorboard wandb)"),
    56: cli(["--eval_steps", "5", "--metric_for_best_model", "f1"], "argument --metric_for_best_model: 'f1' is not a "
            "metric of the evaluation; use loss, accuracy (a classifier's), consensus_distance, runtime, "
            "samples_per_second, steps_per_second, and loss_node_<i>, accuracy_node_<i>, bytes_sent_node_<i> for a "
            "node i in 0..3"),
    57: cli(["--skew", "0.5", "--shard-column", "topic"], "argument --shard-column: the recipes read the text (or "
            "image) and label columns of their data only, and skew the shards on the label; to skew on another "
            "column, train your own dataset from Python (DecentralizedTrainer with shard_column=...); drop it"),
    58: Row("`OMP_NUM_THREADS=abc` (or a launcher's `WORLD_SIZE`, `RANK` that is not a whole number)", "exit 2",
            "environment variable OMP_NUM_THREADS='abc' must be a whole number >= 1"),
    59: Row("no `--data-dir` while the hub is offline", "exit 2",
            "could not load 'ag_news' from the hub (offline); pass --data-dir with a local copy"),
    60: cli(["--num_nodes", "3", "--nodes", "2"], "argument --nodes: given more than once (--num_nodes and --nodes): "
            "give it once"),
    61: Row("vision recipe, `--norm batchnorm --groups 4`", "exit 2",
            "argument --groups/--norm: groups=4 is the group count of groupnorm, evonorm, range_evonorm; "
            "norm='batchnorm' has no groups: leave groups at 2"),
    62: Row("`--data-dir DIR`, DIR holding `test.csv` and no `train.csv`", "exit 2",
            "argument --data-dir: data_dir 'DIR' holds test.csv but no train.csv: test.csv is the test split beside a "
            "train.csv, and its rows are never trained on; add train.csv or rename test.csv"),
    63: Row("resume with another `--lr` (the checkpoint's optimizer state holds the learning rate)", "exit 2",
            "argument --resume-from-checkpoint: cannot resume from DIR/checkpoint-2: it was written with "
            "learning_rate=3e-05 (this run: 0.001); resume with the arguments of the interrupted run"),
    64: Row("`--gradient_accumulation_steps 4`, a node's shard holding fewer batches", "exit 2",
            "gradient_accumulation_steps=4 exceeds the batches per epoch of the smallest shard (1): lower it, the "
            "batch size or the number of nodes"),
    65: cli(["--straggler"], "argument --straggler: expected at least one argument"),
    66: cli(["--compressor", "randomk"], "argument --compressor: compressor='randomk' chooses which entries "
            "compression > 0 drops, and compression=0 sends every entry: set compression > 0 or leave compressor at "
            "'topk'"),
    67: cli(["--qgm_beta", "0.5"], "argument --qgm_beta: qgm_beta=0.5 is the quasi-global momentum's beta, and "
            "qgm=False: set qgm=True, or leave qgm_beta at 0.9"),
    68: cli(["--lr_decay", "0.5"], "argument --lr_decay: lr_decay=0.5 is the factor at each of lr_milestones, and "
            "lr_milestones=None: give lr_milestones, or leave lr_decay at 0.1"),
    69: cli(["--gossip_timeout", "5"], "argument --gossip_timeout: gossip_timeout=5.0 is how long a process waits "
            "for its peers, and backend='simulated' runs every node in this process: use backend='distributed', or "
            "leave gossip_timeout at 300.0"),
    70: cli(["--optim", "lomo"], "argument --optim: optim='lomo' is not supported by DecentralizedTrainer (LOMO "
            "updates each weight inside backward, before the node's NaN/Inf check, clipping and gossip): use "
            "adamw_torch, sgd or another optimizer that steps in optimizer.step()"),
    71: cli(["--dataloader_persistent_workers"], "argument --dataloader_persistent_workers: "
            "dataloader_persistent_workers=True is a setting of dataloader worker processes, and "
            "dataloader_num_workers=0 starts none: set dataloader_num_workers > 0 or leave "
            "dataloader_persistent_workers at its default"),
    72: cli(["--push_to_hub"], "argument --push_to_hub: the recipes write the trained model to <output-dir>/model and "
            "the run's files beside it; upload that folder (hf upload <repo> <output-dir>/model), or train from Python "
            "with DecentralizedTrainer(push_to_hub=True); drop it"),
    73: cli(["--prediction_loss_only"], "argument --prediction_loss_only: the recipes report the accuracy of the "
            "averaged model and of each node, which needs the predictions; drop it"),
    74: cli(["--label_names", "label"], "argument --label_names: the recipes name the label of their batches "
            "themselves ('labels' for text, 'label' for images); drop it"),
    75: Row("`--dataloader_drop_last`, a test split smaller than one evaluation batch", "exit 2",
            "argument --dataloader_drop_last: the test split's 5 rows are fewer than one evaluation batch (32), so the "
            "evaluation would drop them all and report no accuracy: give more test rows, or drop it"),
    76: Row("`--model DIR`, DIR holding the config and weights but no tokenizer files", "exit 2",
            "argument --model: DIR: its tokenizer has no vocabulary, only 5 special tokens (no tokenizer files such "
            "as tokenizer.json or vocab.txt): save the tokenizer into the folder (tokenizer.save_pretrained)"),
    77: cli(["--lr_scheduler_kwargs", '{"foo":1}'], "argument --lr_scheduler_kwargs: lr_scheduler_type='linear' with "
            "lr_scheduler_kwargs={'foo': 1} gives no schedule (TypeError: get_linear_schedule_with_warmup() got an "
            "unexpected keyword argument 'foo')"),
    78: cli(["--lr_scheduler_kwargs", "cycles=2"], "argument --lr_scheduler_kwargs: expected a JSON object of the "
            "schedule's arguments, e.g. '{\"num_cycles\": 2}', got 'cycles=2'"),
    79: cli(["--lr_scheduler_type", "cosine_with_min_lr"], "argument --lr_scheduler_type: "
            "lr_scheduler_type='cosine_with_min_lr' with lr_scheduler_kwargs={} gives no schedule (ValueError: One of "
            "min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`)"),
    80: cli(["--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs", '{"power":-1}'],
            "argument --lr_scheduler_kwargs: lr_scheduler_type='polynomial' with lr_scheduler_kwargs={'power': -1} "
            "gives no schedule (ZeroDivisionError: 0.0 cannot be raised to a negative power)",
            " (it failed at the last step of training)"),
    81: Row("resume a checkpoint at step 2 with `max_steps=1`", "CheckpointError at train()",
            "cannot resume from DIR/checkpoint-2: it is at step 2, past this run's last step, 1 (max_steps, "
            "num_train_epochs): train for more steps, or resume from an earlier checkpoint"),
    82: Row("`RANK=5 WORLD_SIZE=2` (or a `RANK`, `LOCAL_RANK` without `WORLD_SIZE`)", "exit 2",
            "environment variable RANK=5 must be below WORLD_SIZE=2, the processes of the launch"),
    83: cli(["--nodes", "1", "--comp", "99"], "argument --comp: compression=99.0 is a setting of the gossip, and "
            "num_nodes=1 has no neighbour to send to: set num_nodes >= 2, or leave compression at 0.0",
            " (also `--topology`, `--compressor`, `--consensus_lr`, `--drop-prob`, `--final-merge` ...)"),
    84: cli(["--nodes", "1", "--skew", "0.9"], "argument --skew: skew=0.9 is how unevenly the training set is split "
            "among the nodes, and num_nodes=1 holds all of it: set num_nodes >= 2, or leave skew at 0.0"),
    85: cli(["--include_for_metrics", "inputs"], "argument --include_for_metrics: a setting of compute_metrics, and "
            "the recipes compute accuracy without one (from Python, DecentralizedTrainer(compute_metrics=...) takes "
            "it); drop it", " (also `--batch_eval_metrics`, `--eval_do_concat_batches`)"),
    86: cli(["--hub_model_id", "me/model"], "argument --hub_model_id: a setting of --push_to_hub, which the recipes "
            "refuse; drop it", " (also the other `--hub_*` flags)"),
    87: cli(["--optim", "sgd", "--optim_args", "momentum=0.9,moment=0.5"], "argument --optim_args: optim_args entry "
            "'moment=0.5' is not read by optim='sgd' (transformers ignores it): drop it"),
    88: cli(["--optim", "sgd", "--optim_args", "momentum=high"], "argument --optim_args: optim_args='momentum=high' for "
            "optim='sgd': could not convert string to float: 'high'"),
    89: cli(["--eval_steps", "5", "--eval_strategy", "epoch"], "argument --eval_steps: eval_steps is the interval of "
            "eval_strategy='steps', and eval_strategy is 'epoch': drop one of them",
            " (also `--save_steps`, `--logging_steps` with another strategy)"),
    90: cli(["--load_best_model_at_end"], "argument --load_best_model_at_end: load_best_model_at_end is a setting of "
            "evaluation during training, and this run evaluates only at its end: give --eval-steps or --eval-strategy, "
            "or drop it", " (`--metric_for_best_model`, `--greater_is_better`, `--eval_delay`: \"... is a setting of "
            "evaluation during training, and eval_strategy='no' evaluates at the end only\")"),
    91: cli(["--do_predict"], "argument --do_predict: what a training script runs, and a recipe always trains, then "
            "evaluates the averaged model and each node on the test split (results.json); drop it",
            " (also `--do_train`, `--do_eval`)"),
    92: cli(["--ddp_timeout", "5"], "argument --ddp_timeout: ddp_timeout=5 is how long a process waits at a collective "
            "over all processes, and backend='simulated' runs every node in this process: use "
            "backend='distributed', or leave ddp_timeout at 1800"),
    93: Row("`--model DIR`, DIR's tokenizer without a padding token or an end-of-sequence token to pad with",
            "exit 2", "argument --model: DIR: its tokenizer has no padding token and no end-of-sequence token to pad "
            "with: set one (tokenizer.pad_token = ...; tokenizer.save_pretrained)"),
    94: Row("float labels for a classifier (`label` 0.0, 1.0, ...)", "ValueError",
            "train_dataset: labels must be class ids 0..3 (the model has num_labels=4), found [0.0, 1.0, 2.0, 3.0]"),
    95: Row("evaluation or test labels the model cannot predict (a set of a dict `eval_dataset` at construction; "
            "a set given to `evaluate()` or `predict()` there)", "ValueError",
            "eval_dataset['shifted']: labels must be class ids 0..3 (the model has num_labels=4), found [4]"),
    96: Row("`--model DIR`, DIR an encoder-decoder (BART, T5) whose tokenizer has no padding token", "exit 2",
            "argument --model: DIR: its tokenizer has no padding token, and the end-of-sequence token cannot pad for "
            "a bart classifier, which reads it: set one (tokenizer.pad_token = ...; tokenizer.save_pretrained)"),
    97: cli(["--qgm", "--qgm_beta", "0.5"], "argument --qgm_beta: qgm_beta=0.5 applies to SGD; with AdamW the "
            "quasi-global first moment uses adam_beta1 (0.9): set adam_beta1 instead and leave qgm_beta at 0.9"),
    98: cli(["--no_logging_nan_inf_filter"], "argument --no_logging_nan_inf_filter: logging_nan_inf_filter=False is "
            "not supported by DecentralizedTrainer (must stay True: a non-finite loss never enters the logged loss (the "
            "run stops naming the node, or skips it with skip_nonfinite)); leave it at True"),
    99: cli(["--optim", "sgd", "--adam_beta1", "0.5"], "argument --adam_beta1: adam_beta1=0.5 is not read by "
            "optim='sgd' (transformers ignores it): leave it at 0.9, or use an optimizer that reads it (adamw_torch)"),
    100: cli(["--restore_callback_states_from_checkpoint"], "argument --restore_callback_states_from_checkpoint: it "
             "restores the callbacks' states from the checkpoint a run resumes from, and this run starts afresh: give "
             "--resume-from-checkpoint or drop it"),
    101: cli(["--gossip-reference", "Initial"], "argument --gossip-reference: gossip_reference must be one of ('zero', "
             "'initial'), got 'Initial'"),
    102: cli(["--straggler", "1:0"], "argument --straggler: stragglers: expected NODE:SECONDS with NODE >= 0 and finite "
             "SECONDS > 0, got '1:0'"),
    103: cli(["--full-precision", "--gossip-reference", "initial"], "argument --gossip-reference: "
             "gossip_reference='initial' changes what compressed messages carry, and these are exact (float32 values, "
             "compression=0): the same algorithm at the cost of a model copy; leave gossip_reference at 'zero', or "
             "compress (low_precision or compression > 0)"),
    104: cli(["--topology", "my_graph.npy"], "argument --topology: topology: no file 'my_graph.npy' (a graph of your "
             "own: a .npy or .json file of its mixing matrices)"),
    105: Row("`--lr 1e-4` given to one process of `torchrun --nproc_per_node 2 recipes/agnews_choco.py --backend "
             "distributed --nodes 2`", "printed once (the processes exit 2; torchrun exits 1)",
             "argument --lr: the processes of the launch were given different values (rank 1: 0.0001, rank 0: 3e-05): "
             "give every process the same flags (launch them with one command)"),
}
CLI_ROWS = [*range(1, 18), 43, 47, 55, 56, 57, 60, *range(65, 75), *range(77, 81), *range(83, 93), *range(97, 105)]


def docs_table() -> str:
    """docs/bad_inputs.md's table, from :data:`ROWS`."""
    lines = ["| # | wrong input | what you get |", "| --- | --- | --- |"]
    for number, row in ROWS.items():
        gives = "" if row.gives == "exit 2" else f"{row.gives}: "
        lines.append(f"| {number} | {row.wrong_input} | {gives}`{row.message}` |")
    return "\n".join(lines) + "\n"


def test_docs_table_is_this_table():
    docs = (REPO / "docs" / "bad_inputs.md").read_text()
    assert docs_table() in docs, "docs/bad_inputs.md's table differs from ROWS; its table should read:\n" + docs_table()


@pytest.mark.parametrize("number", CLI_ROWS)
def test_cli_row(number, capsys):
    row = ROWS[number]
    assert cli_error(row.wrong_input.split("`")[1].split(), capsys) == row.message


def test_row18_distributed_backend_without_a_launcher(capsys, monkeypatch):
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert cli_error(["--backend", "distributed"], capsys) == ROWS[18].message


def test_row58_a_bad_thread_variable_is_refused_in_one_line_before_openmp_reads_it():
    """OpenMP (loaded with torch) prints its own complaint about OMP_NUM_THREADS: the recipe refuses
    the variable before it imports torch, so the user sees one line."""
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "agnews_choco.py")], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="abc"), timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"agnews_choco.py: error: {ROWS[58].message}\n"


@pytest.mark.distributed
def test_row19_torchrun_world_size_differs_from_nodes():
    """A real 2-process torchrun of a recipe asked for 4 nodes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "recipes" / "agnews_choco.py"), "--backend", "distributed", "--nodes", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1  # torchrun's status when a worker fails
    assert re.search(r"exitcode\s*: 2 ", proc.stderr), proc.stderr[-3000:]  # the first process's, in torchrun's report
    errors = [text for text in proc.stderr.splitlines() if text.startswith("agnews_choco.py: error:")]
    assert errors == [f"agnews_choco.py: error: {ROWS[19].message}"], proc.stderr[-3000:]
    assert "lp_decentral_nlp" not in proc.stderr  # no traceback through our code (torchrun prints its own)


@pytest.mark.distributed
@pytest.mark.parametrize("argv, message", [
    (["--skew", "2"], "argument --skew: skew must be a number in [0, 1], got 2.0"),
    (["--backend", "distributed", "--nodes", "4", "--data-dir", "/nonexistent/ag_news"],
     "argument --data-dir: path '/nonexistent/ag_news' does not exist"),
], ids=["flag-check", "after-joining-the-process-group"])
def test_a_refusal_under_torchrun_is_printed_once(argv, message):
    """Every process of a launch refuses the same input: the line was printed once per process (4
    times here). A bad flag is refused before torch is imported, a missing --data-dir after the
    arguments joined torchrun's process group."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(REPO / "recipes" / "agnews_choco.py"), *argv],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    errors = [text for text in proc.stderr.splitlines() if text.startswith("agnews_choco.py: error:")]
    assert errors == [f"agnews_choco.py: error: {message}"], proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("rank_1_flags, message", [
    (["--lr", "1e-4"], ROWS[105].message),
    (["--full-precision"], "argument --low-precision: the processes of the launch were given different values "
                           "(rank 1: False, rank 0: True): give every process the same flags (launch them with one "
                           "command)"),
    # the default output folder is named after --skew: the skew is named, not the folder
    (["--skew", "0.9"], "argument --skew: the processes of the launch were given different values (rank 1: 0.9, "
                        "rank 0: 0.0): give every process the same flags (launch them with one command)"),
    (["--straggler", "1:0.5"], "argument --straggler: the processes of the launch were given different values "
                               "(rank 1: ['1:0.5'], rank 0: None): give every process the same flags (launch them "
                               "with one command)"),
], ids=["row105-lr", "full-precision", "skew", "straggler"])
def test_row105_a_launch_whose_processes_were_given_other_flags(rank_1_flags, message, ag_news_csv, tmp_path):
    """--full-precision on one process waited 30 minutes at the initial model's broadcast, silently;
    another --lr (or --skew, --max-train-samples) trained, and results.json gave rank 0's flags.
    Refused before the data or the model is loaded."""
    wrapper = tmp_path / "rank_1_differs.py"
    wrapper.write_text("import os, runpy, sys\n"
                       f"if os.environ['RANK'] == '1':\n    sys.argv += {rank_1_flags!r}\n"
                       f"runpy.run_path({str(REPO / 'recipes' / 'agnews_choco.py')!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(wrapper), "--backend", "distributed", "--nodes", "2", "--data-dir", str(ag_news_csv)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert proc.returncode == 1  # torchrun's status when a worker fails
    errors = [text for text in proc.stderr.splitlines() if text.startswith("agnews_choco.py: ")]
    assert errors == [f"agnews_choco.py: error: {message}"], proc.stderr[-3000:]
    assert "lp_decentral_nlp" not in proc.stderr  # no traceback through our code (torchrun prints its own)
    assert sorted(os.listdir(tmp_path)) == ["rank_1_differs.py"]  # no output folder (runs/...)


def test_a_refusal_not_left_to_another_process_is_reported_after_the_wait(capsys, monkeypatch):
    """A process other than the first of its machine waits for the launcher to stop it before it
    reports a refusal, and reports it when nothing stops it (the refusal was its own); the first
    process, and a process without a launcher, report at once."""
    from lp_decentral_nlp.commands import run

    waits = []
    monkeypatch.setattr(run.time, "sleep", waits.append)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for env, wait in (({}, []), ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}, []),
                      ({"WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1"}, []),  # an unusable rank: at once
                      ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"}, [run.REFUSAL_REPORT_WAIT_S]),
                      ({"WORLD_SIZE": "8", "RANK": "4", "LOCAL_RANK": "0"}, [])):  # the first of a second machine
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        waits.clear()
        assert cli_error(["--skew", "2"], capsys) == "argument --skew: skew must be a number in [0, 1], got 2.0"
        assert waits == wait, env


def test_cli_reports_the_training_arguments_own_cross_checks_as_a_flag_error(capsys):
    """A combination only DecentralizedTrainingArguments rejects (8-bit D-PSGD sends Choco messages,
    which need a static graph) is one parser error line, not a traceback from inside the run."""
    assert cli_error(["--topology", "exponential"], capsys, algorithm="dpsgd") == (
        "argument --topology: topology='exponential' changes every step (period 2), but algorithm='dpsgd' with "
        "low_precision (8-bit Choco messages) needs a static graph: use algorithm='deepsqueeze' (or 'dpsgd' with low_precision=False) or a "
        "static topology")
    build_nlp_parser("ag_news", "dpsgd").parse(["--topology", "exponential", "--full-precision"])


def test_row20_straggler_slower_than_the_gossip_timeout(capsys, monkeypatch):
    assert cli_error(["--backend", "distributed", "--straggler", "1:400"], capsys, {"WORLD_SIZE": "4"},
                     monkeypatch) == ROWS[20].message


def test_row21_output_dir_without_a_checkpoint(capsys, tmp_path):
    assert cli_error(["--resume-from-checkpoint", str(tmp_path)], capsys) == ROWS[21].expected(tmp_path)


def test_row22_incomplete_checkpoint(capsys, run_dir, tmp_path):
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(run_dir / "checkpoint-2", broken)
    (broken / "node-3.safetensors").unlink()
    assert cli_error(["--resume-from-checkpoint", str(broken)], capsys) == ROWS[22].expected(tmp_path)


def test_row23_resume_with_another_number_of_nodes(capsys, run_dir):
    assert cli_error(["--resume-from-checkpoint", str(run_dir), "--batch-size", "8", "--nodes", "2"],
                     capsys) == ROWS[23].expected(run_dir)


def test_row81_resume_past_the_last_step(tmp_path, data, run_dir):
    """It trained nothing and reported the checkpoint's model as this run's (results: steps 2, max_steps 1)."""
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=1), train_dataset=data["train"])
    with pytest.raises(CheckpointError) as exc:
        trainer.train(resume_from_checkpoint=str(run_dir))
    assert str(exc.value) == ROWS[81].expected(run_dir)


def test_row63_resume_with_another_learning_rate(capsys, run_dir):
    assert cli_error(["--resume-from-checkpoint", str(run_dir), "--batch-size", "8", "--lr", "1e-3"],
                     capsys) == ROWS[63].expected(run_dir)


def test_a_resume_with_another_schedule_clipping_or_smoothing_is_refused(capsys, run_dir):
    """Resumed with another lr_scheduler_type, warmup, max_grad_norm or label smoothing, a run went on
    silently as neither the interrupted run nor a fresh one (a cosine resume of a linear run logged
    2.5e-4 where either schedule gives another rate)."""
    message = cli_error(["--resume-from-checkpoint", str(run_dir), "--batch-size", "8", "--lr-scheduler-type",
                         "cosine", "--warmup-steps", "1", "--max-grad-norm", "1", "--label-smoothing-factor", "0.1"],
                        capsys)
    for difference in ("lr_scheduler_type='linear' (this run: 'cosine')", "warmup_steps=0 (this run: 1.0)",
                       "max_grad_norm=0.0 (this run: 1.0)", "label_smoothing_factor=0.0 (this run: 0.1)"):
        assert difference in message


def test_row24_dataset_without_label_column(tmp_path, data):
    train = data["train"].rename_column("label", "target")
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=0.5), train_dataset=train)
    assert str(err.value) == ROWS[24].message


def test_row25_labels_the_model_cannot_predict(tmp_path, data):
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=tiny_model(num_labels=2), args=targs(tmp_path), train_dataset=data["train"])
    assert str(err.value) == ROWS[25].message


def test_rows94_95_labels_that_are_no_class_ids_fail_before_training_not_in_the_loss(tmp_path, data):
    """Float labels (skew 0: no shards to build) reached the loss at the first step, which read them
    as multi-label targets ("Target size ... must be the same as input size"); evaluation labels
    were not checked at all, and an IndexError came at the first evaluation, after training."""
    floats = data["train"].cast_column("label", Value("float32"))
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=floats)
    assert str(err.value) == ROWS[94].message
    shifted = data["test"].cast_column("label", Value("int64")).map(lambda row: {"label": row["label"] + 1})
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=data["train"],
                             eval_dataset={"plain": data["test"], "shifted": shifted})
    assert str(err.value) == ROWS[95].message
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=data["train"],
                                   eval_dataset=data["test"])
    for call, what in ((trainer.evaluate, "eval_dataset"), (trainer.predict, "test_dataset")):
        with pytest.raises(ValueError) as err:
            call(shifted)
        assert str(err.value) == ROWS[95].message.replace("eval_dataset['shifted']", what)


class NoLinear(nn.Module):
    """Embedding bag + a head named 'classifier' (kept full precision): nothing to quantize."""

    def __init__(self):
        super().__init__()
        self.embed = nn.EmbeddingBag(30522, 8)
        self.classifier = nn.Linear(8, 4)

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.classifier(self.embed(input_ids))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_row26_model_without_quantizable_layers(tmp_path, data):
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=NoLinear(), args=targs(tmp_path), train_dataset=data["train"])
    # the supported types are those registered so far (the vision norms join when lp_decentral_nlp.vision is imported)
    assert ROWS[26].matches(str(err.value)), str(err.value)


def test_row27_torus_rows_that_do_not_divide_the_nodes(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, topology="torus", torus_rows=3)
    assert str(err.value) == ROWS[27].message


def test_row28_choco_on_the_exponential_graph(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, algorithm="choco", topology="exponential")
    assert str(err.value) == ROWS[28].message


def test_row29_batch_larger_than_a_shard(tmp_path, data):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, per_device_train_batch_size=64),
                                   train_dataset=data["train"])
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert str(err.value) == ROWS[29].message
    with pytest.raises(ValueError) as err:  # the cost report (written before training) refuses it the same way
        trainer.cost_report((16,))
    assert str(err.value) == ROWS[29].message


def test_row30_plain_training_arguments(tmp_path, data):
    with pytest.raises(TypeError) as err:
        DecentralizedTrainer(model=tiny_model(), args=TrainingArguments(output_dir=str(tmp_path)),
                             train_dataset=data["train"])
    assert str(err.value) == ROWS[30].message


def test_row31_fault_plan_naming_a_missing_node(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, stragglers=["9:1.0"])
    assert str(err.value) == ROWS[31].message


def test_row32_resume_with_another_algorithm(tmp_path, data, run_dir):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, algorithm="deepsqueeze"),
                                   train_dataset=data["train"])
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(run_dir))
    assert str(err.value) == ROWS[32].expected(run_dir)


def test_row33_resume_into_another_model(tmp_path, data, run_dir):
    trainer = DecentralizedTrainer(model=tiny_model(dim=16), args=targs(tmp_path), train_dataset=data["train"])
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(run_dir))
    assert ROWS[33].matches(str(err.value), run_dir), str(err.value)


def test_row34_gossip_timeout_zero(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, gossip_timeout=0)
    assert str(err.value) == ROWS[34].message


def test_row45_full_precision_run_of_an_8bit_model(tmp_path, tiny_model_dir, ag_news_csv, capsys):
    model = quantize_model(AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=4,
                                                                              ignore_mismatched_sizes=True))
    model.save_pretrained(tmp_path)  # an 8-bit checkpoint: from_pretrained gives the 8-bit layers back
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tmp_path), "--data-dir", str(ag_news_csv), "--full-precision",
                                  "--max-train-samples", "160", "--max-length", "32", "--output-dir",
                                  str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[45].expected(tmp_path)
    assert not (tmp_path / "run").exists()


def test_row46_quant_config_for_an_8bit_model(tmp_path, data):
    model = quantize_model(tiny_model(), QuantConfig(kernel="simulated"))
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=model, args=targs(tmp_path), quant_config=QuantConfig(kernel="int8"),
                             train_dataset=data["train"])
    assert str(err.value) == ROWS[46].message
    with pytest.raises(ValueError, match="quant_kernel='int8', but model already has 8-bit layers made with kernel "
                                         "'simulated': leave quant_kernel at 'auto' or pass the float model"):
        DecentralizedTrainer(model=model, args=targs(tmp_path, quant_kernel="int8"), train_dataset=data["train"])
    # the same kernel, or auto, trains the 8-bit model as it is
    DecentralizedTrainer(model=model, args=targs(tmp_path, quant_kernel="simulated"), train_dataset=data["train"])


def test_row44_quant_config_in_full_precision(tmp_path, data):
    model = tiny_model()
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=model, args=targs(tmp_path, low_precision=False), quant_config=QuantConfig(),
                             train_dataset=data["train"])
    assert str(err.value) == ROWS[44].message
    assert not any(isinstance(m, QuantModule) for m in model.modules())  # the user's model is left as it was


# Rows 35-42: data the recipes cannot train on, told as a flag error before any model is built.

def agnews_rows(count: int) -> bytes:
    """The header and the first `count` rows of the real AG News sample."""
    from conftest import AG_NEWS_CSV

    if not AG_NEWS_CSV.exists():
        pytest.skip("AG News sample not available")
    return b"".join(AG_NEWS_CSV.read_bytes().splitlines(keepends=True)[:count + 1])


@pytest.mark.parametrize("number, content, flags", [
    (35, b"", []),
    (36, b"label,title,description\n", []),
    (37, b"a,b\n1,2\n3,4\n", []),
    (38, b"label,title,description\n1,t,d\n7,t,d\n2,x,y\n", []),
    (39, "label,title,description\n1,café,d\n".encode("latin-1"), []),
    (40, 80, ["--nodes", "4", "--batch-size", "17", "--skew", "0.5"]),
    (41, 6000, ["--nodes", "4", "--batch-size", "16", "--skew", "0.5", "--max-train-samples", "60"]),
])
def test_data_the_recipe_cannot_train_on(number, content, flags, tiny_model_dir, tmp_path, capsys):
    data_file = tmp_path / "data.csv"
    data_file.write_bytes(agnews_rows(content) if isinstance(content, int) else content)
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(data_file),
                                  "--output-dir", str(tmp_path / "run"), *flags])
    assert one_line_error(exc, capsys) == ROWS[number].expected(tmp_path)
    assert not (tmp_path / "run").exists()  # stopped before the run wrote anything


def test_row42_vision_data_dir_that_is_a_file(tmp_path, capsys):
    from lp_decentral_nlp.vision.recipe import main as vision_main

    (tmp_path / "data.csv").write_text("not images\n")
    with pytest.raises(SystemExit) as exc:
        vision_main("choco", ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data.csv"),
                              "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[42].expected(tmp_path)


def test_row61_vision_groups_for_a_norm_without_groups(tmp_path, capsys):
    from lp_decentral_nlp.vision.recipe import main as vision_main

    with pytest.raises(SystemExit) as exc:
        vision_main("choco", ["--norm", "batchnorm", "--groups", "4", "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[61].expected(tmp_path)


def test_row62_a_data_dir_with_test_csv_and_no_train_csv(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "test.csv").write_bytes(agnews_rows(40))
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(tmp_path),
                                  "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[62].expected(tmp_path)


def test_row75_drop_last_with_a_test_split_smaller_than_one_batch(tmp_path, tiny_model_dir, ag_news_csv, capsys):
    """The run trained, then failed with KeyError 'eval_accuracy' and a "running" results.json."""
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples",
                                  "160", "--max-eval-samples", "5", "--max-length", "32", "--dataloader_drop_last", "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[75].message
    assert not (tmp_path / "run").exists()


def test_row76_a_model_folder_without_tokenizer_files(tmp_path, tiny_model_dir, ag_news_csv, capsys):
    """transformers built a tokenizer of the 5 special tokens: every word became [UNK], and the run
    trained on nothing, exit 0."""
    model_dir = copied_model(tiny_model_dir, tmp_path / "model")
    for name in model_dir.iterdir():
        if name.name not in ("config.json", "model.safetensors"):
            name.unlink()
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples",
                                  "160", "--max-length", "32", "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[76].expected(model_dir)


@pytest.mark.parametrize("number", [93, 96])
def test_rows93_96_a_tokenizer_with_nothing_to_pad_with(number, tmp_path, tiny_model_dir, minilm_path, ag_news_csv,
                                                        capsys):
    """A tokenizer without a padding token pads with its end-of-sequence token; one without either
    (93), or of an encoder-decoder, whose classifier reads that token (96), is refused before the
    data is read."""
    from transformers import AutoTokenizer

    model_dir = (copied_model(tiny_model_dir, tmp_path / "model") if number == 93
                 else saved_encoder_decoder_model(tmp_path / "model", minilm_path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token, tokenizer.eos_token = None, None if number == 93 else "[SEP]"
    tokenizer.save_pretrained(model_dir)
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples",
                                  "160", "--max-length", "32", "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[number].expected(model_dir)
    assert not (tmp_path / "run").exists()


def test_a_validation_split_is_refused_alone_and_named_unused_beside_train(tmp_path, tiny_model_dir, capsys):
    """A folder of validation.csv alone was trained on; beside train.csv it was read, checked and
    never used, silently (the recipes evaluate on 'test', held out from train.csv)."""
    (tmp_path / "validation.csv").write_bytes(agnews_rows(40))
    flags = ["--model", str(tiny_model_dir), "--data-dir", str(tmp_path), "--max-length", "16", "--nodes", "2",
             "--batch-size", "4", "--max-steps", "1", "--output-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", flags)
    assert one_line_error(exc, capsys) == (
        f"argument --data-dir: data_dir {str(tmp_path)!r} holds validation.csv but no train.csv: validation.csv is the "
        "validation split beside a train.csv, and its rows are never trained on; add train.csv or rename validation.csv")
    (tmp_path / "train.csv").write_bytes(agnews_rows(80))
    (tmp_path / "test.csv").write_bytes(agnews_rows(16))  # without it, validation.csv is the test split
    main("ag_news", "choco", flags)
    assert (f"notice: {tmp_path}: the 'validation' (40 rows) split is not used: the recipes train on 'train' and "
            "evaluate on 'test'") in capsys.readouterr().err


def copied_model(tiny_model_dir, folder):
    shutil.copytree(tiny_model_dir, folder)
    return folder


def test_row48_max_length_beyond_the_models_positions(tmp_path, tiny_model_dir, ag_news_csv, capsys):
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-length",
                                  "200", "--max-train-samples", "160", "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[48].expected(tiny_model_dir)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("number, damage", [(49, "config.json"), (50, "model.safetensors")])
def test_rows49_50_a_damaged_model_folder(number, damage, tmp_path, tiny_model_dir, ag_news_csv, capsys):
    model_dir = copied_model(tiny_model_dir, tmp_path / "model")
    data = (model_dir / damage).read_bytes()
    (model_dir / damage).write_bytes(data[: len(data) // 2] if damage == "config.json" else data[:7])
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples",
                                  "160", "--max-length", "32", "--output-dir", str(tmp_path / "run")])
    assert ROWS[number].matches(one_line_error(exc, capsys), model_dir)


def test_row51_a_run_larger_than_the_memory(tmp_path, tiny_model_dir, ag_news_csv, capsys, monkeypatch):
    from lp_decentral_nlp.commands import run

    monkeypatch.setattr(run, "available_memory_mb", lambda device: 1.0)
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples",
                                  "160", "--max-length", "32", "--output-dir", str(tmp_path / "run")])
    message = one_line_error(exc, capsys)
    assert ROWS[51].matches(message)
    # the nodes step one after another: a node's gradients and activations are counted once, not per node
    need, nodes, stored, working, shared = (float(v.replace(",", "")) for v in re.match(
        r"the run needs at least ([\d,]+) MB \((\d+) nodes in this process x ([\d,]+) MB each of weights and "
        r"optimizer state; ([\d,]+) MB of one node's gradients and saved activations; ([\d,]+) MB", message).groups())
    assert nodes == 4 and abs(need - (nodes * stored + working + shared)) <= 3


def test_rows52_54_an_output_dir_that_cannot_be_created(tmp_path, capsys):
    (tmp_path / "afile").write_text("not a folder")
    assert cli_error(["--output-dir", str(tmp_path / "afile" / "run")], capsys) == ROWS[52].expected(tmp_path)
    assert cli_error(["--output-dir", ""], capsys) == ROWS[53].message
    if pathlib.Path("/proc/self").is_dir():  # Linux: /proc takes no new folders, even from root
        assert cli_error(["--output-dir", "/proc/run"], capsys) == ROWS[54].message
    # a folder that can be created is checked by creating it, and not left behind
    build_nlp_parser("ag_news", "choco").parse(["--output-dir", str(tmp_path / "new" / "run")])
    assert not (tmp_path / "new").exists()


def test_processes_of_one_launch_check_the_same_new_output_dir_at_once(tmp_path):
    """Every process of a distributed launch checks ``--output_dir`` before they meet: checking a
    folder that does not exist yet never creates it, so one process's check cannot make another
    see a folder that vanishes under it (or a folder it cannot create)."""
    from concurrent.futures import ThreadPoolExecutor

    from lp_decentral_nlp.commands import output_dir_problem

    target = tmp_path / "new" / "run"
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: output_dir_problem(str(target)), range(2000)))
    assert set(answers) == {None} and list(tmp_path.iterdir()) == []


def test_row64_more_accumulated_batches_than_a_shard_holds(tmp_path, tiny_model_dir, ag_news_csv, capsys):
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples",
                                  "160", "--max-length", "32", "--gradient_accumulation_steps", "4",
                                  "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[64].message
    assert not (tmp_path / "run").exists()


def test_row58_unusable_environment_variables(capsys, monkeypatch):
    assert cli_error([], capsys, {"OMP_NUM_THREADS": "abc"}, monkeypatch) == ROWS[58].message
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cli_error([], capsys, {"WORLD_SIZE": "4.0"}, monkeypatch) == (
        "environment variable WORLD_SIZE='4.0' must be a whole number >= 1")


def test_row82_a_rank_the_launch_cannot_have(capsys, monkeypatch):
    """RANK=5 of WORLD_SIZE=2 waited for peers until ddp_timeout (30 minutes); a stray LOCAL_RANK
    (no launcher) got torch's 'MASTER_ADDR expected', a stray RANK=1 ran without its summary line."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert cli_error(["--backend", "distributed", "--nodes", "2"], capsys, {"WORLD_SIZE": "2", "RANK": "5"},
                     monkeypatch) == ROWS[82].message
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "1")):
        assert cli_error([], capsys, {name: value}, monkeypatch) == (
            f"environment variable {name}={value} is set but WORLD_SIZE is not: a launcher sets both (torchrun "
            "--nproc_per_node N); unset it")
        monkeypatch.delenv(name)


def test_the_text_task_without_data_is_refused_in_the_same_words_by_the_library_and_the_recipes(capsys):
    """The text task has no data of its own: load_task, the recipes and finetune_single.py said so
    in three different wordings (two naming a shorter list of what is read)."""
    from lp_decentral_nlp.data import load_task

    with pytest.raises(ValueError) as err:
        load_task("text")
    with pytest.raises(SystemExit) as exc:
        build_nlp_parser("text", "choco").parse([])
    assert one_line_error(exc, capsys) == f"argument --data-dir: {str(err.value).removeprefix('data_dir: ')}"
    assert str(err.value).startswith("data_dir: the text task trains on your own data: give a CSV file")


def test_row59_no_data_dir_while_the_hub_is_offline(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from lp_decentral_nlp.commands import run

    monkeypatch.setattr(run, "hub_offline", lambda: True)
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--max-length", "32", "--output-dir",
                                  str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == ROWS[59].message


def test_a_tokenizer_larger_than_the_models_embeddings_is_refused(tmp_path, minilm_path, ag_news_csv, capsys):
    """A folder of a 1,000-token model beside the MiniLM's 30,522-token tokenizer trained until
    "IndexError: index out of range in self" in the first step, leaving a "running" results.json."""
    folder = tmp_path / "small-vocab"
    config = DistilBertConfig(vocab_size=1000, dim=32, n_layers=1, n_heads=2, hidden_dim=37, max_position_embeddings=64)
    DistilBertForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(folder)
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(folder), "--data-dir", str(ag_news_csv), "--max-length", "16",
                                  "--max-train-samples", "64", "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == (
        f"argument --model: {folder}: its tokenizer has 30522 tokens, and the model's input embeddings hold 1000 "
        "(config.vocab_size): ids from 1000 on would fail in the first step; save the model's own tokenizer into the "
        "folder, or resize the embeddings (model.resize_token_embeddings(len(tokenizer)); save_pretrained)")


def test_classes_only_the_test_split_holds_are_named(tmp_path, tiny_model_dir, capsys):
    """A test split with classes the training split lacks (a -1 of unlabelled rows saved as an integer,
    or a subset by --max-train-samples) gave an accuracy bounded below 1 without a word."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("text,label\n" + "".join(f"t{i},{'ab'[i % 2]}\n" for i in range(32)))
    (tmp_path / "data" / "test.csv").write_text("text,label\n" + "".join(f"u{i},{'abc'[i % 3]}\n" for i in range(9)))
    main("text", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"), "--max-length", "16",
                           "--nodes", "2", "--batch-size", "4", "--max-steps", "1", "--output-dir", str(tmp_path / "run")])
    assert (f"notice: {tmp_path / 'data'}: the test split has classes the training split lacks: 'c' (3 rows); no node "
            "learns them, so their rows count as errors") in capsys.readouterr().err


def test_a_run_that_fails_in_training_records_it(tmp_path, tiny_model_dir, ag_news_csv, monkeypatch, capsys):
    """Only NonFiniteError and GossipPeerError were recorded: any other failure left results.json
    "running" for good."""
    def failing_loss(*args, **kwargs):
        raise RuntimeError("the loss\nfailed")

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", failing_loss)
    with pytest.raises(RuntimeError, match="the loss"):
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-length", "16",
                                  "--max-train-samples", "64", "--nodes", "2", "--batch-size", "4", "--max-steps", "2",
                                  "--output-dir", str(tmp_path / "run")])
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["status"], results["step"], results["next"]) == ("failed", 0, "RuntimeError: the loss failed")


def test_a_full_disk_is_one_line_naming_the_output_folder(tmp_path, tiny_model_dir, ag_news_csv, monkeypatch, capsys):
    """The final save on a full disk was safetensors' traceback (os error 28)."""
    import errno

    from lp_decentral_nlp.trainer import DecentralizedTrainer

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DecentralizedTrainer, "save_model", full_disk)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-length", "16",
                                  "--max-train-samples", "64", "--nodes", "2", "--batch-size", "4", "--max-steps", "2",
                                  "--output-dir", str(out)])
    assert exc.value.code == 1 and capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f": error: argument --output-dir: no space left on the disk of {out} while writing the model at step 2: free "
        "space, then no checkpoint was written (--save-steps N writes them): run it again with --overwrite-output-dir")
    assert json.loads((out / "results.json").read_text())["status"] == "failed"


def test_an_absence_after_the_run_is_a_flag_error(tmp_path, tiny_model_dir, ag_news_csv, capsys):
    """--leave 1:100:200 on a 4-step run trained as if it was not given."""
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-length", "16",
                                  "--max-train-samples", "64", "--batch-size", "4", "--max-steps", "4", "--leave",
                                  "1:100:200", "--output-dir", str(tmp_path / "run")])
    assert one_line_error(exc, capsys) == (
        "argument --leave: node 1 away for iterations 100 to 199, and the run has 4 steps (iterations 0 to 3): it "
        "would change nothing; drop it or move it into the run")
    assert not (tmp_path / "run").exists()


def test_ctrl_c_in_a_resumed_run_that_saved_nothing_yet_advises_the_checkpoint_it_resumed(
        tmp_path, tiny_model_dir, ag_news_csv, monkeypatch, capsys):
    """It said "no checkpoint was written (--save-steps N writes them): run it again" though --save-steps
    was given and the checkpoint it had resumed from still continues it."""
    flags = ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-length", "16",
             "--max-train-samples", "64", "--nodes", "2", "--batch-size", "4"]
    main("ag_news", "choco", [*flags, "--max-steps", "2", "--save-steps", "2", "--output-dir", str(tmp_path / "first")])

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", ctrl_c)  # in the resumed run's first step
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", [*flags, "--max-steps", "3", "--save-steps", "10", "--output-dir",
                                  str(tmp_path / "second"), "--resume-from-checkpoint",
                                  str(tmp_path / "first" / "checkpoint-2")])
    assert exc.value.code == 130 and capsys.readouterr().err.rstrip().rsplit("\n", 1)[-1].endswith(
        f"resume from its last checkpoint with --resume-from-checkpoint {tmp_path / 'first' / 'checkpoint-2'}")


def test_ctrl_c_after_training_records_the_run_as_interrupted(tmp_path, tiny_model_dir, ag_news_csv, monkeypatch,
                                                              capsys):
    """Ctrl-C in the final evaluation left results.json "running" and said "the run did not finish: run
    it again", though training had ended (and a checkpoint at its last step resumes straight to it)."""
    from lp_decentral_nlp.commands import run

    def interrupted(trainer):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "final_evaluation", interrupted)
    with pytest.raises(SystemExit) as exc:
        main("ag_news", "choco", ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-length", "16",
                                  "--max-train-samples", "64", "--nodes", "2", "--batch-size", "4", "--max-steps", "2",
                                  "--save-steps", "2", "--output-dir", str(tmp_path / "run")])
    assert exc.value.code == 130
    assert capsys.readouterr().err.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[1] == (
        "interrupted after training ended at step 2, before its final evaluation and model were "
        f"written: resume from its last checkpoint with --resume-from-checkpoint {tmp_path / 'run' / 'checkpoint-2'}")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["status"], results["step"]) == ("interrupted", 2)
    assert results["next"].endswith(str(tmp_path / "run" / "checkpoint-2"))
