"""Gossip traffic of the cost report: bytes counted are the bytes the engine encodes."""
import json

import pytest
import torch
from torch import nn

from lp_decentral_nlp.cost import communication_cost, estimate_cost
from lp_decentral_nlp.cost.__main__ import main
from lp_decentral_nlp.gossip import SGP, ChocoSGD, DeepSqueeze, Identity, Quantize, TopK, make_topology


def test_bytes_match_a_real_multi_node_step():
    model = nn.Sequential(nn.Linear(3, 2))
    gossip = ChocoSGD(make_topology("ring", 4), TopK(0.5), gamma=0.5)
    cost = communication_cost(model, gossip)
    # TopK(0.5): weight 6 -> 3 kept (3 uint8 indices + 3 fp32 values), bias 2 -> 1 kept (1 + 4),
    # push-sum weight 4 bytes; an undirected ring node sends to 2 peers
    assert cost.message_bytes == 15 + 5 + 4 and cost.bytes_per_iteration == 2 * 24
    nodes = [[p.detach().clone() for p in model.parameters()] for _ in range(4)]
    stats = gossip.step(nodes)
    assert stats.message_bytes == cost.message_bytes
    assert stats.bytes_sent == [cost.bytes_per_iteration] * 4


def test_8bit_messages_are_about_4x_smaller():
    model = nn.Sequential(nn.Linear(64, 64))
    ring = make_topology("directed_ring", 4)
    fp32 = communication_cost(model, ChocoSGD(ring, Identity()))
    int8 = communication_cost(model, ChocoSGD(ring, Quantize(8)))
    assert fp32.message_bytes == (4096 + 64) * 4 + 4
    # one byte per value + fp32 scale and zero point per tensor + the push-sum weight
    assert int8.message_bytes == (4096 + 8) + (64 + 8) + 4
    assert communication_cost(model, SGP(ring)).message_bytes == fp32.message_bytes
    assert communication_cost(model, DeepSqueeze(ring, Identity())).message_bytes == fp32.message_bytes


@pytest.mark.parametrize(
    "topology, fanout",
    [(make_topology("exponential", 8), 1), (make_topology("torus", 16, rows=4, cols=4), 4)],
)
def test_per_epoch_follows_the_graph(topology, fanout):
    model = nn.Sequential(nn.Linear(3, 2))
    cost = communication_cost(model, DeepSqueeze(topology, Identity()), batch_size=32, samples_per_node=100)
    assert cost.iterations_per_epoch == 3  # floor(100 / 32): the loaders drop the last partial batch
    assert cost.bytes_per_iteration == fanout * cost.message_bytes
    assert cost.bytes_per_epoch == 3 * fanout * cost.message_bytes
    with pytest.raises(ValueError, match=r"^samples_per_node=20 holds no full batch of batch_size=32"):
        communication_cost(model, DeepSqueeze(topology, Identity()), batch_size=32, samples_per_node=20)


def test_model_untouched_and_report_carries_the_traffic():
    model = nn.Sequential(nn.Linear(8, 8))
    before = [p.detach().clone() for p in model.parameters()]
    gossip = ChocoSGD(make_topology("directed_ring", 4), TopK(0.25, value_bits=8), gamma=0.1)
    r = estimate_cost(model, (8,), 4, "int8", gossip=gossip, samples_per_node=10)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert r.communication.iterations_per_epoch == 2 and r.communication.compressor.startswith("TopK")
    assert r.to_dict()["communication"]["message_bytes"] == r.communication.message_bytes
    assert "gossip MB/epoch" in str(r)


def test_bad_arguments():
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(TypeError, match="gossip must be"):
        communication_cost(model, Identity())
    with pytest.raises(ValueError, match="give both"):
        communication_cost(model, SGP(make_topology("ring", 4)), batch_size=4)


def test_cli_vision(capsys):
    pytest.importorskip("lp_decentral_nlp.vision")
    assert main(["--arch", "resnet20", "--batch-size", "2", "--train-samples", "64", "--compression", "99"]) == 0
    out = capsys.readouterr().out
    for row in ("train energy (mJ)", "train memory (MB)", "gossip bytes/iteration", "gossip MB/epoch", "ratio"):
        assert row in out
    assert "ops without a cost rule" not in out


def test_cli_prices_qsgd_at_its_levels_and_names_the_messages(capsys):
    """QSGD was priced at 16 levels only (no --qsgd-levels), and the header named no compressor."""
    assert main(["--arch", "resnet20", "--batch-size", "2", "--compressor", "qsgd", "--qsgd-levels", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("messages QSGD(levels=1, scaled=True, bucket_size=1024) (fp32), "
                           "QSGD(levels=1, scaled=True, bucket_size=1024) (8-bit)")
    assert main(["--arch", "resnet20", "--batch-size", "2", "--compression", "99"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("messages TopK(keep=0.01, value_bits=None) (fp32), "
                                                            "TopK(keep=0.01, value_bits=8) (8-bit)")


def test_cli_output_writes_both_reports_as_printed(capsys, tmp_path):
    pytest.importorskip("lp_decentral_nlp.vision")
    path = tmp_path / "out" / "cost.json"  # a folder that does not exist yet is made
    assert main(["--arch", "resnet20", "--batch-size", "2", "--compression", "99", "--output", str(path)]) == 0
    out = capsys.readouterr().out
    record = json.loads(path.read_text())
    assert record["settings"]["arch"] == "resnet20" and record["settings"]["train_samples"] == 50_000
    assert set(record["reports"]) == {"fp32", "int8"}
    for precision, report in record["reports"].items():
        assert report["precision"] == precision and report["convention"] == "ours" and report["layers"]
        assert report["communication"]["num_nodes"] == 4
    reports = record["reports"]
    assert reports["int8"]["communication"]["message_bytes"] < reports["fp32"]["communication"]["message_bytes"]
    printed = float(out.split("weight-gradient GEMM priced int8 as well")[1].split(": ")[1].split(" mJ")[0])
    assert record["int8_train_energy_mj_int8_weight_gradient"] == pytest.approx(printed, rel=1e-3)
    assert f"wrote {path}" in out


def test_cli_output_refused_before_any_work(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["--arch", "resnet20", "--output", str(tmp_path)])
    assert exc.value.code == 2
    assert f"argument --output: cannot write {tmp_path}: a folder" in capsys.readouterr().err


def test_cli_paper_convention(capsys):
    pytest.importorskip("lp_decentral_nlp.vision")
    assert main(["--arch", "resnet20", "--batch-size", "2", "--convention", "paper"]) == 0
    out = capsys.readouterr().out
    assert "convention paper" in out and "inference memory (MiB)" in out
    assert "weight-gradient GEMM priced int8 as well" not in out  # an ours-only figure


def test_cli_hf_model(capsys, minilm_path):
    assert main(["--model", str(minilm_path), "--seq-len", "16", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "forward MACs in int8" in out and "optimizer=adam" in out


@pytest.mark.parametrize(
    "argv, message",
    [(["--compression", "100"], "argument --compression: compression must be a percentage in [0, 100)"),
     (["--train-samples", "2"], "error: argument --train-samples: 2 samples must give each of --num-nodes (4) at "
                                "least one --batch-size (2) batch"),
     (["--convention", "table10"], "argument --convention: invalid choice: 'table10'")],
)
def test_cli_rejects_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["--arch", "resnet20", "--batch-size", "2", *argv])
    assert message in capsys.readouterr().err


def test_communication_cost_names_a_model_that_is_no_module():
    from lp_decentral_nlp.gossip import SGP, make_topology

    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module, got str$"):
        communication_cost("x", SGP(make_topology("ring", 3)))


def test_only_the_trainable_parameters_are_priced_as_gossip():
    """The traffic counted every parameter; the trainer gossips the trained ones only."""
    from lp_decentral_nlp.gossip import SGP, make_topology

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    gossip = SGP(make_topology("directed_ring", 4))
    whole = communication_cost(model, gossip).bytes_per_iteration
    model[0].requires_grad_(False)
    head = communication_cost(model, gossip).bytes_per_iteration
    assert head == whole * (64 * 2 + 2 + 1) // (64 * 64 + 64 + 64 * 2 + 2 + 1)  # fp32 entries and the weight
    with pytest.raises(ValueError, match=r"^model has no trainable parameter"):
        communication_cost(model.requires_grad_(False), gossip)


def test_cli_prices_a_model_saved_in_bfloat16_as_the_recipes_train_it(capsys, tmp_path):
    """transformers builds a model in its config's saved dtype: a bfloat16 checkpoint was refused
    as an error of --batch-size; the recipes train it in float32."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertForSequenceClassification(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    path = tmp_path / "cost.json"
    assert main(["--model", str(tmp_path / "bf16"), "--seq-len", "8", "--batch-size", "2", "--output", str(path)]) == 0
    reports = json.loads(path.read_text())["reports"]
    assert reports["fp32"]["train_energy_mj"] > reports["int8"]["train_energy_mj"] > 0
    assert (f"notice: {tmp_path / 'bf16'}: saved in bfloat16, priced in float32 (training keeps float32 master "
            "weights)") in capsys.readouterr().err.splitlines()


def test_cli_prices_a_saved_classifier_with_its_own_labels(capsys, tmp_path):
    """--model priced every classifier with a 4-label head: a saved 3-label model's head was
    rebuilt with 4 outputs unless --num-classes was given."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, id2label={0: "neg", 1: "neu", 2: "pos"})
    BertForSequenceClassification(config).save_pretrained(tmp_path / "sentiment")

    def head_macs(argv):
        path = tmp_path / "cost.json"
        assert main(["--model", str(tmp_path / "sentiment"), "--seq-len", "8", "--batch-size", "2",
                     "--output", str(path), *argv]) == 0
        record = json.loads(path.read_text())
        layers = {row["name"]: row for row in record["reports"]["fp32"]["layers"]}
        return record["settings"]["num_classes"], layers["classifier"]["forward_macs"]

    assert head_macs([]) == (3, 2 * 16 * 3)
    assert head_macs(["--num-classes", "5"]) == (5, 2 * 16 * 5)  # an explicit flag is honoured
    capsys.readouterr()


def test_cli_prices_activation_checkpointing(capsys, tmp_path, minilm_path):
    """The API priced activation checkpointing (estimate_cost(activation_checkpointing=True)); the
    command line had no way to ask for it."""
    args = ["--model", str(minilm_path), "--seq-len", "64", "--batch-size", "8"]
    saved = {}
    for flags in ([], ["--activation-checkpointing"]):
        path = tmp_path / f"{len(flags)}.json"
        assert main([*args, *flags, "--output", str(path)]) == 0
        saved[bool(flags)] = json.loads(path.read_text())["reports"]["int8"]["memory_breakdown_mb"]["train"]
    assert saved[True]["activations"] < saved[False]["activations"] / 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--arch", "resnet20", "--activation-checkpointing"])
    assert "argument --activation-checkpointing: not a setting of --arch models: drop it" in capsys.readouterr().err


def test_cli_takes_the_recipes_names_of_the_same_settings(capsys, tmp_path):
    """--nodes, --num_nodes and --comp were unrecognized (the recipes' names of --num-nodes and
    --compression), and the sequence length was --seq-len alone (the recipes' --max-length)."""
    pytest.importorskip("lp_decentral_nlp.vision")
    records = []
    for flags in (["--num-nodes", "8", "--compression", "99", "--batch-size", "2"],
                  ["--nodes", "8", "--comp", "99", "--batch_size", "2"], ["--num_nodes", "8", "--comp", "99",
                                                                          "--batch-size", "2"]):
        path = tmp_path / f"{len(records)}.json"
        assert main(["--arch", "resnet20", *flags, "--output", str(path)]) == 0
        records.append({k: v for k, v in json.loads(path.read_text())["settings"].items() if k != "output"})
    assert records[0] == records[1] == records[2] and records[0]["num_nodes"] == 8 and records[0]["compression"] == 99
    capsys.readouterr()


def test_cli_output_after_equals_reads_tilde_as_home(capsys, tmp_path, monkeypatch):
    """--output=~/t.json (the shell leaves '~' after '=') printed 'wrote ~/t.json' and wrote ./~/t.json."""
    pytest.importorskip("lp_decentral_nlp.vision")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["--arch", "resnet20", "--batch-size", "2", "--output=~/t.json"]) == 0
    assert (tmp_path / "home" / "t.json").is_file() and not (tmp_path / "~").exists()
    assert f"wrote {tmp_path / 'home' / 't.json'}" in capsys.readouterr().out
