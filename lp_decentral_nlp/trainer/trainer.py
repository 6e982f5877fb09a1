"""DecentralizedTrainer: n peer nodes, each with its own model, optimizer and skewed data shard,
training in lock-step and gossiping compressed models over a directed graph (SPEC sections 1-2).

The trainer reuses `transformers.Trainer` for what does not change with decentralization
(arguments, optimizer and scheduler factories, collators, loss computation, callbacks, logging
integrations, progress bars) and replaces the training loop, evaluation and saving, because the
state being trained is ``n`` models rather than one. Where the nodes run (one process, or one
process per node) is hidden in :class:`~.node_group.NodeGroup`; the pieces of the trainer are:

* :mod:`.arguments` -- :class:`DecentralizedTrainingArguments` and its checks;
* :mod:`.node_data` -- each node's skewed shard (SPEC 6) and its loader;
* :mod:`.optimizers` -- each node's optimizer and LR schedule, and quasi-global momentum;
* :mod:`.local_step` -- one SPEC 2 iteration (local steps, NaN/Inf check, gossip);
* :mod:`.evaluation` -- the averaged model ``mean_i z_i``, final merge, training logs, evaluation;
* :mod:`.checkpointing` -- atomic checkpoints of the whole decentralized state and resuming;
* :mod:`.rng` -- per-node random streams, so both backends draw the same numbers per node.

Gradients never cross nodes: the model is never wrapped in DDP and the only traffic per step is
the gossip messages. A NaN/Inf loss or gradient stops the run naming the node and step (or skips
that node's update with ``skip_nonfinite``) before anything is gossiped. Faults can be injected for
robustness studies (``drop_prob``, ``stragglers``, ``absences``; rules in
:mod:`lp_decentral_nlp.gossip.faults`).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import signal
import time
import types
from pathlib import Path

import safetensors.torch
import torch
from accelerate.utils import DynamoBackend
from accelerate.utils.memory import clear_device_cache
from transformers import Seq2SeqTrainingArguments, Trainer, TrainingArguments
from transformers.debug_utils import DebugOption, DebugUnderflowOverflow
from transformers.integrations.neftune import activate_neftune, deactivate_neftune
from transformers.trainer_jit_checkpoint import JITCheckpointCallback
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES)
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, TrainOutput, speed_metrics, unwrap_peft_model
from transformers.utils import logging as hf_logging

from ..gossip.factory import build_gossip
from ..gossip.push_sum import gossiped_parameters
from ..gossip.transport import GossipPeerError, GossipTimeoutError
from ..quant import QuantConfig, QuantModule, quantize_model
from ..quant.kernels import AUTO
from ..utils.cpu_malloc import tune_process_for_training
from ..utils.logs import set_verbosity
from ..utils.models import input_embeddings
from .arguments import PROCESS_LOCAL_FIELDS, DecentralizedTrainingArguments
from .checkpointing import CheckpointMixin
from .evaluation import EvaluationMixin, describe_evaluation_metrics, evaluation_metric_names
from .inputs import check_trainer_inputs, eval_sets, refusing_misread_outputs
from .local_step import LocalStepMixin
from .model_card import fault_settings, write_model_card
from .preemption import SigtermWatch
from .node_data import NodeDataMixin, check_columns, check_labels, read_shard_labels, rows_digest
from .node_group import NodeGroup
from .optimizers import (OptimizerMixin, check_qgm_optimizer, cost_optimizer, milestone_steps,
                         refuse_settings_a_given_optimizer_ignores)
from .rng import NodeRNG

logger = hf_logging.get_logger(__name__)


def check_model_precision(model, args: DecentralizedTrainingArguments, quant_config=None) -> None:
    """Refuse 8-bit settings a run would not honour (ValueError naming the setting): a `quant_config`
    or a `quant_kernel` other than ``"auto"`` with ``low_precision=False`` (``__post_init__``
    refuses the latter alone), a `model` that already has 8-bit layers (``quantize_model``, or an
    8-bit checkpoint) with ``low_precision=False``, or with a `quant_config` (its layers keep the
    ``QuantConfig`` they were made with) or a `quant_kernel` their kernels differ from, and a
    `quant_config` whose kernel differs from a `quant_kernel` other than ``"auto"``."""
    layer_kernels = {m.quant_config.kernel for m in model.modules() if isinstance(m, QuantModule)}
    if quant_config is not None and not args.low_precision:
        raise ValueError("quant_config is the 8-bit surgery, and low_precision=False trains in full precision: "
                         "drop quant_config or set low_precision=True")
    if layer_kernels and not args.low_precision:
        raise ValueError("model has 8-bit layers (quantize_model or an 8-bit checkpoint), and low_precision=False "
                         "trains in full precision: give the float model (dequantize_model) or train in 8-bit")
    if layer_kernels and quant_config is not None:
        raise ValueError("quant_config: model already has 8-bit layers (quantize_model or an 8-bit checkpoint), "
                         "which keep the QuantConfig they were made with: drop quant_config or pass the float model")
    if layer_kernels and args.quant_kernel != AUTO and layer_kernels != {args.quant_kernel}:
        raise ValueError(f"quant_kernel={args.quant_kernel!r}, but model already has 8-bit layers made with kernel "
                         f"{' and '.join(map(repr, sorted(layer_kernels)))}: leave quant_kernel at 'auto' or pass the "
                         f"float model")
    if quant_config is not None and args.quant_kernel != AUTO and quant_config.kernel != args.quant_kernel:
        raise ValueError(f"quant_kernel={args.quant_kernel!r} disagrees with quant_config.kernel="
                         f"{quant_config.kernel!r}: set the kernel in one of them")


def check_trained_dtype(model, args: DecentralizedTrainingArguments) -> None:
    """Refuse trained parameters the nodes cannot keep as float32 master weights (ValueError naming
    one parameter): parameters of two dtypes (each node gossips them as one vector), 16-bit ones
    (each node would keep its weights, optimizer state and gossip values in 16 bits: the push-sum
    average drifts by the rounding of every step, SPEC 2), and float64 ones with mixed precision
    (autocast computes in 16 bits only what is float32: ``bf16``/``fp16`` would do nothing)."""
    first_of_dtype = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            first_of_dtype.setdefault(p.dtype, name)
    if len(first_of_dtype) > 1:  # the gossip engine refused them at the first step, naming no parameter
        kinds = " and ".join(f"{dtype} (e.g. {name!r})" for dtype, name in sorted(first_of_dtype.items(), key=str))
        raise ValueError(f"model's trained parameters are of {kinds}: each node gossips them as one vector of one "
                         "dtype; convert the model to one, e.g. model.float() (autocast, bf16=True, for lower "
                         "precision compute)")
    (dtype, name), = first_of_dtype.items()
    if dtype.itemsize < 4:
        raise ValueError(f"model's trained parameters are {dtype} (e.g. {name!r}): each node would keep its weights, "
                         f"optimizer state and gossip values in {dtype}, and a 16-bit gossip average drifts by the "
                         "rounding of every step; load the model in float32 (from_pretrained(..., "
                         "dtype=torch.float32), or model.float()) and pass bf16=True for bfloat16 compute")
    if dtype == torch.float64 and args.mixed_precision in ("bf16", "fp16"):
        raise ValueError(f"mixed precision {args.mixed_precision} ({args.mixed_precision}=True, or accelerate launch "
                         f"--mixed_precision) computes under autocast, which casts only float32, and the model's "
                         f"trained parameters are {dtype} (e.g. {name!r}): convert the model with model.float(), or "
                         "train without mixed precision")


#: `Trainer` methods the decentralized loop never calls, and what runs in their place: a subclass
#: that overrides one is refused at construction, since its override would silently not run
UNCALLED_TRAINER_METHODS = {
    "training_step": "each node's step is DecentralizedTrainer's own (override compute_loss, which it calls)",
    "get_train_dataloader": "each node reads its own shard through node_dataloaders()",
    "create_optimizer_and_scheduler": "each node builds its own with create_optimizer(model) and create_scheduler()",
    "evaluation_loop": "evaluate() and predict() run prediction_step over the averaged model and each node",
}


#: the causal-LM classes (``AutoModelForCausalLM``'s), whose losses shift the labels by one
CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
#: the multiple-choice classes (``AutoModelForMultipleChoice``'s)
MULTIPLE_CHOICE_CLASSES = frozenset(MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES.values())


def _arguments_advice(args) -> str:
    """What to do instead of passing ``args``, transformers' own arguments, to DecentralizedTrainer."""
    if isinstance(args, Seq2SeqTrainingArguments):
        return ("; generation in evaluation (predict_with_generate, generation_max_length ...) is not supported: "
                "train a sequence-to-sequence model with DecentralizedTrainingArguments (evaluate() scores the "
                "teacher-forced loss) and generate with trainer.model.generate() afterwards")
    if isinstance(args, TrainingArguments):
        return ": it takes TrainingArguments' fields and the decentralized ones (num_nodes, skew, algorithm ...)"
    return ""


def _class_count(model) -> int | None:
    """The number of classes ``model`` predicts (``config.num_labels``, or the model's own
    ``num_labels``: an ``ImageClassifier``'s), or None for a model whose labels are not class ids
    of its own head: one with output embeddings (a language model, whose ``num_labels`` is an
    unused config default), a multiple-choice model (its labels index the choices of each row,
    however many the data holds) or one with neither."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    if get_output_embeddings is not None and get_output_embeddings() is not None:
        return None
    if any(cls.__name__ in MULTIPLE_CHOICE_CLASSES for cls in type(unwrap_peft_model(model)).__mro__):
        return None
    config = getattr(model, "config", None)
    return getattr(model, "num_labels", None) if config is None else getattr(config, "num_labels", None)


def _check_label_smoothing(args: DecentralizedTrainingArguments, model, num_classes: int | None) -> None:
    """``label_smoothing_factor`` smooths one class target per sample: refused for a regression head
    (one output: Trainer's smoother fails in the first step with an index error) and a multi-label
    one (Trainer turns it off with a warning)."""
    if not args.label_smoothing_factor:
        return
    problem_type = getattr(getattr(model, "config", None), "problem_type", None)
    if problem_type == "multi_label_classification":
        what = "a multi-label classifier (problem_type='multi_label_classification'), whose targets are multi-hot"
    elif problem_type == "regression" or num_classes == 1:
        what = "a regression head (one output), whose targets are numbers"
    else:
        return
    raise ValueError(f"label_smoothing_factor={args.label_smoothing_factor} smooths one class target per sample, and "
                     f"the model is {what}: leave label_smoothing_factor at 0")


@contextlib.contextmanager
def _config_while_trainer_is_built(model, smoothing: bool):
    """With label smoothing, transformers' ``Trainer.__init__`` reads ``model.config.problem_type``
    (it turns smoothing off for multi-label classification) and fails on a model without a config
    (:class:`~lp_decentral_nlp.vision.ImageClassifier`, any plain ``nn.Module``): such a model holds
    an empty one inside (no problem type: the smoother applies), removed after."""
    if not smoothing or getattr(model, "config", None) is not None:
        yield
        return
    model.config = types.SimpleNamespace()
    try:
        yield
    finally:
        del model.config


@contextlib.contextmanager
def _transformers_progress_bars(enabled: bool):
    """transformers' own progress bars (``save_pretrained``'s "Writing model shards") off inside,
    unless ``enabled`` (``disable_tqdm`` is False); their process-wide setting is restored after."""
    if enabled or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _check_best_metric_name(args: DecentralizedTrainingArguments, eval_dataset, compute_metrics) -> None:
    """``metric_for_best_model`` (``load_best_model_at_end`` sets ``loss``) must name a metric the
    evaluation returns, or the first evaluation in training stops the run (Trainer's KeyError): a
    ValueError at construction. With a dict ``eval_dataset`` every metric is named per set
    (``eval_<set>_loss``); without ``compute_metrics`` the names are known
    (:func:`~.evaluation.evaluation_metric_names`)."""
    metric = args.metric_for_best_model
    if metric is None:
        return
    key = metric if metric.startswith("eval_") else f"eval_{metric}"
    sets = list(eval_dataset) if isinstance(eval_dataset, dict) and eval_dataset else None
    if sets and not any(key.startswith(f"eval_{name}_") for name in sets):
        example = f"eval_{sets[0]}_loss"  # (the metric given may name no metric either)
        raise ValueError(f"metric_for_best_model={metric!r}: with a dict eval_dataset every metric is named after its "
                         f"set, eval_<set>_<metric> (sets: {', '.join(map(repr, sets))}): name one, "
                         f"e.g. {example!r}")
    if compute_metrics is not None:
        return
    # the name after a set's prefix: every set it may be (a set may be named like the start of another)
    names = [key.removeprefix(f"eval_{s}_") for s in sets if key.startswith(f"eval_{s}_")] if sets else \
        [key.removeprefix("eval_")]
    if not set(names) & set(evaluation_metric_names(args.num_nodes)):
        raise ValueError(f"metric_for_best_model={metric!r} is not a metric of the evaluation: without compute_metrics "
                         f"it returns {describe_evaluation_metrics(args.num_nodes)}"
                         f"{' (each as eval_<set>_<metric>)' if sets else ''}; the first evaluation in training would "
                         "stop the run")


def _check_processes_agree(node_group: NodeGroup, args, model, quant_config, optimizer_cls_and_kwargs,
                           train_dataset, eval_dataset) -> None:
    """ValueError (on every process) unless every process of a distributed run was given the same
    arguments (but :data:`PROCESS_LOCAL_FIELDS`), the same model (its tensors' names, shapes and
    dtypes: process 0 broadcasts the values), quant_config and data (row counts and
    :func:`~.node_data.rows_digest`): a difference made the broadcast of the initial model wait for
    ``ddp_timeout``, or trained something else than the command said, silently. One gather."""
    if not node_group.distributed:
        return
    settings = {name: value for name, value in args.to_dict().items() if name not in PROCESS_LOCAL_FIELDS}
    settings["model"] = type(model).__name__
    settings["model tensors"] = [f"{name} {tuple(t.shape)} {t.dtype}" for name, t in model.state_dict().items()]
    settings["quant_config"] = repr(quant_config)
    settings["optimizer_cls_and_kwargs"] = repr(optimizer_cls_and_kwargs)
    for what, part in [("train_dataset", train_dataset), *eval_sets(eval_dataset)]:
        settings[f"{what} rows"] = len(part) if hasattr(part, "__len__") else None
        settings[f"{what} rows (digest)"] = rows_digest(part)
    found = node_group.disagreement(settings)
    if found is not None:
        name, rank, theirs, ours = found
        raise ValueError(f"{name}: rank {rank} was given {theirs!r} and rank 0 {ours!r}: every process of a "
                         "distributed run must be given the same settings, model and data (launch them with one "
                         "command)")


def node_compile_settings(plugin) -> tuple[dict | None, bool]:
    """How every node is compiled, from accelerate's dynamo plugin (the accelerator's, or one read
    from the ``ACCELERATE_DYNAMO_*`` variables): ``torch.compile``'s arguments, those accelerate
    compiles the model ``Trainer`` prepares with (the nodes are not prepared), or None for none,
    and whether by regions (``accelerate launch --dynamo_use_regional_compilation``, accelerate >=
    1.7). The plugin holds ``torch_compile`` / ``torch_compile_backend`` / ``torch_compile_mode`` or,
    without them, the launcher's ``--dynamo_backend`` and its options."""
    if plugin is None or plugin.backend == DynamoBackend.NO:
        return None, False
    return plugin.to_kwargs(), bool(getattr(plugin, "use_regional_compilation", False))


def compile_in_place(module: torch.nn.Module, compile_kwargs: dict, regions: bool) -> None:
    """``module.compile(**compile_kwargs)`` (in place: parameter names stay, for checkpoints and
    averaging). ``regions``: as accelerate's ``compile_regions`` (``accelerate launch
    --dynamo_use_regional_compilation``), each block of a stack of same-class blocks (a ``ModuleList``)
    compiled alone, every child holding no stack compiled whole, the modules around them not."""

    def is_stack(m: torch.nn.Module) -> bool:
        return isinstance(m, torch.nn.ModuleList) and len(m) > 0 and all(type(b) is type(m[0]) for b in m)

    if not regions or not any(is_stack(m) for m in module.modules()):
        module.compile(**compile_kwargs)
    elif is_stack(module):
        for block in module:
            block.compile(**compile_kwargs)
    else:
        for child in module.children():
            compile_in_place(child, compile_kwargs, regions)


class DecentralizedTrainer(NodeDataMixin, OptimizerMixin, LocalStepMixin, EvaluationMixin, CheckpointMixin, Trainer):
    """Decentralized training of ``num_nodes`` replicas of ``model`` (SPEC 1-2).

    Args:
        model: the initial model; every node starts from a copy of its weights. It becomes
            ``trainer.model`` (the object itself, as `Trainer` trains the model it is given): with
            ``args.low_precision`` it is quantized in place (``quantize_model``) unless it already
            has 8-bit layers, and after training (and at every evaluation) it holds the *averaged*
            de-biased model ``mean_i z_i``, the evaluation model of SPEC 1. Pass
            ``copy.deepcopy(model)`` to keep the float model.
        args: :class:`DecentralizedTrainingArguments`.
        train_dataset: the full training set (a map-style dataset); it is split into ``num_nodes``
            shards with :func:`~lp_decentral_nlp.data.skewed_partition`, skewed on
            ``args.shard_column`` (default ``label``, else ``labels``; random shards when
            ``skew=0`` and there is no class column).
        quant_config: 8-bit surgery applied to every node; needs ``args.low_precision`` (default
            ``QuantConfig(kernel=args.quant_kernel)``).
        Other arguments are those of `transformers.Trainer` (``compute_metrics``,
        ``preprocess_logits_for_metrics``, ``compute_loss_func``, ``optimizer_cls_and_kwargs``,
        callbacks, collator, processing class); ``model_init`` and ``optimizers`` are refused.
        A subclass may override ``compute_loss``, ``prediction_step``, ``create_optimizer`` (called
        once per node with that node's model) and ``create_scheduler``; overriding a method of
        :data:`UNCALLED_TRAINER_METHODS` is refused.

    Attributes (per local node, aligned with ``node_ids``): ``nodes`` (the models z_i),
    ``bytes_sent`` (int64, bytes put on the wire), ``nonfinite_skips`` (int64, steps skipped under
    ``skip_nonfinite``), ``overflow_skips`` (int64, float16 steps skipped by the loss scaler),
    ``lost_messages`` and ``absent_steps`` (int64, under the fault plan: :meth:`fault_counts`), and
    after ``train()`` starts, ``node_optimizers``, ``node_schedulers`` and ``node_scalers``
    (``torch.amp.GradScaler`` per node with float16 mixed precision, else None).
    ``node_group`` (:class:`~.node_group.NodeGroup`) holds the backend. ``resumed_from``: the
    checkpoint folder and step the last ``train()`` resumed from (``(path, step)``), else None.
    ``stopped_by_sigterm``: whether the last ``train()`` ended early on SIGTERM (``enable_jit_checkpoint``), after writing
    a checkpoint at its last step. ``log_sigterm_stop`` (class attribute, True): whether that stop
    is logged as a warning naming the checkpoint to resume from (the recipes set it False on their
    trainer and print a line naming their flag instead).
    """

    log_sigterm_stop = True

    def __init__(self, model=None, args: DecentralizedTrainingArguments | None = None, *, quant_config=None, **kwargs):
        if args is None:  # as Trainer: the default arguments, writing to tmp_trainer
            args = DecentralizedTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, DecentralizedTrainingArguments):
            raise TypeError(f"args must be DecentralizedTrainingArguments, got {type(args).__name__}"
                            + _arguments_advice(args))
        if model is None:
            raise ValueError("model is required (model_init is not supported by DecentralizedTrainer)")
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init is not supported by DecentralizedTrainer: pass the initial model as model")
        check_trainer_inputs(model, quant_config, kwargs)
        if isinstance(kwargs.get("callbacks"), tuple):  # Trainer adds a list to it
            kwargs["callbacks"] = list(kwargs["callbacks"])
        if any(o is not None for o in kwargs.get("optimizers") or ()):
            raise ValueError("optimizers is not supported by DecentralizedTrainer: every node builds its own optimizer "
                             "and schedule from args (optim, learning_rate, lr_scheduler_type, ...) or "
                             "optimizer_cls_and_kwargs")
        for name, instead in UNCALLED_TRAINER_METHODS.items():
            if getattr(type(self), name) is not getattr(DecentralizedTrainer, name):
                raise TypeError(f"{type(self).__name__} overrides {name}(), which DecentralizedTrainer never calls: "
                                f"{instead}")
        try:
            inspect.signature(self.create_optimizer).bind(model)
        except TypeError:
            raise TypeError(f"{type(self).__name__}.create_optimizer() must take the model to build the optimizer for: "
                            f"DecentralizedTrainer calls create_optimizer(model) once per node") from None
        check_model_precision(model, args, quant_config)
        if args.neftune_noise_alpha is not None and input_embeddings(model) is None:
            raise ValueError(f"neftune_noise_alpha={args.neftune_noise_alpha} adds noise to the model's input "
                             f"embeddings, and {type(model).__name__} has none (get_input_embeddings()): leave it None")
        images = getattr(model, "main_input_name", None) == "pixel_values"
        if args.include_num_input_tokens_seen == "non_padding" and images:
            raise ValueError("include_num_input_tokens_seen='non_padding' counts the input tokens that are not "
                             "padding, and the model's main input pixel_values (images) has no padding: use 'all' "
                             "(every pixel value) or 'no'")
        if args.activation_checkpointing and not hasattr(model, "activation_checkpointing_enable"):
            raise ValueError(f"activation_checkpointing (gradient_checkpointing) needs a model with "
                             f"activation_checkpointing_enable() (a transformers PreTrainedModel), got "
                             f"{type(model).__name__}")
        train_dataset = kwargs.get("train_dataset")
        _check_best_metric_name(args, kwargs.get("eval_dataset"), kwargs.get("compute_metrics"))
        if kwargs.get("compute_metrics") is None:  # both shape only what compute_metrics receives (as in Trainer)
            for name, value in (("include_for_metrics", args.include_for_metrics),
                                ("batch_eval_metrics", args.batch_eval_metrics)):
                if value:
                    raise ValueError(f"{name}={value!r} is a setting of compute_metrics, and none was given: pass "
                                     f"compute_metrics, or leave {name} at its default")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("model has no trainable parameter (requires_grad=True): nothing to train or gossip")
        check_trained_dtype(model, args)
        # everything that can refuse the inputs (Trainer's own checks included) runs before the surgery
        # changes the user's model
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            refuse_settings_a_given_optimizer_ignores(args, model, kwargs["optimizer_cls_and_kwargs"])
        if args.qgm:
            check_qgm_optimizer(args, model, kwargs.get("optimizer_cls_and_kwargs"))
        node_group = NodeGroup(args.num_nodes, args.backend)
        num_classes = _class_count(model)  # the bound of the labels of every data set (None: not a classifier)
        _check_label_smoothing(args, model, num_classes)
        shard_labels = None if train_dataset is None else read_shard_labels(train_dataset, args, num_classes)
        collator_given = kwargs.get("data_collator") is not None
        check_columns(train_dataset, model, args, "train_dataset", collator_given)
        eval_dataset = kwargs.get("eval_dataset")  # checked now, not at the first evaluation after training began
        for what, part in eval_sets(eval_dataset):
            check_labels(part, num_classes, what)
            check_columns(part, model, args, what, collator_given)
        _check_processes_agree(node_group, args, model, quant_config, kwargs.get("optimizer_cls_and_kwargs"),
                               train_dataset, eval_dataset)
        sigterm_handler = signal.getsignal(signal.SIGTERM)
        with _config_while_trainer_is_built(model, args.label_smoothing_factor != 0):
            super().__init__(model=model, args=args, **kwargs)
        if args.label_names is None and self.compute_loss_func is not None and not self.label_names:
            # the labels compute_loss_func is given, which a forward without label arguments does not name: Trainer's
            # evaluation then passed them to forward (a TypeError) instead of to the function
            self.label_names = ["labels"]
        if args.low_precision and not any(isinstance(m, QuantModule) for m in model.modules()):
            config = quant_config or QuantConfig(kernel=args.quant_kernel)
            try:
                quantize_model(model, config)
            except ValueError:
                plan = quantize_model(model, config, dry_run=True)  # (a refusal changed nothing)
                if quant_config is None and not plan.quantized:  # the user called no quantize_model: name the setting
                    raise ValueError(f"low_precision=True (its default) trains every node in 8-bit, and quantize_model "
                                     f"finds {'; '.join(plan.problems)}: pass low_precision=False to train in full "
                                     "precision") from None
                raise
        set_verbosity(args.get_process_log_level())  # ours, as Trainer set transformers' from log_level
        if args.enable_jit_checkpoint:  # Trainer's own JIT checkpointing, from construction on: ours is train()'s
            self.pop_callback(JITCheckpointCallback)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if sigterm_handler is None else sigterm_handler)
        # read now: TrainingArguments built after this one (as the recipes do) reset accelerate's shared state
        self._compile_kwargs, self._compile_regions = node_compile_settings(self.accelerator.state.dynamo_plugin)
        # the labels a causal LM's loss averages over skip each row's first (the loss shifts them):
        # Trainer's rule for its num_items_in_batch (_loss_shifts_labels, from the model's loss_type)
        # misses causal-LM classes whose loss_type is unset, e.g. GPT-2, whose eval_loss read ~10% low;
        # a subclass of one (a user's own GPT2LMHeadModel) computes the same loss, as does one PEFT wraps
        inspected = unwrap_peft_model(model)
        self._loss_shifts_labels = bool(getattr(self, "_loss_shifts_labels", False)) or (
            any(cls.__name__ in CAUSAL_LM_CLASSES for cls in type(inspected).__mro__)
            and not getattr(inspected.config, "is_encoder_decoder", False))
        self._shard_labels, self.node_group = shard_labels, node_group
        self._num_classes = num_classes  # for a set given to evaluate() or predict()
        self.node_ids = self.node_group.node_ids
        # SPEC 1: every node starts from the same weights (process 0's)
        self.node_group.broadcast_(list(self.model.parameters()) + list(self.model.buffers()))
        self.nodes = [copy.deepcopy(self.model) for _ in self.node_ids]
        if DebugOption.UNDERFLOW_OVERFLOW in args.debug:  # as Trainer hooks its model (for good: no handles)
            for node in self.nodes:
                DebugUnderflowOverflow(node)
        self._average_is_current = True  # self.model is the nodes' average (they are its copies)
        # z_i of every local node, as the gossip engine updates them in place: the trained parameters
        # (a frozen one, e.g. a LoRA model's base, is equal on every node and never changes)
        self.node_params = [gossiped_parameters(node) for node in self.nodes]
        self.gossip = build_gossip(args.gossip_config, self.node_group.transport(args.gossip_timeout),
                                   self.node_params[0] if args.gossip_reference == "initial" else None)
        # the engine as built (step 0, push-sum weights 1; no buffer exists before its first step): each
        # train() starts it there again, so its step is the run's (the fault plan's and the seeds')
        self._gossip_start = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.gossip.state_dict().items()}
        self.qgm = None  # with args.qgm, built by train() from the nodes' optimizers (:meth:`_build_qgm`)
        self._zero_counters()
        self._eval_loaders = {}  # get_eval_dataloader's, by set name, kept with dataloader_persistent_workers
        self._input_tokens = 0  # this process's, not yet in state.num_input_tokens_seen (include_num_input_tokens_seen)
        self._step_lr = None  # the LR node 0's last step ran at, which the logs report (Trainer's: before the update)
        self._flos_per_token = None  # Trainer's flos of one token of the main input (floating_point_ops)
        plan = args.fault_plan
        self.fault_plan = plan if plan.active else None
        self.resumed_from = None  # (checkpoint folder, step) once train() resumes
        #: with load_best_model_at_end, the checkpoint train() loaded at its end: {"step", "checkpoint", <metric>: value}
        self.best_model_loaded = None
        self.stopped_by_sigterm = False  # the last train() ended early on SIGTERM
        self._output_form_checked = False  # a model's output form, checked at its first forward here
        self.cpu_malloc_tuned = False  # the last train() applied the malloc policy (tune_cpu_malloc)
        self._rng = NodeRNG(args.seed, self.node_ids)
        self._mark_main_process()

    # --- setup -----------------------------------------------------------------------------

    # --- training ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """Train every node in lock-step: local step on each node, then one gossip step (SPEC 2).

        Args:
            resume_from_checkpoint: a ``checkpoint-<step>`` directory written by this trainer, a
                directory holding such checkpoints (its latest complete one is used), or True
                (the latest in ``args.output_dir``). None uses ``args.resume_from_checkpoint``;
                False starts afresh. The run continues exactly where the checkpoint was taken:
                the same final weights, bytes and metrics as a run that never stopped (identical
                in the simulated backend) as long as the arguments that shape the run are the
                same (checked: nodes, graph, algorithm, compression, precision, QGM, skew, shard
                column, seed and data_seed, batch size, gradient accumulation, training set and rows, optimizer
                and its settings, learning rate and schedule, warmup, gradient clipping, label
                smoothing, the 8-bit layers' ``QuantConfig``; not checked: their kernel). Random
                data transforms and collators repeat too: each batch is read under a seed of
                its own (seed, node, epoch, batch), in dataloader workers as in the main process.
            trial: must be None: hyperparameter search needs ``model_init``, which is refused.
            ignore_keys_for_eval: as in `Trainer`.
        """
        if trial is not None:
            raise ValueError("trial is for Trainer.hyperparameter_search, which needs model_init; DecentralizedTrainer "
                             "builds its nodes from model and does not run it: leave trial=None")
        args = self.args
        self._memory_tracker.start()  # Trainer's: train_mem_* metrics with skip_memory_metrics=False, else nothing
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        if resume_from_checkpoint is True:
            resume_from_checkpoint = args.output_dir
        # the one process-wide setting the trainer changes (lp_decentral_nlp.utils.cpu_malloc)
        self.cpu_malloc_tuned = tune_process_for_training(args.device, args.tune_cpu_malloc)
        loaders = self.node_dataloaders()
        steps_per_epoch = self.steps_per_epoch()
        max_steps = self.total_steps()
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        self.check_absences()
        self.check_lr_milestones()
        made = [self._make_optimizer_and_scheduler(node, max_steps, steps_per_epoch) for node in self.nodes]
        self.node_optimizers = [optimizer for optimizer, _ in made]
        self.node_schedulers = [scheduler for _, scheduler in made]
        # float16 gradients underflow without loss scaling; each node scales its own loss (SPEC 2 step 1)
        self.node_scalers = ([torch.amp.GradScaler(args.device.type) for _ in self.nodes]
                             if args.mixed_precision == "fp16" else None)
        if args.mixed_precision == "fp16" and args.device.type == "cpu" and self.is_world_process_zero():
            # honoured, unlike Trainer on the CPU
            logger.warning("fp16 on the CPU: few CPUs multiply float16 in hardware, so float16 autocast is usually "
                           "several times slower than float32 there; bf16 is the CPU's mixed precision")
        self.qgm = self._build_qgm() if args.qgm else None
        for node in self.nodes:
            self._enable_checkpointing(node)
            if self._compile_kwargs is not None:
                compile_in_place(node, self._compile_kwargs, self._compile_regions)

        self.state = self._new_trainer_state()
        # a run starts from clean gradients, counters and gossip state, as Trainer's from clean gradients (a
        # train() stopped mid-step, by an error or KeyboardInterrupt, leaves a node's gradient; a checkpoint
        # restores the rest)
        for node in self.nodes:
            node.zero_grad(set_to_none=True)
        self._zero_counters()
        self.gossip.load_state_dict(self._gossip_start)
        self._loss_sum = torch.zeros(len(self.nodes), device=args.device)  # per local node, since the last log
        self._input_tokens, self.current_flos = 0, 0.0  # this process's, not yet in self.state
        self._loss_count = torch.zeros(len(self.nodes), dtype=torch.int64)  # steps in _loss_sum, per local node
        self._grad_norm = torch.full((len(self.nodes),), torch.nan, device=args.device)  # last step's, per local node
        # the steps of the windows with a finite loss, and their loss summed over those steps (train_loss)
        self._last_logged, self._total_loss, self._loss_steps = 0, 0.0, 0
        self._drift_trail, self._drift_peak, self._drift_warned = [], 0.0, False
        epoch, done = 0, 0  # position in the data: epoch, optimizer steps of it taken
        self.resumed_from, self.best_model_loaded = None, None
        if resume_from_checkpoint:
            epoch, done = self._load_checkpoint(resume_from_checkpoint, steps_per_epoch, max_steps)
        self._data_position = (epoch, done)
        self._mark_main_process()
        if resume_from_checkpoint:
            self._continue_schedules_over(self.state.max_steps, max_steps)  # the checkpoint's total
        self.state.max_steps, self.state.num_train_epochs = max_steps, num_epochs
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        self._steps_per_epoch = steps_per_epoch
        self.is_in_train = True
        start, first_step = time.time(), self.state.global_step
        # Trainer's: its training logs' train_tokens_per_second count this call's tokens over its time
        self._train_start, self._initial_num_input_tokens_seen = start, self.state.num_input_tokens_seen
        self._log_run_summary(steps_per_epoch)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        # Trainer's NEFTune hook on each node's input embeddings: noise in training only, drawn in
        # the node's RNG stream (so the same in both backends and across a resume); removed after train()
        neftune = [activate_neftune(node, args.neftune_noise_alpha) for node in self.nodes
                   ] if args.neftune_noise_alpha is not None else []
        sigterm = SigtermWatch() if args.enable_jit_checkpoint else None
        self.stopped_by_sigterm, self._checkpoint_step = False, None
        with self._schedule_order_warning_hidden(), sigterm.installed() if sigterm else contextlib.nullcontext():
            try:
                while epoch < num_epochs and self.state.global_step < max_steps:
                    if done >= steps_per_epoch:
                        epoch, done = epoch + 1, 0
                        continue
                    self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
                    iterators = self._start_epoch(loaders, epoch, done * args.gradient_accumulation_steps)
                    while done < steps_per_epoch and self.state.global_step < max_steps:
                        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                        self._iteration(self._next_batches(iterators))
                        self.state.global_step += 1
                        if args.torch_empty_cache_steps and self.state.global_step % args.torch_empty_cache_steps == 0:
                            clear_device_cache()  # as Trainer: the allocator's cached blocks go back to the device
                        done += 1
                        self.state.epoch = epoch + done / steps_per_epoch
                        self._data_position = (epoch, done)
                        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                        self._maybe_log_save_evaluate(trial, ignore_keys_for_eval)
                        if sigterm is not None and sigterm.agreed(self.node_group):
                            self._checkpoint_and_stop()
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
                stragglers = dict(self.fault_plan.stragglers) if self.fault_plan else {}
                # peer None: NCCL cannot tell which of the step's peers (the slowest straggler is the likely one)
                delay = stragglers.get(exc.peer) if exc.peer is not None else max(stragglers.values(), default=None)
                if isinstance(exc, GossipTimeoutError) and delay:  # the fault injected, not a failure
                    who = "an injected straggler" if exc.peer is None else f"rank {exc.peer} is an injected straggler: it"
                    exc = type(exc)(f"{exc} ({who} waits {delay:g} s before each send, which with the rest of its "
                                    f"step exceeds gossip_timeout={args.gossip_timeout:g} s: raise gossip_timeout)",
                                    exc.peer)
                raise type(exc)(f"{exc} (in training step {self.state.global_step + 1}: the gossip engine counts its "
                                f"steps from 0). {self._resume_hint()}",
                                exc.peer) from exc
            finally:
                self.gossip.close()  # the engine's worker threads; a later train() starts them again
                for node, hook in zip(self.nodes, neftune):
                    deactivate_neftune(node, hook)
        if self._last_logged < self.state.global_step:  # the last window's loss, logged unless logging is off
            self._log_train(log=args.logging_strategy != IntervalStrategy.NO)
        if args.load_best_model_at_end:
            self._load_best_nodes()
        self._finish_current_push()  # Trainer's: a checkpoint upload (push_to_hub) still running ends first
        self._keep_only_best_checkpoint()
        if args.final_merge and not self.stopped_by_sigterm:  # after the last step, which a stopped run did not reach
            self.merge_nodes()
        self._refresh_average_model()
        self.is_in_train = False
        # as Trainer's, the mean over the steps, here those with a loss (NaN if none had: every node away or skipped)
        train_loss = self._total_loss / self._loss_steps if self._loss_steps else math.nan
        steps_run = self.state.global_step - first_step  # by this call (a resumed run's earlier steps excluded)
        # over all nodes
        samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_nodes
        self.store_flos()
        metrics = {**speed_metrics("train", start, num_samples=steps_run * samples_per_step, num_steps=steps_run),
                   "total_flos": self.state.total_flos, "train_loss": train_loss}
        self._memory_tracker.stop_and_update_metrics(metrics)
        self.log(metrics)  # adds the epoch, as Trainer's
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _zero_counters(self) -> None:
        """The per-node counters of the class docstring, at zero (int64, one entry per local node)."""
        for name in ("bytes_sent", "nonfinite_skips", "overflow_skips", "lost_messages", "absent_steps"):
            setattr(self, name, torch.zeros(len(self.node_ids), dtype=torch.int64))

    def total_steps(self) -> int:
        """Optimizer steps ``train()`` runs in all: ``max_steps`` if set, else ``num_train_epochs``
        of :meth:`steps_per_epoch`."""
        args = self.args
        return args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * self.steps_per_epoch())

    def check_lr_milestones(self) -> None:
        """ValueError for an ``lr_milestones`` epoch past the run's end (its decay would never
        happen), as :meth:`check_absences` refuses an absence after the run."""
        if not self.args.lr_milestones:
            return
        steps_per_epoch, max_steps = self.steps_per_epoch(), self.total_steps()
        late = [epoch for epoch, step in zip(self.args.lr_milestones, milestone_steps(self.args.lr_milestones,
                                                                                       steps_per_epoch))
                if step > max_steps]
        if late:
            raise ValueError(f"lr_milestones: epoch {late[0]:g} is past the run's end ({max_steps} steps, "
                             f"{max_steps / steps_per_epoch:g} epochs): its decay would never happen; drop it or move "
                             "it into the run")

    def check_absences(self, warn: bool = True) -> None:
        """ValueError for an absence (``absences``) that starts after the run's last iteration (it
        would change nothing), and for every node away at every iteration; with `warn`, a warning
        when every node is away at once (those iterations train and gossip nothing while the LR
        schedules advance), and one when faults that move the push-sum weights meet compressed
        messages (sparsified, QSGD or 8-bit) of the models themselves (``gossip_reference="zero"``).
        ``train()`` checks it first (a caller that checked earlier refuses without warning:
        ``warn=False``)."""
        plan = self.fault_plan
        if plan is None:
            return
        max_steps = self.total_steps()
        late = next(((node, start, end) for node, start, end in plan.absences if start >= max_steps), None)
        if late is not None:
            raise ValueError(f"absences: node {late[0]} away for iterations {late[1]} to {late[2] - 1}, and the run has "
                             f"{max_steps} steps (iterations 0 to {max_steps - 1}): it would change nothing; drop it "
                             "or move it into the run")
        away_0 = (t for node, start, end in plan.absences if node == 0 for t in range(start, min(end, max_steps)))
        everyone = sorted(t for t in away_0 if len(plan.absent(t)) == self.args.num_nodes)
        if len(everyone) == max_steps:
            raise ValueError(f"absences: every node is away at every one of the run's {max_steps} iterations: nothing "
                             "would train or gossip; leave some node present")
        if everyone and warn:
            logger.warning(f"absences: every node is away at {len(everyone)} of the {max_steps} iterations (from "
                           f"iteration {everyone[0]} to {everyone[-1]}): they train and gossip nothing, while the LR "
                           "schedules advance")
        args = self.args
        if warn and args.gossip_config.compresses and args.gossip_reference == "zero" and (
                plan.drop_prob > 0 or plan.absences):
            logger.warning("drop_prob/absences (--drop-prob, --leave) move the push-sum weights, and compressed "
                           "messages of the models themselves (gossip_reference='zero') then carry each weight's change "
                           "times the whole model, rounded or a fraction per step: a pretrained model's nodes drift "
                           "apart; gossip_reference='initial' (--gossip-reference initial) compresses what each node "
                           "changed since the start instead (docs/design.md, Faults)")

    def _log_run_summary(self, steps_per_epoch: int) -> None:
        """Trainer's "Running training" summary at info level (``log_level="info"``), with the
        decentralized setting: the nodes, their shards, the steps and the batch over all nodes."""
        if not logger.isEnabledFor(logging.INFO):
            return
        args, state, shards = self.args, self.state, [len(shard) for shard in self._shards()]
        faults = fault_settings(args, state.max_steps)
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
        logger.info("\n".join([
            "***** Running decentralized training *****",
            f"  Nodes = {args.num_nodes} ({args.backend} backend; {self.gossip.topology.name} graph of spectral gap "
            f"{self.gossip.topology.period_spectral_gap():.3g}, {args.algorithm}, compression {args.compression:g}%, "
            f"consensus step {args.gamma:g}"
            + ("; messages relative to the initial model)" if args.gossip_reference == "initial" else ")"),
            f"  Examples per node = {min(shards):,} to {max(shards):,} (label skew {args.skew:g})",
            f"  Num Epochs = {state.num_train_epochs:,} ({steps_per_epoch:,} optimization steps each)",
            f"  Batch size per node = {batch:,} ({args.per_device_train_batch_size:,} x "
            f"{args.gradient_accumulation_steps} accumulated); over all nodes = {batch * args.num_nodes:,}",
            f"  Total optimization steps = {state.max_steps:,} (from step {state.global_step:,})",
            f"  Precision = {'8-bit (SPEC 4)' if args.low_precision else 'float32'}",
            *([f"  Faults = {'; '.join(f'{k} {v}' for k, v in faults.items())}"] if faults else [])]))

    def get_train_dataloader(self):
        """Refused: there is no one training loader; each node has its own over its shard (`node_dataloaders`)."""
        raise NotImplementedError("DecentralizedTrainer has one training loader per node, over its shard: "
                                  "node_dataloaders()")

    def create_optimizer_and_scheduler(self, num_training_steps: int):
        """Refused: each node has its own optimizer and schedule, built by `train` (`node_optimizers`,
        `node_schedulers`) with `create_optimizer(model)` and `create_scheduler`."""
        raise NotImplementedError("DecentralizedTrainer builds one optimizer and schedule per node in train() "
                                  "(node_optimizers, node_schedulers), with create_optimizer(model) and create_scheduler()")

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """Where each node's forward and loss run, in training and evaluation (``Trainer`` enters it
        through ``compute_loss_context_manager``): with mixed precision (``args.bf16`` /
        ``args.fp16``, or ``accelerate launch --mixed_precision bf16|fp16``: ``args.mixed_precision``),
        ``torch.autocast`` to bfloat16 or float16 on the nodes' device (``args.device``), the mixed
        precision ``Trainer`` gets from the model accelerate prepares (the nodes are not prepared);
        otherwise nothing. Master weights, gradients, optimizer states and gossip stay float32, and
        the 8-bit layers keep their GEMMs in float32 (autocast is off inside them: a 16-bit product
        cannot hold the 8-bit grid exactly). float16 gradients are loss-scaled per node
        (:attr:`node_scalers`)."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.args.mixed_precision)
        if dtype is not None:
            return torch.autocast(self.args.device.type, dtype=dtype, cache_enabled=cache_enabled)
        return contextlib.nullcontext()

    def _checking_output_form(self, model) -> contextlib.AbstractContextManager:
        """Until one forward of a model of this trainer has returned, its forwards refuse an output
        ``Trainer`` would misread (:func:`~.inputs.refusing_misread_outputs`: a bare tensor, or a
        tuple when the model is given no labels); after that they run as they are (a model's output
        form does not change from call to call): a ``nullcontext``."""
        if self._output_form_checked:
            return contextlib.nullcontext()
        return self._first_forward_checked(model)

    @contextlib.contextmanager
    def _first_forward_checked(self, model):
        with refusing_misread_outputs(model, self.compute_loss_func is not None or self.label_smoother is not None):
            yield
        self._output_form_checked = True

    def hyperparameter_search(self, *args, **kwargs):
        """Refused: a search builds each trial's model with ``model_init``, which this trainer refuses."""
        raise NotImplementedError("hyperparameter_search needs model_init, which DecentralizedTrainer refuses (it builds "
                                  "its nodes from model): run one trainer per trial instead")

    def log_metrics(self, split, metrics) -> None:
        """Trainer's table of `metrics`, with consensus distances in four significant digits:
        transformers rounds floats to four decimals, and a converging run's ``1e-13`` read 0.0."""
        shown = {key: f"{value:.4g}" if key.endswith("consensus_distance") and isinstance(value, float) else value
                 for key, value in metrics.items()}
        super().log_metrics(split, shown)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, after adding the tokens the nodes read since the last log to
        ``state.num_input_tokens_seen`` (summed over the processes) when
        ``include_num_input_tokens_seen`` asks for it; Trainer then logs the total."""
        if self.args.include_num_input_tokens_seen != "no":
            self._collect_input_tokens()
        super().log(logs, start_time)

    def _maybe_log_save_evaluate(self, trial, ignore_keys_for_eval) -> None:
        """As `Trainer`'s: log, evaluate (stepping metric-driven LR schedules and tracking the best
        ``metric_for_best_model`` in ``state.best_metric``), then save (only a new best under ``save_strategy="best"``)."""
        if self.control.should_log:
            self._log_train()
        if self.control.should_evaluate:
            metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
            self._step_schedules_on_metric(metrics)
            new_best = self._determine_best_metric(metrics=metrics, trial=trial)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = new_best
        if self.control.should_save:
            self._save_checkpoint(self.model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _mark_main_process(self):
        """Only one process prints progress and writes logs (rank 0 in the distributed backend)."""
        main = self.node_group.is_main
        self.state.is_world_process_zero = self.state.is_local_process_zero = main

    def _enable_checkpointing(self, node) -> None:
        """``activation_checkpointing`` on `node`, as Trainer: ``every_n_layers`` and ``offload`` of
        ``activation_checkpointing_kwargs`` choose the layers and where their inputs live; the other
        keys go to ``torch.utils.checkpoint``. On the CPU the inputs are on the host already
        (transformers' offload would pin memory, which needs an accelerator)."""
        args = self.args
        if not args.activation_checkpointing:
            return
        checkpointing = dict(args.activation_checkpointing_kwargs or {})
        every_n_layers = checkpointing.pop("every_n_layers", 1)
        offload = checkpointing.pop("offload", False) and args.device.type != "cpu"
        node.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing or None,
                                             every_n_layers=every_n_layers, offload=offload)

    def cost_report(self, input_shape):
        """SPEC 7 cost of one iteration of one node of this run (compute, energy, memory, gossip bytes).
        Compute, energy and memory are those of one batch of ``per_device_train_batch_size``
        (``gradient_accumulation_steps`` of them make an optimizer step); the traffic per epoch is
        that of the :meth:`steps_per_epoch` gossip steps, one per optimizer step.

        Args:
            input_shape: one sample's shape without the batch dimension: ``(seq_len,)`` for token
                models, ``(C, H, W)`` for images.
        Returns:
            :class:`lp_decentral_nlp.cost.CostReport` (``.to_dict()`` for ``results.json``).
        Raises:
            ValueError: the smallest shard cannot fill one batch (as :meth:`train` does).
        """
        from ..cost import checkpointable_layers, estimate_cost

        optimizer = cost_optimizer(self.args, self.nodes[0], self.optimizer_cls_and_kwargs, warn=True)
        bs = self.args.per_device_train_batch_size
        # an epoch gossips once per optimizer step: its samples are read in those steps' batches
        samples_per_node = self.steps_per_epoch() * bs
        node = self.nodes[0]
        if self.args.activation_checkpointing and not any(m.gradient_checkpointing for m in checkpointable_layers(node)):
            node = copy.deepcopy(node)  # before train(), which enables it on the nodes: as train() will
            self._enable_checkpointing(node)
        return estimate_cost(node, input_shape, bs,
                             "int8" if self.args.low_precision else "fp32", optimizer=optimizer,
                             gossip=self.gossip, samples_per_node=samples_per_node)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the averaged model (HF format; an 8-bit one reloads with `load_quantized`).

        ``train()``, ``evaluate()`` and ``predict()`` leave ``self.model`` the nodes' average
        (as every rank computed it), so afterwards the main process may call this alone, as with
        Trainer under DDP. Once the nodes have moved since (a training step, a restored checkpoint),
        forming the average is a sum over every process: in the distributed backend every rank
        must then call it. With ``push_to_hub``, ``args.output_dir`` is then uploaded, as
        Trainer's ``push_to_hub()`` does (the averaged model and :meth:`create_model_card`'s card)."""
        if not self._average_is_current:
            self._refresh_average_model()
        output_dir = output_dir or self.args.output_dir
        if self.node_group.is_main:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            self._write_model(output_dir)
        if self.args.push_to_hub and not _internal_call:  # Trainer's push_to_hub (every process calls it)
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                          tasks=None, dataset_tags=None, dataset=None, dataset_args=None) -> None:
        """Trainer's draft model card of the averaged model, ``output_dir/README.md`` (the main
        process writes it), with the decentralized setting among its hyperparameters (nodes,
        graph, algorithm, compressor, consensus step, precision, QGM, skew, the batch over all
        nodes: :func:`~.model_card.decentralized_hyperparameters`) and the averaged model's
        evaluation results (the per-node ones stay in the logs). Arguments as in Trainer."""
        if not self.node_group.is_main:
            return
        write_model_card(self, self.args.output_dir, language=language, license=license, tags=tags,
                         model_name=model_name, finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                         dataset=dataset, dataset_args=dataset_args)
        if hasattr(self.model, "create_or_update_model_card"):  # a PEFT model adds its library and adapter
            self.model.create_or_update_model_card(self.args.output_dir)

    def _write_model(self, output_dir) -> None:
        """The averaged model via ``save_pretrained`` (a plain ``nn.Module``: its state dict as
        ``model.safetensors``), the processing class, and the training arguments as Trainer saves
        them (``training_args.bin``, read back with ``torch.load(..., weights_only=False)``)."""
        if hasattr(self.model, "save_pretrained"):
            with _transformers_progress_bars(not self.args.disable_tqdm):
                self.model.save_pretrained(output_dir)
        else:
            safetensors.torch.save_model(self.model, str(Path(output_dir) / "model.safetensors"))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, Path(output_dir) / TRAINING_ARGS_NAME)

    # --- checkpoints -------------------------------------------------------------------------


