"""The nodes as one model: the averaged model ``mean_i z_i`` (SPEC 1), the final merge (SPEC 2a),
training logs with the consensus distance and its drift guard, evaluation and prediction."""
from __future__ import annotations

import math
import time

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers.trainer_pt_utils import EvalLoopContainer, find_batch_size, nested_detach
from transformers.trainer_utils import (
    EvalLoopOutput,
    EvalPrediction,
    PredictionOutput,
    denumpify_detensorize,
    speed_metrics,
)
from transformers.utils import logging

from ..gossip import QSGD, RandomK, TopK, compression_quality, gossiped_parameters
from ..gossip.factory import build_compressor
from .inputs import eval_sets
from .node_data import check_labels
from .rng import seeded_host_rngs

logger = logging.get_logger(__name__)

#: the drift guard warns when the consensus distance grew over this many consecutive logging steps ...
DRIFT_WINDOW = 3
#: ... and by at least this factor over them (a plateau's noise alone rises for a few logs by chance)
DRIFT_GROWTH = 2.0

#: the metrics the trainer adds to every evaluation (a node's are named ``<metric>_node_<i>``):
#: ``compute_metrics`` may not return them (its ``loss`` replaces the loss, as in Trainer)
_TRAINER_METRICS = ("consensus_distance", "bytes_sent", "runtime", "samples_per_second", "steps_per_second")


def _own_metrics(metrics: dict) -> dict:
    """`metrics` from ``compute_metrics``; ValueError for a name of the trainer's own metrics, which
    it replaced silently (a ``consensus_distance`` of the user's became the run's)."""
    taken = [name for name in metrics if name.removeprefix("eval_").partition("_node_")[0] in _TRAINER_METRICS]
    if taken:
        raise ValueError(f"compute_metrics returned {', '.join(map(repr, taken))}, a name of the metrics the trainer "
                         f"adds to every evaluation ({', '.join(_TRAINER_METRICS)}, per node <metric>_node_<i>): "
                         "rename it")
    return metrics


def evaluation_metric_names(num_nodes: int) -> tuple[str, ...]:
    """The metrics :meth:`EvaluationMixin.evaluate` returns without ``compute_metrics``, without
    their prefix (``eval_``): the averaged model's ``loss`` and ``accuracy`` (a classifier's),
    ``consensus_distance``, Trainer's ``runtime``, ``samples_per_second``, ``steps_per_second``, and
    ``loss``, ``accuracy`` and ``bytes_sent`` of each node ``i`` (``loss_node_<i>``, ...)."""
    return ("loss", "accuracy", "consensus_distance", "runtime", "samples_per_second", "steps_per_second",
            *(f"{name}_node_{i}" for name in ("loss", "accuracy", "bytes_sent") for i in range(num_nodes)))


def describe_evaluation_metrics(num_nodes: int) -> str:
    """:func:`evaluation_metric_names` as a message says them."""
    return ("loss, accuracy (a classifier's), consensus_distance, runtime, samples_per_second, steps_per_second, and "
            f"loss_node_<i>, accuracy_node_<i>, bytes_sent_node_<i> for a node i in 0..{num_nodes - 1}")


class EvaluationMixin:
    """`DecentralizedTrainer`'s averaged model, final merge, training logs and evaluation."""

    def _float_state(self, model):
        """What the nodes' average is formed over, in ``state_dict`` order: its float entries but
        the frozen parameters (equal on every node, never changed: they stay as they are)."""
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return [t for name, t in model.state_dict().items() if t.is_floating_point() and name not in frozen]

    @torch.no_grad()
    def _refresh_average_model(self):
        """``self.model`` <- mean_i z_i over parameters and float buffers (SPEC 1 evaluation model)."""
        sums = self.node_group.sum([self._float_state(node) for node in self.nodes])
        for dst, s in zip(self._float_state(self.model), sums):
            dst.copy_(s / self.args.num_nodes)
        # counters (e.g. act_num_batches, which switches 8-bit layers to their running range in
        # eval) advance in lock-step on every node: take the first local node's
        for dst, src in zip(self.model.state_dict().values(), self.nodes[0].state_dict().values()):
            if not dst.is_floating_point():
                dst.copy_(src)
        self._average_is_current = True

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """``1/n * sum_i ||z_i - mean z||^2`` over the gossiped parameters (SPEC 1)."""
        self._refresh_average_model()
        mean = gossiped_parameters(self.model)
        local = torch.zeros(len(self.nodes), dtype=torch.float64)
        for k, params in enumerate(self.node_params):
            diffs = torch._foreach_sub(params, mean)
            local[k] = sum(torch.linalg.vector_norm(d, dtype=torch.float64) ** 2 for d in diffs)
        return float(self.node_group.gather(local).mean())

    def fault_counts(self) -> dict[str, list[int]]:
        """What the injected faults and the non-finite guard did so far, per node over all nodes
        (in the distributed backend a collective: call it on every rank), for the settings in
        use and those a checkpoint this run resumed from counted under other settings:
        ``lost_messages`` (messages a node sent that were lost: dropped under ``drop_prob``,
        or to a neighbour away under ``absences``), ``absent_steps`` (steps a node was away),
        ``nonfinite_skips`` (``skip_nonfinite``) and ``overflow_skips`` (float16 steps the loss
        scaler skipped)."""
        plan = self.fault_plan  # None without faults
        drops, absences = (plan.drop_prob > 0, bool(plan.absences)) if plan is not None else (False, False)
        counters = {"lost_messages": (self.lost_messages, drops or absences),
                    "absent_steps": (self.absent_steps, absences),
                    "nonfinite_skips": (self.nonfinite_skips, self.args.skip_nonfinite),
                    "overflow_skips": (self.overflow_skips, self.args.mixed_precision == "fp16")}
        gathered = {name: ([int(v) for v in self.node_group.gather(values)], used)
                    for name, (values, used) in counters.items()}
        return {name: counts for name, (counts, used) in gathered.items() if used or any(counts)}


    @torch.no_grad()
    def merge_nodes(self) -> None:
        """Skew-compensated final merge (SPEC 2a): every node's model becomes the exact average
        ``mean_i z_i`` of all nodes' de-biased models (parameters and float buffers; one sum over
        nodes, in the distributed backend all-gathered and added in node order: the simulation's
        bits). Also leaves ``self.model`` the average."""
        self._refresh_average_model()
        averaged = self._float_state(self.model)
        for node in self.nodes:
            torch._foreach_copy_(self._float_state(node), averaged)

    def _log_train(self, log: bool = True) -> None:
        """Log the mean loss of each node since the last log, and add the window to the run's
        ``train_loss`` (its loss times its steps, and its steps; a window without a finite loss,
        every node absent or skipped, adds neither).

        A node that took no step in the window (absent, or every step skipped) logs NaN; the
        overall ``loss`` is the mean over the nodes that did. ``grad_norm_node_{i}``: node ``i``'s
        total gradient norm at its last step in the window, before clipping (NaN without one);
        ``grad_norm`` their mean, as Trainer logs its one model's. ``log=False`` only takes the window's
        loss (the end of a run with ``logging_strategy="no"``).
        """
        steps = self.state.global_step - self._last_logged
        count = self._loss_count.to(self._loss_sum.device)
        mean = torch.where(count > 0, self._loss_sum / count.clamp(min=1), torch.nan)
        node_losses = self.node_group.gather(mean)
        self._loss_sum.zero_()
        self._loss_count.zero_()
        self._last_logged = self.state.global_step
        loss = float(node_losses.nanmean())  # NaN when no node took a step in the window
        self.store_flos()
        if log:
            # as Trainer: the rate the step ran at, read before its schedule stepped
            lr = self._step_lr if self._step_lr is not None else self.node_schedulers[0].get_last_lr()[0]
            logs = {"loss": loss, "learning_rate": lr}
            logs.update({f"loss_node_{i}": float(v) for i, v in enumerate(node_losses)})
            grad_norms = self.node_group.gather(self._grad_norm)
            logs["grad_norm"] = float(grad_norms.nanmean())  # mean over the nodes of their last step's norm
            logs.update({f"grad_norm_node_{i}": float(v) for i, v in enumerate(grad_norms)})
            self._grad_norm.fill_(torch.nan)  # a node that takes no step before the next log logs NaN
            logs.update({f"bytes_sent_node_{i}": int(v) for i, v in enumerate(self.node_group.gather(self.bytes_sent))})
            for name, counts in self.fault_counts().items():
                logs.update({f"{name}_node_{i}": count for i, count in enumerate(counts)})
            logs["consensus_distance"] = self.consensus_distance()
            self._watch_drift(logs["consensus_distance"])
            self.log(logs, start_time=self._train_start)  # Trainer's token speed with include_num_input_tokens_seen
        if math.isfinite(loss):
            self._total_loss += loss * steps
            self._loss_steps += steps

    def drift_warmup_steps(self) -> int:
        """Optimizer steps the drift guard waits beyond the first epoch: ``ceil(1 / keep)`` with a
        top-k or random-k compressor keeping ``keep`` of each tensor's entries, ``ceil(3 / delta)``
        with scaled QSGD of quality ``delta``, else 0. The nodes start from the same weights and
        spread out by design until gossip catches up, and the public copies Choco mixes (SPEC 2,
        they start at 0) fill at the messages' rate: a sparse message carries ``keep`` of the
        model (on digits at 1% top-k the distance rose for the first 70 steps of healthy runs), a
        QSGD message all of it shrunk by ``delta`` (MiniLM, Choco at the default step: the
        distance peaked at step 8 with 16 levels, ``3 / delta = 9``, and at step 88 with 1 level,
        ``99``; docs/consensus_step.md)."""
        compressor = build_compressor(self.args.gossip_config)
        if isinstance(compressor, QSGD):
            return math.ceil(3 / compression_quality(compressor))
        return math.ceil(1 / compressor.keep) if isinstance(compressor, (TopK, RandomK)) else 0

    def _watch_drift(self, distance: float) -> None:
        """Drift guard: ONE warning when the consensus distance grew over ``DRIFT_WINDOW``
        consecutive logging steps, by ``DRIFT_GROWTH`` times or more in all, to beyond any distance
        logged before in this run, after the first epoch and :meth:`drift_warmup_steps`.

        Before that point the nodes spread out from the same initial weights, so the distance grows
        from 0 by design. Passing the run's peak is what a too-large consensus step does (it
        diverges); a distance that regrows below the peak after falling is compression noise
        around a consensus already reached (digits at top-10%: from 0.2 back to 3 in the last
        epochs, after a peak of 60, every node within 0.3 points; docs/consensus_step.md)."""
        peak, self._drift_peak = self._drift_peak, max(self._drift_peak, distance)
        if self.state.epoch is None or self.state.epoch < 1 or self._drift_warned \
                or self.state.global_step < self.drift_warmup_steps():
            self._drift_trail = []
            return
        self._drift_trail = (self._drift_trail + [distance])[-(DRIFT_WINDOW + 1):]
        trail = self._drift_trail
        if len(trail) > DRIFT_WINDOW and all(a < b for a, b in zip(trail, trail[1:])) \
                and trail[-1] >= DRIFT_GROWTH * trail[0] and distance > peak:
            self._drift_warned = True
            logger.warning(f"consensus distance grew over {DRIFT_WINDOW} consecutive logging steps to {distance:.4g} "
                           f"(step {self.state.global_step}), beyond its earlier peak {peak:.4g}: the nodes are "
                           f"drifting apart; lower consensus_lr (--consensus-lr, now {self.args.gamma:g})")

    def _run_model(self, model, dataloader, desc: str, ignore_keys, keep_outputs: bool,
                   labelled: bool = False) -> EvalLoopOutput:
        """:meth:`_run_batches` with torch's CPU generator, ``random`` and NumPy seeded from
        ``args.data_order_seed`` (restored after), so a random collator (masked LM's masks) gives
        the averaged model and every node the same batches, at every evaluation."""
        with seeded_host_rngs(self.args.data_order_seed):
            return self._run_batches(model, dataloader, desc, ignore_keys, keep_outputs, labelled)

    @torch.no_grad()
    def _run_batches(self, model, dataloader, desc: str, ignore_keys, keep_outputs: bool,
                     labelled: bool = False) -> EvalLoopOutput:
        """Run ``model`` over ``dataloader`` (`Trainer.prediction_step` per batch, then the callbacks'
        ``on_prediction_step``).

        Returns an `EvalLoopOutput` whose ``metrics`` (unprefixed) hold ``loss`` (mean over
        samples), ``accuracy`` (argmax of ``(batch, classes)`` logits, ``classes > 1``, against
        ``(batch,)`` integer labels; of an output tuple's first element, the logits, where the model
        returns more, as T5's and BART's classifiers do; NaN where a row of logits holds a NaN or
        no finite value: a diverged model classifies nothing) when there is no ``compute_metrics``, and whatever
        ``compute_metrics`` returns on all predictions, numpy values made Python numbers (with the
        model's main inputs as ``inputs`` and each sample's batch loss as ``losses`` where
        ``include_for_metrics`` names ``"inputs"`` / ``"loss"``, as Trainer); ``predictions`` and
        ``label_ids`` are numpy arrays (padded with -100 across batches; lists of each batch's
        arrays with ``eval_do_concat_batches=False``) when ``keep_outputs``, else None. They
        gather on the model's device in Trainer's ``EvalLoopContainer`` and move to the host every
        ``eval_accumulation_steps`` batches (at the end without it). With ``batch_eval_metrics``,
        ``compute_metrics`` gets each batch's tensors instead and ``compute_result=True`` at the
        last batch, whose return is the metrics. ``num_samples``: the samples seen (a loader
        without a length, e.g. over an iterable dataset, counts them as it goes). All as in Trainer.
        ``labelled`` (evaluation): ValueError at the first batch when it lacks a key the user's
        ``label_names`` names (Trainer then computes no loss and no metrics, without a word).
        """
        model.eval()
        loss_only = self.args.prediction_loss_only and not keep_outputs
        keep = keep_outputs or (self.compute_metrics is not None and not loss_only)
        every, include = self.args.eval_accumulation_steps, self.args.include_for_metrics
        main_input = getattr(model, "main_input_name", "input_ids")
        per_batch = self.args.batch_eval_metrics and self.compute_metrics is not None and not loss_only
        batch_metrics = None  # batch_eval_metrics: what compute_metrics returned for the last batch
        loss_sum, loss_samples, seen, correct, classified, unscored = 0.0, 0, 0, 0, 0, False
        gathered = {name: EvalLoopContainer(self.args.eval_do_concat_batches, padding_index=-100)
                    for name in ("predictions", "label_ids", "inputs", "losses")}
        batches = tqdm(dataloader, desc=desc, leave=False,  # one process draws them (rank 0)
                       disable=self.args.disable_tqdm or not self.state.is_world_process_zero)
        for step, (batch, last) in enumerate(_flag_last(batches), 1):
            batch = self._prepare_inputs(batch)
            if labelled and step == 1:
                self._check_label_names(batch)
            size = find_batch_size(batch)
            seen += size
            with self._checking_output_form(model):
                loss, logits, labels = self.prediction_step(model, batch, loss_only, ignore_keys=ignore_keys)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
            if loss is not None:
                loss_sum += float(loss.double()) * size
                loss_samples += size
            if logits is None:
                continue
            scores = logits[0] if isinstance(logits, (tuple, list)) and logits else logits
            if self.compute_metrics is None and torch.is_tensor(labels) and torch.is_tensor(scores) \
                    and scores.dim() == 2 and scores.shape[-1] > 1 and labels.dim() == 1 \
                    and not labels.is_floating_point():  # (several label names: a tuple, no accuracy)
                correct += int((scores.argmax(-1) == labels).sum())
                classified += labels.shape[0]
                # argmax reads a row of NaN logits as class 0: a diverged model scored the share of class 0
                # (a -inf logit, a class masked out, still leaves the row its argmax)
                unscored = unscored or bool((scores.isnan().any(-1) | ~scores.isfinite().any(-1)).any())
            if keep:
                if self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, labels)
                new = {"predictions": nested_detach(logits), "label_ids": labels}
                if "inputs" in include:
                    if main_input not in batch:
                        raise ValueError(f"include_for_metrics=['inputs'] passes the model's main input {main_input!r} "
                                         f"to compute_metrics, but the evaluation batches lack it ({sorted(batch)})")
                    new["inputs"] = batch[main_input]
                if "loss" in include and loss is not None:
                    new["losses"] = loss.detach().reshape(1).repeat(size)
                if per_batch and labels is not None:  # as Trainer: the batch's tensors, compute_result at the last
                    batch_metrics = self.compute_metrics(EvalPrediction(**new), compute_result=last)
                for name, value in new.items():
                    if value is not None and (keep_outputs or not per_batch):
                        gathered[name].add(value)
                if every and step % every == 0:
                    for container in gathered.values():
                        container.to_cpu_and_numpy()
        on_host = {name: container.get_arrays() for name, container in gathered.items()}
        metrics = {"loss": loss_sum / loss_samples} if loss_samples else {}
        if classified:
            metrics["accuracy"] = math.nan if unscored else correct / classified
        if batch_metrics is not None:
            metrics.update(_own_metrics(denumpify_detensorize(batch_metrics)))
        predictions, label_ids = on_host["predictions"], on_host["label_ids"]
        if self.compute_metrics is not None and predictions is not None and label_ids is not None and not per_batch:
            metrics.update(_own_metrics(denumpify_detensorize(self.compute_metrics(EvalPrediction(
                predictions=predictions, label_ids=label_ids, inputs=on_host["inputs"], losses=on_host["losses"])))))
        if not keep_outputs:
            predictions, label_ids = None, None
        return EvalLoopOutput(predictions=predictions, label_ids=label_ids, metrics=metrics, num_samples=seen)

    def _check_label_names(self, batch) -> None:
        """ValueError when ``batch`` (a dict of an evaluation batch's tensors) lacks a key of the
        ``label_names`` the user set; their default (None: the model's label arguments) passes."""
        names = self.label_names if self.args.label_names is not None else []  # as Trainer: set at construction
        missing = [name for name in names if name not in batch]
        if missing:
            raise ValueError(f"label_names={list(names)}: the evaluation batches hold no {missing[0]!r} (their keys: "
                             f"{sorted(batch)}), so evaluate() would report no loss and no metrics; name the "
                             f"batches' label keys, or leave label_names unset for the model's own")

    def _speed_metrics(self, prefix: str, start: float, num_samples: int) -> dict[str, float]:
        """Trainer's ``{prefix}_runtime`` (seconds since ``start``), ``{prefix}_samples_per_second``
        and ``{prefix}_steps_per_second`` for one pass over ``num_samples`` evaluation samples."""
        steps = math.ceil(num_samples / self.args.per_device_eval_batch_size)
        return speed_metrics(prefix, start, num_samples=num_samples, num_steps=steps)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Metrics of the averaged model and of every node, consensus distance, bytes sent.

        ``eval_dataset`` (or the trainer's) may be a dict ``{name: dataset}``: each is evaluated
        with the prefix ``{metric_key_prefix}_{name}``; a name alone evaluates that one of the
        trainer's. Logged through `Trainer.log` (so callbacks and ``report_to`` integrations see
        it) and returned as a dict with keys ``{p}_loss`` and ``{p}_<metric>`` of the averaged
        model (``accuracy`` for classification without ``compute_metrics``, else
        ``compute_metrics``'s keys; one already named ``{p}_...`` keeps its name, as in Trainer),
        ``{p}_<metric>_node_{i}`` of node ``i``, ``{p}_consensus_distance`` and
        ``{p}_bytes_sent_node_{i}``, where ``p`` is the prefix; and Trainer's speed metrics:
        ``{p}_runtime`` (seconds this process took for the whole evaluation, the averaged model and
        its local nodes), ``{p}_samples_per_second`` and ``{p}_steps_per_second`` (samples and
        batches of the evaluation set per second of it); with ``skip_memory_metrics=False``,
        Trainer's memory metrics ``{p}_mem_cpu_alloc_delta`` / ``..._peaked_delta`` (bytes of this
        process, and ``..._gpu_...`` on a GPU) too.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if eval_dataset is not None and not isinstance(eval_dataset, (dict, str)):  # the trainer's were checked
            check_labels(eval_dataset, self._num_classes, "eval_dataset")
        if isinstance(dataset, dict):
            eval_sets(dataset)  # refuses an empty one
            metrics = {}
            for name, part in dataset.items():  # the trainer's own sets by name (their loaders may be kept)
                metrics.update(self.evaluate(part if eval_dataset is not None else name, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        self._memory_tracker.start()  # Trainer's eval_mem_* metrics (skip_memory_metrics=False); not within train()
        start = time.time()
        dataloader = self.get_eval_dataloader(eval_dataset)  # None or a name: the trainer's set
        p = metric_key_prefix
        metrics = {f"{p}_consensus_distance": self.consensus_distance()}  # also refreshes self.model
        averaged = self._run_model(self.model, dataloader, "eval: average", ignore_keys, keep_outputs=False,
                                   labelled=True)
        metrics.update(_prefixed(averaged.metrics, p))
        local = [self._run_model(node, dataloader, f"eval: node {i}", ignore_keys, keep_outputs=False).metrics
                 for i, node in zip(self.node_ids, self.nodes)]
        per_node = [m for process in self.node_group.gather_objects(local) for m in process]
        for i, node_metrics in enumerate(per_node):
            metrics.update(_prefixed(node_metrics, p, f"_node_{i}"))
        metrics.update({f"{p}_bytes_sent_node_{i}": int(v) for i, v in enumerate(self.node_group.gather(self.bytes_sent))})
        metrics.update(self._speed_metrics(p, start, averaged.num_samples))
        self._memory_tracker.stop_and_update_metrics(metrics)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions of the averaged model ``mean_i z_i`` on ``test_dataset``.

        Returns:
            `PredictionOutput`: ``predictions`` (numpy, e.g. ``(samples, classes)`` logits, padded
            with -100 across batches), ``label_ids`` (or None without labels), both None with
            ``prediction_loss_only``, and ``metrics`` (``{metric_key_prefix}_loss``,
            ``..._accuracy`` or ``compute_metrics``'s keys, and Trainer's ``..._runtime`` in
            seconds, ``..._samples_per_second``, ``..._steps_per_second``).
        """
        if isinstance(test_dataset, dict):  # evaluate() takes a dict of sets; Trainer's predict failed in the loader
            raise ValueError(f"test_dataset: predict() takes one dataset, got a dict of {len(test_dataset)} sets: call "
                             "it once per set (evaluate() takes the dict)")
        check_labels(test_dataset, self._num_classes, "test_dataset")
        self._memory_tracker.start()
        start = time.time()
        self._refresh_average_model()
        dataloader = self.get_test_dataloader(test_dataset)
        output = self._run_model(self.model, dataloader, "predict", ignore_keys,
                                 keep_outputs=not self.args.prediction_loss_only)
        metrics = {**_prefixed(output.metrics, metric_key_prefix),
                   **self._speed_metrics(metric_key_prefix, start, output.num_samples)}
        self._memory_tracker.stop_and_update_metrics(metrics)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=metrics)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """A plain (unsharded) loader: every process evaluates on the whole evaluation set.
        ``eval_dataset`` may name one of a dict ``eval_dataset`` given to the trainer, as in Trainer.
        With ``dataloader_persistent_workers`` the loader of each of the trainer's own evaluation
        sets is kept, so its workers outlive an evaluation, as in Trainer."""
        key = eval_dataset if isinstance(eval_dataset, str) else "eval" if eval_dataset is None else None
        if key in self._eval_loaders:
            return self._eval_loaders[key]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        if isinstance(dataset, str):
            named = self.eval_dataset if isinstance(self.eval_dataset, dict) else {}
            if dataset not in named:
                raise ValueError(f"eval_dataset={dataset!r} names one of the trainer's evaluation sets, which are "
                                 f"{sorted(named) if named else 'not a dict of named sets'}")
            dataset = named[dataset]
        loader = self._plain_loader(dataset, "evaluation")
        if key is not None and self.args.dataloader_persistent_workers:  # (it needs workers: the arguments check)
            self._eval_loaders[key] = loader
        return loader

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        """A plain (unsharded) loader over ``test_dataset``."""
        return self._plain_loader(test_dataset, "test")

    def _plain_loader(self, dataset, description: str) -> DataLoader:
        return DataLoader(batch_size=self.args.per_device_eval_batch_size, drop_last=self.args.dataloader_drop_last,
                          **self._loader_options(dataset, description))


def _prefixed(metrics: dict, prefix: str, suffix: str = "") -> dict:
    """``{prefix}_{name}{suffix}`` for every metric; a name that already starts with ``{prefix}_``
    is not prefixed again (as Trainer's evaluation loop)."""
    return {f"{prefix}_{name.removeprefix(prefix + '_')}{suffix}": value for name, value in metrics.items()}


def _flag_last(iterable):
    """``(item, is_last)`` for each item of ``iterable``, looking one item ahead (works without a length)."""
    iterator = iter(iterable)
    try:
        previous = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield previous, False
        previous = item
    yield previous, True
