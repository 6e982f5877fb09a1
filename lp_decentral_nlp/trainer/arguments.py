"""DecentralizedTrainingArguments: `TrainingArguments` plus the decentralized setting (SPEC 1-2, 6, 8),
with every check of its fields in one place (numeric ranges: :data:`lp_decentral_nlp.checks.NUMBER_FIELDS`,
the checks the recipes' flags make too)."""
from __future__ import annotations

import logging
import math
import numbers
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from functools import cached_property

import torch
from transformers import TrainingArguments, training_args
from transformers.debug_utils import DebugOption
from transformers.trainer_utils import SchedulerType

from ..checks import Number, check_choice, check_fields, check_flags, plain_number, path_text
from ..gossip.factory import COMPRESSORS, REFERENCES, TOPOLOGIES, GossipConfig
from ..gossip.step_size import ALGORITHMS
from ..gossip.faults import FaultPlan
from ..quant.kernels import AUTO, kernel_names
from ..utils.fields_doc import document_fields
from .field_policy import field_default, refuse_unsupported

logger = logging.getLogger(__name__)

BACKENDS = ("simulated", "distributed")
#: the evaluation metrics of this trainer that are better lower, though their names do not end in
#: "loss" (Trainer's rule for an unset greater_is_better): with or without ``eval_`` and the name of
#: an eval_dataset dict's set (``val_consensus_distance``)
LOWER_IS_BETTER = re.compile(r"(eval_)?(\w+_)?(consensus_distance|loss_node_\d+|bytes_sent_node_\d+)")
#: the ``TrainingArguments`` fields that transformers passes to Adam-family optimizers only
ADAM_SETTINGS = ("adam_beta1", "adam_beta2", "adam_epsilon")
_DEFAULT_DDP_TIMEOUT = TrainingArguments.__dataclass_fields__["ddp_timeout"].default  # seconds
# TrainingArguments' warning when a process group exists without DDP: the distributed backend runs
# one node per process and gossips instead (docs/design.md), so it does not apply
_NOT_DDP_WARNING = "torch.distributed process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED"
_INSIDE_BACKWARD = "updates each weight inside backward, before the node's NaN/Inf check, clipping and gossip"
_NEEDS_TARGETS = "needs optim_target_modules, which is refused (not checked with gossip)"
#: ``optim`` values whose optimizers step outside a node's ``optimizer.step()`` or keep weights gossip
#: does not average, by name prefix, and why they are refused
REFUSED_OPTIMIZERS = {
    "lomo": f"LOMO {_INSIDE_BACKWARD}",
    "adalomo": f"AdaLomo {_INSIDE_BACKWARD}",
    "schedule_free": "a schedule-free optimizer keeps a second weight sequence in its state, which gossip does not "
                     "average",
    "galore": f"GaLore {_NEEDS_TARGETS}",
    "apollo": f"APOLLO {_NEEDS_TARGETS}",
}
# the numeric fields checked here, against lp_decentral_nlp.checks.NUMBER_FIELDS (the gossip fields are checked by
# GossipConfig, drop_prob by FaultPlan, against the same table)
NUMBER_SETTINGS = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                   "max_steps", "num_train_epochs", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
                   "adam_epsilon", "max_grad_norm", "label_smoothing_factor", "warmup_steps", "logging_steps",
                   "save_steps", "eval_steps", "eval_delay", "save_total_limit", "seed", "data_seed",
                   "dataloader_num_workers", "dataloader_prefetch_factor", "skew", "qgm_beta", "lr_decay",
                   "gossip_timeout", "num_nodes", "torus_rows", "compression", "qsgd_levels", "consensus_lr",
                   "drop_prob", "neftune_noise_alpha")


#: the GossipConfig fields that are training arguments of the same name (``faults`` is built from
#: ``drop_prob``, ``stragglers`` and ``absences``: :attr:`DecentralizedTrainingArguments.fault_plan`)
_GOSSIP_FIELDS = tuple(f.name for f in fields(GossipConfig) if f.name != "faults")


#: the environment variables by which accelerate launch turns on a sharding engine, with its flag
LAUNCHER_SHARDING = {"ACCELERATE_USE_FSDP": "--use_fsdp", "ACCELERATE_USE_DEEPSPEED": "--use_deepspeed",
                     "ACCELERATE_USE_MEGATRON_LM": "--use_megatron_lm"}


#: the fields that shape only one process's output or data loading, not what it computes: the
#: processes of a distributed run may differ in them (every other field must agree)
PROCESS_LOCAL_FIELDS = frozenset({"local_rank", "disable_tqdm", "log_level", "log_level_replica", "log_on_each_node",
                                  "logging_dir", "dataloader_num_workers", "dataloader_pin_memory",
                                  "dataloader_persistent_workers", "dataloader_prefetch_factor", "tune_cpu_malloc"})


@document_fields("the fields added to `TrainingArguments` or given another default; the others: "
                 "``help(transformers.TrainingArguments)``", inherited=False)
@dataclass(repr=False)  # TrainingArguments' repr: one field a line, hub_token hidden
class DecentralizedTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the decentralized setting.

    ``per_device_train_batch_size`` is the batch size of *each node*. ``max_grad_norm`` clips each
    node's gradient separately (default 0: no clipping, as in the paper). Every `TrainingArguments`
    field is honoured or refused at construction (:mod:`.field_policy`, ``docs/trainer.md``);
    numeric fields that are NaN, infinite, out of range or floats where an integer is meant are a
    ValueError naming the field.
    """

    num_nodes: int = field(default=4, metadata={"help": "Number of peer nodes n."})
    topology: str = field(default="directed_ring", metadata={
        "help": f"Communication graph, one of {TOPOLOGIES}, or a .npy or .json file of a graph of your own: its "
                "column-stochastic mixing matrix (num_nodes, num_nodes), or (T, num_nodes, num_nodes) for one that "
                "cycles through T."})
    algorithm: str = field(default="choco", metadata={"help": f"Gossip algorithm, one of {ALGORITHMS}."})
    compression: float = field(
        default=0.0, metadata={"help": "Percent of entries dropped per tensor by topk/randomk, 0 <= c < 100 "
                                       "(0: every entry is sent)."}
    )
    compressor: str = field(default="topk", metadata={
        "help": f"Message compressor, one of {COMPRESSORS}: topk/randomk keep (100 - compression)%% of each tensor "
                "(when compression > 0); qsgd sends qsgd_levels levels per entry (compression stays 0)."})
    qsgd_levels: int = field(default=16, metadata={"help": "QSGD levels s (1..127), for compressor='qsgd'."})
    consensus_lr: float | None = field(
        default=None, metadata={"help": "Consensus step size gamma in (0, 1]; default: from the compressor, the algorithm, "
                                     "the graph and the message loss (lp_decentral_nlp.gossip.default_consensus_lr, "
                                     "docs/consensus_step.md)."}
    )
    skew: float = field(default=0.0, metadata={"help": "Degree of label skew of the shards, in [0, 1] (SPEC 6)."})
    low_precision: bool = field(
        default=True, metadata={"help": "8-bit training on every node and 8-bit values on the wire."}
    )
    qgm: bool = field(default=False, metadata={
        "help": "Quasi-global momentum (SPEC 2): SGD's momentum buffer, or Adam/AdamW's first moment (the second "
                "moment stays local); other optimizers are refused."})
    qgm_beta: float = field(default=0.9, metadata={
        "help": "QGM momentum factor beta in [0, 1), for SGD (with Adam/AdamW the first moment uses adam_beta1)."})
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
                "names the peer (over NCCL, the step's peers). Count the slowest peer's work between two steps "
                "(evaluation, saving) in it."})
    drop_prob: float = field(default=0.0, metadata={
        "help": "Fault injection: probability in [0, 1) that a gossip message is lost (seeded per step and edge; "
                "the push-sum mass stays exact under the rules of lp_decentral_nlp.gossip.faults)."})
    stragglers: list[str] | None = field(default=None, metadata={
        "help": "Fault injection: 'NODE:SECONDS' entries (from Python also (node, seconds) pairs); that node sleeps "
                "SECONDS before each send."})
    absences: list[str] | None = field(default=None, metadata={
        "help": "Fault injection: 'NODE:START:END' entries (from Python also (node, start, end) triples); the node "
                "leaves for iterations START..END-1 (no local step, no messages) and rejoins; iterations count from 0, "
                "iteration t is logged as step t + 1."})
    skip_nonfinite: bool = field(default=False, metadata={
        "help": "On a NaN/Inf loss or gradient, skip that node's update for the step (and count it) instead of "
                "stopping the run."})
    shard_column: str | None = field(default=None, metadata={
        "help": "Column of class ids (or category names) the shards are skewed on when skew > 0 (SPEC 6). Default: "
                "'label', else 'labels' when it holds one class id per sample. With skew = 0 the shards are random: "
                "leave it unset."})
    gossip_reference: str = field(default="zero", metadata={
        "help": f"What the gossip messages are compressed relative to, one of {REFERENCES}: 'zero' (SPEC 2 as "
                "written, the paper's rule: the models themselves) or 'initial' (the nodes' common initial model: "
                "what each node changed since the start; keeps a fine-tuned model's nodes together under faults, "
                "docs/design.md, Faults)."})
    final_merge: bool = field(default=False, metadata={
        "help": "Skew-Compensated Sparse-Push final merge (SPEC 2a): after the last step every node's model becomes "
                "the exact average of all nodes' de-biased models."})
    quant_kernel: str = field(default="auto", metadata={
        "help": "GEMM kernel of the 8-bit surgery when no quant_config is given (QuantConfig.kernel): 'auto' or one "
                "of lp_decentral_nlp.quant.KERNELS; another than 'auto' needs low_precision=True."})
    average_tokens_across_devices: bool = field(default=False, metadata={
        "help": "Must stay False: a node's loss is normalised over its own batch (gradients never cross nodes)."})
    tune_cpu_malloc: bool = field(default=True, metadata={
        "help": "Training on the CPU under glibc: keep freed tensor memory in the process for the next step "
                "(lp_decentral_nlp.utils.cpu_malloc.keep_freed_memory) instead of page-faulting it in again every step."})

    def __post_init__(self):
        check_choice("backend", self.backend, BACKENDS)
        check_fields(self, NUMBER_SETTINGS)
        if self.max_steps == 0:  # Trainer reads only a positive max_steps: 0 trained for num_train_epochs
            raise ValueError("max_steps=0 would train for num_train_epochs (only a positive max_steps sets the run's "
                             "length): give max_steps >= 1, or leave it at -1 to train for num_train_epochs")
        self.topology = path_text(self.topology)
        self.resume_from_checkpoint = path_text(self.resume_from_checkpoint)
        check_flags(self, ("qgm", "skip_nonfinite", "final_merge", "tune_cpu_malloc", "low_precision"))
        self.gossip_config  # noqa: B018 -- building it checks the gossip fields (GossipConfig.__post_init__)
        check_choice("quant_kernel", self.quant_kernel, kernel_names())
        if not self.low_precision and self.quant_kernel != AUTO:
            raise ValueError(f"quant_kernel={self.quant_kernel!r} chooses the GEMM kernel of 8-bit training, and "
                             f"low_precision=False trains in full precision: drop one of them")
        if self.shard_column is not None and (not isinstance(self.shard_column, str) or not self.shard_column):
            raise ValueError(f"shard_column must be a column name or None, got {self.shard_column!r}")
        for name in ("dataloader_persistent_workers", "dataloader_multiprocessing_context"):
            if getattr(self, name) not in (False, None) and self.dataloader_num_workers == 0:  # as torch's DataLoader
                raise ValueError(f"{name}={getattr(self, name)!r} is a setting of dataloader worker processes, and "
                                 f"dataloader_num_workers=0 starts none: set dataloader_num_workers > 0 or leave "
                                 f"{name} at its default")
        self._check_lr_milestones()
        self._refuse_unused_settings()
        self._check_constant_schedule()
        plan = self.fault_plan
        for name in ("stragglers", "absences"):  # entries given as tuples, as plain numbers (NumPy's are no JSON)
            given = getattr(self, name)
            if given is not None and not all(isinstance(entry, str) for entry in given):
                setattr(self, name, [entry if isinstance(entry, str) else parsed
                                     for entry, parsed in zip(given, getattr(plan, name))])
        slow = [(n, s) for n, s in plan.stragglers if s >= self.gossip_timeout]
        if slow and self.backend == "distributed":
            raise ValueError(f"stragglers: node {slow[0][0]} sleeps {slow[0][1]:g} s per step, not less than "
                             f"gossip_timeout={self.gossip_timeout:g} s: its peers would give up on it")
        # before TrainingArguments' own checks, which answer bf16=True on a CPU with "Your setup doesn't support bf16"
        refuse_unsupported(self)
        for variable, flag in LAUNCHER_SHARDING.items():  # the fields' refusal, given through the launcher
            if os.environ.get(variable, "").lower() in ("1", "true", "yes"):
                raise ValueError(f"{variable}={os.environ[variable]} (accelerate's switch, which accelerate launch "
                                 f"{flag}, its config's distributed_type or a plugin made in this process sets) shards "
                                 "the model or its training state, which DecentralizedTrainer does not support (every "
                                 "node holds a whole model and its own optimizer): launch without it")
        if (self.greater_is_better is None and isinstance(self.metric_for_best_model, str)
                and LOWER_IS_BETTER.fullmatch(self.metric_for_best_model)):
            self.greater_is_better = False  # Trainer's rule would keep the most divergent, or the worst node's, model
        passed_over = None  # a default accelerator the nodes do not run on, said once the process index is known
        if not self.use_cpu and not torch.cuda.is_available():
            if torch.accelerator.is_available():  # Apple's MPS (no float64 for the nodes' sums), XPU, ...
                passed_over = torch.accelerator.current_accelerator().type
                self.use_cpu = True
            elif self.backend == "distributed":
                # the CPU is what use_cpu=False picks here too; without the flag transformers makes the process
                # group without a backend (each rank sees world size 1) and the first gossip message fails
                self.use_cpu = True
        super().__post_init__()
        if passed_over is not None and self.process_index == 0:
            logger.warning(f"DecentralizedTrainer runs its nodes on CUDA or the CPU, and this machine's default device "
                           f"is {passed_over}: the nodes train on the CPU (use_cpu=True)")
        if self.mixed_precision not in ("no", "bf16", "fp16"):  # the launcher's setting (fp8)
            raise ValueError(f"mixed precision {self.mixed_precision} (ACCELERATE_MIXED_PRECISION={self.mixed_precision}, "
                             f"set by accelerate launch --mixed_precision {self.mixed_precision} or its config) is not "
                             f"supported by DecentralizedTrainer (the nodes run bf16 or fp16 autocast, or none): launch "
                             f"with --mixed_precision bf16, fp16 or no")
        if DebugOption.TPU_METRICS_DEBUG in self.debug:  # a list of DebugOption once TrainingArguments parsed it
            raise ValueError("debug='tpu_metrics_debug' prints torch_xla's TPU metrics after evaluation, which "
                             "DecentralizedTrainer does not run on TPUs: use debug='underflow_overflow' or none")
        optim = str(getattr(self.optim, "value", self.optim))
        refused = next((why for prefix, why in REFUSED_OPTIMIZERS.items() if optim.startswith(prefix)), None)
        if refused:
            raise ValueError(f"optim={optim!r} is not supported by DecentralizedTrainer ({refused}): use adamw_torch, "
                             f"sgd or another optimizer that steps in optimizer.step()")
        self._refuse_settings_optim_ignores(optim)
        self._check_qgm_beta()
        self._check_schedule_builds()
        # after TrainingArguments has normalised its spellings (include_num_input_tokens_seen=False is "no")
        check_choice("include_num_input_tokens_seen", self.include_num_input_tokens_seen, ("all", "non_padding", "no"))
        for extra in self.include_for_metrics:
            check_choice("include_for_metrics entries", extra, ("inputs", "loss"))

    def _check_schedule_builds(self, steps: int = 1000):
        """``lr_scheduler_type`` with its ``lr_scheduler_kwargs``: a schedule transformers builds,
        whose learning rate is a finite number at the first step, the end of warm-up and the last
        step (tried now on a stand-in optimizer over ``max_steps`` or ``steps`` steps: the nodes
        build theirs once training starts, and a bad ``power`` failed only at the last step).
        ValueError ``"<field>: ..."`` naming the field given (the kwargs where there are any)."""
        if self.lr_milestones:  # the paper's step decay (MultiStepLR) replaces the schedule
            return
        from transformers import get_scheduler

        kwargs = self.lr_scheduler_kwargs
        field_name = "lr_scheduler_type" if not kwargs else "lr_scheduler_kwargs"
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"lr_scheduler_kwargs: expected a JSON object of the schedule's arguments, e.g. "
                             f"'{{\"num_cycles\": 2}}', got {kwargs!r}")
        name = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        steps = self.max_steps if self.max_steps > 0 else steps
        warmup = self.get_warmup_steps(steps)
        try:
            scheduler = get_scheduler(name, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                      num_warmup_steps=warmup, num_training_steps=steps,
                                      scheduler_specific_kwargs=kwargs)
            for step in (0, warmup, steps):
                for factor in getattr(scheduler, "lr_lambdas", ()):
                    if not math.isfinite(factor(step)):
                        raise ValueError(f"the learning rate at step {step} is {factor(step)} times learning_rate")
        except (TypeError, ValueError, ArithmeticError) as err:
            reason = (str(err).strip().splitlines() or [""])[0]  # some span lines
            raise ValueError(f"{field_name}: lr_scheduler_type={name!r} with lr_scheduler_kwargs={kwargs or {}} gives "
                             f"no schedule ({type(err).__name__}: {reason})") from None

    def _check_qgm_beta(self):
        """:func:`qgm_beta_problem` of ``optim``'s optimizer (``optimizer_cls_and_kwargs``, which the
        trainer takes, is checked there)."""
        if not self.qgm or self.qgm_beta == type(self).__dataclass_fields__["qgm_beta"].default:
            return
        from transformers import Trainer

        try:
            optimizer_cls = Trainer.get_optimizer_cls_and_kwargs(self, torch.nn.Linear(1, 1))[0]
        except ImportError:  # the optimizer's package is not installed: the trainer says so when it builds it
            return
        problem = qgm_beta_problem(self, optimizer_cls)
        if problem:
            raise ValueError(problem)

    def _refuse_settings_optim_ignores(self, optim: str):
        """Optimizer settings ``optim``'s optimizer does not read, which transformers drops silently:
        ``adam_beta1``, ``adam_beta2`` or ``adam_epsilon`` away from their defaults
        (:func:`unread_adam_settings`: read by the Adam family, the betas by Lion too; not by
        ``sgd``, ``adagrad``, ``rmsprop`` or ``adafactor``) and any ``optim_args`` entry (every entry for ``adamw_torch`` and
        ``adafactor``; all but ``momentum``, ``dampening``, ``weight_decay``, ``nesterov`` for
        ``sgd``); ``optim_args`` that do not parse are refused too."""
        settings = vars(self)
        try:
            optimizer_kwargs(settings)
        except ImportError:  # the optimizer's package is not installed: the trainer says so when it builds it
            return
        except ValueError as err:
            if not self.optim_args:  # the optimizer cannot be built here: the trainer says why when it builds it
                return
            raise ValueError(f"optim_args={self.optim_args!r} for optim={optim!r}: {err}") from None
        unread = unread_adam_settings(settings)
        for name in ADAM_SETTINGS:
            default = field_default(TrainingArguments, name)
            if getattr(self, name) != default and name in unread:
                raise ValueError(f"{name}={getattr(self, name)!r} is not read by optim={optim!r} (transformers "
                                 f"ignores it): leave it at {default}, or use an optimizer that reads it (adamw_torch)")
        entries = [entry for entry in (self.optim_args or "").replace(" ", "").split(",") if entry]
        for entry in entries:
            if optimizer_ignores(settings, "optim_args", ",".join(e for e in entries if e != entry) or None):
                raise ValueError(f"optim_args entry {entry!r} is not read by optim={optim!r} (transformers ignores it): "
                                 "drop it")

    @property
    def data_order_seed(self) -> int:
        """The seed of every node's SPEC 6 shard, shuffling order and batch seeds (and, in the
        recipes, of the held-out test rows and row subsets): ``data_seed`` when set (as Trainer
        seeds its samplers), else ``seed``."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def gossip_config(self) -> GossipConfig:
        """The run's :class:`~lp_decentral_nlp.gossip.factory.GossipConfig` (checks its fields:
        ValueError naming the one that is wrong). Built once per value of the settings it holds, so
        a graph file is read once: a run (its checkpoints, card and messages) keeps the graph it
        started with if the file is later changed or removed."""
        settings = {name: getattr(self, name) for name in _GOSSIP_FIELDS}  # all but faults: the plan's fields
        key = (tuple(settings.values()), self.drop_prob, repr(self.stragglers), repr(self.absences))
        built = self.__dict__.get("_gossip_config")
        if built is None or built[0] != key:
            plan = self.fault_plan
            built = key, GossipConfig(**settings, faults=plan if plan.active else None)
            self.__dict__["_gossip_config"] = built
        return built[1]

    @property
    def fault_plan(self) -> FaultPlan:
        """The :class:`~lp_decentral_nlp.gossip.faults.FaultPlan` of ``drop_prob``, ``stragglers`` and
        ``absences`` (seeded with ``seed``); ValueError naming the argument that is wrong."""
        plan = FaultPlan(drop_prob=self.drop_prob, seed=self.seed,  # entries: strings or tuples, as FaultPlan's
                         stragglers=() if self.stragglers is None else self.stragglers,
                         absences=() if self.absences is None else self.absences)
        plan.check_nodes(self.num_nodes)
        return plan

    def _check_lr_milestones(self):
        if self.lr_milestones is None:
            return
        m = [] if isinstance(self.lr_milestones, (str, bytes, numbers.Number)) else list(self.lr_milestones)
        if not m or not all(Number(low=0, low_open=True).admits(e) for e in m) or m != sorted(set(m)):
            raise ValueError(f"lr_milestones must be a non-empty, strictly increasing list of epochs > 0 "
                             f"(or None), got {self.lr_milestones!r}")
        self.lr_milestones = [plain_number(e) for e in m]
        if SchedulerType(self.lr_scheduler_type) != SchedulerType.CONSTANT:
            raise ValueError(f"lr_milestones needs lr_scheduler_type='constant' (the milestones are the schedule), "
                             f"got lr_scheduler_type={self.lr_scheduler_type!r}")

    def _refuse_unused_settings(self):
        """A decentralized setting another one switches off: refused rather than ignored."""
        fields = type(self).__dataclass_fields__
        unused = [("qgm_beta", not self.qgm, "the quasi-global momentum's beta, and qgm=False: set qgm=True"),
                  ("lr_decay", self.lr_milestones is None, "the factor at each of lr_milestones, and lr_milestones=None: "
                                                           "give lr_milestones"),
                  ("gossip_timeout", self.backend == "simulated", "how long a process waits for its peers, and "
                                                                  "backend='simulated' runs every node in this process: "
                                                                  "use backend='distributed'"),
                  ("ddp_timeout", self.backend == "simulated", "how long a process waits at a collective over all "
                                                               "processes, and backend='simulated' runs every node in "
                                                               "this process: use backend='distributed'"),
                  ("skew", self.num_nodes == 1, "how unevenly the training set is split among the nodes, and "
                                                "num_nodes=1 holds all of it: set num_nodes >= 2"),
                  ("shard_column", self.skew == 0, "the column skew > 0 skews the shards on, and skew=0 splits at "
                                                   "random: set skew > 0")]
        # the gossip's own settings with num_nodes=1: GossipConfig's check
        unused.append(("final_merge", self.num_nodes == 1, "a setting of the gossip, and num_nodes=1 has no neighbour "
                                                           "to send to: set num_nodes >= 2"))
        strategy = {name: str(getattr(getattr(self, name), "value", getattr(self, name)))
                    for name in ("eval_strategy", "save_strategy", "logging_strategy")}
        unused += [("save_total_limit", strategy["save_strategy"] == "no", "how many checkpoints are kept, and "
                                                                         "save_strategy='no' writes none: set "
                                                                         "save_strategy"),
                   ("save_only_model", strategy["save_strategy"] == "no", "what a checkpoint holds, and "
                                                                        "save_strategy='no' writes none: set "
                                                                        "save_strategy"),
                   *((name, strategy["eval_strategy"] == "no", "a setting of evaluation during training, and "
                                                              "eval_strategy='no' evaluates at the end only: set "
                                                              "eval_strategy")
                     for name in ("eval_delay", "metric_for_best_model", "greater_is_better")),
                   ("greater_is_better", self.metric_for_best_model is None and not self.load_best_model_at_end,
                    "the order of metric_for_best_model's values, and none is set (nor load_best_model_at_end, "
                    "which picks loss): set metric_for_best_model"),
                   # hub_model_id, hub_token, ... also serve a push_to_hub() called after training
                   *((name, not self.push_to_hub, "when and what the training uploads, and push_to_hub=False uploads "
                                                  "nothing during training (trainer.push_to_hub() uploads the saved "
                                                  "model once): set push_to_hub=True")
                     for name in ("hub_strategy", "hub_always_push")),
                   *((name, not (self.gradient_checkpointing or self.activation_checkpointing),
                      "the options of activation (gradient) checkpointing, which is off: set activation_checkpointing")
                     for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"))]
        for name, off, why in unused:
            if off and getattr(self, name) != fields[name].default:
                raise ValueError(f"{name}={getattr(self, name)!r} is {why}, or leave {name} at "
                                 f"{fields[name].default!r}")
        # transformers evaluates every logging_steps under eval_strategy='steps' without eval_steps
        evaluates_every_log = strategy["eval_strategy"] == "steps" and self.eval_steps is None
        for steps, name in (("eval_steps", "eval_strategy"), ("save_steps", "save_strategy"),
                            ("logging_steps", "logging_strategy")):
            read_anyway = steps == "logging_steps" and evaluates_every_log
            if getattr(self, steps) != fields[steps].default and strategy[name] != "steps" and not read_anyway:
                raise ValueError(f"{steps}: {steps} is the interval of {name}='steps', and {name} is "
                                 f"{strategy[name]!r}: drop one of them")

    def _check_constant_schedule(self):
        """A constant schedule (transformers' ``constant``, or ``lr_milestones``' multi-step one)
        takes no warm-up and no scheduler options, and one that steps after evaluations
        (``reduce_lr_on_plateau``, ``greedy``) no warm-up: refused rather than ignored."""
        kind = SchedulerType(self.lr_scheduler_type)
        if kind in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY) and self.warmup_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} has no effect with lr_scheduler_type={kind.value!r}, "
                             "which changes the learning rate after evaluations from the first step on (transformers "
                             "gives it no warm-up): leave warmup_steps at 0")
        if kind != SchedulerType.CONSTANT:
            return
        if self.lr_milestones:
            schedule, instead = "lr_milestones (a multi-step schedule)", "leave warmup_steps at 0"
        else:
            schedule = "lr_scheduler_type='constant'"
            instead = "use lr_scheduler_type='constant_with_warmup' for a warm-up, or warmup_steps=0"
        if self.warmup_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} has no effect with {schedule}: {instead}")
        if self.lr_scheduler_kwargs:
            raise ValueError(f"lr_scheduler_kwargs={self.lr_scheduler_kwargs!r} has no effect with {schedule}, "
                             f"which takes no options: leave it empty")

    @cached_property
    def _setup_devices(self):
        """``TrainingArguments``' device setup, without its advice to launch DDP (the nodes of the
        distributed backend gossip; every copy of the arguments would repeat it on every rank), and
        with ``ddp_timeout`` on the CPU as well: transformers passes it to the process group it
        creates on GPUs only, so on the CPU accelerate's ``PartialState`` creates it first."""
        from accelerate import PartialState

        def not_ddp_advice(record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(_NOT_DDP_WARNING)

        on_cpu = self.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
        if on_cpu and self.ddp_timeout != _DEFAULT_DDP_TIMEOUT and not torch.distributed.is_initialized():
            PartialState(cpu=True, backend=self.ddp_backend, timeout=timedelta(seconds=self.ddp_timeout))
        training_args.logger.addFilter(not_ddp_advice)
        try:
            return TrainingArguments._setup_devices.func(self)
        finally:
            training_args.logger.removeFilter(not_ddp_advice)

    @property
    def gamma(self) -> float:
        """Consensus step size (:attr:`GossipConfig.gamma <lp_decentral_nlp.gossip.factory.GossipConfig.gamma>`)."""
        return self.gossip_config.gamma


def optimizer_kwargs(settings: dict) -> dict:
    """The keyword arguments transformers gives the optimizer of the ``TrainingArguments`` field
    values `settings` (by field name; ``optim``, ``optim_args``, ``learning_rate``, ``adam_*``...;
    the fields not given at their defaults): ``Trainer.get_optimizer_cls_and_kwargs`` on a bare
    ``TrainingArguments`` holding them, which it only reads (building one would set up the devices
    and join a launcher's process group). ImportError when the optimizer's package is missing,
    ValueError when it cannot be built."""
    from transformers import Trainer

    probe = object.__new__(TrainingArguments)
    probe.__dict__.update({f.name: f.default for f in fields(TrainingArguments) if f.default is not MISSING})
    probe.__dict__.update(settings)
    return Trainer.get_optimizer_cls_and_kwargs(probe, torch.nn.Linear(1, 1))[1]


def optimizer_ignores(settings: dict, name: str, value) -> bool:
    """Whether the optimizer of the field values `settings` (:func:`optimizer_kwargs`) is built the
    same with field `name` at `value`: transformers does not read `name` for it."""
    return optimizer_kwargs(settings) == optimizer_kwargs({**settings, name: value})


def unread_adam_settings(settings: dict) -> set[str]:
    """The :data:`ADAM_SETTINGS` the optimizer of the field values `settings` (by name, as
    :func:`optimizer_kwargs` takes them) does not read, whatever their values: its keyword
    arguments are the same at two values of each. Empty when the optimizer cannot be built here
    (its package missing: the trainer says so when it builds it)."""
    try:
        return {name for name in ADAM_SETTINGS if optimizer_ignores({**settings, name: 0.25}, name, 0.5)}
    except (ImportError, ValueError):
        return set()


def qgm_beta_problem(args: DecentralizedTrainingArguments, optimizer_cls) -> str | None:
    """Why ``args.qgm_beta`` cannot apply to ``optimizer_cls``, or None: it is the factor of SGD's
    quasi-global momentum buffer (SPEC 2), and with Adam/AdamW (``torch.optim.Adam`` and
    subclasses) the quasi-global first moment uses ``adam_beta1``, so it must keep its default."""
    default = DecentralizedTrainingArguments.qgm_beta
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Adam) and args.qgm_beta != default:
        return (f"qgm_beta={args.qgm_beta} applies to SGD; with {optimizer_cls.__name__} the quasi-global first moment "
                f"uses adam_beta1 ({args.adam_beta1}): set adam_beta1 instead and leave qgm_beta at {default}")
    return None
