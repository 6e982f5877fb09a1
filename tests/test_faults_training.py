"""Training under injected faults and non-finite numbers (DecentralizedTrainer, simulated backend),
on the real scikit-learn digits with a small 8-bit MLP: --drop-prob 0.1 still converges and keeps
the push-sum mass; a node that leaves is frozen and rejoins; NaN stops the run naming node and
step, or is skipped without reaching the other nodes."""
import copy
import logging
import math
import warnings

import datasets
import numpy as np
import pytest
import torch
from torch import nn
from transformers import TrainerCallback
from transformers.modeling_outputs import SequenceClassifierOutput

from lp_decentral_nlp.data import skewed_partition
from lp_decentral_nlp.trainer import (
    DecentralizedTrainer, DecentralizedTrainingArguments, NonFiniteError, EpochSampler, node_seed,
)


class DigitsMLP(nn.Module):
    """64 -> 64 -> 10 classifier over flattened 8x8 digits (the hidden layer is 8-bit under surgery)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(64, 64)
        self.classifier = nn.Linear(64, 10)

    def forward(self, pixel_values, labels=None):
        logits = self.classifier(torch.relu(self.hidden(pixel_values)))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def digits(poison=None):
    """scikit-learn's digits as (train, test) datasets with ``pixel_values`` in [0, 1]; ``poison``:
    a training row index whose pixels become NaN."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    train, test = order[:1400], order[1400:]
    xs = x[train].copy()
    if poison is not None:
        xs[poison] = np.nan
    make = lambda px, y: datasets.Dataset.from_dict({"pixel_values": px.tolist(), "label": y.tolist()}).with_format("torch")
    return make(xs, d.target[train]), make(x[test], d.target[test])


def digits_args(out, **kw):
    base = dict(output_dir=str(out), num_nodes=4, algorithm="choco", compression=90.0, consensus_lr=0.3,
                per_device_train_batch_size=16, per_device_eval_batch_size=400, learning_rate=1e-2,
                num_train_epochs=4, logging_steps=20, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    base.update(kw)
    return DecentralizedTrainingArguments(**base)


def digits_trainer(out, poison=None, callbacks=None, **kw):
    train, test = digits(poison)
    return DecentralizedTrainer(model=DigitsMLP(), args=digits_args(out, **kw), train_dataset=train, eval_dataset=test,
                                callbacks=callbacks)


class PushSumInvariant(TrainerCallback):
    """Checks around every gossip step that the push-sum mass is unchanged: before it,
    sum_i (x_i + delta_i), the local update delta_i = z~_i - z_i entering unscaled (SPEC 2 step 1);
    after it, sum_i w_i z_i (parameters and weight)."""

    def __init__(self, trainer):
        self.trainer, self.worst = trainer, 0.0
        step = trainer.gossip.step
        written = [[p.detach().clone() for p in params] for params in trainer.node_params]

        def checked(nodes):
            delta = sum(torch.cat([torch.cat([(p - q).double().flatten() for p, q in zip(params, old)]),
                                   torch.zeros(1, dtype=torch.float64)]) for params, old in zip(nodes, written))
            before = self.mass(written) + delta
            stats = step(nodes)
            after = self.mass(nodes)
            written[:] = [[p.detach().clone() for p in params] for params in nodes]
            self.worst = max(self.worst, ((after - before).abs().max() / before.abs().max()).item())
            return stats

        trainer.gossip.step = checked

    def mass(self, nodes):
        w = self.trainer.gossip.weights.double()
        return sum(w[k] * torch.cat([torch.cat([p.double().flatten() for p in params]), torch.ones(1, dtype=torch.float64)])
                   for k, params in enumerate(nodes))


def test_with_drop_prob_01_training_converges_and_push_sum_mass_is_conserved(tmp_path):
    trainer = digits_trainer(tmp_path, drop_prob=0.1)
    check = PushSumInvariant(trainer)
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] > 0.9  # 397 test digits, 4 nodes, 8-bit, Choco top-10%, 10% of messages lost
    assert all(metrics[f"eval_accuracy_node_{i}"] > 0.85 for i in range(4))
    assert check.worst < 1e-6  # float32 parameters: the mass moves by rounding only
    assert trainer.gossip.weights.sum().item() == pytest.approx(4.0, abs=1e-5)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.35 * losses[0]


def test_a_node_that_leaves_is_frozen_and_rejoins(tmp_path):
    seen = {}

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen[state.global_step] = ([p.detach().clone() for p in trainer.nodes[2].parameters()],
                                       trainer.gossip.weights[2].item(), trainer.node_optimizers[2].state_dict()["state"][0]["step"].item(),
                                       trainer.node_schedulers[2].get_last_lr()[0], trainer.bytes_sent[2].item())

    trainer = digits_trainer(tmp_path, absences=["2:5:12"], max_steps=20, lr_scheduler_type="linear")
    trainer.add_callback(Watch())
    trainer.train()
    for step in range(6, 13):  # iterations 5..11 take global_step 5 -> 12: node 2 is away
        params, w, adam_steps, lr, sent = seen[step]
        assert all(torch.equal(a, b) for a, b in zip(seen[5][0], params)) and w == seen[5][1]
        assert adam_steps == seen[5][2] == 5 and sent == seen[5][4]
        assert lr < seen[step - 1][3]  # its LR schedule keeps counting
    assert not all(torch.equal(a, b) for a, b in zip(seen[12][0], seen[13][0]))  # back at iteration 12
    assert seen[20][2] == 20 - 7 and seen[13][4] > seen[12][4]


def test_the_faults_a_run_met_are_counted_logged_and_on_its_card(tmp_path):
    """Lost messages and absent steps were computed every step and thrown away: nothing in the logs,
    results or model card said a run had lost half its messages."""
    trainer = digits_trainer(tmp_path, drop_prob=0.3, absences=["2:3:8"], stragglers=["1:0.001"], max_steps=12,
                             logging_steps=4, skip_nonfinite=True)
    trainer.train()
    plan, topology = trainer.args.fault_plan, trainer.gossip.topology
    lost = [sum(1 for t in range(12) if i not in plan.absent(t) for sender, _ in plan.lost_edges(t, topology)
                if sender == i) for i in range(4)]
    counts = trainer.fault_counts()
    assert counts == {"lost_messages": lost, "absent_steps": [0, 0, 5, 0], "nonfinite_skips": [0, 0, 0, 0]}
    assert sum(lost) > 0
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert [last[f"lost_messages_node_{i}"] for i in range(4)] == lost and last["absent_steps_node_2"] == 5
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    for line in ("message_drop_prob: 0.3", "stragglers: node 1 waits 0.001 s per send",
                 "absences: node 2 away for iterations 3 to 7", "skip_nonfinite: True"):
        assert f"- {line}\n" in card, line
    assert digits_trainer(tmp_path).fault_counts() == {}  # no faults, no counts


def test_resuming_under_other_faults_names_the_default_consensus_step_it_changes(tmp_path):
    """Resuming with another drop_prob was refused as "written with consensus_lr=0.35 (this run:
    0.25)", naming an argument the user never set."""
    first = digits_trainer(tmp_path / "a", drop_prob=0.3, consensus_lr=None, max_steps=4, save_strategy="steps",
                           save_steps=2)
    first.train()
    saved = first.args.gamma
    checkpoint = tmp_path / "a" / "checkpoint-2"
    with pytest.raises(ValueError, match=rf"consensus_lr={saved!r} \(this run's default: .*; it follows the compression, "
                                         rf"graph and drop_prob: pass consensus_lr={saved!r} to resume under other "
                                         r"faults\)"):
        digits_trainer(tmp_path / "b", drop_prob=0.5, consensus_lr=None, max_steps=4).train(
            resume_from_checkpoint=str(checkpoint))
    digits_trainer(tmp_path / "c", drop_prob=0.5, consensus_lr=saved, max_steps=4).train(
        resume_from_checkpoint=str(checkpoint))


def test_a_timeout_on_an_injected_straggler_says_so(tmp_path):
    """A straggler waiting 0.999 s under gossip_timeout=1 passed the arguments' check and timed out
    at the first step with "rank 1 never answered (is it running, alive, ...)"."""
    from lp_decentral_nlp.gossip import GossipTimeoutError

    trainer = digits_trainer(tmp_path, stragglers=["1:0.001"], max_steps=2)

    def timed_out(nodes):
        raise GossipTimeoutError("rank 0: gossip step 0: timed out after 1 s receiving from rank 1", 1)

    trainer.gossip.step = timed_out
    with pytest.raises(GossipTimeoutError, match=r"receiving from rank 1 \(rank 1 is an injected straggler: it waits "
                                                 r"0.001 s before each send, which with the rest of its step exceeds "
                                                 r"gossip_timeout=300 s: raise gossip_timeout\) \(in training step 1"):
        trainer.train()


def test_an_absence_after_the_run_is_refused(tmp_path):
    """--leave 1:100:200 on a 4-step run was accepted and changed nothing."""
    with pytest.raises(ValueError, match=r"^absences: node 1 away for iterations 100 to 199, and the run has 4 steps "
                                         r"\(iterations 0 to 3\): it would change nothing; drop it or move it into the "
                                         r"run$"):
        digits_trainer(tmp_path, absences=["1:100:200"], max_steps=4).train()


def test_an_absence_past_the_runs_end_is_carded_as_lasting_to_its_end(tmp_path):
    """The card said "node 1 away for iterations 2 to 99" of a 4-step run."""
    trainer = digits_trainer(tmp_path, absences=["1:2:100"], max_steps=4)
    trainer.train()
    trainer.create_model_card()
    assert "- absences: node 1 away from iteration 2 to the run's end\n" in (tmp_path / "README.md").read_text()


def test_every_node_away_for_the_whole_run_is_refused(tmp_path):
    """It was a warning, and the run ended "done" with the untrained model."""
    with pytest.raises(ValueError, match=r"^absences: every node is away at every one of the run's 4 iterations: "
                                         r"nothing would train or gossip; leave some node present$"):
        digits_trainer(tmp_path, absences=[f"{i}:0:9" for i in range(4)], max_steps=4).train()


def test_train_loss_is_the_mean_over_the_steps_that_had_a_loss(tmp_path, caplog):
    """Steps in which every node was away (or skipped) added 0 to the sum that train_loss divides by
    every step: with all nodes away for 2 of 4 steps it read half the logged losses."""
    trainer = digits_trainer(tmp_path, absences=[f"{i}:0:2" for i in range(4)], max_steps=4, logging_steps=1)
    with caplog.at_level(logging.WARNING, logger="lp_decentral_nlp"):
        output = trainer.train()
    assert ("absences: every node is away at 2 of the 4 iterations (from iteration 0 to 1): they train and gossip "
            "nothing, while the LR schedules advance") in caplog.text
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert math.isnan(losses[0]) and math.isnan(losses[1]) and all(math.isfinite(v) for v in losses[2:])
    assert output.training_loss == pytest.approx(sum(losses[2:]) / 2, rel=1e-6)


def test_a_node_absent_from_the_start_gets_no_schedule_order_warning(tmp_path):
    """Its LR schedule counts the global step from iteration 0, before its first optimizer.step():
    by design, so torch's warning about that order (and about a skipped first LR) is not shown."""
    trainer = digits_trainer(tmp_path, absences=["1:0:2"], max_steps=3, lr_scheduler_type="linear")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in shown if "lr_scheduler.step()" in str(w.message)]
    assert trainer.node_optimizers[1].state_dict()["state"][0]["step"].item() == 1


def test_an_absent_node_keeps_its_quasi_global_momentum(tmp_path):
    momentum = {}

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            momentum[state.global_step] = [m.clone() for m in trainer.qgm.exp_avg[2]]

    trainer = digits_trainer(tmp_path, absences=["2:3:6"], max_steps=8, qgm=True)
    trainer.add_callback(Watch())
    trainer.train()
    for step in range(4, 7):  # iterations 3..5: node 2 is away, its momentum does not move
        assert all(torch.equal(a, b) for a, b in zip(momentum[3], momentum[step]))
    assert not all(torch.equal(a, b) for a, b in zip(momentum[6], momentum[7]))  # it moves again on return

def poisoned_step(node, step, bs=16, seed=0):
    """Index of a training row that node ``node`` meets in training step ``step`` (1-based, epoch 0)."""
    train, _ = digits()
    shards = skewed_partition(list(train["label"]), 4, 0.0, seed=seed)
    order = list(EpochSampler(len(shards[node]), node_seed(seed, node)))
    return int(shards[node][order[(step - 1) * bs]])


def test_nan_loss_stops_the_run_naming_node_and_step(tmp_path):
    trainer = digits_trainer(tmp_path, poison=poisoned_step(2, 7), max_steps=20)
    with pytest.raises(NonFiniteError, match=r"^node 2, step 7: non-finite loss \(nan\): stopped before the update") as err:
        trainer.train()
    assert (err.value.node, err.value.step) == (2, 7) and trainer.state.global_step == 6
    assert all(torch.isfinite(p).all() for node in trainer.nodes for p in node.parameters())


def test_skip_nonfinite_skips_the_node_and_nothing_non_finite_is_gossiped(tmp_path):
    trainer = digits_trainer(tmp_path, poison=poisoned_step(1, 3), skip_nonfinite=True, max_steps=30, logging_steps=5)
    trainer.train()
    assert trainer.nonfinite_skips.tolist() == [0, 1, 0, 0]  # the poisoned row comes once in 30 steps
    assert all(torch.isfinite(p).all() for node in trainer.nodes for p in node.parameters())
    assert all(torch.isfinite(b).all() for node in trainer.nodes for b in node.buffers())  # running ranges kept
    assert torch.isfinite(trainer.gossip.state_dict()["public"]).all()
    logged = [h for h in trainer.state.log_history if "nonfinite_skips_node_1" in h]
    assert logged[0]["nonfinite_skips_node_1"] == 1 and math.isfinite(logged[0]["loss"])
    assert trainer.evaluate()["eval_accuracy"] > 0.5


@pytest.mark.parametrize("name,max_grad_norm", [("hidden.weight", 0.0), ("classifier.weight", 1.0)])
def test_nan_gradient_is_named_with_its_parameter(tmp_path, name, max_grad_norm):
    # with clipping on, the check must come first: clipping by a NaN total norm makes every gradient
    # NaN, and the first parameter (hidden.weight) would be named instead
    trainer = digits_trainer(tmp_path, max_steps=3, low_precision=False, max_grad_norm=max_grad_norm)
    hook = trainer.nodes[3].get_parameter(name).register_hook(lambda g: g * torch.inf)
    with pytest.raises(NonFiniteError, match=rf"^node 3, step 1: non-finite gradient \(\w+\) in {name}"):
        trainer.train()
    hook.remove()


def test_each_node_steps_with_clipped_gradients_and_only_its_own_gradients_alive(tmp_path):
    trainer = digits_trainer(tmp_path, max_steps=2, low_precision=False, max_grad_norm=0.05)
    raw, seen = {}, []
    for k, node in enumerate(trainer.nodes):  # a parameter hook sees the raw (unclipped) gradient
        for j, p in enumerate(node.parameters()):
            p.register_hook(lambda g, k=k, j=j: raw.setdefault(k, {}).__setitem__(j, g.clone()))

    class WatchSteps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            for k, (node, optimizer) in enumerate(zip(trainer.nodes, trainer.node_optimizers)):
                optimizer.register_step_pre_hook(lambda *_, k=k, node=node: at_step(k, node))

    def at_step(k, node):
        seen.append(k)
        grads = [raw[k][j] for j in range(len(raw[k]))]
        raw_norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        assert raw_norm > 0.05  # clipping has something to do
        for p, g in zip(node.parameters(), grads):  # clip_grad_norm_'s scaling of the raw gradients
            torch.testing.assert_close(p.grad, g * (0.05 / (raw_norm + 1e-6)))
        assert all(p.grad is None for j, other in enumerate(trainer.nodes) if j != k for p in other.parameters())

    trainer.add_callback(WatchSteps())
    trainer.train()
    assert seen == [0, 1, 2, 3] * 2


def test_huge_but_finite_gradients_are_not_mistaken_for_nan(tmp_path):
    trainer = digits_trainer(tmp_path, max_steps=1, low_precision=False)
    trainer.nodes[0].hidden.weight.register_hook(lambda g: g * 1e30)  # finite entries, L2 norm overflows
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.nonfinite_skips.tolist() == [0, 0, 0, 0]
    assert torch.isinf(torch._foreach_norm([torch.full((4,), 1e30)])[0])  # what the fast check sees


def pretrained_digits_mlp(train) -> DigitsMLP:
    """DigitsMLP trained on the whole training set (30 full-batch Adam steps: loss ~0.2), as a
    fine-tuning run starts from a pretrained model."""
    torch.manual_seed(1)
    model = DigitsMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    pixels, labels = torch.stack(list(train["pixel_values"])), torch.tensor(train["label"])
    for _ in range(30):
        optimizer.zero_grad()
        model(pixels, labels).loss.backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("algorithm", ["choco", "deepsqueeze"])
def test_gossip_reference_initial_keeps_a_pretrained_models_nodes_together_under_faults(tmp_path, algorithm, caplog):
    """An absence moves the push-sum weights, and top-10% messages of the models themselves then
    deliver the weights' change times the whole model a tenth per step: the nodes drift apart
    (consensus distance 5.1 with Choco, 88 with Deep-Squeeze here; train() warns of it).
    Compressing the offsets from the initial model keeps them together (0.022 and 0.14)."""
    train, _ = digits()
    pretrained = pretrained_digits_mlp(train)
    spread = {}
    for reference in ("zero", "initial"):
        args = digits_args(tmp_path / reference, algorithm=algorithm, max_steps=30, num_train_epochs=1,
                           absences=["1:5:12"], gossip_reference=reference, low_precision=False)
        trainer = DecentralizedTrainer(model=copy.deepcopy(pretrained), args=args, train_dataset=train)
        with caplog.at_level(logging.WARNING):
            trainer.train()
        warned = "(--gossip-reference initial) compresses what each node changed since the start" in caplog.text
        assert warned is (reference == "zero")
        caplog.clear()
        assert ("reference=#" in trainer.gossip.state_dict()["config"]) is (reference == "initial")
        spread[reference] = float(trainer.consensus_distance())
    assert spread["initial"] < spread["zero"] / 50


@pytest.mark.parametrize("reference", ["zero", "initial"])
def test_16_bit_parameters_are_refused_at_construction(reference, tmp_path):
    """A bfloat16 model trained in pure bfloat16: its weights, optimizer state and gossip values
    (z - r + r with gossip_reference='initial' rounds every weight by a part in a few hundred each
    step); the docs promise float32 master weights, and mixed precision is bf16=True."""
    train, _ = digits()
    model = DigitsMLP().to(torch.bfloat16)
    args = digits_args(tmp_path, gossip_reference=reference, low_precision=False, max_steps=2)
    with pytest.raises(ValueError, match=r"^model's trained parameters are torch\.bfloat16 \(e\.g\. '.*'\): each node "
                                         r"would keep its weights, optimizer state and gossip values in torch\.bfloat16"):
        DecentralizedTrainer(model=model, args=args, train_dataset=train)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_float64_model_is_refused_with_mixed_precision(tmp_path):
    """Autocast casts only float32: bf16=True did nothing to a float64 model."""
    train, _ = digits()
    model = DigitsMLP().double()
    args = digits_args(tmp_path, low_precision=False, max_steps=2, bf16=True)
    with pytest.raises(ValueError, match=r"^mixed precision bf16 \(bf16=True, or accelerate launch --mixed_precision\) "
                                         r"computes under autocast, which casts only float32, and the model's trained "
                                         r"parameters are torch\.float64"):
        DecentralizedTrainer(model=model, args=args, train_dataset=train)
    DecentralizedTrainer(model=model, args=digits_args(tmp_path, low_precision=False, max_steps=2), train_dataset=train)
