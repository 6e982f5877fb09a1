"""DecentralizedTrainer: n peer nodes, each with its own model, optimizer and skewed data shard,
training in lock-step and gossiping compressed models over a directed graph (SPEC sections 1-2).

The trainer reuses `transformers.Trainer` for what does not change with decentralization
(arguments, optimizer and scheduler factories, collators, loss computation, callbacks, logging
integrations, progress bars) and replaces the training loop, evaluation and saving, because the
state being trained is ``n`` models rather than one:

* ``backend="simulated"``: all nodes live in this process and step one after the other.
* ``backend="distributed"``: one node per process of an initialised ``torch.distributed`` group
  (``torchrun`` / ``accelerate launch``); the rank is the node index.

Both backends draw the same random numbers for the same node (each node has its own RNG stream for
data order, dropout and stochastic rounding), so they produce the same models up to float
rounding. Gradients never cross nodes: the model is never wrapped in DDP and the only traffic per
step is the gossip messages.
"""
from __future__ import annotations

import copy
import csv
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, Subset
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer_utils import SchedulerType, TrainOutput

from . import gossip as gossip_lib
from .data import skewed_partition
from .quant import QuantConfig, QuantModule, quantize_model

ALGORITHMS = ("choco", "deepsqueeze", "dpsgd")
BACKENDS = ("simulated", "distributed")
COMPRESSORS = ("topk", "randomk", "qsgd")
TOPOLOGIES = ("directed_ring", "ring", "torus", "exponential", "complete")


@dataclass
class DecentralizedTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the decentralized setting.

    ``per_device_train_batch_size`` is the batch size of *each node*. ``max_grad_norm`` clips each
    node's gradient separately (default 0: no clipping, as in the paper).
    """

    num_nodes: int = field(default=4, metadata={"help": "Number of peer nodes n."})
    topology: str = field(default="directed_ring", metadata={"help": f"Communication graph, one of {TOPOLOGIES}."})
    algorithm: str = field(default="choco", metadata={"help": f"Gossip algorithm, one of {ALGORITHMS}."})
    compression: float = field(
        default=0.0, metadata={"help": "Percent of entries dropped per tensor by the compressor, 0 <= c < 100."}
    )
    compressor: str = field(default="topk", metadata={
        "help": f"Compressor used when compression > 0, one of {COMPRESSORS}. topk/randomk keep (100 - compression)%% "
                "of each tensor; qsgd ignores the percentage and sends qsgd_levels levels per entry."})
    qsgd_levels: int = field(default=16, metadata={"help": "QSGD levels s (1..127) when compressor='qsgd'."})
    consensus_lr: float | None = field(
        default=None, metadata={"help": "Consensus step size gamma; default 1.0 without compression, 0.01 with it."}
    )
    skew: float = field(default=0.0, metadata={"help": "Degree of label skew of the shards, in [0, 1] (SPEC 6)."})
    low_precision: bool = field(
        default=True, metadata={"help": "8-bit training on every node and 8-bit values on the wire."}
    )
    qgm: bool = field(default=False, metadata={
        "help": "Quasi-global momentum (SPEC 2): replaces the optimizer's own momentum (Adam beta1 / SGD momentum)."})
    qgm_beta: float = field(default=0.9, metadata={"help": "QGM momentum factor beta in [0, 1)."})
    torus_rows: int | None = field(default=None, metadata={
        "help": "Rows of the torus topology (default: the most square factorisation of num_nodes)."})
    backend: str = field(default="simulated", metadata={"help": f"Where the nodes run, one of {BACKENDS}."})
    max_grad_norm: float = field(default=0.0, metadata={"help": "Per-node gradient clipping norm (0 = off)."})
    lr_milestones: list[float] | None = field(default=None, metadata={
        "help": "Epochs at which the learning rate is multiplied by lr_decay (multi-step schedule, SPEC 8); "
                "needs lr_scheduler_type='constant'."})
    lr_decay: float = field(default=0.1, metadata={"help": "LR factor applied at each of lr_milestones, in (0, 1]."})
    report_to: str | list[str] | None = field(default="none", metadata={"help": "Logging integrations."})

    def __post_init__(self):
        _check_choice("algorithm", self.algorithm, ALGORITHMS)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("compressor", self.compressor, COMPRESSORS)
        _check_choice("topology", self.topology, TOPOLOGIES)
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise ValueError(f"num_nodes must be an integer >= 1, got {self.num_nodes!r}")
        if not 0.0 <= self.compression < 100.0:
            raise ValueError(f"compression must be a percentage with 0 <= compression < 100, got {self.compression!r}")
        if self.algorithm == "dpsgd" and self.compression > 0:
            raise ValueError("compression > 0 needs algorithm 'choco' or 'deepsqueeze'; 'dpsgd' sends exact models")
        if not 0.0 <= self.skew <= 1.0:
            raise ValueError(f"skew must be in [0, 1], got {self.skew!r}")
        if self.consensus_lr is not None and not 0.0 < self.consensus_lr <= 1.0:
            raise ValueError(f"consensus_lr must be in (0, 1], got {self.consensus_lr!r}")
        if isinstance(self.qsgd_levels, bool) or not isinstance(self.qsgd_levels, int) or not 1 <= self.qsgd_levels <= 127:
            raise ValueError(f"qsgd_levels must be an integer in [1, 127], got {self.qsgd_levels!r}")
        if not 0.0 <= self.qgm_beta < 1.0:
            raise ValueError(f"qgm_beta must be in [0, 1), got {self.qgm_beta!r}")
        if self.torus_rows is not None and (self.topology != "torus" or self.torus_rows < 1
                                            or self.num_nodes % self.torus_rows):
            raise ValueError(f"torus_rows must divide num_nodes={self.num_nodes} and needs topology='torus', "
                             f"got torus_rows={self.torus_rows!r} with topology={self.topology!r}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm!r}")
        self._check_lr_milestones()
        super().__post_init__()

    def _check_lr_milestones(self):
        if not 0.0 < self.lr_decay <= 1.0:
            raise ValueError(f"lr_decay must be in (0, 1], got {self.lr_decay!r}")
        if self.lr_milestones is None:
            return
        m = list(self.lr_milestones)
        if not m or any(isinstance(e, bool) or not isinstance(e, (int, float)) or e <= 0 for e in m) \
                or m != sorted(set(m)):
            raise ValueError(f"lr_milestones must be a non-empty, strictly increasing list of epochs > 0 "
                             f"(or None), got {self.lr_milestones!r}")
        if SchedulerType(self.lr_scheduler_type) != SchedulerType.CONSTANT:
            raise ValueError(f"lr_milestones needs lr_scheduler_type='constant' (the milestones are the schedule), "
                             f"got lr_scheduler_type={self.lr_scheduler_type!r}")

    @property
    def gamma(self) -> float:
        """Consensus step size: ``consensus_lr`` if set, else 1.0 without compression and 0.01 with it."""
        if self.consensus_lr is not None:
            return self.consensus_lr
        return 1.0 if self.compression == 0 else 0.01


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


class _NodeRNG:
    """One torch RNG stream per node, swapped in around that node's work.

    Dropout and stochastic rounding draw from torch's global generator; giving each node its own
    stream makes node ``i`` draw the same numbers whether it runs alone in a process or beside
    other nodes in a simulation.
    """

    def __init__(self, seed: int, node_ids):
        self.states = {}
        saved = self._get()
        for i in node_ids:
            torch.manual_seed(node_seed(seed, i))
            self.states[i] = self._get()
        self._set(saved)

    @staticmethod
    def _get():
        return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    @staticmethod
    def _set(state):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])

    @contextmanager
    def activate(self, node: int):
        saved = self._get()
        self._set(self.states[node])
        try:
            yield
        finally:
            self.states[node] = self._get()
            self._set(saved)


def node_seed(seed: int, node: int) -> int:
    """Seed of node ``node``'s private RNG streams (data order, dropout, stochastic rounding)."""
    return (seed * 1_000_003 + 7919 * (node + 1)) % (2**63 - 1)


def build_gossip(args: DecentralizedTrainingArguments, transport=None):
    """The gossip algorithm described by ``args`` (SPEC 2-3).

    Low precision sends 8-bit values: ``Quantize(8)`` without sparsification, top-k/random-k with
    8-bit values with it. ``dpsgd`` is plain SGP (push-sum D-PSGD); with low precision its messages
    are 8-bit model differences (Choco-style with ``gamma=1``), the only way to put 8-bit values on
    the wire without a drifting error.
    """
    topo = build_topology(args)
    compressor = build_compressor(args)
    kwargs = {"transport": transport, "seed": args.seed}
    if args.algorithm == "dpsgd":
        if compressor is None:
            return gossip_lib.SGP(topo, **kwargs)
        return gossip_lib.ChocoSGD(topo, compressor=compressor, gamma=1.0, **kwargs)
    cls = gossip_lib.ChocoSGD if args.algorithm == "choco" else gossip_lib.DeepSqueeze
    return cls(topo, compressor=compressor or gossip_lib.Identity(), gamma=args.gamma, **kwargs)


def build_topology(args: DecentralizedTrainingArguments) -> gossip_lib.Topology:
    """The graph of ``args``; a torus uses ``torus_rows`` or the most square ``rows x cols``."""
    if args.topology != "torus":
        return gossip_lib.make_topology(args.topology, num_nodes=args.num_nodes)
    n = args.num_nodes
    rows = args.torus_rows or max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return gossip_lib.make_topology("torus", num_nodes=n, rows=rows, cols=n // rows)


def build_compressor(args: DecentralizedTrainingArguments):
    """Compressor for ``args`` or None for exact fp32 messages."""
    value_bits = 8 if args.low_precision else None
    if args.compression == 0:
        return gossip_lib.Quantize(bits=8) if value_bits else None
    keep = (100.0 - args.compression) / 100.0
    if args.compressor == "topk":
        return gossip_lib.TopK(keep, value_bits=value_bits)
    if args.compressor == "randomk":
        return gossip_lib.RandomK(keep, value_bits=value_bits)
    # scaled: divide by 1 + omega so Choco/Deep-Squeeze stay stable with QSGD's variance
    return gossip_lib.QSGD(levels=args.qsgd_levels, scaled=True)


class DecentralizedTrainer(Trainer):
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
    """

    def __init__(self, model=None, args: DecentralizedTrainingArguments | None = None, *, quant_config=None, **kwargs):
        if not isinstance(args, DecentralizedTrainingArguments):
            raise TypeError(f"args must be DecentralizedTrainingArguments, got {type(args).__name__}")
        if model is None:
            raise ValueError("model is required (model_init is not supported by DecentralizedTrainer)")
        if args.low_precision and not any(isinstance(m, QuantModule) for m in model.modules()):
            quantize_model(model, quant_config or QuantConfig())
        super().__init__(model=model, args=args, **kwargs)
        if self.train_dataset is not None and "label" not in self.train_dataset.column_names:
            raise ValueError(f"train_dataset needs a 'label' column to build skewed shards; "
                             f"found {self.train_dataset.column_names}")

        n = args.num_nodes
        if args.backend == "distributed":
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("backend='distributed' needs an initialised torch.distributed process group: "
                                   "launch with torchrun/accelerate launch, one process per node")
            if dist.get_world_size() != n:
                raise ValueError(f"num_nodes={n} but the torch.distributed world size is {dist.get_world_size()}: "
                                 "launch exactly one process per node")
            self.node_ids = [dist.get_rank()]
            self._broadcast_initial_model()
            transport = gossip_lib.TorchDistributedTransport()
        else:
            self.node_ids = list(range(n))
            transport = None
        self.nodes = [copy.deepcopy(self.model) for _ in self.node_ids]
        # z_i of every local node, as the gossip engine updates them in place
        self.node_params = [[p.detach() for p in node.parameters()] for node in self.nodes]
        self.gossip = build_gossip(args, transport)
        self.qgm = gossip_lib.QuasiGlobalMomentum(self.node_params, beta=args.qgm_beta) if args.qgm else None
        self.bytes_sent = torch.zeros(len(self.node_ids), dtype=torch.int64)
        self._rng = _NodeRNG(args.seed, self.node_ids)
        self._mark_main_process()

    # --- setup -----------------------------------------------------------------------------

    def _broadcast_initial_model(self):
        """Make every rank start from rank 0's weights (SPEC 1: same initial weights)."""
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(tensor.data, src=0)

    def _node_dataloaders(self) -> list[DataLoader]:
        """One loader per local node over its skewed shard; each has its own seeded shuffle."""
        if self.train_dataset is None:
            raise ValueError("DecentralizedTrainer.train() needs a train_dataset")
        labels = list(self.train_dataset["label"])
        shards = skewed_partition(labels, self.args.num_nodes, self.args.skew, seed=self.args.seed)
        dataset = self._remove_unused_columns(self.train_dataset, description="training")
        bs = self.args.per_device_train_batch_size
        self.shard_sizes = [len(s) for s in shards]
        if min(self.shard_sizes) < bs:
            raise ValueError(f"per_device_train_batch_size={bs} exceeds the smallest shard ({min(self.shard_sizes)} "
                             "samples): lower the batch size or the number of nodes")
        loaders = []
        for i in self.node_ids:
            generator = torch.Generator().manual_seed(node_seed(self.args.seed, i))
            shard = Subset(dataset, shards[i].tolist())
            loaders.append(DataLoader(shard, batch_size=bs, sampler=RandomSampler(shard, generator=generator),
                                      collate_fn=self.data_collator, drop_last=True,
                                      num_workers=self.args.dataloader_num_workers))
        return loaders

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
        """Train every node in lock-step: local step on each node, then one gossip step (SPEC 2)."""
        if resume_from_checkpoint:
            raise NotImplementedError("resume_from_checkpoint is not supported by DecentralizedTrainer yet")
        args = self.args
        loaders = self._node_dataloaders()
        steps_per_epoch = min(self.shard_sizes) // args.per_device_train_batch_size
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        opts = [self._make_optimizer_and_scheduler(node, max_steps, steps_per_epoch) for node in self.nodes]

        self.state = TrainerState()
        self._mark_main_process()
        self.state.max_steps, self.state.num_train_epochs = max_steps, num_epochs
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        self.is_in_train = True
        start = time.time()
        self._loss_sum = torch.zeros(len(self.nodes), device=args.device)  # per local node, since the last log
        self._last_logged, total_loss = 0, 0.0
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        for epoch in range(num_epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            iterators = [iter(loader) for loader in loaders]
            for step in range(min(steps_per_epoch, max_steps - self.state.global_step)):
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                self._loss_sum += self._iteration([next(it) for it in iterators], opts)
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / steps_per_epoch
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                if self.control.should_log:
                    total_loss += self._log_train(opts[0][1].get_last_lr()[0])
                if self.control.should_evaluate:
                    self.evaluate(ignore_keys=ignore_keys_for_eval)
                if self.control.should_save:
                    self._save_checkpoint(self.model, trial)
                    self.control = self.callback_handler.on_save(args, self.state, self.control)
                if self.control.should_training_stop or self.control.should_epoch_stop:
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            if self.control.should_training_stop or self.state.global_step >= max_steps:
                break
        if self._last_logged < self.state.global_step:
            total_loss += self._log_train(opts[0][1].get_last_lr()[0])
        self._refresh_average_model()
        self.is_in_train = False
        runtime = time.time() - start
        train_loss = total_loss / max(self.state.global_step, 1)
        metrics = {"train_runtime": runtime, "train_loss": train_loss,
                   "train_steps_per_second": self.state.global_step / max(runtime, 1e-9)}
        self.log(dict(metrics))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _iteration(self, batches, opts) -> torch.Tensor:
        """One SPEC 2 iteration of every local node; returns the local nodes' losses, shape (nodes,).

        Step 1 (gradient at z_i on a local batch, optimizer update) runs node by node, each in
        its own RNG stream; steps 2-5 are one gossip step. With QGM the momentum buffer, driven by
        the change of z_i across the whole iteration, is added to every gradient before the update.
        """
        if self.qgm is not None:
            self.qgm.begin_iteration()
        losses = torch.stack([self._backward(k, node, batch) for k, (node, batch) in enumerate(zip(self.nodes, batches))])
        if self.qgm is not None:
            # a parameter the loss does not reach has no gradient: momentum into a discarded zero
            self.qgm.add_momentum([[p.grad if p.grad is not None else torch.zeros_like(p) for p in node.parameters()]
                                   for node in self.nodes])
        lr = opts[0][0].param_groups[0]["lr"]
        for optimizer, scheduler in opts:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        stats = self.gossip.step(self.node_params)
        self.bytes_sent += torch.as_tensor(stats.bytes_sent, dtype=torch.int64)
        if self.qgm is not None:
            self.qgm.end_iteration(lr)
        return losses

    def _backward(self, k: int, node, batch) -> torch.Tensor:
        """Loss and gradient of local node ``k`` at z_k on its batch (in that node's RNG stream)."""
        node.train()
        with self._rng.activate(self.node_ids[k]):
            batch = self._prepare_inputs(batch)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(node, batch)
            loss.backward()
        if self.args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(node.parameters(), self.args.max_grad_norm)
        return loss.detach()

    def _log_train(self, lr: float) -> float:
        """Log the mean loss of each node since the last log; returns the loss summed over those steps."""
        steps = self.state.global_step - self._last_logged
        node_losses = self._gather(self._loss_sum / steps)
        self._loss_sum.zero_()
        self._last_logged = self.state.global_step
        logs = {"loss": float(node_losses.mean()), "learning_rate": lr}
        logs.update({f"loss_node_{i}": float(v) for i, v in enumerate(node_losses)})
        logs.update({f"bytes_sent_node_{i}": int(v) for i, v in enumerate(self._gather(self.bytes_sent))})
        logs["consensus_distance"] = self.consensus_distance()
        self.log(logs)
        return float(node_losses.mean()) * steps

    def _mark_main_process(self):
        """Only rank 0 prints progress and writes logs in the distributed backend."""
        main = self.args.backend == "simulated" or dist.get_rank() == 0
        self.state.is_world_process_zero = self.state.is_local_process_zero = main

    # --- the nodes as one system ---------------------------------------------------------------

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-node values of all nodes, shape (num_nodes, ...), from each process's local nodes."""
        if self.args.backend == "simulated":
            return local
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    def _float_state(self, model):
        return [t for t in model.state_dict().values() if t.is_floating_point()]

    @torch.no_grad()
    def _node_sum(self, tensors_per_node) -> list[torch.Tensor]:
        """Sum over all nodes of each tensor (an all-reduce in the distributed backend)."""
        total = [torch.stack(ts).sum(0) for ts in zip(*tensors_per_node)]
        if self.args.backend == "distributed":
            for t in total:
                dist.all_reduce(t)
        return total

    @torch.no_grad()
    def _refresh_average_model(self):
        """``self.model`` <- mean_i z_i over parameters and float buffers (SPEC 1 evaluation model)."""
        sums = self._node_sum([self._float_state(node) for node in self.nodes])
        for dst, s in zip(self._float_state(self.model), sums):
            dst.copy_(s / self.args.num_nodes)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """``1/n * sum_i ||z_i - mean z||^2`` over all parameters (SPEC 1)."""
        self._refresh_average_model()
        mean = list(self.model.parameters())
        local = torch.zeros(len(self.nodes), dtype=torch.float64)
        for k, node in enumerate(self.nodes):
            diffs = torch._foreach_sub(list(node.parameters()), mean)
            local[k] = sum(torch.linalg.vector_norm(d, dtype=torch.float64) ** 2 for d in diffs)
        return float(self._gather(local).mean())

    def cost_report(self, input_shape):
        """SPEC 7 cost of one iteration of one node of this run (compute, energy, memory, gossip bytes).

        Args:
            input_shape: one sample's shape without the batch dimension: ``(seq_len,)`` for token
                models, ``(C, H, W)`` for images.
        Returns:
            :class:`lp_decentral_nlp.cost.CostReport` (``.to_dict()`` for ``results.json``).
        """
        from .cost import estimate_cost

        optim = str(self.args.optim).lower()
        optimizer = "adam" if "adam" in optim else ("momentum" if "sgd" in optim else "adam")
        labels = list(self.train_dataset["label"])
        shards = skewed_partition(labels, self.args.num_nodes, self.args.skew, seed=self.args.seed)
        return estimate_cost(self.nodes[0], tuple(input_shape), self.args.per_device_train_batch_size,
                             "int8" if self.args.low_precision else "fp32", optimizer=optimizer,
                             gossip=self.gossip, samples_per_node=min(len(s) for s in shards))

    # --- evaluation and saving -------------------------------------------------------------

    @torch.no_grad()
    def _eval_model(self, model, dataloader, desc: str) -> tuple[float, float]:
        """Mean loss and accuracy of ``model`` over ``dataloader``."""
        model.eval()
        metric = self._accuracy_metric()
        loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        for batch in tqdm(dataloader, desc=desc, leave=False, disable=self.args.disable_tqdm):
            batch = self._prepare_inputs(batch)
            out = model(**batch)
            n = batch["labels"].shape[0]
            loss_sum += out.loss.double() * n
            count += n
            metric.add_batch(predictions=out.logits.argmax(-1).cpu(), references=batch["labels"].cpu())
        return float(loss_sum) / max(count, 1), metric.compute()["accuracy"]

    def _accuracy_metric(self):
        from .data import accuracy_metric

        if not hasattr(self, "_metric"):
            self._metric = accuracy_metric()
        return self._metric

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Accuracy and loss of the averaged model and of every node, consensus distance, bytes sent.

        Logged through `Trainer.log` (so callbacks and ``report_to`` integrations see it) and
        returned as a dict with keys ``{prefix}_accuracy``, ``{prefix}_loss``,
        ``{prefix}_accuracy_node_{i}``, ``{prefix}_loss_node_{i}``, ``{prefix}_consensus_distance``,
        ``bytes_sent_node_{i}``.
        """
        dataloader = self.get_eval_dataloader(eval_dataset)
        p = metric_key_prefix
        metrics = {f"{p}_consensus_distance": self.consensus_distance()}  # also refreshes self.model
        metrics[f"{p}_loss"], metrics[f"{p}_accuracy"] = self._eval_model(self.model, dataloader, "eval: average")
        node_metrics = torch.tensor([self._eval_model(node, dataloader, f"eval: node {i}")
                                     for i, node in zip(self.node_ids, self.nodes)], dtype=torch.float64)
        for i, (loss, acc) in enumerate(self._gather(node_metrics).tolist()):
            metrics[f"{p}_loss_node_{i}"], metrics[f"{p}_accuracy_node_{i}"] = loss, acc
        metrics.update({f"bytes_sent_node_{i}": int(v) for i, v in enumerate(self._gather(self.bytes_sent))})
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """A plain (unsharded) loader: every process evaluates on the whole evaluation set."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        dataset = self._remove_unused_columns(dataset, description="evaluation")
        return DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator,
                          num_workers=self.args.dataloader_num_workers)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the averaged model (HF format; an 8-bit one reloads with `load_quantized`)."""
        self._refresh_average_model()
        output_dir = output_dir or self.args.output_dir
        if self.args.backend == "distributed" and dist.get_rank() != 0:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_checkpoint(self, model, trial):
        """Periodic checkpoints store the averaged model under ``output_dir/checkpoint-<step>``."""
        self.save_model(os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}"))


class MetricsCSVCallback(TrainerCallback):
    """Append every logged dict as a row of a CSV file (one column per metric, ``step`` first)."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or logs is None:
            return
        self.rows.append({"step": state.global_step, **logs})
        columns = list(dict.fromkeys(k for row in self.rows for k in row))
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
