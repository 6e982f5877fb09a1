"""DecentralizedTrainer: n peer nodes, each with its own model, optimizer and skewed data shard,
training in lock-step and gossiping compressed models over a directed graph (SPEC sections 1-2).

The trainer reuses `transformers.Trainer` for what does not change with decentralization
(arguments, optimizer and scheduler factories, collators, loss computation, callbacks, logging
integrations, progress bars) and replaces the training loop, evaluation and saving, because the
state being trained is ``n`` models rather than one. Where the nodes run (one process, or one
process per node) is hidden in :class:`~.node_group.NodeGroup`; the pieces of the trainer are:

* :mod:`.arguments` -- :class:`DecentralizedTrainingArguments` and its checks;
* :mod:`.local_step` -- one SPEC 2 iteration (local steps, NaN/Inf check, gossip);
* :mod:`.evaluation` -- the averaged model ``mean_i z_i`` and evaluation;
* :mod:`.checkpointing` -- atomic checkpoints of the whole decentralized state and resuming;
* :mod:`.rng` -- per-node random streams, so both backends draw the same numbers per node.

Gradients never cross nodes: the model is never wrapped in DDP and the only traffic per step is
the gossip messages. A NaN/Inf loss or gradient stops the run naming the node and step (or skips
that node's update with ``skip_nonfinite``) before anything is gossiped. Faults can be injected for
robustness studies (``drop_prob``, ``stragglers``, ``absences``; rules in
:mod:`lp_decentral_nlp.gossip.faults`).
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import numpy as np
from datasets import Dataset
import safetensors.torch
import torch
from torch.utils.data import DataLoader, IterableDataset, Subset
from transformers import Trainer, TrainerState
from transformers.trainer_utils import SaveStrategy, TrainOutput
from transformers.utils import logging

from .. import gossip as gossip_lib
from ..data import skewed_partition
from ..gossip.factory import build_gossip
from ..gossip.transport import GossipPeerError
from ..quant import QuantConfig, QuantModule, quantize_model
from ..utils.cpu_malloc import tune_process_for_training
from .arguments import DecentralizedTrainingArguments
from .checkpointing import CheckpointMixin
from .evaluation import EvaluationMixin
from .local_step import LocalStepMixin
from .node_group import NodeGroup
from .rng import EpochSampler, NodeRNG, node_seed

logger = logging.get_logger(__name__)

#: the drift guard warns when the consensus distance grew over this many consecutive logging steps
DRIFT_WINDOW = 3


class DecentralizedTrainer(LocalStepMixin, EvaluationMixin, CheckpointMixin, Trainer):
    """Decentralized training of ``num_nodes`` replicas of ``model`` (SPEC 1-2).

    Args:
        model: the initial model; every node starts from a copy of its weights. After training
            (and at every evaluation) ``trainer.model`` holds the *averaged* de-biased model
            ``mean_i z_i``, the evaluation model of SPEC 1.
        args: :class:`DecentralizedTrainingArguments`.
        train_dataset: the full training set; it is split into ``num_nodes`` skewed shards with
            :func:`~lp_decentral_nlp.data.skewed_partition` on its ``label`` column.
        quant_config: 8-bit surgery applied to every node when ``args.low_precision`` (default
            :class:`~lp_decentral_nlp.quant.QuantConfig`).
        Other arguments are those of `transformers.Trainer`.

    Attributes (per local node, aligned with ``node_ids``): ``nodes`` (the models z_i),
    ``bytes_sent`` (int64, bytes put on the wire), ``nonfinite_skips`` (int64, steps skipped under
    ``skip_nonfinite``), and after ``train()`` starts, ``node_optimizers`` and ``node_schedulers``.
    ``node_group`` (:class:`~.node_group.NodeGroup`) holds the backend.
    """

    def __init__(self, model=None, args: DecentralizedTrainingArguments | None = None, *, quant_config=None, **kwargs):
        if not isinstance(args, DecentralizedTrainingArguments):
            raise TypeError(f"args must be DecentralizedTrainingArguments, got {type(args).__name__}")
        if model is None:
            raise ValueError("model is required (model_init is not supported by DecentralizedTrainer)")
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init is not supported by DecentralizedTrainer: pass the initial model as model")
        if any(o is not None for o in kwargs.get("optimizers") or ()):
            raise ValueError("optimizers is not supported by DecentralizedTrainer: every node builds its own optimizer "
                             "and schedule from args (optim, learning_rate, lr_scheduler_type, ...) or "
                             "optimizer_cls_and_kwargs")
        if quant_config is not None and args.quant_kernel != "auto" and quant_config.kernel != args.quant_kernel:
            raise ValueError(f"quant_kernel={args.quant_kernel!r} disagrees with quant_config.kernel="
                             f"{quant_config.kernel!r}: set the kernel in one of them")
        if args.activation_checkpointing and not hasattr(model, "activation_checkpointing_enable"):
            raise ValueError(f"activation_checkpointing (gradient_checkpointing) needs a model with "
                             f"activation_checkpointing_enable() (a transformers PreTrainedModel), got "
                             f"{type(model).__name__}")
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is not None and (isinstance(train_dataset, IterableDataset)
                                          or not hasattr(train_dataset, "__len__")):
            raise ValueError("train_dataset must be map-style (a datasets.Dataset, or a torch Dataset with __len__ and "
                             "__getitem__): the SPEC 6 shards are index sets over a dataset of known length, got "
                             f"{type(train_dataset).__name__}")
        if args.low_precision and not any(isinstance(m, QuantModule) for m in model.modules()):
            quantize_model(model, quant_config or QuantConfig(kernel=args.quant_kernel))
        super().__init__(model=model, args=args, **kwargs)
        if self.train_dataset is not None:
            self._shard_labels = self._read_shard_labels(self.train_dataset)

        self.node_group = NodeGroup(args.num_nodes, args.backend)
        self.node_ids = self.node_group.node_ids
        # SPEC 1: every node starts from the same weights (process 0's)
        self.node_group.broadcast_(list(self.model.parameters()) + list(self.model.buffers()))
        self.nodes = [copy.deepcopy(self.model) for _ in self.node_ids]
        # z_i of every local node, as the gossip engine updates them in place
        self.node_params = [[p.detach() for p in node.parameters()] for node in self.nodes]
        self.gossip = build_gossip(args.gossip_config, self.node_group.transport(args.gossip_timeout))
        self.qgm = gossip_lib.QuasiGlobalMomentum(self.node_params, beta=args.qgm_beta) if args.qgm else None
        self.bytes_sent = torch.zeros(len(self.node_ids), dtype=torch.int64)
        self.nonfinite_skips = torch.zeros(len(self.node_ids), dtype=torch.int64)
        plan = args.fault_plan
        self.fault_plan = plan if plan.active else None
        self._rng = NodeRNG(args.seed, self.node_ids)
        self._mark_main_process()

    # --- setup -----------------------------------------------------------------------------

    def _read_shard_labels(self, dataset) -> list[int] | None:
        """The class id of every training sample that the SPEC 6 shards are skewed on, read from
        ``args.shard_column`` (default: ``label``, else ``labels`` when it holds one class id per
        sample); None when there is no such column (then ``skew`` must be 0: random shards).
        ValueError naming the column or argument that is wrong."""
        args = self.args
        if len(dataset) == 0:
            raise ValueError("train_dataset is empty")
        first = dataset[0]
        columns = list(dataset.column_names) if hasattr(dataset, "column_names") else \
            (list(first) if isinstance(first, dict) else [])
        name = args.shard_column
        if name is None:
            name = next((c for c in ("label", "labels") if c in columns and _is_class_id(first[c])), None)
        elif name not in columns:
            raise ValueError(f"shard_column={name!r} is not a column of train_dataset (columns: {columns})")
        if name is None:
            if args.skew > 0:
                raise ValueError(f"skew={args.skew} needs a column of class ids to skew the shards on, and "
                                 f"train_dataset has no 'label' or 'labels' column with one class id per sample "
                                 f"(columns: {columns}): name one with shard_column, or use skew=0")
            return None
        if hasattr(dataset, "with_format"):  # no formatting transform (e.g. image decoding) on every row
            values = dataset.with_format(None)[name]
        else:
            values = [dataset[i][name] for i in range(len(dataset))]
        values = [int(v) if torch.is_tensor(v) and v.dim() == 0 else v for v in values]
        num_labels = getattr(getattr(self.model, "config", None), "num_labels", None) \
            if name in ("label", "labels") else None
        bad = sorted({v for v in values if not _is_class_id(v) or v < 0 or (num_labels and v >= num_labels)}, key=repr)
        if bad:
            allowed = f"0..{num_labels - 1} (the model has num_labels={num_labels})" if num_labels else "integers >= 0"
            what = "labels" if name in ("label", "labels") else f"shard_column {name!r}"
            raise ValueError(f"train_dataset: {what} must be class ids {allowed}, found {bad[:5]}")
        return values

    def _shards(self) -> list:
        """SPEC 6 shards of the training set (indices per node), the same on every rank; random
        (skew 0) when the training set has no class column."""
        labels = self._shard_labels if self._shard_labels is not None else [0] * len(self.train_dataset)
        return skewed_partition(labels, self.args.num_nodes, self.args.skew, seed=self.args.seed)

    def _model_columns(self, dataset, description: str):
        """``dataset`` without the columns the model's forward does not take (``remove_unused_columns``;
        a plain torch Dataset is passed as it is, as `Trainer` does for its collator)."""
        return self._remove_unused_columns(dataset, description=description) if isinstance(dataset, Dataset) else dataset

    def _loader_options(self) -> dict:
        """DataLoader options from ``args`` (workers, pinned memory on an accelerator)."""
        args = self.args
        options = {"collate_fn": self.data_collator, "num_workers": args.dataloader_num_workers,
                   "pin_memory": args.dataloader_pin_memory and args.device.type != "cpu"}
        if args.dataloader_num_workers > 0:
            options.update(persistent_workers=args.dataloader_persistent_workers,
                           prefetch_factor=args.dataloader_prefetch_factor,
                           multiprocessing_context=args.dataloader_multiprocessing_context)
        return options

    def node_dataloaders(self) -> list[DataLoader]:
        """One loader per local node over its skewed shard, shuffled by an :class:`EpochSampler`
        of its own (``loader.sampler.set_epoch(epoch, start)`` picks the epoch and position)."""
        if self.train_dataset is None:
            raise ValueError("DecentralizedTrainer.train() needs a train_dataset")
        shards = self._shards()
        dataset = self._model_columns(self.train_dataset, "training")
        bs = self.args.per_device_train_batch_size
        self.shard_sizes = [len(s) for s in shards]
        if min(self.shard_sizes) < bs:
            raise ValueError(f"per_device_train_batch_size={bs} exceeds the smallest shard ({min(self.shard_sizes)} "
                             "samples): lower the batch size or the number of nodes")
        loaders = []
        for i in self.node_ids:
            shard = Subset(dataset, shards[i].tolist())
            # the loader's own generator only seeds worker processes; reseeded per epoch in _start_epoch
            loaders.append(DataLoader(shard, batch_size=bs, sampler=EpochSampler(len(shard), node_seed(self.args.seed, i)),
                                      drop_last=True, generator=torch.Generator(), **self._loader_options()))
        return loaders

    @staticmethod
    def _start_epoch(loaders, epoch: int, batches_done: int) -> list:
        """Iterators over epoch ``epoch`` of every loader, from batch ``batches_done`` on."""
        for loader in loaders:
            loader.sampler.set_epoch(epoch, batches_done * loader.batch_size)
            loader.generator.manual_seed(loader.sampler.epoch_seed())
        return [iter(loader) for loader in loaders]

    def _make_optimizer_and_scheduler(self, node_model, max_steps, steps_per_epoch):
        """Each node's own optimizer and LR schedule, built by `Trainer`'s factories from ``args``.

        With QGM the optimizer's own momentum is switched off (Adam ``beta1 = 0``, SGD
        ``momentum = 0``): the quasi-global buffer takes its place (SPEC 2). With
        ``args.lr_milestones`` the schedule is ``MultiStepLR``: the LR is multiplied by
        ``args.lr_decay`` after step ``max(1, round(epoch * steps_per_epoch))`` of each milestone.
        """
        self.optimizer, self.lr_scheduler = None, None
        optimizer = self.create_optimizer(node_model)
        if self.args.qgm:
            for group in optimizer.param_groups:
                if "betas" in group:
                    group["betas"] = (0.0, group["betas"][1])
                if "momentum" in group:
                    group["momentum"] = 0.0
        if self.args.lr_milestones:
            milestones = [max(1, round(e * steps_per_epoch)) for e in self.args.lr_milestones]
            scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=self.args.lr_decay)
        else:
            scheduler = self.create_scheduler(max_steps, optimizer=optimizer)
        self.optimizer, self.lr_scheduler = None, None
        return optimizer, scheduler

    # --- training ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Train every node in lock-step: local step on each node, then one gossip step (SPEC 2).

        Args:
            resume_from_checkpoint: a ``checkpoint-<step>`` directory written by this trainer, a
                directory holding such checkpoints (its latest complete one is used), or True
                (the latest in ``args.output_dir``). None uses ``args.resume_from_checkpoint``;
                False starts afresh. The run continues exactly where the checkpoint was taken:
                the same final weights, bytes and metrics as a run that never stopped (identical
                in the simulated backend) as long as the arguments that shape the run are the
                same (checked: nodes, graph, algorithm, compression, precision, QGM, skew, seed,
                batch size, training set size). With ``dataloader_num_workers > 0`` random data
                transforms do not repeat after a mid-epoch resume.
        """
        args = self.args
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        if resume_from_checkpoint is True:
            resume_from_checkpoint = args.output_dir
        # the one process-wide setting the trainer changes (lp_decentral_nlp.utils.cpu_malloc)
        self.cpu_malloc_tuned = tune_process_for_training(args.device, args.tune_cpu_malloc)
        loaders = self.node_dataloaders()
        accumulation = args.gradient_accumulation_steps
        batches_per_epoch = min(self.shard_sizes) // args.per_device_train_batch_size
        if batches_per_epoch < accumulation:
            raise ValueError(f"gradient_accumulation_steps={accumulation} exceeds the batches per epoch of the smallest "
                             f"shard ({batches_per_epoch}): lower it, the batch size or the number of nodes")
        steps_per_epoch = batches_per_epoch // accumulation  # optimizer steps; leftover micro-batches are dropped
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        made = [self._make_optimizer_and_scheduler(node, max_steps, steps_per_epoch) for node in self.nodes]
        self.node_optimizers = [optimizer for optimizer, _ in made]
        self.node_schedulers = [scheduler for _, scheduler in made]
        for node in self.nodes:
            if args.activation_checkpointing:
                node.activation_checkpointing_enable(activation_checkpointing_kwargs=args.activation_checkpointing_kwargs)
            if args.torch_compile:
                node.compile(backend=args.torch_compile_backend, mode=args.torch_compile_mode)

        self.state = TrainerState()
        self._loss_sum = torch.zeros(len(self.nodes), device=args.device)  # per local node, since the last log
        self._loss_count = torch.zeros(len(self.nodes), dtype=torch.int64)  # steps in _loss_sum, per local node
        self._last_logged, self._total_loss = 0, 0.0
        self._drift_trail, self._drift_warned = [], False
        epoch, done = 0, 0  # position in the data: epoch, batches of it consumed
        if resume_from_checkpoint:
            epoch, done = self._load_checkpoint(resume_from_checkpoint, steps_per_epoch)
        self._data_position = (epoch, done)
        self._mark_main_process()
        self.state.max_steps, self.state.num_train_epochs = max_steps, num_epochs
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        self._steps_per_epoch = steps_per_epoch
        self.is_in_train = True
        start = time.time()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        try:
            while epoch < num_epochs and self.state.global_step < max_steps:
                if done >= steps_per_epoch:
                    epoch, done = epoch + 1, 0
                    continue
                self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
                iterators = self._start_epoch(loaders, epoch, done * accumulation)
                while done < steps_per_epoch and self.state.global_step < max_steps:
                    self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                    self._iteration(self._next_batches(iterators))
                    self.state.global_step += 1
                    done += 1
                    self.state.epoch = epoch + done / steps_per_epoch
                    self._data_position = (epoch, done)
                    self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                    self._maybe_log_save_evaluate(trial, ignore_keys_for_eval)
                    if self.control.should_training_stop or self.control.should_epoch_stop:
                        break
                if done >= steps_per_epoch or self.control.should_epoch_stop:
                    epoch, done = epoch + 1, 0
                    self._data_position = (epoch, done)
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                self._maybe_log_save_evaluate(trial, ignore_keys_for_eval)
                if self.control.should_training_stop:
                    break
        except GossipPeerError as exc:
            raise type(exc)(f"{exc} [training step {self.state.global_step + 1}]. {self._resume_hint()}",
                            exc.peer) from exc
        if self._last_logged < self.state.global_step:
            self._total_loss += self._log_train()
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_nodes(self.state.best_model_checkpoint)
        if args.final_merge:
            self.merge_nodes()
        self._refresh_average_model()
        self.is_in_train = False
        runtime = time.time() - start
        train_loss = self._total_loss / max(self.state.global_step, 1)
        metrics = {"train_runtime": runtime, "train_loss": train_loss,
                   "train_steps_per_second": self.state.global_step / max(runtime, 1e-9)}
        self.log(dict(metrics))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    @torch.no_grad()
    def merge_nodes(self) -> None:
        """Skew-compensated final merge (SPEC 2a): every node's model becomes the exact average
        ``mean_i z_i`` of all nodes' de-biased models (parameters and float buffers; one sum over
        nodes, an all-reduce in the distributed backend). Also leaves ``self.model`` the average."""
        self._refresh_average_model()
        averaged = self._float_state(self.model)
        for node in self.nodes:
            torch._foreach_copy_(self._float_state(node), averaged)

    def _maybe_log_save_evaluate(self, trial, ignore_keys_for_eval) -> None:
        """As `Trainer`'s: log, evaluate (tracking the best ``metric_for_best_model`` in
        ``state.best_metric``), then save (only a new best under ``save_strategy="best"``)."""
        if self.control.should_log:
            self._total_loss += self._log_train()
        if self.control.should_evaluate:
            metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
            new_best = self._determine_best_metric(metrics=metrics, trial=trial)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = new_best
        if self.control.should_save:
            self._save_checkpoint(self.model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _next_batches(self, iterators) -> list[list]:
        """The next ``gradient_accumulation_steps`` micro-batches of every local node, drawn in that
        node's RNG stream (random transforms)."""
        batches = []
        for i, it in zip(self.node_ids, iterators):
            with self._rng.activate(i):
                batches.append([next(it) for _ in range(self.args.gradient_accumulation_steps)])
        return batches


    def _log_train(self) -> float:
        """Log the mean loss of each node since the last log; returns the loss summed over those steps.

        A node that took no step in the window (absent, or every step skipped) logs NaN; the
        overall ``loss`` is the mean over the nodes that did.
        """
        steps = self.state.global_step - self._last_logged
        count = self._loss_count.to(self._loss_sum.device)
        mean = torch.where(count > 0, self._loss_sum / count.clamp(min=1), torch.nan)
        node_losses = self.node_group.gather(mean)
        self._loss_sum.zero_()
        self._loss_count.zero_()
        self._last_logged = self.state.global_step
        loss = float(node_losses.nanmean())  # NaN when no node took a step in the window
        logs = {"loss": loss, "learning_rate": self.node_schedulers[0].get_last_lr()[0]}
        logs.update({f"loss_node_{i}": float(v) for i, v in enumerate(node_losses)})
        logs.update({f"bytes_sent_node_{i}": int(v) for i, v in enumerate(self.node_group.gather(self.bytes_sent))})
        if self.args.skip_nonfinite:
            logs.update({f"nonfinite_skips_node_{i}": int(v) for i, v in enumerate(self.node_group.gather(self.nonfinite_skips))})
        logs["consensus_distance"] = self.consensus_distance()
        self._watch_drift(logs["consensus_distance"])
        self.log(logs)
        return loss * steps if math.isfinite(loss) else 0.0

    def _watch_drift(self, distance: float) -> None:
        """Drift guard: ONE warning when the consensus distance grew over ``DRIFT_WINDOW``
        consecutive logging steps after the first epoch (in the first the nodes spread out from
        the same initial weights, so the distance grows from 0 by design)."""
        if self.state.epoch is None or self.state.epoch < 1 or self._drift_warned:
            self._drift_trail = []
            return
        self._drift_trail = (self._drift_trail + [distance])[-(DRIFT_WINDOW + 1):]
        trail = self._drift_trail
        if len(trail) > DRIFT_WINDOW and all(a < b for a, b in zip(trail, trail[1:])):
            self._drift_warned = True
            logger.warning(f"consensus distance grew over {DRIFT_WINDOW} consecutive logging steps to {distance:.4g} "
                           f"(step {self.state.global_step}): the nodes are drifting apart; lower consensus_lr "
                           f"(--consensus-lr, now {self.args.gamma:g})")

    def _mark_main_process(self):
        """Only one process prints progress and writes logs (rank 0 in the distributed backend)."""
        main = self.node_group.is_main
        self.state.is_world_process_zero = self.state.is_local_process_zero = main

    def cost_report(self, input_shape):
        """SPEC 7 cost of one iteration of one node of this run (compute, energy, memory, gossip bytes).

        Args:
            input_shape: one sample's shape without the batch dimension: ``(seq_len,)`` for token
                models, ``(C, H, W)`` for images.
        Returns:
            :class:`lp_decentral_nlp.cost.CostReport` (``.to_dict()`` for ``results.json``).
        """
        from ..cost import estimate_cost

        optim = str(self.args.optim).lower()
        optimizer = "adam" if "adam" in optim else ("momentum" if "sgd" in optim else "adam")
        bs = self.args.per_device_train_batch_size
        # the loaders drop the last partial batch: an epoch is floor(shard / batch) iterations
        samples_per_node = min(len(s) for s in self._shards()) // bs * bs
        return estimate_cost(self.nodes[0], tuple(input_shape), bs,
                             "int8" if self.args.low_precision else "fp32", optimizer=optimizer,
                             gossip=self.gossip, samples_per_node=samples_per_node)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the averaged model (HF format; an 8-bit one reloads with `load_quantized`)."""
        self._refresh_average_model()
        output_dir = output_dir or self.args.output_dir
        if not self.node_group.is_main:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self._write_model(output_dir)

    def _write_model(self, output_dir) -> None:
        """The averaged model via ``save_pretrained`` (a plain ``nn.Module``: its state dict as
        ``model.safetensors``) and the processing class."""
        if hasattr(self.model, "save_pretrained"):
            self.model.save_pretrained(output_dir)
        else:
            safetensors.torch.save_model(self.model, str(Path(output_dir) / "model.safetensors"))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    # --- checkpoints -------------------------------------------------------------------------



def _is_class_id(value) -> bool:
    """Whether ``value`` is one integer class id (a Python/numpy int or a 0-d integer tensor)."""
    if torch.is_tensor(value):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
