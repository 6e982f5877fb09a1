"""DecentralizedTrainer honours the transformers.Trainer settings users rely on (issue 21): metrics,
gradient accumulation, best-model tracking and early stopping, dict eval sets, predict, tasks
without class labels, plain torch datasets, gradient checkpointing, the final merge, the drift
guard, and refuses what it cannot honour. Tiny random models, a few steps, public API only."""
import collections
import concurrent.futures
import copy
import logging
import re
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers.trainer
from datasets import Dataset
from helpers import agnews_sample
from helpers import tiny_distilbert as tiny_model
from transformers import (
    AutoModelForSequenceClassification, BertConfig, BertForMaskedLM, BertForMultipleChoice, BertForQuestionAnswering,
    DataCollatorForLanguageModeling, DataCollatorForTokenClassification, DistilBertConfig,
    DistilBertForTokenClassification, EarlyStoppingCallback, GPT2Config, GPT2LMHeadModel, Seq2SeqTrainingArguments,
    TrainerCallback,
)

from lp_decentral_nlp.data import skewed_partition
from lp_decentral_nlp.gossip import make_topology
from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments, NonFiniteError


@pytest.fixture(scope="module")
def agnews_small(tokenizer):
    return agnews_sample(tokenizer, max_length=16, max_train_samples=128, max_eval_samples=32)


def targs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), num_nodes=4, per_device_train_batch_size=8, per_device_eval_batch_size=32,
                learning_rate=1e-3, max_steps=2, logging_steps=1, save_strategy="no", use_cpu=True,
                disable_tqdm=True, seed=0, low_precision=False)
    base.update(kw)
    return DecentralizedTrainingArguments(**base)


def trainer_for(tmp_path, data, tokenizer, **kw):
    trainer_kw = {k: kw.pop(k) for k in ("compute_metrics", "callbacks", "eval_dataset") if k in kw}
    trainer_kw.setdefault("eval_dataset", data["test"])
    return DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **kw), train_dataset=data["train"],
                                processing_class=tokenizer, **trainer_kw)


def predicted_class_share(eval_pred):
    """A metric only compute_metrics can produce: the share of samples predicted as class 0."""
    return {"share_class0": float((eval_pred.predictions.argmax(-1) == 0).mean()),
            "samples": float(len(eval_pred.label_ids))}


def test_compute_metrics_runs_on_the_averaged_model_with_the_eval_prefix(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, compute_metrics=predicted_class_share)
    trainer.train()
    metrics = trainer.evaluate()
    out = trainer.predict(agnews_small["test"])  # the averaged model's predictions
    assert metrics["eval_share_class0"] == pytest.approx(float((out.predictions.argmax(-1) == 0).mean()))
    assert metrics["eval_samples"] == 32 and metrics["eval_samples_node_3"] == 32
    assert out.predictions.shape == (32, 4) and out.label_ids.tolist() == agnews_small["test"]["label"]
    assert out.metrics["test_share_class0"] == metrics["eval_share_class0"]
    assert out.metrics["test_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-6)
    custom = trainer.evaluate(metric_key_prefix="dev")
    assert {"dev_loss", "dev_share_class0", "dev_consensus_distance", "dev_bytes_sent_node_0"} <= set(custom)
    assert not [k for k in custom if not k.startswith("dev_") and k != "epoch"]  # Trainer.log adds the epoch


def test_evaluate_and_predict_report_trainers_speed_metrics(tmp_path, agnews_small, tokenizer):
    """``{p}_runtime`` (seconds), ``{p}_samples_per_second`` and ``{p}_steps_per_second`` as Trainer
    reports them: 32 evaluation samples in one batch of 32; logged with the evaluation."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=1)
    trainer.train()
    for metrics, p in ((trainer.evaluate(), "eval"), (trainer.predict(agnews_small["test"]).metrics, "test")):
        runtime = metrics[f"{p}_runtime"]
        assert runtime > 0
        assert metrics[f"{p}_samples_per_second"] == pytest.approx(32 / runtime, rel=1e-2)
        assert metrics[f"{p}_steps_per_second"] == pytest.approx(1 / runtime, rel=1e-2)
    assert trainer.state.log_history[-1]["eval_runtime"] > 0


def test_train_reports_the_speed_of_the_steps_it_ran(tmp_path, agnews_small, tokenizer):
    """``train_samples_per_second`` counts every node's batch (4 nodes x 8 samples per step); a
    resumed run counts only the steps it ran itself."""
    out = trainer_for(tmp_path / "a", agnews_small, tokenizer, max_steps=4, save_strategy="steps", save_steps=2).train()
    runtime = out.metrics["train_runtime"]
    assert out.metrics["train_steps_per_second"] == pytest.approx(4 / runtime, rel=1e-2)
    assert out.metrics["train_samples_per_second"] == pytest.approx(4 * 4 * 8 / runtime, rel=1e-2)
    resumed = trainer_for(tmp_path / "b", agnews_small, tokenizer, max_steps=4).train(
        resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")).metrics
    assert resumed["train_steps_per_second"] == pytest.approx(2 / resumed["train_runtime"], rel=1e-2)


def test_include_num_input_tokens_seen_counts_every_nodes_tokens(tmp_path, tokenizer):
    """Rows of 8 token positions, 5 of them real: each step the 4 nodes read 4 x 8 rows, so
    ``"all"`` counts 256 tokens per step and ``"non_padding"`` 160, in every log and across a resume;
    the training logs carry Trainer's token speed of the train() call (``train_tokens_per_second``
    over ``train_runtime``: a resumed call counts its own tokens)."""
    rows = Dataset.from_dict({"input_ids": [[101, 7, 8, 9, 102, 0, 0, 0]] * 64,
                              "attention_mask": [[1] * 5 + [0] * 3] * 64, "label": [i % 4 for i in range(64)]})
    data = {"train": rows, "test": rows.select(range(8))}
    for mode, per_step in (("all", 256), ("non_padding", 160)):
        trainer = trainer_for(tmp_path / mode, data, tokenizer, max_steps=3, include_num_input_tokens_seen=mode,
                              save_strategy="steps", save_steps=2)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert [h["num_input_tokens_seen"] for h in logs] == [per_step, 2 * per_step, 3 * per_step]
        for h in logs:
            assert h["train_tokens_per_second"] == pytest.approx(h["num_input_tokens_seen"] / h["train_runtime"],
                                                                 rel=0.05)
        assert trainer.evaluate()["num_input_tokens_seen"] == trainer.state.num_input_tokens_seen == 3 * per_step
        resumed = trainer_for(tmp_path / f"{mode}_resumed", data, tokenizer, max_steps=3,
                              include_num_input_tokens_seen=mode)
        resumed.train(resume_from_checkpoint=str(tmp_path / mode / "checkpoint-2"))
        assert resumed.state.num_input_tokens_seen == 3 * per_step
        last = [h for h in resumed.state.log_history if "loss" in h][-1]  # step 3, after the checkpoint's logs
        assert last["train_tokens_per_second"] == pytest.approx(per_step / last["train_runtime"], rel=0.05)
    with pytest.raises(ValueError, match=r"include_num_input_tokens_seen must be one of \('all', 'non_padding', "
                                         r"'no'\), got 'tokens'"):
        targs(tmp_path, include_num_input_tokens_seen="tokens")


def test_torch_empty_cache_steps_empties_the_device_cache_every_n_steps(tmp_path, agnews_small, tokenizer,
                                                                        monkeypatch):
    """As Trainer: accelerate's ``clear_device_cache`` after every ``torch_empty_cache_steps`` steps
    (on a GPU it returns the allocator's cached blocks; the CPU keeps none, so the calls are counted)."""
    from lp_decentral_nlp.trainer import trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "clear_device_cache", lambda: calls.append(1))
    trainer_for(tmp_path, agnews_small, tokenizer, max_steps=5, torch_empty_cache_steps=2).train()
    assert len(calls) == 2  # after steps 2 and 4


def test_eval_accumulation_steps_moves_predictions_to_the_host_without_changing_them(tmp_path, agnews_small,
                                                                                     tokenizer, monkeypatch):
    from transformers.trainer_pt_utils import EvalLoopContainer

    moves = []  # each move of the predictions and of the labels to the host
    to_host = EvalLoopContainer.to_cpu_and_numpy
    monkeypatch.setattr(EvalLoopContainer, "to_cpu_and_numpy",
                        lambda self: (moves.append(1) if self.tensors is not None else None, to_host(self))[1])
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=1, per_device_eval_batch_size=5,
                          compute_metrics=predicted_class_share)
    trainer.train()
    whole = trainer.predict(agnews_small["test"])  # 32 samples in 7 batches, moved to the host at the end
    assert len(moves) == 2
    trainer.args.eval_accumulation_steps = 3  # moved after batches 3 and 6, and the last one at the end
    chunked = trainer.predict(agnews_small["test"])
    assert len(moves) == 2 + 6
    np.testing.assert_array_equal(chunked.predictions, whole.predictions)
    np.testing.assert_array_equal(chunked.label_ids, whole.label_ids)
    assert chunked.predictions.shape == (32, 4) and chunked.metrics["test_share_class0"] == \
        whole.metrics["test_share_class0"]
    trainer.args.eval_do_concat_batches = False  # as Trainer: a list of each batch's arrays (compute_metrics too)
    trainer.compute_metrics = None
    batches = trainer.predict(agnews_small["test"])
    assert [len(p) for p in batches.predictions] == [5] * 6 + [2]
    np.testing.assert_array_equal(np.concatenate(batches.predictions), whole.predictions)


def inputs_and_losses(eval_pred):
    """A metric of what include_for_metrics adds: the inputs' shape and the mean of the per-sample losses."""
    return {"input_rows": float(eval_pred.inputs.shape[0]), "mean_loss": float(eval_pred.losses.mean())}


def test_include_for_metrics_passes_inputs_and_losses_to_compute_metrics(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=1, per_device_eval_batch_size=8,
                          compute_metrics=inputs_and_losses, include_for_metrics=["inputs", "loss"])
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_input_rows"] == 32 and metrics["eval_input_rows_node_2"] == 32
    assert metrics["eval_mean_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)  # 4 equal batches of 8
    with pytest.raises(ValueError, match=r"include_for_metrics entries must be one of \('inputs', 'loss'\), got 'logits'"):
        targs(tmp_path, include_for_metrics=["logits"])


class RunningShare:
    """A batch_eval_metrics metric as Trainer documents them: accumulates per batch, reports and
    resets at ``compute_result=True``."""

    def __init__(self):
        self.hits, self.seen, self.calls = 0, 0, 0

    def __call__(self, eval_pred, compute_result: bool):
        self.calls += 1
        self.hits += int((eval_pred.predictions.argmax(-1) == 0).sum())
        self.seen += len(eval_pred.label_ids)
        if not compute_result:
            return {}
        result = {"share_class0": self.hits / self.seen, "samples": float(self.seen)}
        self.hits, self.seen = 0, 0
        return result


def test_batch_eval_metrics_calls_compute_metrics_per_batch(tmp_path, agnews_small, tokenizer):
    whole = trainer_for(tmp_path / "whole", agnews_small, tokenizer, max_steps=1, per_device_eval_batch_size=5,
                        compute_metrics=predicted_class_share)
    whole.train()
    running = RunningShare()
    batched = trainer_for(tmp_path / "batched", agnews_small, tokenizer, max_steps=1, per_device_eval_batch_size=5,
                          compute_metrics=running, batch_eval_metrics=True)
    batched.train()
    expected, metrics = whole.evaluate(), batched.evaluate()
    assert running.calls == 5 * 7  # 7 batches of the averaged model and of each of the 4 nodes
    for key in ("eval_share_class0", "eval_samples", "eval_share_class0_node_3"):
        assert metrics[key] == pytest.approx(expected[key]), key


def test_a_dict_eval_dataset_gives_one_prefix_per_set(tmp_path, agnews_small, tokenizer):
    halves = {"first": agnews_small["test"].select(range(16)), "second": agnews_small["test"].select(range(16, 32))}
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, eval_dataset=halves, max_steps=1)
    trainer.train()
    metrics = trainer.evaluate()
    assert {"eval_first_accuracy", "eval_second_accuracy", "eval_first_loss_node_2", "eval_second_bytes_sent_node_1"} \
        <= set(metrics)
    whole = trainer.evaluate(agnews_small["test"])
    assert whole["eval_loss"] == pytest.approx((metrics["eval_first_loss"] + metrics["eval_second_loss"]) / 2)


def test_label_names_that_name_no_key_of_the_evaluation_batches_are_refused(tmp_path, agnews_small, tokenizer):
    # the collator renames the column "label" to "labels": label_names=["label"] matched nothing, and
    # evaluate() (as Trainer's) reported no loss and no accuracy without a word
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, label_names=["label"])
    with pytest.raises(ValueError, match=r"^label_names=\['label'\]: the evaluation batches hold no 'label' "
                                         r"\(their keys: \['attention_mask', 'input_ids', 'labels'\]\)"):
        trainer.evaluate()
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, label_names=["labels"])
    assert {"eval_loss", "eval_accuracy"} <= set(trainer.evaluate())
    assert trainer.predict(agnews_small["test"].remove_columns("label")).label_ids is None  # unlabelled: predictions


def test_a_best_metric_that_names_no_set_of_a_dict_eval_dataset_is_refused_before_training(tmp_path, agnews_small,
                                                                                            tokenizer):
    sets = {"first": agnews_small["test"].select(range(16)), "second": agnews_small["test"].select(range(16, 32))}
    with pytest.raises(ValueError, match=r"^metric_for_best_model='loss': with a dict eval_dataset every metric is "
                                         r"named after its set, eval_<set>_<metric> \(sets: 'first', 'second'\): "
                                         r"name one, e.g. 'eval_first_loss'$"):
        trainer_for(tmp_path, agnews_small, tokenizer, eval_dataset=sets, load_best_model_at_end=True,
                    eval_strategy="steps", save_strategy="steps", eval_steps=1, save_steps=1)
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, eval_dataset=sets, load_best_model_at_end=True,
                          eval_strategy="steps", save_strategy="steps", eval_steps=1, save_steps=1,
                          metric_for_best_model="second_loss")
    trainer.train()
    assert trainer.state.best_metric == min(h["eval_second_loss"] for h in trainer.state.log_history
                                            if "eval_second_loss" in h)


def test_gradient_accumulation_is_one_gossip_step_per_optimizer_step(tmp_path, agnews_small, tokenizer):
    """k micro-batches of b samples per optimizer step: with a model without dropout this is the
    step of one batch of k*b samples (the mean loss), and global_step counts optimizer steps."""
    accumulated = trainer_for(tmp_path / "a", agnews_small, tokenizer, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, max_steps=2)
    accumulated.train()
    assert accumulated.state.global_step == 2 and accumulated.gossip.num_steps == 2
    # the same two steps by hand: each node's first 2 x 4 samples form one batch of 8
    whole = trainer_for(tmp_path / "w", agnews_small, tokenizer, per_device_train_batch_size=8, max_steps=2)
    loaders = accumulated.node_dataloaders()
    whole_loaders = whole.node_dataloaders()
    for small, big in zip(loaders, whole_loaders):  # the same order of the same shard
        order = [[i for batch in loader.batch_sampler for i, _ in batch] for loader in (small, big)]
        assert small.dataset.indices == big.dataset.indices and order[0] == order[1]
    whole.train()
    for a, b in zip(accumulated.nodes, whole.nodes):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    steps_logged = [h["step"] for h in accumulated.state.log_history if "loss" in h]
    assert steps_logged == [1, 2]


class FirstStepOfNode0(TrainerCallback):
    """Node 0's micro-batches (as its loss saw them) and gradient at the first optimizer step."""

    def __init__(self):
        self.batches, self.grads = [], None

    def on_pre_optimizer_step(self, args, state, control, node=None, model=None, **kwargs):
        if node == 0 and state.global_step == 0:
            self.grads = [p.grad.clone() for p in model.parameters()]


def first_step_recorder(record):
    class Recording(DecentralizedTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model is self.nodes[0] and self.state.global_step == 0:
                record.batches.append({k: v.clone() for k, v in inputs.items()})
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
    return Recording


def varied_length_rows(tokenizer, n=32):
    text = [" ".join(["word"] * (1 + i % 7) + ["end"]) for i in range(n)]
    return Dataset.from_dict(dict(tokenizer(text, truncation=True, max_length=12)))


def gradient(model, loss):
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("task", ["causal_lm", "token_classification"])
def test_gradient_accumulation_averages_over_every_label_of_the_accumulated_batch(task, tmp_path, tokenizer):
    """Micro-batches holding different numbers of labels: the node's gradient is that of the mean
    loss over all their labels, as one batch of them all (Trainer's ``num_items_in_batch``), not
    the mean of the micro-batches' means. GPT-2 also checks the causal shift (its first label of
    each row is no target), which Trainer's own count misses for GPT-2."""
    data = varied_length_rows(tokenizer)
    torch.manual_seed(0)
    if task == "causal_lm":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=16, n_embd=16, n_layer=1,
                                           n_head=2, pad_token_id=tokenizer.pad_token_id, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0))
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:
        model = DistilBertForTokenClassification(DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=16, n_layers=1,
                                                                  n_heads=2, hidden_dim=32, num_labels=3,
                                                                  dropout=0.0, attention_dropout=0.0))
        data = data.map(lambda row: {"labels": [-100] + [t % 3 for t in row["input_ids"][1:]]})
        collator = DataCollatorForTokenClassification(tokenizer)
    start = copy.deepcopy(model)
    record = FirstStepOfNode0()
    trainer = first_step_recorder(record)(
        model=model, args=targs(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1),
        train_dataset=data, data_collator=collator, callbacks=[record])
    trainer.train()
    first, second = record.batches
    shift = 1 if task == "causal_lm" else 0

    def summed_loss(batch):
        logits = start(**{key: value for key, value in batch.items() if key != "labels"}).logits
        labels = batch["labels"][:, shift:]
        logits = logits[:, :logits.shape[1] - shift]
        return torch.nn.functional.cross_entropy(logits.reshape(labels.numel(), -1), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")

    counts = [int(b["labels"][:, shift:].ne(-100).sum()) for b in (first, second)]
    assert counts[0] != counts[1]  # else both rules agree
    start.train()
    whole = gradient(start, (summed_loss(first) + summed_loss(second)) / sum(counts))
    for got, want in zip(record.grads, whole):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


class OwnGPT2(GPT2LMHeadModel):
    """A user's subclass: the same loss as GPT-2's."""


def lora_wrapped(model):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("model_class, wrap", [(GPT2LMHeadModel, None), (OwnGPT2, None), (GPT2LMHeadModel, lora_wrapped)],
                         ids=["gpt2", "subclass", "peft"])
def test_a_gpt2_eval_loss_is_the_mean_over_its_shifted_labels(model_class, wrap, tmp_path, tokenizer):
    """GPT-2 leaves ``loss_type`` unset, and Trainer's count of a batch's labels then includes each
    row's first, which no prediction targets: its eval_loss read about 10% low (a subclass's, or
    one PEFT wraps, still did). It is the mean loss over the predicted tokens, as training computes
    it. (The PEFT case needs peft, which the [test] extra installs.)"""
    data = varied_length_rows(tokenizer, n=8)
    torch.manual_seed(0)
    model = model_class(GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                   pad_token_id=tokenizer.pad_token_id))
    assert model.loss_type is None
    model = model if wrap is None else wrap(model)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = DecentralizedTrainer(model=model, args=targs(tmp_path), train_dataset=data, eval_dataset=data,
                                   data_collator=collator)
    batch = collator([data[i] for i in range(8)])  # one evaluation batch of every row
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(logits.reshape(labels.numel(), -1), labels.reshape(-1))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(float(expected), rel=1e-5)


def test_a_micro_batch_without_labels_adds_nothing_to_the_step(tmp_path, tokenizer):
    """Its mean loss is NaN (no label to average over): it weighs 0 and is not back-propagated, so
    the step is that of the other micro-batches, as Trainer's count-normalised loss gives, not a
    non-finite stop. One node holding both rows: its one step accumulates both."""
    data = varied_length_rows(tokenizer, n=2).map(
        lambda row, i: {"labels": [t % 3 if i == 0 else -100 for t in row["input_ids"]]}, with_indices=True)
    torch.manual_seed(0)
    model = DistilBertForTokenClassification(DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=16, n_layers=1,
                                                              n_heads=2, hidden_dim=32, num_labels=3, dropout=0.0,
                                                              attention_dropout=0.0))
    start = copy.deepcopy(model)
    record = FirstStepOfNode0()
    trainer = first_step_recorder(record)(
        model=model, args=targs(tmp_path, num_nodes=1, algorithm="dpsgd", per_device_train_batch_size=1,
                                gradient_accumulation_steps=2, max_steps=1),
        train_dataset=data, data_collator=DataCollatorForTokenClassification(tokenizer), callbacks=[record])
    trainer.train()
    labelled = [b for b in record.batches if b["labels"].ne(-100).any()]
    assert len(record.batches) == 2 and len(labelled) == 1
    start.train()
    want = gradient(start, start(**labelled[0]).loss)
    for got, expected in zip(record.grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    assert np.isfinite(trainer.state.log_history[0]["loss"])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_node_whose_batch_has_no_label_takes_no_update(accumulation, tmp_path, tokenizer):
    """Every micro-batch of a step all -100 (a prompt-masked LM row whose answer was cut off):
    nothing to learn from, so the node keeps its weights and logs no loss for the step, as the
    micro-batch rule above gives; the run stopped with a non-finite loss (the mean over no label
    is NaN). A labelled row still trains."""
    def run(labelled_rows, out):
        data = varied_length_rows(tokenizer, n=4).map(
            lambda row, i: {"labels": [t % 3 if i in labelled_rows else -100 for t in row["input_ids"]]},
            with_indices=True)
        torch.manual_seed(0)
        model = DistilBertForTokenClassification(DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=16, n_layers=1,
                                                                  n_heads=2, hidden_dim=32, num_labels=3))
        trainer = DecentralizedTrainer(
            model=model, args=targs(out, num_nodes=1, per_device_train_batch_size=1, max_steps=4 // accumulation,
                                    gradient_accumulation_steps=accumulation, low_precision=True),
            train_dataset=data, data_collator=DataCollatorForTokenClassification(tokenizer))
        start = [p.detach().clone() for p in trainer.nodes[0].parameters()]
        trainer.train()
        moved = not all(torch.equal(a, b) for a, b in zip(start, trainer.nodes[0].parameters()))
        return moved, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    moved, losses = run((), tmp_path / "none")
    assert not moved and len(losses) == 4 // accumulation and np.isnan(losses).all()
    moved, losses = run((3,), tmp_path / "one")
    assert moved and np.isfinite(losses).sum() == 1  # the step holding row 3


def test_compute_loss_func_gets_the_label_count_of_the_accumulated_batch(tmp_path, tokenizer):
    """Trainer's contract: ``compute_loss_func(outputs, labels, num_items_in_batch)`` gets the
    labels of every micro-batch of the optimizer step and normalises by it; its loss is not scaled
    again."""
    seen = []

    def summed_over_items(outputs, labels, num_items_in_batch):
        seen.append(int(num_items_in_batch))
        logits = outputs.logits
        return torch.nn.functional.cross_entropy(logits.reshape(labels.numel(), -1), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum") / num_items_in_batch

    data = varied_length_rows(tokenizer).map(lambda row: {"labels": [t % 3 for t in row["input_ids"]]})
    torch.manual_seed(0)
    model = DistilBertForTokenClassification(DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=16, n_layers=1,
                                                              n_heads=2, hidden_dim=32, num_labels=3,
                                                                  dropout=0.0, attention_dropout=0.0))
    start = copy.deepcopy(model)
    record = FirstStepOfNode0()
    trainer = first_step_recorder(record)(
        model=model, args=targs(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1),
        train_dataset=data, data_collator=DataCollatorForTokenClassification(tokenizer), callbacks=[record],
        compute_loss_func=summed_over_items)
    trainer.train()
    total = sum(int(b["labels"].ne(-100).sum()) for b in record.batches)
    assert seen[:2] == [total, total]  # node 0's two micro-batches
    start.train()
    want = gradient(start, sum(summed_over_items(start(**{k: v for k, v in b.items() if k != "labels"}), b["labels"],
                                                 total) for b in record.batches))
    for got, expected in zip(record.grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_disable_tqdm_also_hides_the_bars_of_saving_the_model(disable_tqdm, tmp_path, agnews_small, tokenizer, capfd):
    """transformers' ``save_pretrained`` draws its own bar ("Writing model shards") at every
    checkpoint and ``save_model``: with ``disable_tqdm`` there is none, and the process-wide
    setting is as it was after."""
    from transformers.utils import logging as hf_logging

    trainer = trainer_for(tmp_path, agnews_small, tokenizer, save_strategy="steps", save_steps=1,
                          disable_tqdm=disable_tqdm)
    capfd.readouterr()
    trainer.train()
    trainer.save_model(str(tmp_path / "model"))
    assert ("Writing model shards" in capfd.readouterr().err) is not disable_tqdm
    assert hf_logging.is_progress_bar_enabled()


def test_save_model_after_training_needs_no_other_process(tmp_path, agnews_small, tokenizer, monkeypatch):
    """After ``train()`` the averaged model is current, so ``save_model`` forms no average again:
    under torchrun the main process may call it alone, as with Trainer (forming the average is a
    sum over every process, which would wait for ranks that never call it)."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=2)
    trainer.train()

    def no_collective(*args, **kwargs):
        raise AssertionError("save_model waited for the other processes")

    monkeypatch.setattr(trainer.node_group, "sum", no_collective)
    trainer.save_model(str(tmp_path / "model"))
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "model")
    for key, value in trainer.model.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[key], value)


class RecordEvals(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.steps.append(state.global_step)


def test_load_best_model_at_end_restores_the_best_averaged_model(tmp_path, agnews_small, tokenizer):
    record = RecordEvals()
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=6, eval_strategy="steps", eval_steps=2,
                          save_strategy="steps", save_steps=2, save_total_limit=1, load_best_model_at_end=True,
                          metric_for_best_model="loss", eval_on_start=True, learning_rate=5e-3, callbacks=[record])
    trainer.train()
    assert record.steps == [0, 2, 4, 6]  # eval_on_start, then every 2 steps
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h and h["step"] > 0}
    best_step = min(evals, key=evals.get)
    assert trainer.state.best_metric == evals[best_step]
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best_step}")
    # save_total_limit=1 keeps the best checkpoint (and nothing else)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{best_step}"]
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[best_step], rel=1e-5)


def test_a_best_evaluation_without_a_checkpoint_is_named_beside_the_checkpoint_loaded(tmp_path, agnews_small,
                                                                                     tokenizer, caplog):
    """save_steps=2 of eval_steps=1: the best score (0.9, step 3) was never saved, and the log said
    "loading the best model from checkpoint-2 (score: 0.9)", whose score is 0.5, though checkpoint-4
    scored 0.7 (Trainer's last checkpoint at a running best); with the best on the first step nothing
    was loaded, silently. The best evaluated checkpoint is, with a warning naming both."""
    def trained(folder, scores, save_steps=2):  # evaluated every step, scored by step (steps: 1 to len(scores))
        trainer = trainer_for(tmp_path / folder, agnews_small, tokenizer, max_steps=len(scores), eval_strategy="steps",
                              eval_steps=1, save_strategy="steps", save_steps=save_steps, load_best_model_at_end=True,
                              metric_for_best_model="score",
                              compute_metrics=lambda _: {"score": scores[trainer.state.global_step]})
        trainer.train()
        return trainer

    trainer = trained("a", {1: 0.1, 2: 0.5, 3: 0.9, 4: 0.7})
    assert (trainer.state.best_global_step, trainer.state.best_metric) == (3, 0.9)
    assert trainer.best_model_loaded == {"step": 4, "checkpoint": str(tmp_path / "a" / "checkpoint-4"), "score": 0.7}
    assert ("load_best_model_at_end: the best evaluation (score=0.9 at step 3) has no checkpoint: loading "
            f"{tmp_path / 'a' / 'checkpoint-4'}, the best evaluated checkpoint (score=0.7 at step 4); "
            "save_strategy='best' (or save_steps=eval_steps) saves every new best") in caplog.text
    assert trained("b", {1: 0.9, 2: 0.5, 3: 0.1, 4: 0.2}).best_model_loaded["step"] == 2
    # the run's end is saved too: step 3 (0.1) with save_steps=4, the one evaluated checkpoint
    assert trained("c", {1: 0.9, 2: 0.5, 3: 0.1}, save_steps=4).best_model_loaded["step"] == 3
    # a checkpoint an earlier run (another learning rate) left at a step this run evaluated best is not this run's
    trainer_for(tmp_path / "d", agnews_small, tokenizer, max_steps=2, save_strategy="steps", save_steps=2,
                learning_rate=5e-3).train()
    assert trained("d", {1: 0.1, 2: 0.9, 3: 0.2}, save_steps=3).best_model_loaded["step"] == 3


def test_a_best_metric_the_evaluation_does_not_return_is_refused_before_training(tmp_path, agnews_small, tokenizer):
    """Without compute_metrics the names are known: "f1" stopped the run at the first evaluation
    (Trainer's KeyError), after the steps before it; a set's metric of a dict eval_dataset too."""
    with pytest.raises(ValueError, match=r"^metric_for_best_model='f1' is not a metric of the evaluation: without "
                                         r"compute_metrics it returns loss, accuracy .* for a node i in 0\.\.3; the "
                                         r"first evaluation in training would stop the run$"):
        trainer_for(tmp_path, agnews_small, tokenizer, eval_strategy="steps", eval_steps=1,
                    metric_for_best_model="f1")
    with pytest.raises(ValueError, match=r"^metric_for_best_model='eval_a_f1' is not a metric .*\(each as "
                                         r"eval_<set>_<metric>\)"):
        trainer_for(tmp_path, agnews_small, tokenizer, eval_strategy="steps", eval_steps=1,
                    eval_dataset={"a": agnews_small["test"]}, metric_for_best_model="eval_a_f1")
    for name in ("accuracy_node_3", "eval_consensus_distance", "runtime"):
        trainer_for(tmp_path, agnews_small, tokenizer, eval_strategy="steps", eval_steps=1, metric_for_best_model=name)
    for name in ("eval_test_ood_loss", "test_accuracy_node_1"):  # a set named like the start of another
        trainer_for(tmp_path, agnews_small, tokenizer, eval_strategy="steps", eval_steps=1, metric_for_best_model=name,
                    eval_dataset={"test": agnews_small["test"], "test_ood": agnews_small["test"]})
    trainer_for(tmp_path, agnews_small, tokenizer, eval_strategy="steps", eval_steps=1,  # compute_metrics' own
                metric_for_best_model="f1", compute_metrics=lambda _: {"f1": 1.0})
    with pytest.raises(ValueError, match=r"^greater_is_better=True is the order of metric_for_best_model's values, "
                                         r"and none is set"):
        targs(tmp_path, eval_strategy="steps", eval_steps=1, greater_is_better=True)
    # load_best_model_at_end picks loss (after these checks, in TrainingArguments), whose order it reads
    assert targs(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                 load_best_model_at_end=True, greater_is_better=True).greater_is_better


def test_compute_metrics_may_not_replace_the_trainers_own_metrics_and_predict_takes_one_set(tmp_path, agnews_small,
                                                                                          tokenizer):
    """A compute_metrics "consensus_distance" replaced the run's silently; predict() of a dict failed
    deep in the DataLoader (KeyError: 0)."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, compute_metrics=lambda _: {"consensus_distance": -1.0})
    with pytest.raises(ValueError, match=r"^compute_metrics returned 'consensus_distance', a name of the metrics the "
                                         r"trainer adds to every evaluation \(consensus_distance, bytes_sent, runtime, "
                                         r"samples_per_second, steps_per_second, per node <metric>_node_<i>\): rename it$"):
        trainer.evaluate()
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, compute_metrics=lambda _: {"runtime": 7.0, "f1": 0.5})
    with pytest.raises(ValueError, match=r"^compute_metrics returned 'runtime'"):
        trainer.evaluate()
    trainer = trainer_for(tmp_path, agnews_small, tokenizer)
    with pytest.raises(ValueError, match=r"^test_dataset: predict\(\) takes one dataset, got a dict of 1 sets"):
        trainer.predict({"a": agnews_small["test"]})


def test_a_model_whose_logits_are_not_numbers_has_no_accuracy(tmp_path, agnews_small, tokenizer):
    """argmax reads a row of NaN logits as class 0: a diverged run (--skip-nonfinite) reported the
    share of class 0 in the test set as its accuracy."""
    import math

    trainer = trainer_for(tmp_path, agnews_small, tokenizer)
    with torch.no_grad():
        for node in trainer.nodes:
            node.classifier.bias.fill_(math.nan)
    metrics = trainer.evaluate()
    assert math.isnan(metrics["eval_accuracy"]) and math.isnan(metrics["eval_accuracy_node_0"])
    with torch.no_grad():  # a class masked out with -inf leaves every row its argmax
        for node in trainer.nodes:
            node.classifier.bias.copy_(torch.tensor([0.0, -math.inf, 0.0, 0.0]))
    assert 0 <= trainer.evaluate()["eval_accuracy"] <= 1


def test_max_steps_0_is_refused_not_read_as_unset(tmp_path):
    """Trainer reads only a positive max_steps: 0 trained for the epochs, silently."""
    with pytest.raises(ValueError, match=r"^max_steps=0 would train for num_train_epochs .*: give max_steps >= 1, or "
                                         r"leave it at -1"):
        targs(tmp_path, max_steps=0)


def test_a_torus_of_a_prime_number_of_nodes_says_it_is_the_ring(tmp_path, agnews_small, tokenizer):
    """5 nodes have no 2-D torus: the most square one is 1 x 5, the ring, which ran as "torus"."""
    with pytest.warns(UserWarning, match=r"^a torus of 5 nodes is 1 x 5, the ring \(5 is prime\)"):
        trainer = trainer_for(tmp_path, agnews_small, tokenizer, num_nodes=5, topology="torus")
    assert trainer.gossip.topology.name == "torus(1x5)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer_for(tmp_path, agnews_small, tokenizer, num_nodes=6, topology="torus")
        make_topology("torus", 7, rows=1)  # a shape asked for is built as asked


class RecordCheckpoints(TrainerCallback):
    """The checkpoint steps on disk after every save."""

    def __init__(self):
        self.on_disk = []

    def on_save(self, args, state, control, **kwargs):
        self.on_disk.append(sorted(int(p.name.split("-")[1]) for p in Path(args.output_dir).glob("checkpoint-*")))


def test_save_total_limit_1_keeps_the_newest_checkpoint_until_the_run_ends(tmp_path, agnews_small, tokenizer):
    # the best score is the first evaluation's (step 2); Trainer keeps the newest checkpoint beside
    # it during the run, to resume from, and deletes it at the end
    saved = RecordCheckpoints()
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=6, eval_strategy="steps", eval_steps=2,
                          save_strategy="steps", save_steps=2, save_total_limit=1, metric_for_best_model="score",
                          compute_metrics=lambda _: {"score": {2: 3.0, 4: 1.0, 6: 2.0}[trainer.state.global_step]},
                          callbacks=[saved])
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert saved.on_disk == [[2], [2, 4], [2, 6]]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_log_level_info_shows_the_run_summary_and_the_packages_info_lines(tmp_path, agnews_small, tokenizer, caplog):
    """The package's loggers were not under log_level: their info lines (a resume, the best model's
    load) never printed, and there was no summary of the run as Trainer's "Running training"."""
    quiet = trainer_for(tmp_path / "quiet", agnews_small, tokenizer)  # log_level "passive": warnings
    quiet.train()
    assert "Running decentralized training" not in caplog.text
    trainer = trainer_for(tmp_path / "info", agnews_small, tokenizer, log_level="info", save_strategy="steps",
                          save_steps=1)
    trainer.train()
    assert "***** Running decentralized training *****\n  Nodes = 4 (simulated backend; directed_ring graph of " \
           "spectral gap 0.293, choco," in caplog.text  # 1 - |(1 + i) / 2|
    assert "  Total optimization steps = 2 (from step 0)" in caplog.text
    resumed = trainer_for(tmp_path / "info", agnews_small, tokenizer, log_level="info", save_strategy="steps",
                          save_steps=1, max_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "info" / "checkpoint-2"))
    assert "resumed from " in caplog.text and "(from step 2)" in caplog.text


def test_log_metrics_shows_a_small_consensus_distance(tmp_path, agnews_small, tokenizer, capsys):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer)
    trainer.log_metrics("eval", {"eval_consensus_distance": 2.674e-13, "eval_loss": 0.51234567})
    shown = capsys.readouterr().out
    assert "eval_consensus_distance = 2.674e-13" in shown  # was 0.0 (four decimals)
    assert "eval_loss               =    0.5123" in shown


def test_the_logged_learning_rate_is_the_one_the_step_ran_at(tmp_path, agnews_small, tokenizer):
    """As Trainer's (read before the schedule steps): it was the next step's, so the first step logged
    less than learning_rate and every linear run ended at 0."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=4, lr_scheduler_type="linear",
                          logging_steps=1)
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_reduce_lr_on_plateau_steps_every_node_on_the_evaluated_metric(tmp_path, agnews_small, tokenizer):
    # the score worsens at every evaluation (ReduceLROnPlateau minimises by default): with patience 0
    # each evaluation after the first halves every node's LR, and the steps between do not touch it
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=6, eval_strategy="steps", eval_steps=2,
                          lr_scheduler_type="reduce_lr_on_plateau", lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
                          metric_for_best_model="score",
                          compute_metrics=lambda _: {"score": float(trainer.state.global_step)})
    trainer.train()
    lrs = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    assert lrs == {1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 1e-3, 5: 5e-4, 6: 5e-4}  # logged before the step's evaluation
    assert [opt.param_groups[0]["lr"] for opt in trainer.node_optimizers] == [2.5e-4] * 4


def test_greedy_lr_schedule_trains_on_the_evaluated_loss(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=4, eval_strategy="steps", eval_steps=2,
                          lr_scheduler_type="greedy")
    assert trainer.train().global_step == 4
    lrs = {opt.param_groups[0]["lr"] for opt in trainer.node_optimizers}
    assert len(lrs) == 1  # every node steps on the same averaged-model loss


class RecordUpdates(TrainerCallback):
    """Trainer's per-update events: (event, node) pairs, and whether each pre-update call saw the
    node's own model holding gradients."""

    def __init__(self):
        self.events, self.saw_gradients, self.predictions = [], [], 0

    def on_substep_end(self, args, state, control, node=None, **kwargs):
        self.events.append(("substep_end", node))

    def on_pre_optimizer_step(self, args, state, control, node=None, model=None, optimizer=None, **kwargs):
        self.events.append(("pre_optimizer_step", node))
        self.saw_gradients.append(all(p.grad is not None for p in model.parameters() if p.requires_grad)
                                  and optimizer.param_groups[0]["params"][0] is next(model.parameters()))

    def on_optimizer_step(self, args, state, control, node=None, **kwargs):
        self.events.append(("optimizer_step", node))

    def on_prediction_step(self, args, state, control, **kwargs):
        self.predictions += 1


def test_callbacks_see_every_nodes_substeps_and_update(tmp_path, agnews_small, tokenizer):
    record = RecordUpdates()
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, max_steps=2, callbacks=[record])
    trainer.train()
    per_node = [[("substep_end", i), ("pre_optimizer_step", i), ("optimizer_step", i)] for i in range(4)]
    assert record.events == [event for node in per_node for event in node] * 2
    assert record.saw_gradients == [True] * 8
    trainer.evaluate()  # one batch of 32 through the averaged model and each of the 4 nodes
    assert record.predictions == 5


class WarnEachUpdate(TrainerCallback):
    def on_optimizer_step(self, args, state, control, **kwargs):
        warnings.warn("the same warning after every node's update")


def test_a_warning_repeated_every_step_is_shown_once(tmp_path, agnews_small, tokenizer):
    """Python shows a warning once per place it comes from; the training loop must not reset that
    (leaving ``warnings.catch_warnings`` does), or a model's warning floods the log every step."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=3, callbacks=[WarnEachUpdate()])
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        trainer.train()
    assert [str(w.message) for w in shown if "after every node" in str(w.message)] == [
        "the same warning after every node's update"]


def test_logging_strategy_no_logs_no_training_loss(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, logging_strategy="no", logging_steps=500, max_steps=3)
    output = trainer.train()
    assert [h for h in trainer.state.log_history if "loss" in h] == []  # only the run's summary
    assert trainer.state.log_history[-1]["train_loss"] == output.training_loss > 0


def test_logs_carry_each_nodes_gradient_norm_before_clipping(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=2, max_grad_norm=1e-3)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        norms = [log[f"grad_norm_node_{i}"] for i in range(4)]
        assert all(n > 1e-3 for n in norms)  # the norm clipping scaled down, not the clipped one
        assert log["grad_norm"] == pytest.approx(float(np.mean(norms)))
    assert logs[0]["grad_norm_node_0"] != logs[1]["grad_norm_node_0"]  # the last step's, each time


def test_early_stopping_stops_the_decentralized_run(tmp_path, agnews_small, tokenizer):
    # the loss must improve by more than 10 per evaluation: the first comparison fails, the run stops
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=20, eval_strategy="steps", eval_steps=1,
                          save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                          metric_for_best_model="loss",
                          callbacks=[EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)])
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_resumed_run_restores_early_stoppings_patience_when_asked(tmp_path, agnews_small, tokenizer):
    """Checkpoints hold the callbacks' states as Trainer's do; ``restore_callback_states_from_checkpoint``
    brings them back, so early stopping counts the evaluations without improvement before the checkpoint."""
    def run(out, restore=False, resume=None):
        stop = EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=10.0)
        trainer = trainer_for(out, agnews_small, tokenizer, max_steps=20, eval_strategy="steps", eval_steps=1,
                              save_strategy="steps", save_steps=1, metric_for_best_model="loss",
                              restore_callback_states_from_checkpoint=restore, callbacks=[stop])
        trainer.train(resume_from_checkpoint=resume)
        return trainer.state.global_step

    # evaluation 1 sets the best loss, 2-4 do not beat it by 10: the run stops at step 4
    assert run(tmp_path / "straight") == 4
    checkpoint = str(tmp_path / "straight" / "checkpoint-3")  # 2 evaluations without improvement so far
    assert run(tmp_path / "restored", restore=True, resume=checkpoint) == 4
    assert run(tmp_path / "fresh", resume=checkpoint) == 6  # Trainer's default: the callback starts over


def test_a_causal_lm_trains_decentralized_and_lowers_its_eval_loss(tmp_path, tokenizer):
    """No class labels: skew 0 splits at random; DataCollatorForLanguageModeling makes the labels."""
    text = [f"the {w} sat on the mat and the {w} sat on the hat" for w in ("cat", "dog", "bird", "fox") * 16]
    encoded = Dataset.from_dict(dict(tokenizer(text, truncation=True, max_length=16)))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=32, n_embd=32, n_layer=1,
                                       n_head=2, bos_token_id=tokenizer.cls_token_id,
                                       eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id))
    args = targs(tmp_path, per_device_train_batch_size=4, max_steps=12, learning_rate=3e-3, logging_steps=6)
    trainer = DecentralizedTrainer(model=model, args=args, train_dataset=encoded, eval_dataset=encoded.select(range(16)),
                                   data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before - 1.0
    assert "eval_accuracy" not in after and "eval_loss_node_3" in after


def test_token_classification_with_a_labels_column_and_skew_zero(tmp_path):
    torch.manual_seed(0)
    model = DistilBertForTokenClassification(DistilBertConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2,
                                                              hidden_dim=32, max_position_embeddings=16, num_labels=3))
    ids = torch.randint(1, 50, (32, 6))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids % 3).tolist()})
    trainer = DecentralizedTrainer(model=model, args=targs(tmp_path, max_steps=2, per_device_train_batch_size=4),
                                   train_dataset=data, eval_dataset=data)
    trainer.train()
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and "eval_accuracy" not in metrics  # no class-per-sample labels
    with pytest.raises(ValueError, match="skew=0.5 needs a column of class ids"):
        DecentralizedTrainer(model=model, args=targs(tmp_path, skew=0.5), train_dataset=data)
    tags = Dataset.from_dict({"input_ids": ids.tolist(), "labels": [[*row[:3], 3, -100, 0] for row in (ids % 3).tolist()]})
    with pytest.raises(ValueError, match=r"^train_dataset: labels must be tag ids 0\.\.2 \(the model has num_labels=3\) "
                                         r"or -100, found 3 in row 0$"):
        DecentralizedTrainer(model=model, args=targs(tmp_path), train_dataset=tags)
    with pytest.raises(ValueError, match=r"^train_dataset: labels holds lists such as \[\d, \d, .*, not one integer "
                                         r"class id per sample: name a column of class ids with shard_column, or "
                                         r"use skew=0$"):
        DecentralizedTrainer(model=model, args=targs(tmp_path, skew=0.5, shard_column="labels"), train_dataset=data)
    with pytest.raises(ValueError, match=r"^shard_column='labels' is the column skew > 0 skews the shards on, and "
                                         r"skew=0 splits at random: set skew > 0, or leave shard_column at None$"):
        targs(tmp_path, shard_column="labels")  # was accepted, and did nothing
    # the tags are checked whatever the shards are skewed on: they failed in the first step with a topic column
    topics = tags.add_column("topic", [i % 4 for i in range(32)])
    with pytest.raises(ValueError, match=r"^train_dataset: labels must be tag ids 0\.\.2 .* found 3 in row 0$"):
        DecentralizedTrainer(model=model, args=targs(tmp_path, skew=0.5, shard_column="topic"), train_dataset=topics)


class TorchDigits(torch.utils.data.Dataset):
    """A plain map-style torch Dataset with a transformers-style ``labels`` class column."""

    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": torch.zeros(4, dtype=torch.long) + int(self.y[i]) + 1, "labels": self.y[i]}


def test_a_plain_torch_dataset_with_labels_is_skewed_and_an_iterable_one_refused(tmp_path):
    data = TorchDigits()
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=1.0), train_dataset=data)
    expected = skewed_partition(data.y.tolist(), 4, 1.0, seed=0)  # skewed on the labels column
    assert [loader.dataset.indices for loader in trainer.node_dataloaders()] == [e.tolist() for e in expected]
    trainer.train()
    assert trainer.state.global_step == 2

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data)

    with pytest.raises(ValueError, match="train_dataset must be map-style.*got Stream"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=Stream())


def test_fault_entries_of_numpy_numbers_are_kept_as_plain_numbers(tmp_path):
    """NumPy numbers in stragglers/absences stayed NumPy scalars: to_json_string() (which logging
    integrations call) failed with "Object of type int64 is not JSON serializable"."""
    args = targs(tmp_path, stragglers=[(np.int64(1), np.float32(0.5))], absences=["2:1:3"])
    assert args.stragglers == [(1, 0.5)] and type(args.stragglers[0][0]) is int and args.absences == ["2:1:3"]
    args.to_json_string()


def test_the_cost_report_counts_activation_checkpointing_before_training_too(tmp_path, agnews_small, tokenizer):
    """The nodes are switched to checkpointing when train() starts: the recipes' cost report,
    written before, counted every activation as saved (and the adds of one forward)."""
    plain = trainer_for(tmp_path / "p", agnews_small, tokenizer).cost_report((16,))
    checkpointed = trainer_for(tmp_path / "c", agnews_small, tokenizer, activation_checkpointing=True)
    before = checkpointed.cost_report((16,))
    assert before.train_memory_mb < plain.train_memory_mb and before.adds.train > plain.adds.train
    checkpointed.train()
    after = checkpointed.cost_report((16,))
    assert (after.train_memory_mb, after.adds.train) == (before.train_memory_mb, before.adds.train)


def test_lr_milestones_outside_the_run_or_not_a_list_are_refused(tmp_path, agnews_small):
    """A milestone past the run's end was ignored in silence (an absence there is refused); a bare
    number was a TypeError from list()."""
    with pytest.raises(ValueError, match=r"^lr_milestones must be a non-empty, strictly increasing list of epochs > 0 "
                                         r"\(or None\), got 3"):
        targs(tmp_path, lr_milestones=3, lr_scheduler_type="constant")
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, lr_milestones=[5], lr_scheduler_type="constant",
                                                                  max_steps=-1, num_train_epochs=1),
                                   train_dataset=agnews_small["train"])
    with pytest.raises(ValueError, match=r"^lr_milestones: epoch 5 is past the run's end \(\d+ steps, 1 epochs\): its "
                                         r"decay would never happen"):
        trainer.train()


def test_logging_steps_is_the_evaluation_interval_without_eval_steps(tmp_path):
    """transformers evaluates every logging_steps under eval_strategy='steps' without eval_steps,
    whatever the logging strategy: not refused as unread there."""
    assert targs(tmp_path, logging_strategy="epoch", logging_steps=7, eval_strategy="steps").eval_steps == 7


@pytest.mark.parametrize("setting", [dict(include_for_metrics=["inputs"]), dict(batch_eval_metrics=True)])
def test_a_setting_of_compute_metrics_without_one_is_refused(setting, tmp_path, agnews_small):
    """Both shape only what compute_metrics receives: without one they did nothing."""
    name, value = next(iter(setting.items()))
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))} is a setting of compute_metrics, and "
                                         r"none was given: pass compute_metrics"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **setting), train_dataset=agnews_small["train"])


@pytest.mark.parametrize("given, message", [
    (dict(model=DistilBertForTokenClassification), r"^model must be a torch\.nn\.Module, got the class "
                                                       r"DistilBertForTokenClassification \(a class: build it"),
    (dict(quant_config={"kernel": "int8"}), r"^quant_config must be a QuantConfig or None, got dict: "
                                            r"QuantConfig\(\*\*quant_config\)"),
    (dict(processing_class="bert-base-uncased"), r"^processing_class must be a tokenizer or processor .*got str: "
                                                 r"AutoTokenizer\.from_pretrained"),
    (dict(compute_metrics="accuracy"), r"^compute_metrics must be a function or None, got str"),
    (dict(data_collator="default"), r"^data_collator must be a function or None, got str"),
    (dict(optimizer_cls_and_kwargs="sgd"), r"^optimizer_cls_and_kwargs must be an \(optimizer class, keyword "
                                           r"arguments dict\) pair"),
    (dict(callbacks=EarlyStoppingCallback()), r"^callbacks must be a list of TrainerCallback instances "
                                                           r"or classes, got EarlyStoppingCallback: \[callback\]"),
    (dict(callbacks=["x"]), r"^callbacks must hold TrainerCallback instances or classes, got str"),
    (dict(train_dataset=["one text", "another"]), r"^train_dataset's samples must be dicts of the model's inputs "
                                                  r".*got str at index 0"),
    (dict(train_dataset="data.csv"), r"^train_dataset must be a data set, got a str: load it first"),
    (dict(eval_dataset=Dataset.from_dict({"text": ["a"]}).to_pandas()), r"^eval_dataset must be a data set, got a "
                                                                        r"pandas DataFrame"),
    (dict(eval_dataset=5), r"^eval_dataset must be a data set .*got int"),
    (dict(eval_dataset={0: []}), r"^eval_dataset's names must be strings \(they prefix its metrics\), got 0"),
    (dict(eval_dataset={}), r"^eval_dataset is an empty dict: it names no evaluation set"),
])
def test_an_argument_of_the_wrong_kind_is_refused_before_anything_is_built(given, message, tmp_path, agnews_small):
    """They failed deep inside transformers or torch, some only after training (a string
    processing_class at save_model), and quant_config=dict after the output folder was made."""
    kwargs = {"model": tiny_model(), "args": targs(tmp_path / "out"), "train_dataset": agnews_small["train"], **given}
    with pytest.raises(ValueError, match=message):
        DecentralizedTrainer(**kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting, message", [
    (dict(learning_rate=0.05), r"^learning_rate=0\.05 is not read when optimizer_cls_and_kwargs builds the optimizer: "
                               r"its keyword arguments set the LR \(no lr, so SGD's default\); pass lr=0\.05 in them"),
    (dict(optim="adamw_torch"), r"^optim='adamw_torch' builds AdamW, and optimizer_cls_and_kwargs builds SGD: "
                                r"transformers builds the pair's and ignores optim; leave optim at 'adamw_torch_fused' "
                                r"or name the same optimizer$"),
    (dict(adam_beta1=0.5), r"^adam_beta1=0\.5 is not read when optimizer_cls_and_kwargs builds the optimizer"),
])
def test_settings_an_optimizer_cls_and_kwargs_run_does_not_read_are_refused(setting, message, tmp_path, agnews_small):
    """The nodes trained at SGD's default LR 1e-3 with learning_rate=0.05 given, and optim,
    optim_args and adam_* were dropped without a word (as transformers does)."""
    with pytest.raises(ValueError, match=message):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, **setting), train_dataset=agnews_small["train"],
                             optimizer_cls_and_kwargs=(torch.optim.SGD, {"momentum": 0.9}))


def test_a_learning_rate_equal_to_the_pairs_lr_is_accepted_and_trained_with(tmp_path, agnews_small):
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, learning_rate=0.05),
                                   train_dataset=agnews_small["train"],
                                   optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}))
    trainer.train()
    assert trainer.node_optimizers[0].param_groups[0]["initial_lr"] == 0.05


def test_evaluate_of_an_empty_dict_is_refused_not_an_empty_result(tmp_path, agnews_small):
    """evaluate({}) returned {}: no metric, no error."""
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=agnews_small["train"])
    with pytest.raises(ValueError, match=r"^eval_dataset is an empty dict: it names no evaluation set"):
        trainer.evaluate({})


def test_splits_a_frame_or_too_few_rows_as_train_dataset_are_refused_naming_it(tmp_path, agnews_small):
    """A DatasetDict or a pandas DataFrame failed with a bare KeyError; three rows for four nodes
    only at train(), after the model had been quantized."""
    train = agnews_small["train"]
    for given, message in ((agnews_small, r"^train_dataset must be one data set, got a DatasetDict of splits "
                                          r"\['train', 'test'\]: pass one of them, e\.g\. data\['train'\]"),
                           (train.to_pandas(), r"^train_dataset must be a data set, got a pandas DataFrame: pass "
                                               r"datasets\.Dataset\.from_pandas\(df\)"),
                           (train.select(range(3)), r"^train_dataset has 3 rows, fewer than num_nodes=4")):
        with pytest.raises(ValueError, match=message):
            DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path), train_dataset=given)


def test_a_shard_column_with_a_missing_value_names_its_row(tmp_path, agnews_small):
    """The category names were listed as the bad values: "... or category names (strings), found
    ['b', 's', 't', 'w', None]"."""
    topics = ["w", "s", "b", "t"] * (len(agnews_small["train"]) // 4)
    topics[5] = None
    train = agnews_small["train"].select(range(len(topics))).add_column("topic", topics)
    with pytest.raises(ValueError, match=r"^train_dataset: shard_column 'topic' has no value \(None\) at row 5"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, skew=1.0, shard_column="topic"),
                             train_dataset=train)


@pytest.mark.parametrize("low_precision, kwargs, layers", [
    (False, None, [True, True]), (True, None, [True, True]),
    (True, {"every_n_layers": 2, "offload": True, "use_reentrant": False}, [True, False])])
def test_activation_checkpointing_is_enabled_on_every_node_and_changes_no_result(tmp_path, agnews_small, tokenizer,
                                                                                 low_precision, kwargs, layers):
    """In 8-bit too: the recomputed forward leaves the activation ranges as one forward does.
    ``every_n_layers`` and ``offload`` are Trainer's keys (not torch.utils.checkpoint's): every
    other layer checkpointed, its inputs kept on the host."""
    plain = trainer_for(tmp_path / "p", agnews_small, tokenizer, low_precision=low_precision)
    plain.train()
    checkpointed = trainer_for(tmp_path / "c", agnews_small, tokenizer, activation_checkpointing=True,
                               activation_checkpointing_kwargs=kwargs, low_precision=low_precision)
    checkpointed.train()
    assert all(node.is_activation_checkpointing for node in checkpointed.nodes)
    for node in checkpointed.nodes:
        assert [layer.gradient_checkpointing for layer in node.distilbert.transformer.layer] == layers
    for a, b in zip(plain.nodes, checkpointed.nodes):
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(p, q, msg=name)


def test_final_merge_leaves_every_node_equal_to_the_averaged_model(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, algorithm="choco", compression=90.0, final_merge=True,
                          skew=1.0)
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_consensus_distance"] == 0.0
    for i in range(4):
        assert metrics[f"eval_accuracy_node_{i}"] == metrics["eval_accuracy"]
        assert metrics[f"eval_loss_node_{i}"] == pytest.approx(metrics["eval_loss"], rel=1e-6)


class GrowingDistance(TrainerCallback):
    """Pushes node 0 of ``trainer`` away from the others after every step from ``start`` on, 1.5x
    further each time, after one push of ``kick`` at step 1."""

    def __init__(self, start=1, kick=0.0):
        self.trainer, self.start, self.kick = None, start, kick

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        push = (self.kick if step == 1 else 0.0) + (0.01 * 1.5 ** (step - self.start) if step >= self.start else 0.0)
        with torch.no_grad():
            for p in self.trainer.nodes[0].parameters():
                p.add_(push)


def drift_warnings(tmp_path, data, tokenizer, caplog, push=None, **kw) -> tuple[DecentralizedTrainer, list[str]]:
    push = push or GrowingDistance()
    trainer = trainer_for(tmp_path, data, tokenizer, algorithm="choco", callbacks=[push], **kw)
    push.trainer = trainer
    with caplog.at_level(logging.WARNING):
        trainer.train()
    return trainer, [r.getMessage() for r in caplog.records if "consensus distance grew" in r.getMessage()]


def test_drift_guard_warns_once_naming_the_distance_and_consensus_lr(tmp_path, agnews_small, tokenizer, caplog):
    trainer, warnings = drift_warnings(tmp_path, agnews_small, tokenizer, caplog, compression=90.0, max_steps=16)
    assert trainer.drift_warmup_steps() == 10  # 1 / the kept 10%
    assert len(warnings) == 1 and "consensus_lr (--consensus-lr, now 0.5)" in warnings[0]
    step = int(warnings[0].split("(step ")[1].split(")")[0])
    assert 10 <= step <= 16


def test_drift_guard_ignores_a_regrowth_below_the_runs_peak(tmp_path, agnews_small, tokenizer, caplog):
    # one large push at step 1 sets the peak; gossip pulls the nodes together, then they drift again
    trainer, warnings = drift_warnings(tmp_path, agnews_small, tokenizer, caplog, compression=0.0, max_steps=16,
                                       push=GrowingDistance(start=8, kick=1.0))
    distances = [log["consensus_distance"] for log in trainer.state.log_history if "consensus_distance" in log]
    regrowth = distances[-4:]  # the last 3 logs rose, by 2x or more, yet stayed below the step-1 peak
    assert all(a < b for a, b in zip(regrowth, regrowth[1:])) and regrowth[-1] >= 2 * regrowth[0]
    assert max(distances[1:]) < distances[0]
    assert warnings == []


def test_drift_guard_waits_while_sparse_messages_load_the_copies(tmp_path, agnews_small, tokenizer, caplog):
    # the same push at 1% top-k: all 16 steps lie within the 100 steps the copies need to hold the model
    trainer, warnings = drift_warnings(tmp_path, agnews_small, tokenizer, caplog, compression=99.0, max_steps=16)
    assert trainer.drift_warmup_steps() == 100 and warnings == []
    assert trainer.state.log_history[-2]["consensus_distance"] > 10 * trainer.state.log_history[3]["consensus_distance"]
    # QSGD's messages carry the whole model shrunk by its quality: 1 level (1/33) warned at step 32 of a
    # warm-up that peaked at step 88
    assert trainer_for(tmp_path, agnews_small, tokenizer, compressor="qsgd", qsgd_levels=1).drift_warmup_steps() == 99
    assert trainer_for(tmp_path, agnews_small, tokenizer, compressor="qsgd").drift_warmup_steps() == 9


@pytest.mark.parametrize("kwargs, field", [
    (dict(learning_rate=float("nan")), "learning_rate"), (dict(learning_rate=float("inf")), "learning_rate"),
    (dict(learning_rate=-1e-3), "learning_rate"), (dict(per_device_train_batch_size=8.0), "per_device_train_batch_size"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"), (dict(num_nodes=10**9), "num_nodes"),
    (dict(weight_decay=float("nan")), "weight_decay"), (dict(adam_beta2=1.0), "adam_beta2"),
    (dict(skew=float("nan")), "skew"), (dict(lr_decay=float("nan")), "lr_decay"),
    (dict(num_train_epochs=float("inf"), max_steps=-1), "num_train_epochs"), (dict(seed=-1), "seed"),
    (dict(compression=float("nan")), "compression"), (dict(consensus_lr=float("inf")), "consensus_lr"),
    (dict(gossip_timeout=float("nan")), "gossip_timeout"), (dict(max_grad_norm=float("inf")), "max_grad_norm"),
    (dict(logging_steps=float("nan")), "logging_steps"), (dict(save_total_limit=1.5), "save_total_limit"),
])
def test_bad_numbers_are_refused_naming_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        targs(tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(fp16_full_eval=True), "fp16_full_eval"), (dict(eval_use_gather_object=True), "eval_use_gather_object"),
    (dict(save_on_each_node=True), "save_on_each_node"), (dict(average_tokens_across_devices=True),
                                                      "average_tokens_across_devices"),
    (dict(use_liger_kernel=True), "use_liger_kernel"),
    (dict(logging_nan_inf_filter=False), "logging_nan_inf_filter"),
])
def test_settings_the_trainer_cannot_honour_are_refused_with_a_reason(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.* is not supported by DecentralizedTrainer \(.+\); leave it at"):
        targs(tmp_path, **kwargs)


def linear_output_dtypes(trainer) -> dict:
    """Hooks on every ``nn.Linear`` of `trainer`'s nodes and averaged model, filling ``{(model,
    layer type, training): {output dtypes}}`` as they run; model is ``"node"`` or ``"average"``."""
    seen = {}
    for which, models in (("node", trainer.nodes), ("average", [trainer.model])):
        for model in models:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_hook(lambda m, args, out, which=which: seen.setdefault(
                        (which, type(m).__name__, m.training), set()).add(out.dtype))
    return seen


def test_bf16_runs_every_nodes_forward_under_bfloat16_autocast_and_keeps_float32_weights(
        tmp_path, agnews_small, tokenizer):
    """Trainer's mixed precision (accelerate's autocast of the model it prepares) on every node, in
    training and in evaluation (each node and the averaged model); weights and gossip stay fp32."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, bf16=True)
    seen = linear_output_dtypes(trainer)
    trainer.train()
    metrics = trainer.evaluate()
    assert seen == {("node", "Linear", True): {torch.bfloat16}, ("node", "Linear", False): {torch.bfloat16},
                    ("average", "Linear", False): {torch.bfloat16}}
    assert {p.dtype for node in trainer.nodes for p in node.parameters()} == {torch.float32}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert np.isfinite(metrics["eval_loss"]) and trainer.state.global_step == 2
    float32 = trainer_for(tmp_path / "fp32", agnews_small, tokenizer)  # the same run without autocast
    float32.train()
    assert float32.evaluate()["eval_loss"] != metrics["eval_loss"]


def test_bf16_keeps_the_8bit_layers_gemms_in_float32(tmp_path, agnews_small, tokenizer):
    """The 8-bit layers turn autocast off (a bfloat16 product cannot hold the 8-bit grid); the float
    heads around them (DEFAULT_SKIP) run in bfloat16."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, bf16=True, low_precision=True)
    seen = linear_output_dtypes(trainer)
    trainer.train()
    trainer.evaluate()
    for which, training in (("node", True), ("node", False), ("average", False)):
        assert seen[(which, "QuantLinear", training)] == {torch.float32}
        assert seen[(which, "Linear", training)] == {torch.bfloat16}


def test_accelerate_launch_mixed_precision_bf16_autocasts_the_nodes_too(tmp_path, agnews_small, tokenizer,
                                                                       monkeypatch):
    """``accelerate launch --mixed_precision bf16`` sets ACCELERATE_MIXED_PRECISION, not bf16: Trainer
    trains under autocast then, and so do the nodes (they ran in float32 before: the setting was
    silently ignored)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    trainer = trainer_for(tmp_path, agnews_small, tokenizer)
    assert not trainer.args.bf16 and trainer.args.mixed_precision == "bf16"
    seen = linear_output_dtypes(trainer)
    trainer.train()
    assert seen == {("node", "Linear", True): {torch.bfloat16}}


def test_fp16_autocasts_every_node_and_unscales_its_gradients_with_a_loss_scaler_per_node(
        tmp_path, agnews_small, tokenizer, caplog):
    """float16 autocast as bf16 does, with one GradScaler per node: the gradient clipped, logged and
    stepped with is the true one, not the loss-scaled one (65536 times larger). On the CPU (where
    Trainer leaves fp16 off) a warning says it is usually slower than float32 there."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, fp16=True, low_precision=True)
    seen = linear_output_dtypes(trainer)
    trainer.train()
    assert ("fp16 on the CPU: few CPUs multiply float16 in hardware, so float16 autocast is usually several times "
            "slower than float32 there; bf16 is the CPU's mixed precision") in caplog.text
    metrics = trainer.evaluate()
    for which, training in (("node", True), ("node", False), ("average", False)):
        assert seen[(which, "QuantLinear", training)] == {torch.float32}
        assert seen[(which, "Linear", training)] == {torch.float16}
    assert {p.dtype for node in trainer.nodes for p in node.parameters()} == {torch.float32}
    assert len(trainer.node_scalers) == 4 and len({id(s) for s in trainer.node_scalers}) == 4
    assert [s.get_scale() for s in trainer.node_scalers] == [2.0 ** 16] * 4  # no overflow in two steps
    assert trainer.overflow_skips.tolist() == [0] * 4 and np.isfinite(metrics["eval_loss"])
    float32 = trainer_for(tmp_path / "fp32", agnews_small, tokenizer, low_precision=True)
    float32.train()
    first, first32 = trainer.state.log_history[0], float32.state.log_history[0]
    assert first["overflow_skips_node_0"] == 0 and "overflow_skips_node_0" not in first32
    assert first["grad_norm"] == pytest.approx(first32["grad_norm"], rel=0.05)  # step 1: both from the same weights
    assert first["loss"] == pytest.approx(first32["loss"], rel=0.01) and first["loss"] != first32["loss"]


class _HugeInitialScale(torch.amp.GradScaler):
    """A loss scale of 2^40: every float16 gradient overflows until it has backed off to ~2^16."""

    def __init__(self, device="cuda", init_scale=2.0 ** 40, **kwargs):
        super().__init__(device, init_scale=init_scale, **kwargs)


def test_fp16_overflow_skips_the_nodes_update_and_lowers_its_scale_without_an_error(
        tmp_path, agnews_small, tokenizer, monkeypatch):
    """An overflowing float16 gradient is the loss scaler's doing, not the model's: no NonFiniteError
    (skip_nonfinite is off), the node does not move (gossip among equal nodes moves them by float
    rounding only) and its scale halves, as GradScaler.step does; the logged loss is the true one,
    and torch's warning about a schedule stepped before its optimizer is not shown (the schedules
    follow the global step by design)."""
    monkeypatch.setattr(torch.amp, "GradScaler", _HugeInitialScale)
    record = RecordUpdates()
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, fp16=True, callbacks=[record])
    start = [p.detach().clone() for p in trainer.model.parameters()]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in shown if "lr_scheduler.step()" in str(w.message)]
    assert [s.get_scale() for s in trainer.node_scalers] == [2.0 ** 38] * 4
    assert trainer.overflow_skips.tolist() == [2] * 4 and trainer.nonfinite_skips.tolist() == [0] * 4
    assert [event for event, _ in record.events] == []  # no node reached its optimizer step
    for node in trainer.nodes:
        assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(node.parameters(), start))
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["overflow_skips_node_3"] for log in logs] == [1, 2] and all(np.isfinite(log["loss"]) for log in logs)


def test_fp16_still_stops_at_a_non_finite_loss(tmp_path, agnews_small, tokenizer):
    """A NaN loss is the model's, not an overflow: NonFiniteError names it as without fp16."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, fp16=True)
    with torch.no_grad():
        next(trainer.nodes[2].parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="node 2, step 1: non-finite loss"):
        trainer.train()


def test_accelerate_launch_mixed_precision_fp16_autocasts_the_nodes_with_loss_scalers(
        tmp_path, agnews_small, tokenizer, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    trainer = trainer_for(tmp_path, agnews_small, tokenizer)
    assert not trainer.args.fp16 and trainer.args.mixed_precision == "fp16"
    seen = linear_output_dtypes(trainer)
    trainer.train()
    assert seen == {("node", "Linear", True): {torch.float16}} and len(trainer.node_scalers) == 4


class EmbeddingNoise(TrainerCallback):
    """Per training forward of each node: whether its input embeddings gave more than the plain
    lookup of the batch, read by a forward hook registered at the first step (after NEFTune's)."""

    def __init__(self, trainer):
        self.trainer, self.noisy = trainer, []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            for node in self.trainer.nodes:
                node.get_input_embeddings().register_forward_hook(self.check)

    def check(self, module, args, output):
        if module.training:
            self.noisy.append(not torch.equal(output, torch.nn.functional.embedding(args[0], module.weight)))


def test_neftune_adds_noise_to_every_nodes_embeddings_in_training_only_and_is_removed_after(
        tmp_path, agnews_small, tokenizer):
    """Trainer's NEFTune on each node, drawn in the node's RNG stream: a run repeats exactly; the
    noise changes training, not evaluation; after train() the nodes' embeddings are plain again."""
    runs = []
    for alpha in (5.0, 5.0, None):
        trainer = trainer_for(tmp_path / str(len(runs)), agnews_small, tokenizer, neftune_noise_alpha=alpha)
        record = EmbeddingNoise(trainer)
        trainer.add_callback(record)
        trainer.train()
        runs.append((trainer, record.noisy, trainer.state.log_history[0]["loss"]))
    (noisy, noisy_seen, loss), (again, _, loss_again), (plain, plain_seen, loss_plain) = runs
    assert noisy_seen == [True] * 8 and plain_seen == [False] * 8  # 4 nodes x 2 steps
    assert loss == loss_again and loss != loss_plain
    for a, b in zip(noisy.nodes, again.nodes):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for node in noisy.nodes:
        embeddings = node.get_input_embeddings()
        assert len(embeddings._forward_hooks) == 1 and not hasattr(embeddings, "neftune_noise_alpha")  # ours only
    noisy.nodes[0].train()  # removed: the same forward as a model that never had it
    batch = {k: v for k, v in tokenizer(["a short text"], return_tensors="pt").items() if k != "token_type_ids"}
    with torch.no_grad():
        torch.testing.assert_close(noisy.nodes[0](**batch).logits, noisy.nodes[0](**batch).logits, rtol=0, atol=0)


@pytest.mark.parametrize("alpha, message", [(0.0, r"neftune_noise_alpha must be a number in \(0, 10000\], got 0.0"),
                                            (5.0, r"neftune_noise_alpha=5.0 adds noise to the model's input "
                                                  r"embeddings, and Linear has none")])
def test_neftune_is_refused_naming_the_field_without_a_positive_alpha_or_input_embeddings(tmp_path, alpha, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        DecentralizedTrainer(model=torch.nn.Linear(4, 2), args=targs(tmp_path, neftune_noise_alpha=alpha))


def first_batches(trainer) -> list[list[int]]:
    """The first training batch's input ids of every node (its shard and order)."""
    return [next(iter(loader))["input_ids"][:, 1].tolist() for loader in trainer.node_dataloaders()]


def test_data_seed_chooses_the_shards_and_data_order_and_seed_the_rest(tmp_path, agnews_small, tokenizer):
    """data_seed, when set, takes seed's place for the data (SPEC 6 shards, order, batch seeds), as
    it seeds Trainer's samplers; the nodes' RNG streams (dropout) stay with seed."""
    def trainer(seed, data_seed=None):
        args = targs(tmp_path / f"{seed}_{data_seed}", seed=seed, data_seed=data_seed, max_steps=1, skew=0.5)
        return DecentralizedTrainer(model=tiny_model(dropout=0.5), args=args, train_dataset=agnews_small["train"])

    plain, data_only, model_only = trainer(0), trainer(0, data_seed=7), trainer(7)
    assert first_batches(data_only) == first_batches(model_only) != first_batches(plain)
    losses = [t.train().training_loss for t in (plain, data_only, model_only)]
    assert len(set(losses)) == 3  # dropout follows seed: data_only and model_only read the same batches


@pytest.mark.parametrize("skip", [False, True])
def test_memory_metrics_are_reported_for_train_evaluate_and_predict_unless_skipped(tmp_path, agnews_small, tokenizer,
                                                                                   skip):
    """Trainer's TrainerMemoryTracker (this process's memory: every local node together)."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, skip_memory_metrics=skip)
    metrics = {"train": trainer.train().metrics, "eval": trainer.evaluate(),
               "test": trainer.predict(agnews_small["test"]).metrics}
    for stage, values in metrics.items():
        memory = {k: v for k, v in values.items() if "_mem_" in k}
        if skip:
            assert memory == {}
        else:
            assert {f"{stage}_mem_cpu_alloc_delta", f"{stage}_mem_cpu_peaked_delta"} <= set(memory)
            assert all(isinstance(v, int) for v in memory.values()) and memory[f"{stage}_mem_cpu_peaked_delta"] >= 0


def test_model_card_gives_the_decentralized_setting_and_the_averaged_models_results(tmp_path, agnews_small,
                                                                                     tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, bf16=True, skew=0.5, algorithm="deepsqueeze",
                          compression=99.0, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.create_model_card(model_name="tiny-decentralized")
    card = (tmp_path / "README.md").read_text()
    for line in ("num_nodes: 4", "algorithm: deepsqueeze", "compressor: TopK(keep=0.01, value_bits=None)", "precision: float32",
                 "label_skew: 0.5", "train_batch_size: 4", "total_train_batch_size: 32",
                 "mixed_precision_training: Native AMP (bf16 autocast per node)", f"Loss: {metrics['eval_loss']:.4f}",
                 f"Consensus Distance: {metrics['eval_consensus_distance']:.4g}", "decentralized", "lp_decentral_nlp"):
        assert f"- {line}\n" in card, line  # the distance was rounded to four decimals (0.0); the tags were the recipes'
    assert "Node" not in card
    assert ("## Model description\n\nThe averaged model of 4 nodes trained by decentralized deepsqueeze with "
            "lp_decentral_nlp (hyperparameters below), in float32. `from_pretrained` loads it") in card


def test_the_best_model_by_consensus_distance_is_the_least_divergent(tmp_path, agnews_small, tokenizer):
    """greater_is_better unset followed Trainer's rule (greater unless the name ends in "loss"): the
    "best" checkpoint by consensus_distance was the most divergent one, by loss_node_<i> the worst."""
    for metric, greater in (("consensus_distance", False), ("eval_loss_node_1", False), ("bytes_sent_node_0", False),
                            ("accuracy_node_0", True), ("loss", False), ("val_consensus_distance", False),
                            ("eval_val_bytes_sent_node_1", False), ("val_accuracy_node_0", True)):
        assert targs(tmp_path, metric_for_best_model=metric, eval_strategy="steps").greater_is_better is greater, metric
    assert targs(tmp_path, metric_for_best_model="consensus_distance", greater_is_better=True,
                 eval_strategy="steps").greater_is_better
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=3, eval_strategy="steps", eval_steps=1,
                          save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                          metric_for_best_model="consensus_distance")
    trainer.train()
    distances = [log["eval_consensus_distance"] for log in trainer.state.log_history if "eval_consensus_distance" in log]
    assert len(distances) == 3 and len(set(distances)) == 3
    assert trainer.state.best_metric == min(distances)


def test_a_transform_that_renames_label_to_labels_trains_with_skewed_shards(tmp_path, agnews_small, tokenizer):
    """A with_transform making ``labels`` from the stored ``label`` (the usual idiom) was a KeyError
    'label' at construction: the shard labels' column was looked up in a transformed row."""
    def to_labels(batch):
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["label"]}

    def node_classes(train):
        trainer = trainer_for(tmp_path, {"train": train, "test": agnews_small["test"]}, tokenizer, skew=1.0,
                              max_steps=1, remove_unused_columns=False)
        return trainer, [collections.Counter(int(label) for batch in loader for label in batch["labels"])
                         for loader in trainer.node_dataloaders()]

    train = agnews_small["train"].with_transform(to_labels)
    trainer, classes = node_classes(train)
    assert classes == node_classes(agnews_small["train"])[1]  # skewed on the stored labels, as without the transform
    assert [counts.most_common(1)[0][0] for counts in classes] != [classes[0].most_common(1)[0][0]] * 4
    trainer.train()
    with pytest.raises(ValueError, match=r"^train_dataset makes its samples with a transform .* pass remove_unused_columns=False$"):
        trainer_for(tmp_path, {"train": train, "test": agnews_small["test"]}, tokenizer, skew=0.5)


def test_a_construction_trainer_refuses_leaves_the_users_model_float(tmp_path, agnews_small, tokenizer):
    """Trainer.__init__'s own refusals (here: an evaluation schedule without an eval_dataset) came after
    the 8-bit surgery: the user's model was left 8-bit, and the retry in full precision refused it."""
    model = tiny_model()
    layers = {name: type(module) for name, module in model.named_modules()}
    with pytest.raises(ValueError, match="eval_dataset"):
        DecentralizedTrainer(model=model, args=targs(tmp_path, low_precision=True, eval_strategy="steps", eval_steps=1),
                             train_dataset=agnews_small["train"], processing_class=tokenizer)
    assert {name: type(module) for name, module in model.named_modules()} == layers
    assert getattr(model.config, "quantization_config", None) is None
    DecentralizedTrainer(model=model, args=targs(tmp_path), train_dataset=agnews_small["train"],
                         processing_class=tokenizer)  # full precision (targs' default) takes it


def test_model_card_of_a_model_from_a_local_folder_is_not_trained_from_scratch(tmp_path, agnews_small, tokenizer):
    """Trainer's card calls a model loaded from a local folder "trained from scratch": the card names
    the folder, or the base model the folder's own card names (a checkpoint Trainer or a recipe wrote)."""
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "checkpoints" / "my-bert"
    tiny_model().save_pretrained(folder)

    def card_after_training(out):
        model = AutoModelForSequenceClassification.from_pretrained(folder)
        trainer = DecentralizedTrainer(model=model, args=targs(out, max_steps=1), train_dataset=agnews_small["train"],
                                       processing_class=tokenizer)
        trainer.train()
        trainer.create_model_card()
        return (out / "README.md").read_text()

    card = card_after_training(tmp_path / "a")
    assert "This model is a fine-tuned version of the local checkpoint `checkpoints/my-bert` on " in card
    assert "from scratch" not in card and "base_model" not in card
    (folder / "README.md").write_text("---\nbase_model: google-bert/bert-base-uncased\nlicense: mit\n---\n# notes\n")
    card = card_after_training(tmp_path / "b")
    assert "base_model: google-bert/bert-base-uncased\n" in card and "local checkpoint" not in card
    assert "This model is a fine-tuned version of [google-bert/bert-base-uncased](" in card
    (folder / "README.md").write_text("---\nbase_model: [a, b\n---\n")  # metadata that does not parse
    assert "the local checkpoint `checkpoints/my-bert`" in card_after_training(tmp_path / "c")


class FakeHub:
    """``transformers.trainer.hf_api()`` offline: records the repos created and the folders uploaded
    (their file names at upload time)."""

    def __init__(self):
        self.repos, self.uploads = [], []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append(repo_id)
        return types.SimpleNamespace(repo_id=f"someone/{repo_id}" if "/" not in repo_id else repo_id)

    def upload_folder(self, repo_id, folder_path, run_as_future=False, **kwargs):
        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        self.uploads.append({"repo_id": repo_id, "files": files, **kwargs})
        if run_as_future:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        return None


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
def test_push_to_hub_uploads_the_averaged_model_and_its_card_as_trainer_does(tmp_path, agnews_small, tokenizer,
                                                                             monkeypatch, strategy):
    """Trainer's Hub machinery through this trainer's save_model, checkpoints and model card: at
    each save the averaged model and output_dir (never the checkpoints inside it), with
    hub_strategy='checkpoint' the whole decentralized checkpoint as last-checkpoint too; and
    push_to_hub() at the end with the card."""
    hub = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, push_to_hub=True, hub_model_id="tiny-decentralized",
                          hub_strategy=strategy, save_strategy="steps", save_steps=2, max_steps=4)
    assert hub.repos == ["tiny-decentralized"] and trainer.hub_model_id == "someone/tiny-decentralized"
    trainer.train()
    trainer.push_to_hub()
    folder_uploads = [u for u in hub.uploads if "path_in_repo" not in u]
    checkpoint_uploads = [u for u in hub.uploads if "path_in_repo" in u]
    assert [u["commit_message"] for u in folder_uploads] == ["Training in progress, step 2",
                                                             "Training in progress, step 4", "End of training"]
    for upload in folder_uploads:
        assert upload["repo_id"] == "someone/tiny-decentralized" and "model.safetensors" in upload["files"]
        assert upload["ignore_patterns"] == ["_*", "checkpoint-*"]
    assert "README.md" in folder_uploads[-1]["files"]
    assert "- num_nodes: 4" in (tmp_path / "README.md").read_text()
    if strategy == "checkpoint":
        assert [u["path_in_repo"] for u in checkpoint_uploads] == ["last-checkpoint"] * 2
        assert {"node-0.safetensors", "node-3.safetensors", "decentralized_state.json"} <= set(
            checkpoint_uploads[-1]["files"])
    else:
        assert checkpoint_uploads == []


@pytest.mark.parametrize("drop_last, samples", [(False, 32), (True, 24)])
def test_dataloader_drop_last_drops_the_last_partial_evaluation_batch(tmp_path, agnews_small, tokenizer, drop_last,
                                                                       samples):
    """As in Trainer: 32 evaluation samples in batches of 12 are 2 full batches and one of 8, which
    dataloader_drop_last leaves out (training drops its last partial batch either way)."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, per_device_eval_batch_size=12,
                          dataloader_drop_last=drop_last)
    assert trainer.predict(agnews_small["test"]).predictions.shape == (samples, 4)
    metrics = trainer.evaluate()
    assert metrics["eval_samples_per_second"] == pytest.approx(samples / metrics["eval_runtime"], rel=0.05)


@pytest.mark.parametrize("named", [False, True])
def test_persistent_workers_keep_the_evaluation_loaders_across_evaluations(tmp_path, agnews_small, tokenizer, named):
    """As in Trainer: with dataloader_persistent_workers the trainer's own evaluation sets keep their
    loaders (and so their worker processes) from one evaluate() to the next; a set passed in does not."""
    sets = {"a": agnews_small["test"], "b": agnews_small["test"].select(range(8))} if named else agnews_small["test"]
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, eval_dataset=sets, dataloader_num_workers=1,
                          dataloader_persistent_workers=True)
    names = ["a", "b"] if named else [None]
    loaders = [trainer.get_eval_dataloader(name) for name in names]
    assert [trainer.get_eval_dataloader(name) for name in names] == loaders  # kept
    first = trainer.evaluate()
    assert trainer.evaluate().keys() == first.keys()
    assert all(trainer.get_eval_dataloader(name) is loader for name, loader in zip(names, loaders))  # evaluate's own
    assert trainer.get_eval_dataloader(agnews_small["test"]) is not trainer.get_eval_dataloader(agnews_small["test"])
    plain = trainer_for(tmp_path / "plain", agnews_small, tokenizer, eval_dataset=sets, dataloader_num_workers=1)
    assert plain.get_eval_dataloader(names[0]) is not plain.get_eval_dataloader(names[0])  # Trainer keeps none either


def test_debug_underflow_overflow_watches_every_node_and_stops_at_the_first_nan_activation(
        tmp_path, agnews_small, tokenizer, capsys):
    """transformers' DebugUnderflowOverflow on each node: a clean run is unchanged; a NaN weight on
    one node stops the run at its first forward, with the frames that led to it printed."""
    watched = trainer_for(tmp_path / "watched", agnews_small, tokenizer, debug="underflow_overflow")
    plain = trainer_for(tmp_path / "plain", agnews_small, tokenizer)
    assert watched.train().training_loss == plain.train().training_loss
    poisoned = trainer_for(tmp_path / "poisoned", agnews_small, tokenizer, debug="underflow_overflow")
    with torch.no_grad():
        poisoned.nodes[2].get_input_embeddings().weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="^DebugUnderflowOverflow: inf/nan detected"):
        poisoned.train()
    assert "Detected inf/nan during batch_number=0" in capsys.readouterr().out


def test_debug_tpu_metrics_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^debug='tpu_metrics_debug' prints torch_xla's TPU metrics"):
        targs(tmp_path, debug="tpu_metrics_debug")


def test_accelerate_launch_mixed_precision_fp8_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match=r"^mixed precision fp8 \(ACCELERATE_MIXED_PRECISION=fp8, set by accelerate "
                                         r"launch --mixed_precision fp8 or its config\) is not supported"):
        targs(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers' answer on a machine without a GPU")
def test_bf16_on_a_cpu_without_use_cpu_gets_transformers_answer_naming_use_cpu(tmp_path):
    with pytest.raises(ValueError, match="use_cpu"):
        DecentralizedTrainingArguments(output_dir=str(tmp_path), report_to="none", bf16=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(qgm_beta=0.5), r"qgm_beta=0.5 is the quasi-global momentum's beta, and qgm=False: set qgm=True, or leave "
                         r"qgm_beta at 0.9"),
    (dict(lr_decay=0.5), r"lr_decay=0.5 is the factor at each of lr_milestones, and lr_milestones=None"),
    (dict(gossip_timeout=5.0), r"gossip_timeout=5.0 is how long a process waits for its peers, and "
                               r"backend='simulated' runs every node in this process"),
    (dict(compressor="randomk"), r"compressor='randomk' chooses which entries compression > 0 drops, and "
                                 r"compression=0 sends every entry"),
    (dict(optim="schedule_free_adamw"), r"optim='schedule_free_adamw' is not supported by DecentralizedTrainer \(a "
                                        r"schedule-free optimizer keeps a second weight sequence"),
    (dict(optim="lomo"), r"optim='lomo' is not supported by DecentralizedTrainer \(LOMO updates each weight inside "
                         r"backward"),
    (dict(optim="galore_adamw_layerwise"), r"optim='galore_adamw_layerwise' is not supported by DecentralizedTrainer "
                                           r"\(GaLore needs optim_target_modules"),
    (dict(dataloader_persistent_workers=True), r"dataloader_persistent_workers=True is a setting of dataloader worker "
                                               r"processes, and dataloader_num_workers=0 starts none"),
    (dict(dataloader_multiprocessing_context="spawn"), r"dataloader_multiprocessing_context='spawn' is a setting of "
                                                       r"dataloader worker processes"),
    (dict(lr_scheduler_type="constant", warmup_steps=4), "warmup_steps=4 has no effect with lr_scheduler_type="),
    (dict(lr_scheduler_type="constant", lr_milestones=[1.0], warmup_steps=0.1),
     r"warmup_steps=0.1 has no effect with lr_milestones \(a multi-step schedule\): leave warmup_steps at 0"),
    (dict(lr_scheduler_type="constant", lr_milestones=[1.0], lr_scheduler_kwargs={"min_lr": 0.0}),
     "lr_scheduler_kwargs=.* has no effect with lr_milestones"),
])
def test_a_constant_schedule_refuses_warmup_and_options_it_would_ignore(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        targs(tmp_path, **kwargs)


def test_train_refuses_arguments_it_would_ignore(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer)
    with pytest.raises(TypeError, match="resume_from_checkpiont"):  # a typo, as Trainer.train refuses it
        trainer.train(resume_from_checkpiont=True)
    with pytest.raises(ValueError, match="^trial is for Trainer.hyperparameter_search"):
        trainer.train(trial={"learning_rate": 1e-3})
    assert trainer.state.global_step == 0


def test_quant_kernel_reaches_the_surgery_and_a_disagreeing_quant_config_is_refused(tmp_path, agnews_small):
    from lp_decentral_nlp.quant import QuantConfig, QuantModule

    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, low_precision=True, quant_kernel="simulated"),
                                   train_dataset=agnews_small["train"])
    assert {m.quant_config.kernel for m in trainer.model.modules() if isinstance(m, QuantModule)} == {"simulated"}
    with pytest.raises(ValueError, match="quant_kernel='int8' disagrees with quant_config.kernel='simulated'"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, low_precision=True, quant_kernel="int8"),
                             quant_config=QuantConfig(kernel="simulated"), train_dataset=agnews_small["train"])
    with pytest.raises(ValueError, match="quant_kernel must be one of"):
        targs(tmp_path, quant_kernel="fast")


def test_docs_list_every_field_with_its_treatment():
    import pathlib

    from lp_decentral_nlp.trainer.field_policy import field_table

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "trainer.md").read_text()
    assert field_table(DecentralizedTrainingArguments) in doc


def test_torch_compile_compiles_every_node(tmp_path, agnews_small, tokenizer):
    plain = trainer_for(tmp_path / "p", agnews_small, tokenizer, num_nodes=2, max_steps=1)
    plain.train()
    trainer = trainer_for(tmp_path / "c", agnews_small, tokenizer, num_nodes=2, max_steps=1, torch_compile=True,
                          torch_compile_backend="eager")
    traced = {0: [], 1: []}
    for k, node in enumerate(trainer.nodes):  # a hook runs inside the compiled call when the node is compiled
        node.register_forward_pre_hook(lambda module, args, k=k: traced[k].append(torch.compiler.is_compiling()))
    trainer.train()
    assert all(any(seen) for seen in traced.values())
    for a, b in zip(plain.nodes, trainer.nodes):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q)


def test_accelerate_launch_dynamo_backend_compiles_every_node_too(tmp_path, agnews_small, tokenizer, monkeypatch):
    """``accelerate launch --dynamo_backend`` sets ACCELERATE_DYNAMO_BACKEND, not torch_compile:
    Trainer's model is compiled then, and the nodes were not (the setting was silently ignored)."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, num_nodes=2, max_steps=1)
    assert not trainer.args.torch_compile
    traced = {0: [], 1: []}
    for k, node in enumerate(trainer.nodes):
        node.register_forward_pre_hook(lambda module, args, k=k: traced[k].append(torch.compiler.is_compiling()))
    trainer.train()
    assert all(any(seen) for seen in traced.values())


def test_accelerate_launch_regional_compilation_compiles_each_block_alone(tmp_path, agnews_small, tokenizer,
                                                                           monkeypatch):
    """``--dynamo_use_regional_compilation`` was dropped: every node was compiled whole. Now as accelerate's
    compile_regions: each transformer block compiled alone (in place: the parameter names stay)."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, num_nodes=2, max_steps=1)
    names = [list(node.state_dict()) for node in trainer.nodes]
    trainer.train()
    for node, before in zip(trainer.nodes, names):
        compiled = {name for name, m in node.named_modules() if m._compiled_call_impl is not None}
        blocks = {name for name, m in node.named_modules() if re.fullmatch(r".*\.layer\.\d+", name)}
        assert blocks and blocks <= compiled and "" not in compiled  # the blocks, not the whole node
        assert list(node.state_dict()) == before


def test_a_refused_dataset_leaves_the_users_model_as_it_was(tmp_path, agnews_small):
    from lp_decentral_nlp.quant import QuantModule

    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="skew=0.5 needs a column of class ids"):
        DecentralizedTrainer(model=model, args=targs(tmp_path, skew=0.5, low_precision=True),
                             train_dataset=agnews_small["train"].rename_column("label", "target"))
    assert not any(isinstance(m, QuantModule) for m in model.modules())  # no 8-bit surgery happened
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_simulated_node_group_holds_every_node_in_this_process():
    from lp_decentral_nlp.trainer import NodeGroup

    group = NodeGroup(3, "simulated")
    assert group.node_ids == [0, 1, 2] and group.is_main and group.transport(timeout=1.0) is None
    per_node = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(group.gather(per_node), per_node)
    assert [t.tolist() for t in group.sum([[torch.ones(2), torch.full((1,), float(i))] for i in range(3)])] == \
        [[3.0, 3.0], [3.0]]
    assert group.gather_objects({"a": 1}) == [{"a": 1}]
    before = torch.ones(2)
    group.broadcast_([before])  # one process: nothing to receive
    assert torch.equal(before, torch.ones(2))
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        NodeGroup(3, "distributed")


def test_the_node_group_names_the_first_setting_a_process_was_given_otherwise(monkeypatch):
    from lp_decentral_nlp.trainer import NodeGroup

    group = NodeGroup(3, "simulated")
    assert group.disagreement({"lr": 0.1}) is None  # one process: nothing to compare
    group.distributed = True  # three processes' settings, as the gather returns them
    every = [{"lr": 0.1, "tensors": ["w (2,)", "act (1,)"]}, {"lr": 0.1, "tensors": ["w (2,)", "act (1,)"]},
             {"lr": 0.1, "tensors": ["w (2,)"]}]
    monkeypatch.setattr(group, "gather_objects", lambda settings: every)
    assert group.disagreement({}) == ("tensors[1]", 2, None, "act (1,)")  # a list: its first differing entry
    every[1]["lr"], every[2]["extra"] = 0.2, 1
    assert group.disagreement({}) == ("lr", 1, 0.2, 0.1)
    every[1]["lr"], every[2]["tensors"] = 0.1, every[0]["tensors"]
    assert group.disagreement({}) == ("extra", 2, 1, None)  # a setting process 0 lacks


def test_averaging_simulated_nodes_holds_one_sum_at_a_time():
    """The sum stacked every node's copy of a tensor first: num_nodes times the largest tensor at
    every log, evaluation and checkpoint (an audit measured +498 MB at 16 nodes of a 34 MB model
    whose embedding is 29 MB), the run's memory peak."""
    from torch.profiler import ProfilerActivity, profile

    from lp_decentral_nlp.trainer import NodeGroup

    nodes = [[torch.randn(1000, 100), torch.randn(10, dtype=torch.float64), torch.randn(7).bfloat16()]
             for _ in range(16)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sums = NodeGroup(16, "simulated").sum(nodes)
    assert max(event.cpu_memory_usage for event in prof.events()) <= 1000 * 100 * 4  # one sum of the largest
    for j, total in enumerate(sums):  # the nodes added in node order, 16-bit ones in float32
        expected = nodes[0][j].float() if j == 2 else nodes[0][j].clone()
        for node in nodes[1:]:
            expected += node[j]
        assert total.dtype == expected.dtype and torch.equal(total, expected)
    # a 16-bit sum stays float32 for the caller to divide: 16 float16 nodes at 5000 summed to inf
    assert NodeGroup(16, "simulated").sum([[torch.full((3,), 5000.0, dtype=torch.float16)]] * 16)[0].tolist() == \
        [80000.0] * 3


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_the_distributed_node_group_gathers_and_sums_cpu_counters_on_any_backend(tmp_path, backend):
    """The trainer's counters (bytes sent, skipped steps) are CPU tensors; NCCL reduces CUDA
    tensors only, so the group moves them for the collective and hands back CPU tensors."""
    import torch.distributed as dist

    from lp_decentral_nlp.trainer import NodeGroup

    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = NodeGroup(1, "distributed")
        counters = torch.tensor([123456789012], dtype=torch.int64)
        gathered = group.gather(counters)
        assert gathered.device.type == "cpu" and gathered.tolist() == [123456789012]
        (total,) = group.sum([[torch.tensor([1.5, 2.0])]])
        assert total.device.type == "cpu" and total.tolist() == [1.5, 2.0]
    finally:
        dist.destroy_process_group()


def test_more_processes_than_gpus_over_nccl_are_refused_naming_the_counts(tmp_path, monkeypatch):
    """accelerate puts the ranks of a machine with fewer GPUs on one device, which NCCL refuses at
    the first collective with an error the trainer read as a peer that stopped answering."""
    import torch.distributed as dist

    from lp_decentral_nlp.trainer import NodeGroup

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        with pytest.raises(RuntimeError, match=r"^backend='distributed' over NCCL needs a GPU per process, and this "
                                               r"machine runs 4 processes \(LOCAL_WORLD_SIZE\) on 1 GPU\(s\): launch "
                                               r"at most 1 per machine, pass use_cpu=True \(gloo\)"):
            NodeGroup(1, "distributed")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        NodeGroup(1, "distributed")
    finally:
        dist.destroy_process_group()


def test_predict_on_a_dataset_without_labels_returns_the_predictions(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=1)
    trainer.train()
    unlabelled = agnews_small["test"].remove_columns("label")
    out = trainer.predict(unlabelled)
    assert out.predictions.shape == (32, 4) and out.label_ids is None and "test_loss" not in out.metrics
    np.testing.assert_allclose(out.predictions, trainer.predict(agnews_small["test"]).predictions, rtol=1e-5)


def test_save_strategy_best_saves_only_new_best_evaluations(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=4, eval_strategy="steps", eval_steps=1,
                          save_strategy="best", metric_for_best_model="accuracy", learning_rate=5e-3)
    trainer.train()
    accuracy = [h["eval_accuracy"] for h in trainer.state.log_history if "eval_accuracy" in h]
    new_best = [step for step in range(1, 5) if accuracy[step - 1] > max(accuracy[:step - 1], default=-1.0)]
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*")) == new_best
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{new_best[-1]}")


def test_evaluate_takes_the_name_of_one_of_the_trainers_eval_sets(tmp_path, agnews_small, tokenizer):
    sets = {"full": agnews_small["test"], "half": agnews_small["test"].select(range(16))}
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, eval_dataset=sets)
    both = trainer.evaluate()
    half = trainer.evaluate("half")  # as Trainer: one set by name, with the prefix as given
    assert half["eval_loss"] == pytest.approx(both["eval_half_loss"], rel=1e-6)
    assert half["eval_samples_per_second"] > 0 and "eval_half_loss" not in half
    with pytest.raises(ValueError, match=r"eval_dataset='other' names one of the trainer's evaluation sets, which "
                                         r"are \['full', 'half'\]"):
        trainer.evaluate("other")


def test_an_iterable_eval_set_evaluates_and_predicts_as_its_map_style_one(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, max_steps=1)
    trainer.train()
    stream = agnews_small["test"].to_iterable_dataset()
    expected, metrics = trainer.evaluate(), trainer.evaluate(stream)
    for key in ("eval_loss", "eval_accuracy", "eval_loss_node_2"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-6)
    assert metrics["eval_samples_per_second"] > 0
    out = trainer.predict(stream)
    assert out.predictions.shape == (32, 4) and out.metrics["test_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)
    given = trainer_for(tmp_path / "given", agnews_small, tokenizer, max_steps=1, eval_dataset=stream)  # as Trainer
    assert given.evaluate()["eval_loss"] > 0


def numpy_metrics(eval_pred):
    """Metrics as numpy scalars, one already carrying the evaluation prefix (both allowed by Trainer)."""
    return {"eval_share": np.float32((eval_pred.predictions.argmax(-1) == 0).mean()), "count": np.int64(3)}


def test_compute_metrics_numpy_values_and_prefixed_names_are_taken_as_trainer_takes_them(tmp_path, agnews_small,
                                                                                       tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, compute_metrics=numpy_metrics, max_steps=2,
                          eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                          metric_for_best_model="share", greater_is_better=True)
    trainer.train()  # saving a checkpoint writes the metrics as JSON
    metrics = trainer.evaluate()
    assert {"eval_share", "eval_count", "eval_share_node_1"} <= set(metrics)
    assert not [key for key in metrics if key.startswith("eval_eval_")]
    assert type(metrics["eval_share"]) is float and type(metrics["eval_count_node_0"]) is int
    assert trainer.state.best_metric is not None


def test_a_regression_head_gets_no_accuracy(tmp_path):
    ids = torch.randint(1, 50, (32, 6), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.float().mean(1).tolist()})
    trainer = DecentralizedTrainer(model=tiny_model(num_labels=1), train_dataset=data, eval_dataset=data,
                                   args=targs(tmp_path, max_steps=1, per_device_train_batch_size=4))
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and not [key for key in metrics if "accuracy" in key]


def test_an_encoder_decoder_classifier_gets_the_accuracy_of_its_logits(tmp_path, agnews_small, tokenizer):
    """BART's and T5's classifiers return their encoder's states beside the logits: the evaluation
    reported no accuracy for them, and a recipe run failed at its end (KeyError 'eval_accuracy')."""
    from transformers import BartConfig, BartForSequenceClassification

    torch.manual_seed(0)
    model = BartForSequenceClassification(BartConfig(
        vocab_size=tokenizer.vocab_size, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_labels=4,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
        decoder_start_token_id=tokenizer.sep_token_id))
    trainer = DecentralizedTrainer(model=model, args=targs(tmp_path, max_steps=1), train_dataset=agnews_small["train"],
                                   eval_dataset=agnews_small["test"], processing_class=tokenizer)
    out = trainer.predict(agnews_small["test"])
    assert isinstance(out.predictions, tuple)  # as Trainer: the logits, then the encoder's last states
    expected = float((out.predictions[0].argmax(-1) == out.label_ids).mean())
    assert out.metrics["test_accuracy"] == pytest.approx(expected)
    assert {"eval_accuracy", "eval_accuracy_node_0"} <= set(trainer.evaluate())


def test_without_args_the_default_arguments_apply_as_in_trainer(tmp_path, agnews_small, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Trainer's default output_dir, tmp_trainer, is relative
    trainer = DecentralizedTrainer(model=tiny_model(), train_dataset=agnews_small["train"])
    assert isinstance(trainer.args, DecentralizedTrainingArguments) and trainer.args.output_dir == "tmp_trainer"
    assert len(trainer.nodes) == trainer.args.num_nodes == 4


def test_a_regression_head_trains_on_integer_targets(tmp_path):
    """Integer targets (e.g. 1-5 stars) of a one-output regression head were refused as class ids
    0..0 of a one-class classifier."""
    ids = torch.randint(1, 50, (32, 6), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 0] % 5 + 1).tolist()})
    trainer = DecentralizedTrainer(model=tiny_model(num_labels=1), train_dataset=data, eval_dataset=data,
                                   args=targs(tmp_path, max_steps=1, per_device_train_batch_size=4))
    trainer.train()
    assert np.isfinite(trainer.evaluate()["eval_loss"])


def test_predict_honours_prediction_loss_only(tmp_path, agnews_small, tokenizer):
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, prediction_loss_only=True)
    out = trainer.predict(agnews_small["test"])
    assert out.predictions is None and out.label_ids is None
    assert "test_loss" in out.metrics and "test_accuracy" not in out.metrics


def test_remove_unused_columns_drops_the_keys_of_a_list_of_dicts(tmp_path, agnews_small, tokenizer):
    rows = [dict(row, text="unused by the model") for row in agnews_small["train"]]
    trainer = DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, max_steps=1), train_dataset=rows,
                                   eval_dataset=rows[:16], processing_class=tokenizer)
    trainer.train()
    assert np.isfinite(trainer.evaluate()["eval_loss"])


def test_a_language_models_label_column_is_not_bounded_by_its_unused_num_labels(tmp_path, tokenizer):
    text = [f"the {w} sat on the mat" for w in ("cat", "dog", "bird", "fox") * 8]
    data = Dataset.from_dict({**tokenizer(text, truncation=True, max_length=12), "label": [i % 4 for i in range(32)]})
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       pad_token_id=tokenizer.pad_token_id))
    assert model.config.num_labels == 2
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    for skew, column in ((0.0, None), (0.5, "label")):  # skewing an LM's shards on a topic column is allowed
        args = targs(tmp_path, skew=skew, shard_column=column, per_device_train_batch_size=4)
        DecentralizedTrainer(model=model, args=args, train_dataset=data, data_collator=collator)
    with pytest.raises(ValueError, match=r"labels must be class ids 0\.\.1 \(the model has num_labels=2\)"):
        DecentralizedTrainer(model=tiny_model(num_labels=2), args=targs(tmp_path), train_dataset=data)


def test_create_optimizer_is_called_per_node_and_overrides_that_would_not_run_are_refused(tmp_path, agnews_small,
                                                                                          tokenizer):
    class PerNodeSGD(DecentralizedTrainer):
        def create_optimizer(self, model=None):
            return torch.optim.SGD(model.parameters(), lr=self.args.learning_rate)

    trainer = PerNodeSGD(model=tiny_model(), args=targs(tmp_path, max_steps=1), train_dataset=agnews_small["train"])
    trainer.train()
    assert all(isinstance(o, torch.optim.SGD) for o in trainer.node_optimizers)
    assert trainer.train().metrics["epoch"] == trainer.state.epoch  # Trainer's train metrics carry the epoch

    class AveragedModelsOptimizer(DecentralizedTrainer):  # Trainer's own override style: self.model
        def create_optimizer(self, model=None):
            return torch.optim.SGD(self.model.parameters(), lr=self.args.learning_rate)

    stale = AveragedModelsOptimizer(model=tiny_model(), args=targs(tmp_path), train_dataset=agnews_small["train"])
    with pytest.raises(ValueError, match=r"^create_optimizer\(model\) returned an optimizer over parameters that are "
                                         r"not the given model's"):
        stale.train()

    class NoModelArgument(DecentralizedTrainer):
        def create_optimizer(self):
            return super().create_optimizer()

    with pytest.raises(TypeError, match=r"^NoModelArgument.create_optimizer\(\) must take the model"):
        NoModelArgument(model=tiny_model(), args=targs(tmp_path))

    class OwnTrainingStep(DecentralizedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"^OwnTrainingStep overrides training_step\(\), which DecentralizedTrainer "
                                        r"never calls: .*override compute_loss"):
        OwnTrainingStep(model=tiny_model(), args=targs(tmp_path))
    for call, message in [(trainer.get_train_dataloader, "one training loader per node"),
                          (lambda: trainer.create_optimizer_and_scheduler(10), "one optimizer and schedule per node"),
                          (trainer.hyperparameter_search, "needs model_init")]:
        with pytest.raises(NotImplementedError, match=message):
            call()


def test_total_flos_counts_every_nodes_training_tokens(tmp_path):
    ids = torch.randint(1, 50, (64, 6), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "label": (ids[:, 0] % 4).tolist()})
    model = tiny_model()
    trainer = DecentralizedTrainer(model=model, train_dataset=data,
                                   args=targs(tmp_path, max_steps=3, per_device_train_batch_size=4, logging_steps=2))
    trainer.train()
    tokens = 4 * 3 * 4 * 6  # nodes x steps x batch x sequence length
    expected = 6 * tokens * model.num_parameters(exclude_embeddings=True)  # Trainer's estimate of a step's flos
    assert trainer.state.total_flos == expected
    assert trainer.state.log_history[-1]["total_flos"] == expected  # the end-of-training log, as Trainer's


def test_the_simulated_backend_under_a_launcher_is_refused(monkeypatch):
    """torchrun/accelerate started several processes for a script with backend='simulated': each
    would run every node and write the same checkpoint and model files (one died mid-save)."""
    from lp_decentral_nlp.trainer import NodeGroup

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="backend='simulated' runs every node in one process, but the launcher "
                                         "started 2 processes: set backend='distributed' and num_nodes=2"):
        NodeGroup(2, "simulated")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert NodeGroup(2, "simulated").node_ids == [0, 1]


def test_distributed_backend_outside_a_launcher_names_the_launch_and_accelerates_single_process(monkeypatch):
    """A script run without a launcher, and one under `accelerate launch --num_processes N` on a
    machine without GPUs, which starts one process unless --multi_gpu is given: the message says so."""
    from lp_decentral_nlp.trainer import NodeGroup

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group: launch with "
                                           "torchrun --nproc_per_node 4"):
        NodeGroup(4, "distributed")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    with pytest.raises(RuntimeError, match="accelerate launch on a machine without GPUs, or with --cpu, starts one "
                                           "process unless --multi_gpu is given: add --multi_gpu and drop --cpu if "
                                           "given"):
        NodeGroup(4, "distributed")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="a machine without an accelerator")
def test_distributed_backend_takes_the_cpu_process_group_without_use_cpu(tmp_path):
    """Without use_cpu, transformers made the launcher's process group without a backend on a CPU
    machine (every rank saw world size 1) and the first gossip message failed; the distributed
    backend sets use_cpu itself there (tests/dist_trainer_worker.py runs without it)."""
    args = DecentralizedTrainingArguments(output_dir=str(tmp_path), backend="distributed", report_to="none")
    assert args.use_cpu
    assert not DecentralizedTrainingArguments(output_dir=str(tmp_path), report_to="none").use_cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_another_accelerator_leaves_the_nodes_on_the_cpu_with_a_warning(tmp_path, monkeypatch, caplog):
    """On a Mac, TrainingArguments picked MPS, where the nodes' float64 sums (consensus distance,
    logged losses) failed at the first log, and a distributed launch there got no process group
    backend, with advice for "a machine without GPUs"; the recipes already train on the CPU."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("mps"))
    for backend in ("simulated", "distributed"):
        args = DecentralizedTrainingArguments(output_dir=str(tmp_path), backend=backend, report_to="none")
        assert args.use_cpu and args.device.type == "cpu"
    assert ("DecentralizedTrainer runs its nodes on CUDA or the CPU, and this machine's default device is mps: the "
            "nodes train on the CPU (use_cpu=True)") in caplog.text


TINY_BERT = dict(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def test_question_answering_evaluates_its_loss_without_compute_metrics(tmp_path):
    """Two label columns (start and end positions) come back from prediction_step as a tuple: the
    evaluation gives the loss and no accuracy (it was AttributeError: 'tuple' object has no
    attribute 'dim'), as Trainer."""
    torch.manual_seed(0)
    ids = torch.randint(1, 60, (32, 8))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "start_positions": (ids[:, 0] % 4).tolist(),
                              "end_positions": (ids[:, 0] % 4 + 2).tolist()})
    trainer = DecentralizedTrainer(model=BertForQuestionAnswering(BertConfig(**TINY_BERT)), eval_dataset=data,
                                   args=targs(tmp_path, num_nodes=2, per_device_train_batch_size=4), train_dataset=data)
    trainer.train()
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and np.isfinite(metrics["eval_loss_node_1"])
    assert not [key for key in metrics if "accuracy" in key]
    output = trainer.predict(data)
    assert [array.shape for array in output.predictions] == [(32, 8), (32, 8)]
    assert [array.tolist() for array in output.label_ids] == [data["start_positions"], data["end_positions"]]


def test_a_multiple_choice_models_labels_index_the_choices_not_its_unused_num_labels(tmp_path):
    """Four choices per row, num_labels left at its default 2: labels 0..3 were refused as
    "labels must be class ids 0..1"; they train, and the accuracy is over the choices."""
    torch.manual_seed(0)
    ids = torch.randint(1, 60, (32, 4, 6))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "label": (ids[:, 0, 0] % 4).tolist()})
    model = BertForMultipleChoice(BertConfig(**TINY_BERT))
    assert model.config.num_labels == 2
    trainer = DecentralizedTrainer(model=model, args=targs(tmp_path, num_nodes=2, skew=0.5, per_device_train_batch_size=4),
                                   train_dataset=data, eval_dataset=data)
    trainer.train()
    metrics = trainer.evaluate()
    logits = trainer.predict(data).predictions
    assert logits.shape == (32, 4)
    assert metrics["eval_accuracy"] == pytest.approx(float((logits.argmax(-1) == np.array(data["label"])).mean()))


def test_a_random_collator_gives_the_averaged_model_and_every_node_the_same_evaluation_batches(tmp_path, tokenizer):
    """Masked LM: every node equal to the average before training, so every model's loss is the
    same on the same masks (the masks were drawn afresh for each model: 6.927 vs 6.913 and
    6.945), at every evaluation; the evaluation leaves torch's generator as it found it."""
    text = [f"the {w} sat on the {v} mat" for w in ("cat", "dog", "bird", "fox") for v in ("red", "big")] * 4
    data = Dataset.from_dict(dict(tokenizer(text, truncation=True, max_length=12)))
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**{**TINY_BERT, "vocab_size": tokenizer.vocab_size}))
    trainer = DecentralizedTrainer(model=model, args=targs(tmp_path, num_nodes=2), eval_dataset=data,
                                   train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer))
    state = torch.get_rng_state()
    first, second = trainer.evaluate(), trainer.evaluate()
    assert torch.equal(torch.get_rng_state(), state)
    assert first["eval_consensus_distance"] == 0
    assert first["eval_loss"] == first["eval_loss_node_0"] == first["eval_loss_node_1"] == second["eval_loss"]


def test_seq2seq_training_arguments_are_refused_with_what_to_do_instead(tmp_path):
    model = BertForMaskedLM(BertConfig(**TINY_BERT))
    with pytest.raises(TypeError, match=r"^args must be DecentralizedTrainingArguments, got Seq2SeqTrainingArguments; "
                                        r"generation in evaluation \(predict_with_generate, .* is not supported: .*"
                                        r"generate with trainer.model.generate\(\) afterwards$"):
        DecentralizedTrainer(model=model, args=Seq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True))


@pytest.mark.parametrize("num_labels, problem_type, what", [
    (1, None, r"a regression head \(one output\), whose targets are numbers"),
    (4, "multi_label_classification", r"a multi-label classifier \(problem_type='multi_label_classification'\)"),
])
def test_label_smoothing_is_refused_where_there_is_no_class_target(num_labels, problem_type, what, tmp_path):
    """A regression head failed in the first step inside Trainer's smoother (index 1 is out of
    bounds); a multi-label one trained unsmoothed after a warning."""
    model = tiny_model(num_labels=num_labels)
    model.config.problem_type = problem_type
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 8, "labels": [[0.0] * num_labels if num_labels > 1 else 0.5]
                              * 8})
    with pytest.raises(ValueError, match=rf"^label_smoothing_factor=0.1 smooths one class target per sample, and the "
                                         rf"model is {what}.*: leave label_smoothing_factor at 0$"):
        DecentralizedTrainer(model=model, args=targs(tmp_path, label_smoothing_factor=0.1), train_dataset=rows)


@pytest.mark.parametrize("schedule", ["reduce_lr_on_plateau", "greedy"])
def test_warmup_is_refused_with_a_schedule_that_has_none(schedule, tmp_path):
    """transformers builds these before it reads the warm-up: the LR was the full one from step 1."""
    with pytest.raises(ValueError, match=rf"^warmup_steps=3 has no effect with lr_scheduler_type='{schedule}'"):
        targs(tmp_path, lr_scheduler_type=schedule, warmup_steps=3, eval_strategy="steps", eval_steps=1)


def test_a_schedule_that_cannot_be_built_is_refused_when_the_arguments_are(tmp_path):
    """From Python it was TypeError at train(), not naming the field (the recipes checked it)."""
    with pytest.raises(ValueError, match=r"^lr_scheduler_kwargs: lr_scheduler_type='linear' with lr_scheduler_kwargs="
                                         r"\{'foo': 1\} gives no schedule \(TypeError: .*unexpected keyword argument"):
        targs(tmp_path, lr_scheduler_kwargs={"foo": 1})


@pytest.mark.parametrize("kwargs, message", [
    (dict(eval_steps=2), r"eval_steps: eval_steps is the interval of eval_strategy='steps', and eval_strategy is 'no'"),
    (dict(save_strategy="epoch", save_steps=2), r"save_steps: save_steps is the interval of save_strategy='steps', and "
                                                r"save_strategy is 'epoch'"),
    (dict(save_total_limit=1), r"save_total_limit=1 is how many checkpoints are kept, and save_strategy='no'"),
    (dict(save_only_model=True), r"save_only_model=True is what a checkpoint holds, and save_strategy='no'"),
    (dict(eval_delay=2), r"eval_delay=2 is a setting of evaluation during training, and eval_strategy='no'"),
    (dict(metric_for_best_model="accuracy"), r"metric_for_best_model='accuracy' is a setting of evaluation during "
                                             r"training, and eval_strategy='no'"),
    (dict(greater_is_better=True), r"greater_is_better=True is a setting of evaluation during training"),
    (dict(logging_strategy="epoch", logging_steps=5), r"logging_steps: logging_steps is the interval of "
                                                      r"logging_strategy='steps', and logging_strategy is 'epoch'"),
    (dict(logging_strategy="epoch", logging_steps=5, eval_strategy="steps", eval_steps=3),
     r"logging_steps: logging_steps is the interval"),
    (dict(gradient_checkpointing_kwargs={"use_reentrant": False}),
     r"gradient_checkpointing_kwargs=\{'use_reentrant': False\} is the options of activation \(gradient\) "
     r"checkpointing, which is off"),
    (dict(activation_checkpointing_kwargs={"use_reentrant": False}), r"activation_checkpointing_kwargs=.* which is off"),
    (dict(hub_strategy="end"), r"hub_strategy='end' is when and what the training uploads, and push_to_hub=False "
                               r"uploads nothing during training"),
    (dict(hub_always_push=True), r"hub_always_push=True is when and what the training uploads"),
])
def test_a_setting_its_strategy_switches_off_is_refused_from_python_too(kwargs, message, tmp_path):
    """The recipes refused these; DecentralizedTrainingArguments accepted them, and they did nothing."""
    with pytest.raises(ValueError, match=f"^{message}"):
        targs(tmp_path, **kwargs)


def test_the_hub_settings_a_later_push_to_hub_reads_are_taken_without_push_to_hub(tmp_path):
    """trainer.push_to_hub() after training reads hub_model_id, hub_token, hub_private_repo and hub_revision."""
    args = targs(tmp_path, hub_model_id="me/model", hub_private_repo=True, hub_revision="dev")
    assert (args.push_to_hub, args.hub_model_id, args.hub_revision) == (False, "me/model", "dev")


@pytest.mark.parametrize("kwargs, message", [
    (dict(optim="sgd", adam_beta2=0.9), r"adam_beta2=0.9 is not read by optim='sgd' \(transformers ignores it\): "
                                        r"leave it at 0.999"),
    (dict(optim="adafactor", adam_epsilon=1e-6), r"adam_epsilon=1e-06 is not read by optim='adafactor'"),
    (dict(optim="rmsprop", adam_beta1=0.5), r"adam_beta1=0.5 is not read by optim='rmsprop'"),
])
def test_an_adam_setting_the_optimizer_does_not_read_is_refused(kwargs, message, tmp_path):
    """transformers passes adam_beta1/2 and adam_epsilon to the Adam family only and drops them
    silently for SGD, Adafactor, RMSprop... ; the Adam family takes them (and their defaults pass)."""
    with pytest.raises(ValueError, match=f"^{message}"):
        targs(tmp_path, **kwargs)
    adamw = targs(tmp_path, optim="adamw_torch", adam_beta1=0.5, adam_beta2=0.9, adam_epsilon=1e-6)
    assert (adamw.adam_beta1, adamw.adam_beta2, adamw.adam_epsilon) == (0.5, 0.9, 1e-6)
    assert targs(tmp_path, optim="sgd").adam_beta2 == 0.999


def test_the_last_runs_state_reads_as_no_run_before_train(tmp_path, agnews_small, tokenizer):
    """stopped_by_sigterm and cpu_malloc_tuned (documented state of the last train()) were set only
    by train(): an AttributeError before it, while resumed_from and best_model_loaded read None."""
    trainer = trainer_for(tmp_path, agnews_small, tokenizer, num_nodes=2, max_steps=1)
    assert (trainer.stopped_by_sigterm, trainer.cpu_malloc_tuned, trainer.resumed_from, trainer.best_model_loaded) \
        == (False, False, None, None)
    trainer.train()
    assert trainer.stopped_by_sigterm is False and trainer.state.global_step == 1


class BagOfWordsLogits(torch.nn.Module):
    """A plain module whose forward returns bare logits ``(N, 4)`` and takes no labels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = torch.nn.EmbeddingBag(30522, 8, mode="sum"), torch.nn.Linear(8, 4)

    def forward(self, input_ids, attention_mask):
        return self.out(self.embed(input_ids, per_sample_weights=attention_mask.float()))


class BagOfWordsLogitsTakingLabels(BagOfWordsLogits):
    def forward(self, input_ids, attention_mask, labels=None):
        return super().forward(input_ids, attention_mask)


class BagOfWordsDict(BagOfWordsLogits):
    """The same model returning ``{"logits": ...}``: what compute_loss_func reads."""

    def forward(self, input_ids, attention_mask):
        return {"logits": super().forward(input_ids, attention_mask)}


def logits_loss(outputs, labels, num_items_in_batch=None):
    return torch.nn.functional.cross_entropy(outputs["logits"], labels)


def test_outputs_trainer_would_misread_are_refused_at_their_first_forward(tmp_path, agnews_small, tokenizer):
    """Trainer reads a loss from a dict's 'loss' or a tuple's first item: bare logits (N, 4) failed in
    backward ("grad can be implicitly created only for scalar outputs"), (N,) outputs would have
    trained on their first entry, and evaluation took outputs[1:] (every row but the first: a size
    mismatch), also with compute_loss_func, which trained; a tuple (logits,) with compute_loss_func
    predicted nothing."""
    train, test = agnews_small["train"], agnews_small["test"]
    args = targs(tmp_path, num_nodes=2, max_steps=2)
    bare = r"^BagOfWordsLogits\w* returned a bare tensor of shape \(8, 4\): Trainer reads a dict's or ModelOutput's 'loss'"
    with pytest.raises(ValueError, match=bare):
        DecentralizedTrainer(model=BagOfWordsLogitsTakingLabels(), args=args, train_dataset=train).train()
    with pytest.raises(ValueError, match=bare):
        DecentralizedTrainer(model=BagOfWordsLogits(), args=args, train_dataset=train,
                             compute_loss_func=lambda outputs, labels, **kw: outputs.sum()).train()
    with pytest.raises(ValueError, match=r"^BagOfWordsLogits returned a bare tensor of shape \(32, 4\)"):
        DecentralizedTrainer(model=BagOfWordsLogits(), args=args, eval_dataset=test).predict(test.remove_columns("label"))

    class BagOfWordsTuple(BagOfWordsLogits):
        def forward(self, input_ids, attention_mask):
            return (super().forward(input_ids, attention_mask),)

    with pytest.raises(ValueError, match=r"^BagOfWordsTuple returned a tuple, and with compute_loss_func"):
        DecentralizedTrainer(model=BagOfWordsTuple(), args=args, train_dataset=train, compute_loss_func=logits_loss).train()
    # label smoothing takes the labels too: a transformers model's tuple (return_dict=False) lost its logits in predict
    tuples = tiny_model()
    tuples.config.return_dict = False
    with pytest.raises(ValueError, match=r"^DistilBertForSequenceClassification returned a tuple, and with "
                                         r"compute_loss_func or label smoothing .* leave config.return_dict True"):
        DecentralizedTrainer(model=tuples, args=targs(tmp_path, num_nodes=2, max_steps=2, label_smoothing_factor=0.1),
                             train_dataset=train).train()


def test_compute_loss_func_gets_the_labels_of_a_forward_that_takes_none(tmp_path, agnews_small, tokenizer):
    """A forward without a labels argument had no label names: evaluation passed the labels to
    forward (a TypeError) instead of to compute_loss_func. A model with label names of its own keeps
    them (adding 'labels' to a question-answering model's dropped its eval loss)."""
    test = agnews_small["test"]
    trainer = DecentralizedTrainer(model=BagOfWordsDict(), args=targs(tmp_path, num_nodes=2, max_steps=2,
                                                                      per_device_eval_batch_size=8),
                                   train_dataset=agnews_small["train"], eval_dataset=test, compute_loss_func=logits_loss)
    assert trainer.label_names == ["labels"]
    trainer.train()
    predicted = trainer.predict(test)
    assert predicted.predictions.shape == (len(test), 4) and predicted.label_ids.shape == (len(test),)
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(predicted.predictions),
                                                 torch.from_numpy(predicted.label_ids))
    assert predicted.metrics["test_loss"] == pytest.approx(expected.item(), rel=1e-5)
    one_row_last = test.select(range(9)).remove_columns("label")  # a last batch of one row keeps its batch dimension
    assert trainer.predict(one_row_last).predictions.shape == (9, 4)
    from transformers import BertConfig, BertForQuestionAnswering

    qa = BertForQuestionAnswering(BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, max_position_embeddings=64))
    trainer = DecentralizedTrainer(model=qa, args=targs(tmp_path), compute_loss_func=lambda outputs, labels, **kw: outputs.loss)
    assert trainer.label_names == ["start_positions", "end_positions"]


def test_trained_parameters_of_two_dtypes_are_refused_at_construction_naming_one(tmp_path, agnews_small, tokenizer):
    """A float64 parameter beside float32 ones trained a step, then the gossip engine refused it
    ("all parameters must share one floating dtype"), naming no parameter."""
    model = tiny_model()
    model.temperature = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^model's trained parameters are of torch.float32 \(e.g. 'distilbert\..*'\) and "
                                         r"torch.float64 \(e.g. 'temperature'\): each node gossips them as one vector"):
        DecentralizedTrainer(model=model, args=targs(tmp_path), train_dataset=agnews_small["train"])
    model.temperature.requires_grad_(False)  # a frozen one is not gossiped
    DecentralizedTrainer(model=model, args=targs(tmp_path), train_dataset=agnews_small["train"])


def test_a_quant_config_of_ones_own_is_refused_in_its_own_words(tmp_path, agnews_small):
    """Every refusal of the surgery was reworded as low_precision's default, also for a quant_config
    the user gave (with advice, low_precision=False, that quant_config refuses)."""
    from lp_decentral_nlp import QuantConfig

    with pytest.raises(ValueError, match=r"^quantize_model: target pattern 'claasifier' matches no quantizable layer"):
        DecentralizedTrainer(model=tiny_model(), args=targs(tmp_path, low_precision=True),
                             train_dataset=agnews_small["train"], quant_config=QuantConfig(target=("claasifier",)))
