"""Every row of the README's bad-input table ("Reliability"): the wrong input and the exact message the
user gets. Command-line rows exit with status 2 and one line on stderr (``<prog>: error: <message>``);
library rows raise ValueError/TypeError with the message."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn
from helpers import agnews_sample
from transformers import DistilBertConfig, DistilBertForSequenceClassification, TrainingArguments

from lp_decentral_nlp.commands import build_nlp_parser
from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_model(num_labels=4, dim=32):
    torch.manual_seed(0)
    return DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=30522, dim=dim, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=64, num_labels=num_labels))


def targs(out, **kw):
    base = dict(output_dir=str(out), num_nodes=4, per_device_train_batch_size=8, max_steps=2, save_strategy="no",
                use_cpu=True, disable_tqdm=True, report_to="none", seed=0)
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
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.split(": error: ", 1)[1].rstrip("\n")


# Rows 1-17: the command line (every recipe, NLP and vision, shares these flags). A value the
# dataclasses refuse is their message behind the flag the user typed.
CLI_ROWS = [
    ("01-nodes-zero", ["--nodes", "0"], "argument --nodes: num_nodes must be an integer in [1, 65536], got 0"),
    ("02-skew-out-of-range", ["--skew", "1.5"], "argument --skew: skew must be a number >= 0 and <= 1, got 1.5"),
    ("03-comp-100", ["--comp", "100"],
     "argument --comp: compression must be a percentage with 0 <= compression < 100, got 100.0"),
    ("04-unknown-topology", ["--topology", "star"],
     "argument --topology: topology must be one of ('directed_ring', 'ring', 'torus', 'exponential', 'complete'), "
     "got 'star'"),
    ("05-not-a-number", ["--lr", "abc"], "argument --lr/--learning_rate/--learning-rate: expected a number, got 'abc'"),
    ("06-missing-data-dir", ["--data-dir", "/no/such/dir"],
     "argument --data-dir: data_dir: path '/no/such/dir' does not exist"),
    ("07-negative-seed", ["--seed", "-1"], "argument --seed: must be in [0, 4294967295], got -1"),
    ("08-drop-prob-1", ["--drop-prob", "1"], "argument --drop-prob: drop_prob must be a probability in [0, 1), got 1.0"),
    ("09-straggler-without-seconds", ["--straggler", "2"],
     "argument --straggler: stragglers: expected NODE:SECONDS (e.g. 2:0.5), got '2'"),
    ("10-straggler-node-out-of-range", ["--straggler", "7:0.5"],
     "argument --straggler: stragglers: node 7 does not exist (nodes are 0..3)"),
    ("11-leave-ends-before-it-starts", ["--leave", "1:50:20"],
     "argument --leave: absences: expected NODE:START:END with NODE >= 0 and 0 <= START < END, got '1:50:20'"),
    ("12-torus-rows-do-not-divide-nodes", ["--topology", "torus", "--torus-rows", "3"],
     "argument --torus-rows: torus_rows must divide num_nodes=4 and needs topology='torus', got torus_rows=3 with "
     "topology='torus'"),
    ("13-torus-rows-without-torus", ["--torus-rows", "2"],
     "argument --torus-rows: torus_rows must divide num_nodes=4 and needs topology='torus', got torus_rows=2 with "
     "topology='directed_ring'"),
    ("14-choco-on-a-time-varying-graph", ["--topology", "exponential"],
     "argument --topology: topology='exponential' changes every step, but algorithm='choco' needs a static graph: use "
     "algorithm='deepsqueeze' (or 'dpsgd' with low_precision=False) or a static topology"),
    ("15-save-total-limit-without-save-steps", ["--save-total-limit", "2"],
     "argument --save-total-limit: needs --save_steps (no checkpoints are written without it)"),
    ("16-missing-checkpoint", ["--resume-from-checkpoint", "/no/such/run"],
     "argument --resume-from-checkpoint: path '/no/such/run' does not exist"),
    ("17-unknown-flag", ["--frobnicate"], "unrecognized arguments: --frobnicate"),
]


@pytest.mark.parametrize("argv, expected", [r[1:] for r in CLI_ROWS], ids=[r[0] for r in CLI_ROWS])
def test_cli_row(argv, expected, capsys):
    assert cli_error(argv, capsys) == expected


def test_row18_distributed_backend_without_a_launcher(capsys, monkeypatch):
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert cli_error(["--backend", "distributed"], capsys) == (
        "argument --backend: 'distributed' runs one process per node, but WORLD_SIZE is not set: launch with "
        "torchrun --nproc_per_node 4 (or use --backend simulated)")


@pytest.mark.distributed
def test_row19_torchrun_world_size_differs_from_nodes():
    """A real 2-process torchrun of a recipe asked for 4 nodes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "recipes" / "agnews_choco.py"), "--backend", "distributed", "--nodes", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    line = ("agnews_choco.py: error: argument --nodes: 4 nodes, but the launcher started 2 processes (WORLD_SIZE=2): "
            "launch one process per node (torchrun --nproc_per_node 4)")
    assert proc.stderr.count(line) == 2, proc.stderr[-3000:]  # once per rank
    assert "lp_decentral_nlp" not in proc.stderr  # no traceback through our code (torchrun prints its own)


def test_cli_reports_the_training_arguments_own_cross_checks_as_a_flag_error(capsys):
    """A combination only DecentralizedTrainingArguments rejects (8-bit D-PSGD sends Choco messages,
    which need a static graph) is one parser error line, not a traceback from inside the run."""
    assert cli_error(["--topology", "exponential"], capsys, algorithm="dpsgd") == (
        "argument --topology: topology='exponential' changes every step, but algorithm='dpsgd' with low_precision (8-bit Choco "
        "messages) needs a static graph: use algorithm='deepsqueeze' (or 'dpsgd' with low_precision=False) or a "
        "static topology")
    build_nlp_parser("ag_news", "dpsgd").parse(["--topology", "exponential", "--full-precision"])


def test_row20_straggler_slower_than_the_gossip_timeout(capsys, monkeypatch):
    assert cli_error(["--backend", "distributed", "--straggler", "1:400"], capsys, {"WORLD_SIZE": "4"}, monkeypatch) == (
        "argument --straggler: stragglers: node 1 sleeps 400 s per step, not less than gossip_timeout=300 s: its peers "
        "would give up on it")


def test_row21_output_dir_without_a_checkpoint(capsys, tmp_path):
    assert cli_error(["--resume-from-checkpoint", str(tmp_path)], capsys) == (
        f"argument --resume-from-checkpoint: no complete checkpoint-<step> directory in {tmp_path}")


def test_row22_incomplete_checkpoint(capsys, run_dir, tmp_path):
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(run_dir / "checkpoint-2", broken)
    (broken / "node-3.safetensors").unlink()
    assert cli_error(["--resume-from-checkpoint", str(broken)], capsys) == (
        f"argument --resume-from-checkpoint: {broken} is incomplete, it lacks node-3.safetensors")


def test_row23_resume_with_another_number_of_nodes(capsys, run_dir):
    assert cli_error(["--resume-from-checkpoint", str(run_dir), "--batch-size", "8", "--nodes", "2"], capsys) == (
        f"argument --resume-from-checkpoint: cannot resume from {run_dir / 'checkpoint-2'}: it was written with "
        "num_nodes=4 (this run: 2); resume with the arguments of the interrupted run")


# Rows 24-33: the library (DecentralizedTrainingArguments / DecentralizedTrainer).

def test_row24_dataset_without_label_column(tmp_path, data):
    train = data["train"].rename_column("label", "target")
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=0.5), train_dataset=train)
    assert str(err.value) == ("skew=0.5 needs a column of class ids to skew the shards on, and train_dataset has no "
                              "'label' or 'labels' column with one class id per sample (columns: ['target', "
                              "'input_ids', 'token_type_ids', 'attention_mask']): name one with shard_column, or use "
                              "skew=0")


def test_row25_labels_the_model_cannot_predict(tmp_path, data):
    with pytest.raises(ValueError) as err:
        DecentralizedTrainer(model=tiny_model(num_labels=2), args=targs(tmp_path), train_dataset=data["train"])
    assert str(err.value) == "train_dataset: labels must be class ids 0..1 (the model has num_labels=2), found [2, 3]"


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
    assert str(err.value).startswith("quantize_model: no layer to quantize (supported types: Linear, Conv1D, Conv2d")


def test_row27_torus_rows_that_do_not_divide_the_nodes(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, topology="torus", torus_rows=3)
    assert str(err.value) == ("torus_rows must divide num_nodes=4 and needs topology='torus', got torus_rows=3 with "
                              "topology='torus'")


def test_row28_choco_on_the_exponential_graph(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, algorithm="choco", topology="exponential")
    assert str(err.value) == ("topology='exponential' changes every step, but algorithm='choco' needs a static graph: "
                              "use algorithm='deepsqueeze' (or 'dpsgd' with low_precision=False) or a static topology")


def test_row29_batch_larger_than_a_shard(tmp_path, data):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, per_device_train_batch_size=64),
                                   train_dataset=data["train"])
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert str(err.value) == ("per_device_train_batch_size=64 exceeds the smallest shard (24 samples): lower the batch "
                              "size or the number of nodes")


def test_row30_plain_training_arguments(tmp_path, data):
    with pytest.raises(TypeError) as err:
        DecentralizedTrainer(model=tiny_model(), args=TrainingArguments(output_dir=str(tmp_path)),
                             train_dataset=data["train"])
    assert str(err.value) == "args must be DecentralizedTrainingArguments, got TrainingArguments"


def test_row31_fault_plan_naming_a_missing_node(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, stragglers=["9:1.0"])
    assert str(err.value) == "stragglers: node 9 does not exist (nodes are 0..3)"


def test_row32_resume_with_another_algorithm(tmp_path, data, run_dir):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, algorithm="deepsqueeze"),
                                   train_dataset=data["train"])
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(run_dir))
    assert str(err.value) == (
        f"resume_from_checkpoint: cannot resume from {run_dir / 'checkpoint-2'}: it was written with "
        "algorithm='choco' (this run: 'deepsqueeze'); resume with the arguments of the interrupted run")


def test_row33_resume_into_another_model(tmp_path, data, run_dir):
    trainer = DecentralizedTrainer(model=tiny_model(dim=16), args=targs(tmp_path), train_dataset=data["train"])
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(run_dir))
    message = str(err.value)
    assert message.startswith(f"{run_dir / 'checkpoint-2' / 'node-0.safetensors'} does not fit this model: ")
    assert "size mismatch for distilbert.embeddings.word_embeddings.weight" in message


def test_row34_gossip_timeout_zero(tmp_path):
    with pytest.raises(ValueError) as err:
        targs(tmp_path, gossip_timeout=0)
    assert str(err.value) == "gossip_timeout must be a positive number of seconds, got 0"
