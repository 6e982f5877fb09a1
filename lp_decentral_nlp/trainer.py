"""DecentralizedTrainer: n peer nodes, each with its own model, optimizer and skewed data shard,
training in lock-step and gossiping compressed models over a directed graph (SPEC sections 1-2).

The trainer reuses `transformers.Trainer` for what does not change with decentralization
(arguments, optimizer and scheduler factories, collators, loss computation, callbacks, logging
integrations, progress bars) and replaces the training loop, evaluation and saving, because the
state being trained is ``n`` models rather than one:

* ``backend="simulated"``: all nodes live in this process and step one after the other.
* ``backend="distributed"``: one node per process of an initialised ``torch.distributed`` group
  (``torchrun`` / ``accelerate launch``); the rank is the node index.

Reliability: ``save_strategy="steps"`` writes the *whole* decentralized state (every node's
weights, optimizer, scheduler, RNG streams, gossip rows, QGM buffers, position in the data, byte
counters) atomically to ``output_dir/checkpoint-<step>/`` (:mod:`lp_decentral_nlp.checkpoint`),
and ``train(resume_from_checkpoint=...)`` continues a run to the same final weights as a run that
never stopped. A NaN/Inf loss or gradient stops the run naming the node and step (or skips that
node's update with ``skip_nonfinite``) before anything is gossiped. Faults can be injected for
robustness studies (``drop_prob``, ``stragglers``, ``absences``; rules in
:mod:`lp_decentral_nlp.gossip.faults`).

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
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler, Subset
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer_utils import SchedulerType, TrainOutput
from transformers.utils import logging

from . import checkpoint as ckpt
from . import gossip as gossip_lib
from .cpu_malloc import keep_freed_memory
from .data import skewed_partition
from .gossip.factory import ALGORITHMS, COMPRESSORS, TOPOLOGIES, GossipConfig, build_compressor, build_gossip, \
    build_topology
from .gossip.faults import FaultPlan, parse_absence, parse_straggler
from .gossip.transport import GossipPeerError
from .quant import QuantConfig, QuantModule, quantize_model

logger = logging.get_logger(__name__)

BACKENDS = ("simulated", "distributed")


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
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Logging integrations."})
    gossip_timeout: float = field(default=300.0, metadata={
        "help": "Distributed backend: seconds a rank waits for a peer's gossip message before a GossipTimeoutError "
                "names the peer. Count the slowest peer's work between two steps (evaluation, saving) in it."})
    drop_prob: float = field(default=0.0, metadata={
        "help": "Fault injection: probability in [0, 1) that a gossip message is lost (seeded per step and edge; "
                "the push-sum mass stays exact under the rules of lp_decentral_nlp.gossip.faults)."})
    stragglers: list[str] | None = field(default=None, metadata={
        "help": "Fault injection: 'NODE:SECONDS' entries; that node sleeps SECONDS before each send."})
    absences: list[str] | None = field(default=None, metadata={
        "help": "Fault injection: 'NODE:START:END' entries; the node leaves for iterations START..END-1 (no local "
                "step, no messages) and rejoins."})
    skip_nonfinite: bool = field(default=False, metadata={
        "help": "On a NaN/Inf loss or gradient, skip that node's update for the step (and count it) instead of "
                "stopping the run."})
    tune_cpu_malloc: bool = field(default=True, metadata={
        "help": "Training on the CPU under glibc: keep freed tensor memory in the process for the next step "
                "(lp_decentral_nlp.cpu_malloc.keep_freed_memory) instead of page-faulting it in again every step."})

    def __post_init__(self):
        _check_choice("backend", self.backend, BACKENDS)
        self.gossip_config  # noqa: B018 -- building it checks the gossip fields (GossipConfig.__post_init__)
        if not 0.0 <= self.skew <= 1.0:
            raise ValueError(f"skew must be in [0, 1], got {self.skew!r}")
        if not 0.0 <= self.qgm_beta < 1.0:
            raise ValueError(f"qgm_beta must be in [0, 1), got {self.qgm_beta!r}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm!r}")
        if isinstance(self.gossip_timeout, bool) or not isinstance(self.gossip_timeout, (int, float)) \
                or not 0 < self.gossip_timeout < math.inf:
            raise ValueError(f"gossip_timeout must be a positive number of seconds, got {self.gossip_timeout!r}")
        self._check_lr_milestones()
        plan = self.fault_plan
        slow = [(n, s) for n, s in plan.stragglers if s >= self.gossip_timeout]
        if slow and self.backend == "distributed":
            raise ValueError(f"stragglers: node {slow[0][0]} sleeps {slow[0][1]:g} s per step, not less than "
                             f"gossip_timeout={self.gossip_timeout:g} s: its peers would give up on it")
        super().__post_init__()

    @property
    def gossip_config(self) -> GossipConfig:
        """The run's :class:`~lp_decentral_nlp.gossip.factory.GossipConfig` (checks its fields:
        ValueError naming the one that is wrong)."""
        plan = self.fault_plan
        return GossipConfig(num_nodes=self.num_nodes, topology=self.topology, torus_rows=self.torus_rows,
                            algorithm=self.algorithm, compression=self.compression, compressor=self.compressor,
                            qsgd_levels=self.qsgd_levels, low_precision=self.low_precision,
                            consensus_lr=self.consensus_lr, seed=self.seed, faults=plan if plan.active else None)

    @property
    def fault_plan(self) -> FaultPlan:
        """The :class:`~lp_decentral_nlp.gossip.faults.FaultPlan` of ``drop_prob``, ``stragglers`` and
        ``absences`` (seeded with ``seed``); ValueError naming the argument that is wrong."""
        def parsed(name, parse, entries):
            if entries is not None and (isinstance(entries, str) or not isinstance(entries, (list, tuple))):
                raise ValueError(f"{name} must be a list of strings, got {entries!r}")
            try:
                return tuple(parse(e) for e in entries or ())
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None

        plan = FaultPlan(drop_prob=self.drop_prob, seed=self.seed,
                         stragglers=parsed("stragglers", parse_straggler, self.stragglers),
                         absences=parsed("absences", parse_absence, self.absences))
        plan.check_nodes(self.num_nodes)
        return plan

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
        """Consensus step size (:attr:`GossipConfig.gamma <lp_decentral_nlp.gossip.factory.GossipConfig.gamma>`)."""
        return self.gossip_config.gamma


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

    def state_dict(self, node: int) -> dict:
        """Node ``node``'s stream: ``{"cpu": uint8 tensor, "cuda": [uint8 tensor per device] or None}``."""
        cpu, cuda = self.states[node]
        return {"cpu": cpu, "cuda": cuda}

    def load_state_dict(self, node: int, state: dict) -> None:
        """Restore :meth:`state_dict`; CUDA streams only when this machine has as many devices."""
        cuda = self.states[node][1]
        saved_cuda = state.get("cuda")
        if cuda is not None and saved_cuda is not None and len(saved_cuda) == len(cuda):
            cuda = list(saved_cuda)
        elif cuda is not None or saved_cuda is not None:
            logger.warning(f"node {node}: the checkpoint's CUDA RNG streams do not fit this machine; dropout and "
                           "stochastic rounding on CUDA will not repeat the interrupted run's draws")
        self.states[node] = (state["cpu"], cuda)


def node_seed(seed: int, node: int) -> int:
    """Seed of node ``node``'s private RNG streams (data order, dropout, stochastic rounding)."""
    return (seed * 1_000_003 + 7919 * (node + 1)) % (2**63 - 1)


class _EpochSampler(Sampler[int]):
    """A node's shuffled shard order: a pure function of ``(seed, epoch)``, so a resumed run can
    start mid-epoch exactly where the interrupted one stopped (:meth:`set_epoch`).

    Args:
        size: samples in the shard.
        seed: the node's seed (:func:`node_seed`).
    """

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch ``epoch``'s order from its ``start``-th sample on."""
        self.epoch, self.start = epoch, start

    def epoch_seed(self) -> int:
        return (self.seed * 6364136223846793005 + 1442695040888963407 * (self.epoch + 1)) % (2**63 - 1)

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch_seed()))
        return iter(order[self.start:].tolist())

    def __len__(self) -> int:
        return self.size - self.start


class NonFiniteError(FloatingPointError):
    """A node's loss or gradient is NaN or infinite; raised before that node's update is applied or gossiped.

    Attributes:
        node: the graph node.
        step: the training step (1-based: the ``global_step`` the step would have reached).
    """

    def __init__(self, message: str, node: int, step: int):
        super().__init__(message)
        self.node, self.step = node, step


def resume_config(args: DecentralizedTrainingArguments) -> dict:
    """The arguments a resumed run must share with its checkpoint (they shape the saved state)."""
    config = args.gossip_config
    return {"num_nodes": args.num_nodes, "topology": build_topology(config).name, "algorithm": args.algorithm,
            "compressor": repr(build_compressor(config)), "consensus_lr": args.gamma, "low_precision": args.low_precision,
            "qgm": args.qgm, "skew": args.skew, "seed": args.seed,
            "per_device_train_batch_size": args.per_device_train_batch_size}


def check_resumable(path, args: DecentralizedTrainingArguments, train_samples: int | None = None):
    """The checkpoint directory ``path`` resolves to (:func:`lp_decentral_nlp.checkpoint.resolve_checkpoint`),
    after checking that it was written by a run with the same :func:`resume_config` (and, when
    given, the same number of training samples). ValueError listing every argument that differs."""
    try:
        path = ckpt.resolve_checkpoint(path)
        saved = ckpt.read_manifest(path)["config"]
    except ValueError as err:
        raise ValueError(f"resume_from_checkpoint: {err}") from None
    now = resume_config(args)
    if train_samples is not None:
        now["train_samples"] = train_samples
    diffs = [f"{key}={saved.get(key)!r} (this run: {value!r})" for key, value in now.items() if saved.get(key) != value]
    if diffs:
        raise ValueError(f"resume_from_checkpoint: cannot resume from {path}: it was written with {', '.join(diffs)}; "
                         "resume with the arguments of the interrupted run")
    return path


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

    Attributes (per local node, aligned with ``node_ids``): ``bytes_sent`` (int64, bytes put on
    the wire), ``nonfinite_skips`` (int64, steps skipped under ``skip_nonfinite``).
    """

    def __init__(self, model=None, args: DecentralizedTrainingArguments | None = None, *, quant_config=None, **kwargs):
        if not isinstance(args, DecentralizedTrainingArguments):
            raise TypeError(f"args must be DecentralizedTrainingArguments, got {type(args).__name__}")
        if model is None:
            raise ValueError("model is required (model_init is not supported by DecentralizedTrainer)")
        if args.low_precision and not any(isinstance(m, QuantModule) for m in model.modules()):
            quantize_model(model, quant_config or QuantConfig())
        super().__init__(model=model, args=args, **kwargs)
        if self.train_dataset is not None:
            self._check_labels(self.train_dataset, "train_dataset")

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
            transport = gossip_lib.TorchDistributedTransport(timeout=args.gossip_timeout)
        else:
            self.node_ids = list(range(n))
            transport = None
        self.nodes = [copy.deepcopy(self.model) for _ in self.node_ids]
        # z_i of every local node, as the gossip engine updates them in place
        self.node_params = [[p.detach() for p in node.parameters()] for node in self.nodes]
        self.gossip = build_gossip(args.gossip_config, transport)
        self.qgm = gossip_lib.QuasiGlobalMomentum(self.node_params, beta=args.qgm_beta) if args.qgm else None
        self.bytes_sent = torch.zeros(len(self.node_ids), dtype=torch.int64)
        self.nonfinite_skips = torch.zeros(len(self.node_ids), dtype=torch.int64)
        plan = args.fault_plan
        self.fault_plan = plan if plan.active else None
        self._rng = _NodeRNG(args.seed, self.node_ids)
        self._mark_main_process()

    # --- setup -----------------------------------------------------------------------------

    def _check_labels(self, dataset, what: str) -> None:
        """ValueError unless ``dataset`` has a ``label`` column of class ids the model can predict."""
        if "label" not in dataset.column_names:
            raise ValueError(f"{what} needs a 'label' column to build skewed shards; found {dataset.column_names}")
        num_labels = getattr(getattr(self.model, "config", None), "num_labels", None)
        labels = dataset.unique("label") if hasattr(dataset, "unique") else list(set(dataset["label"]))
        bad = sorted(v for v in labels if not isinstance(v, int) or v < 0 or (num_labels and v >= num_labels))
        if bad:
            allowed = f"0..{num_labels - 1} (the model has num_labels={num_labels})" if num_labels else "integers >= 0"
            raise ValueError(f"{what}: labels must be class ids {allowed}, found {bad[:5]}")

    def _shards(self) -> list:
        """SPEC 6 shards of the training set (indices per node), the same on every rank."""
        dataset = self.train_dataset
        # read the labels without running a formatting transform (e.g. image decoding) on every row
        labels = dataset.with_format(None)["label"] if hasattr(dataset, "with_format") else dataset["label"]
        return skewed_partition(list(labels), self.args.num_nodes, self.args.skew, seed=self.args.seed)

    def _broadcast_initial_model(self):
        """Make every rank start from rank 0's weights (SPEC 1: same initial weights)."""
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(tensor.data, src=0)

    def _node_dataloaders(self) -> list[DataLoader]:
        """One loader per local node over its skewed shard, shuffled by an :class:`_EpochSampler`
        of its own (``loader.sampler.set_epoch(epoch, start)`` picks the epoch and position)."""
        if self.train_dataset is None:
            raise ValueError("DecentralizedTrainer.train() needs a train_dataset")
        shards = self._shards()
        dataset = self._remove_unused_columns(self.train_dataset, description="training")
        bs = self.args.per_device_train_batch_size
        self.shard_sizes = [len(s) for s in shards]
        if min(self.shard_sizes) < bs:
            raise ValueError(f"per_device_train_batch_size={bs} exceeds the smallest shard ({min(self.shard_sizes)} "
                             "samples): lower the batch size or the number of nodes")
        loaders = []
        for i in self.node_ids:
            shard = Subset(dataset, shards[i].tolist())
            # the loader's own generator only seeds worker processes; reseeded per epoch in _start_epoch
            loaders.append(DataLoader(shard, batch_size=bs, sampler=_EpochSampler(len(shard), node_seed(self.args.seed, i)),
                                      collate_fn=self.data_collator, drop_last=True,
                                      num_workers=self.args.dataloader_num_workers, generator=torch.Generator()))
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
        if args.tune_cpu_malloc and args.device.type == "cpu" and keep_freed_memory():
            logger.info("glibc malloc keeps freed memory for the next step (tune_cpu_malloc=True)")
        loaders = self._node_dataloaders()
        steps_per_epoch = min(self.shard_sizes) // args.per_device_train_batch_size
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        self._opts = opts = [self._make_optimizer_and_scheduler(node, max_steps, steps_per_epoch) for node in self.nodes]

        self.state = TrainerState()
        self._loss_sum = torch.zeros(len(self.nodes), device=args.device)  # per local node, since the last log
        self._loss_count = torch.zeros(len(self.nodes), dtype=torch.int64)  # steps in _loss_sum, per local node
        self._last_logged, self._total_loss = 0, 0.0
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
        try:
            while epoch < num_epochs and self.state.global_step < max_steps:
                if done >= steps_per_epoch:
                    epoch, done = epoch + 1, 0
                    continue
                self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
                iterators = self._start_epoch(loaders, epoch, done)
                while done < steps_per_epoch and self.state.global_step < max_steps:
                    self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                    self._iteration(self._next_batches(iterators), opts)
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
        self._refresh_average_model()
        self.is_in_train = False
        runtime = time.time() - start
        train_loss = self._total_loss / max(self.state.global_step, 1)
        metrics = {"train_runtime": runtime, "train_loss": train_loss,
                   "train_steps_per_second": self.state.global_step / max(runtime, 1e-9)}
        self.log(dict(metrics))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _resume_hint(self) -> str:
        found = ckpt.list_checkpoints(self.args.output_dir) if self.args.output_dir else []
        if not found:
            return "No checkpoint was written yet (save_strategy='steps', --save-steps N writes them)"
        return f"Resume from the last checkpoint with --resume-from-checkpoint {found[-1][1]}"

    def _maybe_log_save_evaluate(self, trial, ignore_keys_for_eval) -> None:
        if self.control.should_log:
            self._total_loss += self._log_train()
        if self.control.should_evaluate:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _next_batches(self, iterators) -> list:
        """The next batch of every local node, drawn in that node's RNG stream (random transforms)."""
        batches = []
        for i, it in zip(self.node_ids, iterators):
            with self._rng.activate(i):
                batches.append(next(it))
        return batches

    def _iteration(self, batches, opts) -> None:
        """One SPEC 2 iteration of every local node.

        Step 1 (gradient at z_i on a local batch, optimizer update) runs node by node
        (:meth:`_local_step`); steps 2-5 are one gossip step. With QGM the momentum buffer, driven
        by the change of z_i across the whole iteration, is added to the gradient before the update.
        A node absent under the fault plan takes no step; its LR schedule still advances.
        """
        t = self.state.global_step
        absent = self.fault_plan.absent(t) if self.fault_plan else frozenset()
        if self.qgm is not None:
            self.qgm.begin_iteration()
        lr = opts[0][0].param_groups[0]["lr"]
        for k, (i, node, batch, (optimizer, scheduler)) in enumerate(zip(self.node_ids, self.nodes, batches, opts)):
            if i not in absent:
                self._local_step(k, node, batch, optimizer, t + 1)
            scheduler.step()
        stats = self.gossip.step(self.node_params)
        self.bytes_sent += torch.as_tensor(stats.bytes_sent, dtype=torch.int64)
        if self.qgm is not None:  # an absent node's momentum does not move either
            self.qgm.end_iteration(lr, skip={k for k, i in enumerate(self.node_ids) if i in absent})

    def _local_step(self, k: int, node, batch, optimizer, step: int) -> None:
        """SPEC 2 step 1 of local node ``k``: gradient, NaN/Inf check, clipping, optimizer update.

        The node's gradients are freed right after its update, so only one node's gradients exist
        at a time and the next node's backward reuses their memory (with all ``n`` alive until
        every backward had run, each backward of a simulated round page-faulted in fresh memory on
        the CPU and ran 24-38% slower than a plain step). A non-finite node raises
        :class:`NonFiniteError` before its own update (nodes earlier in this iteration have taken
        theirs, as other ranks have in the distributed backend) or, with ``skip_nonfinite``, keeps
        its parameters and running statistics.
        """
        # the forward also updates running statistics (8-bit activation ranges, norm statistics):
        # a skipped step must leave them as they were, or one NaN batch poisons them for good
        buffers = [b.clone() for b in node.buffers()] if self.args.skip_nonfinite else None
        loss = self._backward(k, node, batch)
        if self._finite_then_clip(k, loss, step):
            if self.qgm is not None:
                # a parameter the loss does not reach has no gradient: momentum into a discarded zero
                self.qgm.add_momentum(k, [p.grad if p.grad is not None else torch.zeros_like(p)
                                          for p in node.parameters()])
            optimizer.step()
            self._loss_sum[k] += loss  # device-side adds: no host-to-device copy (a sync) per step
            self._loss_count[k] += 1
        elif buffers is not None:
            torch._foreach_copy_(list(node.buffers()), buffers)
        optimizer.zero_grad(set_to_none=True)

    def _finite_then_clip(self, k: int, loss: torch.Tensor, step: int) -> bool:
        """Whether local node ``k``'s loss and gradients are all finite; if so, its gradients are
        clipped to total L2 norm ``max_grad_norm`` (when > 0), as ``clip_grad_norm_`` does.

        One ``_foreach_norm`` over the gradients serves both: a NaN/Inf entry makes its tensor's
        norm non-finite, and the total of those norms is what clipping scales by. Checking first
        keeps one bad entry from spreading to every gradient before it is named. One host sync.
        A flagged node is confirmed entry by entry (a norm can also overflow on finite entries),
        then raises :class:`NonFiniteError`, or returns False and is counted in
        ``nonfinite_skips`` under ``args.skip_nonfinite``.
        """
        params = [p for p in self.nodes[k].parameters() if p.grad is not None]
        norms = torch._foreach_norm([p.grad for p in params]) if params else []
        finite = torch.isfinite(torch.stack([loss.float(), *[n.float() for n in norms]])).all()
        if not (bool(finite) or self._all_finite(k, loss)):
            if not self.args.skip_nonfinite:
                raise NonFiniteError(self._nonfinite_message(k, step, loss) + ": stopped before the update and before "
                                     "gossip; pass skip_nonfinite=True (--skip-nonfinite) to skip such steps, or lower "
                                     "the learning rate", self.node_ids[k], step)
            self.nonfinite_skips[k] += 1
            logger.warning(self._nonfinite_message(k, step, loss) + "; skipped (skip_nonfinite)")
            return False
        if self.args.max_grad_norm > 0 and params:
            total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))  # = get_total_norm
            torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, total)
        return True

    def _all_finite(self, k: int, loss: torch.Tensor) -> bool:
        """Entry-by-entry check of local node ``k``'s loss and gradients (slow; flagged nodes only)."""
        return bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(p.grad).all())
                                                        for p in self.nodes[k].parameters() if p.grad is not None)

    def _nonfinite_message(self, k: int, step: int, loss: torch.Tensor) -> str:
        where = f"node {self.node_ids[k]}, step {step}"
        if not torch.isfinite(loss):
            return f"{where}: non-finite loss ({float(loss)})"
        for name, p in self.nodes[k].named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                kind = "nan" if torch.isnan(p.grad).any() else "inf"
                return f"{where}: non-finite gradient ({kind}) in {name}"
        return f"{where}: non-finite gradient"

    def _backward(self, k: int, node, batch) -> torch.Tensor:
        """Loss and gradient of local node ``k`` at z_k on its batch (in that node's RNG stream)."""
        node.train()
        with self._rng.activate(self.node_ids[k]):
            batch = self._prepare_inputs(batch)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(node, batch)
            loss.backward()
        return loss.detach()

    def _log_train(self) -> float:
        """Log the mean loss of each node since the last log; returns the loss summed over those steps.

        A node that took no step in the window (absent, or every step skipped) logs NaN; the
        overall ``loss`` is the mean over the nodes that did.
        """
        steps = self.state.global_step - self._last_logged
        count = self._loss_count.to(self._loss_sum.device)
        mean = torch.where(count > 0, self._loss_sum / count.clamp(min=1), torch.nan)
        node_losses = self._gather(mean)
        self._loss_sum.zero_()
        self._loss_count.zero_()
        self._last_logged = self.state.global_step
        loss = float(node_losses.nanmean())  # NaN when no node took a step in the window
        logs = {"loss": loss, "learning_rate": self._opts[0][1].get_last_lr()[0]}
        logs.update({f"loss_node_{i}": float(v) for i, v in enumerate(node_losses)})
        logs.update({f"bytes_sent_node_{i}": int(v) for i, v in enumerate(self._gather(self.bytes_sent))})
        if self.args.skip_nonfinite:
            logs.update({f"nonfinite_skips_node_{i}": int(v) for i, v in enumerate(self._gather(self.nonfinite_skips))})
        logs["consensus_distance"] = self.consensus_distance()
        self.log(logs)
        return loss * steps if math.isfinite(loss) else 0.0

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
        # counters (e.g. act_num_batches, which switches 8-bit layers to their running range in
        # eval) advance in lock-step on every node: take the first local node's
        for dst, src in zip(self.model.state_dict().values(), self.nodes[0].state_dict().values()):
            if not dst.is_floating_point():
                dst.copy_(src)

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
        bs = self.args.per_device_train_batch_size
        # the loaders drop the last partial batch: an epoch is floor(shard / batch) iterations
        samples_per_node = min(len(s) for s in self._shards()) // bs * bs
        return estimate_cost(self.nodes[0], tuple(input_shape), bs,
                             "int8" if self.args.low_precision else "fp32", optimizer=optimizer,
                             gossip=self.gossip, samples_per_node=samples_per_node)

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

    def _save_checkpoint(self, model, trial):
        """Write ``output_dir/checkpoint-<step>/`` atomically (:mod:`lp_decentral_nlp.checkpoint`).

        Files: ``node-<i>.safetensors`` per node (:meth:`_node_state`), the averaged model in
        Hugging Face format (``config.json``, ``model.safetensors``, tokenizer), ``trainer_state.json``
        (`TrainerState`: log history...) and the manifest ``decentralized_state.json`` (step,
        position in the data, run configuration, logging accumulators, list of files). In the
        distributed backend every rank writes its own node file into the shared staging
        directory (``output_dir`` must be visible to all ranks), the ranks report success to each
        other (an all-gather), and rank 0 writes the rest and renames the directory.
        """
        step = self.state.global_step
        out = self.args.output_dir
        self._refresh_average_model()  # a collective in the distributed backend: every rank joins
        main = self.state.is_world_process_zero
        if main:
            ckpt.prepare_staging(out, step)
        self._barrier()
        staging = ckpt.staging_dir(out, step)
        error = None
        try:
            for k, i in enumerate(self.node_ids):
                ckpt.save_state_file(staging / ckpt.node_file(i), self._node_state(k))
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        failed = [(r, e) for r, e in enumerate(self._gather_objects(error)) if e]
        if failed:
            rank, msg = failed[0]
            raise RuntimeError(f"checkpoint-{step}: rank {rank} could not write its node file ({msg}); "
                               "earlier checkpoints are untouched")
        if main:
            self._write_model(staging)
            self.state.save_to_json(str(staging / "trainer_state.json"))
            epoch, done = self._data_position
            ckpt.write_json(staging / ckpt.MANIFEST, {
                "format": ckpt.FORMAT, "version": ckpt.VERSION, "global_step": step,
                "data": {"epoch": epoch, "batches_done": done, "steps_per_epoch": self._steps_per_epoch},
                "config": self._resume_config(),
                "logging": {"last_logged": self._last_logged, "total_loss": self._total_loss},
                "backend": self.args.backend,
                "files": [ckpt.node_file(i) for i in range(self.args.num_nodes)] + ["trainer_state.json"],
            })
            ckpt.commit(out, step)
            if self.args.save_total_limit:
                ckpt.rotate(out, self.args.save_total_limit)
        self._barrier()

    def _node_state(self, k: int) -> dict:
        """Everything local node ``k`` holds: model state dict (parameters and buffers, the 8-bit
        activation ranges included), optimizer and LR scheduler state, its RNG stream, its gossip
        rows (push-sum weight, Choco copies / Deep-Squeeze error memory, labelled by node id), QGM
        buffer, and counters (bytes sent, skipped steps, loss accumulated since the last log)."""
        i = self.node_ids[k]
        optimizer, scheduler = self._opts[k]
        return {
            "node": i,
            "model": self.nodes[k].state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": self._rng.state_dict(i),
            "gossip": self.gossip.node_state_dict(i),
            "qgm": list(self.qgm.momentum[k]) if self.qgm is not None else None,
            "counters": {"bytes_sent": int(self.bytes_sent[k]), "nonfinite_skips": int(self.nonfinite_skips[k]),
                         "loss_sum": self._loss_sum[k], "loss_count": int(self._loss_count[k])},
        }

    def _resume_config(self) -> dict:
        return {**resume_config(self.args), "train_samples": len(self.train_dataset)}

    def _load_checkpoint(self, path, steps_per_epoch: int) -> tuple[int, int]:
        """Restore the state :meth:`_save_checkpoint` wrote; returns the data position ``(epoch,
        batches_done)``. ValueError (naming the file or argument) when the checkpoint does not
        fit this run."""
        path = check_resumable(path, self.args, train_samples=len(self.train_dataset))
        manifest = ckpt.read_manifest(path)
        parts = []
        for k, i in enumerate(self.node_ids):
            file = path / ckpt.node_file(i)
            state = ckpt.load_state_file(file)
            try:
                self.nodes[k].load_state_dict(state["model"])
            except RuntimeError as err:  # missing/unexpected keys, size mismatches
                raise ValueError(f"{file} does not fit this model: {err}") from None
            optimizer, scheduler = self._opts[k]
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            self._rng.load_state_dict(i, state["rng"])
            if self.qgm is not None:
                if state["qgm"] is None:
                    raise ValueError(f"{file} has no QGM buffer: the checkpoint was written without qgm")
                torch._foreach_copy_(self.qgm.momentum[k], state["qgm"])
            counters = state["counters"]
            self.bytes_sent[k] = counters["bytes_sent"]
            self.nonfinite_skips[k] = counters["nonfinite_skips"]
            self._loss_sum[k] = counters["loss_sum"]
            self._loss_count[k] = counters["loss_count"]
            parts.append(state["gossip"])
        self.gossip.load_node_state_dicts(parts)
        step = manifest["global_step"]
        if self.gossip.num_steps != step:
            raise ValueError(f"{path}: gossip state is at step {self.gossip.num_steps}, the manifest at step {step}")
        self.state = TrainerState.load_from_json(str(path / "trainer_state.json"))
        self._last_logged = manifest["logging"]["last_logged"]
        self._total_loss = manifest["logging"]["total_loss"]
        data = manifest["data"]
        if data["steps_per_epoch"] != steps_per_epoch:
            raise ValueError(f"cannot resume from {path}: it has {data['steps_per_epoch']} steps per epoch, this run "
                             f"{steps_per_epoch} (a different training set or batch size)")
        self._data_position = (data["epoch"], data["batches_done"])
        logger.info(f"resumed from {path} at step {step} (epoch {data['epoch']}, batch {data['batches_done']})")
        return self._data_position

    def _barrier(self) -> None:
        if self.args.backend == "distributed":
            dist.barrier()

    def _gather_objects(self, obj) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` (``[obj]`` in the simulated backend)."""
        if self.args.backend == "simulated":
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out


class MetricsCSVCallback(TrainerCallback):
    """Append every logged dict as a row of a CSV file (one column per metric, ``step`` first)."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run starts from the rows logged before its checkpoint (``state.log_history``)."""
        if not self.rows and state.log_history:
            self.rows = [{"step": h["step"], **{k: v for k, v in h.items() if k != "step"}} for h in state.log_history]

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
