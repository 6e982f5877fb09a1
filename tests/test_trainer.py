"""DecentralizedTrainer: nodes are independent until gossip, one step matches the SPEC by hand,
8-bit payloads, evaluation/saving, argument errors."""
import copy
import dataclasses
import pydoc

import pytest
import torch
from datasets import Value
from helpers import agnews_sample
from helpers import tiny_distilbert as tiny_model
from transformers import AutoModelForSequenceClassification

from lp_decentral_nlp import load_quantized
from lp_decentral_nlp.gossip import make_topology
from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments, MetricsCSVCallback


@pytest.fixture(scope="module")
def agnews_small(tokenizer):
    return agnews_sample(tokenizer, max_length=24, max_train_samples=256, max_eval_samples=64)


def targs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), num_nodes=4, per_device_train_batch_size=8, per_device_eval_batch_size=32,
                learning_rate=1e-3, max_steps=3, logging_steps=1, save_strategy="no", use_cpu=True,
                disable_tqdm=True, seed=0)
    base.update(kw)
    return DecentralizedTrainingArguments(**base)


def test_one_step_equals_local_adam_then_push_sum_mixing(tmp_path, agnews_small, tokenizer):
    """SPEC 2 with gamma=1 and no compression: x_i = sum_j W[i,j] * AdamStep_j(x0) (weights stay 1)."""
    model = tiny_model()
    initial = copy.deepcopy(model)
    args = targs(tmp_path, algorithm="dpsgd", low_precision=False, max_steps=1, weight_decay=0.0)
    trainer = DecentralizedTrainer(model=model, args=args, train_dataset=agnews_small["train"], processing_class=tokenizer)
    # the batch each node will see first, drawn from the trainer's own loaders
    first_batches = [next(iter(loader)) for loader in trainer.node_dataloaders()]
    trainer.train()

    stepped = []
    for batch in first_batches:
        local = copy.deepcopy(initial)
        opt = torch.optim.AdamW(local.parameters(), lr=1e-3, weight_decay=0.0)
        local(**batch).loss.backward()
        opt.step()
        stepped.append([p.detach() for p in local.parameters()])
    W = make_topology("directed_ring", num_nodes=4).mixing_matrix(step=0).double()
    for i, node in enumerate(trainer.nodes):
        for k, p in enumerate(node.parameters()):
            expected = sum(W[i, j] * stepped[j][k].double() for j in range(4))
            torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_nodes_keep_separate_optimizers_and_shards(tmp_path, agnews_small, tokenizer):
    args = targs(tmp_path, skew=1.0, low_precision=False)
    trainer = DecentralizedTrainer(model=tiny_model(), args=args, train_dataset=agnews_small["train"], processing_class=tokenizer)
    loaders = trainer.node_dataloaders()
    shard_labels = [set(int(l) for b in loader for l in b["labels"]) for loader in loaders]
    assert all(len(s) <= 2 for s in shard_labels)  # skew 1: each node sees one or two classes only
    param_ids = [{id(p) for p in node.parameters()} for node in trainer.nodes]
    assert all(not (param_ids[i] & param_ids[j]) for i in range(4) for j in range(i + 1, 4))


def test_low_precision_train_eval_save_reload(tmp_path, agnews_small, tokenizer):
    csv_path = tmp_path / "metrics.csv"
    args = targs(tmp_path, algorithm="choco", compression=99.0, max_steps=4)
    trainer = DecentralizedTrainer(model=tiny_model(), args=args, train_dataset=agnews_small["train"],
                                   eval_dataset=agnews_small["test"], processing_class=tokenizer,
                                   callbacks=[MetricsCSVCallback(str(csv_path))])
    assert args.gamma == 0.05  # default_consensus_lr: 5 x the kept 1% for Choco
    trainer.train()
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert all(0.0 <= metrics[f"eval_accuracy_node_{i}"] <= 1.0 for i in range(4))
    assert metrics["eval_consensus_distance"] > 0
    assert all(metrics[f"eval_bytes_sent_node_{i}"] > 0 for i in range(4))
    header = csv_path.read_text().splitlines()[0].split(",")
    assert {"step", "loss", "loss_node_0", "bytes_sent_node_3", "consensus_distance"} <= set(header)

    trainer.save_model(str(tmp_path / "model"))
    reloaded = load_quantized(tmp_path / "model", auto_class=AutoModelForSequenceClassification).eval()
    batch = next(iter(trainer.get_eval_dataloader()))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, trainer.model(**batch).logits)
    saved_args = torch.load(tmp_path / "model" / "training_args.bin", weights_only=False)  # as Trainer saves them
    assert saved_args.to_dict() == args.to_dict()


def test_8bit_payload_is_a_quarter_of_fp32(tmp_path, agnews_small, tokenizer):
    sent = {}
    for low in (False, True):
        args = targs(tmp_path, algorithm="choco", low_precision=low, max_steps=1)
        trainer = DecentralizedTrainer(model=tiny_model(), args=args, train_dataset=agnews_small["train"],
                                       processing_class=tokenizer)
        trainer.train()
        sent[low] = int(trainer.bytes_sent.sum())
    assert 0.24 < sent[True] / sent[False] < 0.27  # 8-bit values + one scale/zero-point per tensor


def test_averaged_model_is_the_mean_of_the_nodes(tmp_path, agnews_small, tokenizer):
    args = targs(tmp_path, algorithm="choco", compression=90.0, low_precision=False, max_steps=2)
    trainer = DecentralizedTrainer(model=tiny_model(), args=args, train_dataset=agnews_small["train"], processing_class=tokenizer)
    trainer.train()
    for k, p in enumerate(trainer.model.parameters()):
        mean = torch.stack([list(node.parameters())[k].detach() for node in trainer.nodes]).mean(0)
        torch.testing.assert_close(p.detach(), mean)
    dist = trainer.consensus_distance()
    expected = sum(((list(node.parameters())[k].detach() - p.detach()) ** 2).sum().item()
                   for node in trainer.nodes for k, p in enumerate(trainer.model.parameters())) / 4
    assert dist == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("algorithm, qgm", [("deepsqueeze", False), ("choco", True)])
def test_frozen_parameters_are_not_gossiped_and_stay_as_they_were(tmp_path, agnews_small, tokenizer, algorithm, qgm):
    """Every parameter was gossiped: with random-k messages a frozen base (a LoRA model's, a frozen
    encoder) drifted on every node (a LayerNorm weight of 1.0 ended in [-0.44, 2.44] after 20
    Deep-Squeeze steps), QuasiGlobalAdam decayed it, and bytes_sent counted the whole model."""
    model = tiny_model()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("classifier", "pre_classifier")))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    args = targs(tmp_path, algorithm=algorithm, compression=90.0, compressor="randomk", low_precision=False,
                 max_steps=4, qgm=qgm, weight_decay=0.1 if qgm else 0.0, optim="adamw_torch")
    trainer = DecentralizedTrainer(model=model, args=args, train_dataset=agnews_small["train"],
                                   processing_class=tokenizer)
    trainer.train()
    for net in (trainer.model, *trainer.nodes):
        assert all(torch.equal(p, frozen[name]) for name, p in net.named_parameters() if name in frozen)
    assert [p.numel() for p in trainer.node_params[0]] == [p.numel() for p in model.parameters() if p.requires_grad]
    per_message = int(trainer.bytes_sent[0]) / 4  # 4 steps, one out-neighbour on the directed ring
    assert per_message < 2 * trainable_numel * 4  # the trained parameters' share, not the whole model's
    moved = [not torch.equal(p, q) for p, q in zip(trainer.nodes[0].parameters(), trainer.nodes[1].parameters())
             if p.requires_grad]
    assert any(moved)


def test_a_model_without_trainable_parameters_is_refused(tmp_path, agnews_small, tokenizer):
    model = tiny_model().requires_grad_(False)
    with pytest.raises(ValueError, match=r"^model has no trainable parameter \(requires_grad=True\): nothing to "
                                         r"train or gossip$"):
        DecentralizedTrainer(model=model, args=targs(tmp_path), train_dataset=agnews_small["train"],
                             processing_class=tokenizer)


def test_the_cost_report_names_a_bad_input_shape(tmp_path, agnews_small, tokenizer):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=agnews_small["train"],
                                   processing_class=tokenizer)
    assert trainer.cost_report((16,)).precision == "int8"
    with pytest.raises(ValueError, match=r"^input_shape must be a non-empty tuple of positive ints, got 16$"):
        trainer.cost_report(16)  # was "TypeError: 'int' object is not iterable"


@pytest.mark.parametrize("kwargs, word", [
    (dict(num_nodes=0), "num_nodes"), (dict(compression=100.0), "compression"), (dict(skew=1.5), "skew"),
    (dict(algorithm="gossip"), "algorithm"), (dict(backend="mpi"), "backend"), (dict(topology="star"), "topology"),
    (dict(consensus_lr=0.0), "consensus_lr"), (dict(compressor="sign"), "compressor"),
    (dict(qsgd_levels=0), "qsgd_levels"), (dict(algorithm="dpsgd", compression=50.0), "compression > 0"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, word):
    with pytest.raises(ValueError, match=word):
        targs(tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(compression=0.0, low_precision=False), None),
    (dict(compression=0.0), "Quantize(bits=8)"),
    (dict(compression=99.0), "TopK(keep=0.01, value_bits=8)"),
    (dict(compression=90.0, compressor="randomk", low_precision=False), "RandomK(keep=0.1"),
    (dict(compressor="qsgd", qsgd_levels=4), "QSGD(levels=4, scaled=True, bucket_size=1024)"),
])
def test_compressor_follows_arguments(tmp_path, kwargs, expected):
    from lp_decentral_nlp.gossip.factory import build_compressor

    compressor = build_compressor(targs(tmp_path, **kwargs).gossip_config)
    assert (compressor is None) if expected is None else repr(compressor).startswith(expected)


def test_arguments_repr_hides_the_hub_token_and_help_documents_the_decentralized_fields(tmp_path):
    """A notebook cell ending in ``args`` printed hub_token in clear (the dataclass's own repr);
    ``help(DecentralizedTrainingArguments)`` named none of its fields' meanings."""
    args = targs(tmp_path, hub_token="hf_secret123")
    assert "hf_secret123" not in repr(args) and "hub_token=<HUB_TOKEN>" in repr(args)
    assert "num_nodes=4,\n" in repr(args)  # TrainingArguments' layout: one field a line
    from lp_decentral_nlp.commands import NLPArguments, RunArguments
    from lp_decentral_nlp.vision.recipe import VisionArguments

    for cls in (DecentralizedTrainingArguments, RunArguments, NLPArguments, VisionArguments):
        shown = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        for name in (f.name for f in dataclasses.fields(cls) if f.init and (
                cls is not DecentralizedTrainingArguments or f.name in cls.__annotations__)):
            assert f"    {name} (" in shown, (cls, name)
    doc = pydoc.render_doc(DecentralizedTrainingArguments, renderer=pydoc.plaintext)
    assert "num_nodes (int, default 4): Number of peer nodes n." in doc
    assert "keep (100 - compression)% of each" in doc  # argparse's %% unescaped


@pytest.mark.parametrize("variable, flag", [("ACCELERATE_USE_FSDP", "--use_fsdp"),
                                            ("ACCELERATE_USE_DEEPSPEED", "--use_deepspeed"),
                                            ("ACCELERATE_USE_MEGATRON_LM", "--use_megatron_lm")])
def test_a_sharding_engine_turned_on_by_the_launcher_is_refused_as_its_field_is(variable, flag, tmp_path, monkeypatch):
    """accelerate launch --use_fsdp failed inside accelerate's setup ("no available devices"), or with a
    meta-tensor error on one rank that the others reported as a dead peer."""
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ValueError, match=rf"^{variable}=true \(accelerate's switch, which accelerate launch {flag}, its "
                                         r"config's distributed_type or a plugin made in this process sets\) shards"):
        targs(tmp_path)
    monkeypatch.setenv(variable, "false")
    targs(tmp_path)


def test_distributed_backend_without_process_group_is_an_error(tmp_path, agnews_small):
    with pytest.raises(RuntimeError, match="torch.distributed"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, backend="distributed"),
                             train_dataset=agnews_small["train"])


def test_skewed_shards_need_a_class_column_which_shard_column_names(tmp_path, agnews_small):
    data = agnews_small["train"].rename_column("label", "target")
    with pytest.raises(ValueError, match=r"skew=0.5 needs a column of class ids.*shard_column"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=0.5), train_dataset=data)
    floats = agnews_small["train"].cast_column("label", Value("float32"))  # a regression target, not class ids
    with pytest.raises(ValueError, match=r"skew=0.5 needs a column of class ids to skew the shards on, and its 'label' "
                                         r"column holds 2.0 \(float\), not one integer class id per sample"):
        DecentralizedTrainer(model=tiny_model(num_labels=1), args=targs(tmp_path, skew=0.5), train_dataset=floats)
    with pytest.raises(ValueError, match="shard_column='topic' is not a column"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=0.5, shard_column="topic"), train_dataset=data)
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=1.0, shard_column="target",
                                                                  remove_unused_columns=False), train_dataset=data)
    shard_classes = [{data[j]["target"] for j in loader.dataset.indices} for loader in trainer.node_dataloaders()]
    assert all(len(c) <= 2 for c in shard_classes)  # skewed on the named column
    # a column of category names skews as its ids in sorted order would (it was refused as "not class ids")
    names = data.map(lambda row: {"topic": ["World", "Sports", "Business", "Sci/Tech"][row["target"]]})
    by_name = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=1.0, shard_column="topic"),
                                   train_dataset=names)
    assert [loader.dataset.indices for loader in by_name.node_dataloaders()] == \
        [loader.dataset.indices for loader in DecentralizedTrainer(
            model=tiny_model(), args=targs(tmp_path, skew=1.0, shard_column="target", remove_unused_columns=False),
            train_dataset=names.map(lambda row: {"target": ["Business", "Sci/Tech", "Sports", "World"].index(
                row["topic"])})).node_dataloaders()]
    with pytest.raises(ValueError, match=r"^train_dataset: shard_column 'topic' must be integer class ids >= 0 or "
                                         r"category names \(strings\), found \[-1\]$"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=1.0, shard_column="topic"),
                             train_dataset=data.map(lambda row: {"topic": -1}))
    # skew 0 needs no class column: random shards of every sample
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=data)
    assert sorted(j for loader in trainer.node_dataloaders() for j in loader.dataset.indices) == list(range(len(data)))


def test_averaged_8bit_model_evaluates_with_its_running_ranges(tmp_path, agnews_small, tokenizer):
    """The averaged model carries the nodes' activation-range counters, so in eval a sample's
    logits do not depend on the other samples of its batch (the running range is used)."""
    args = targs(tmp_path, algorithm="choco", max_steps=2)
    trainer = DecentralizedTrainer(model=tiny_model(), args=args, train_dataset=agnews_small["train"],
                                   eval_dataset=agnews_small["test"], processing_class=tokenizer)
    trainer.train()
    counts = [b for name, b in trainer.model.named_buffers() if name.endswith("act_num_batches")]
    assert counts and all(int(c) == 2 for c in counts)
    batch = next(iter(trainer.get_eval_dataloader()))
    trainer.model.eval()
    with torch.no_grad():
        together = trainer.model(**batch).logits[:1]
        alone = trainer.model(**{k: v[:1] for k, v in batch.items()}).logits
    torch.testing.assert_close(alone, together, rtol=1e-4, atol=1e-5)


def test_the_cost_reports_epoch_gossips_once_per_optimizer_step(tmp_path, agnews_small, tokenizer):
    """Under gradient accumulation the report counted an epoch's micro-batches as gossip steps:
    twice the traffic an epoch sends with gradient_accumulation_steps=2."""
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, gradient_accumulation_steps=2),
                                   train_dataset=agnews_small["train"], processing_class=tokenizer)
    communication = trainer.cost_report((16,)).communication
    assert communication.iterations_per_epoch == trainer.steps_per_epoch() == 256 // 4 // 8 // 2
    trainer.train()  # 3 steps
    assert trainer.bytes_sent.tolist() == [3 * communication.bytes_per_epoch / trainer.steps_per_epoch()] * 4


def test_a_graph_of_ones_own_from_a_file_trains_as_the_same_graph_by_name(tmp_path, agnews_small, tokenizer):
    """topology takes a file of mixing matrices (a path, ~ expanded, saved as text): the run is the
    named graph's run when the file holds its matrices, and its reports name the file."""
    import json

    import numpy as np

    from lp_decentral_nlp.commands import build_nlp_parser
    from lp_decentral_nlp.gossip import GossipConfig

    graph_file = tmp_path / "my_ring.npy"
    np.save(graph_file, make_topology("ring", 4).mixing_matrix().numpy())
    finals = []
    for topology in ("ring", graph_file):
        args = targs(tmp_path / "run", topology=topology, compression=90.0)
        trainer = DecentralizedTrainer(model=tiny_model(), args=args, train_dataset=agnews_small["train"],
                                       processing_class=tokenizer)
        trainer.train()
        finals.append([p.detach().clone() for node in trainer.nodes for p in node.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))
    assert args.topology == str(graph_file) and json.loads(args.to_json_string())["topology"] == str(graph_file)
    assert trainer.gossip.topology.name == "my_ring.npy"
    with pytest.MonkeyPatch.context() as env:  # ~ expanded, as output_dir's: in the arguments, the settings, the flag
        env.setenv("HOME", str(tmp_path))
        assert targs(tmp_path, topology="~/my_ring.npy").topology == str(graph_file)
        assert GossipConfig(topology="~/my_ring.npy").graph.fingerprint() == make_topology("ring", 4).fingerprint()
        parsed = build_nlp_parser("ag_news", "choco").parse(["--topology=~/my_ring.npy"])
        assert parsed.training.topology == str(graph_file)
