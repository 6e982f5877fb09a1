"""How :class:`DecentralizedTrainer` treats every field of `TrainingArguments` and of
:class:`DecentralizedTrainingArguments`: honoured, honoured per node, left to the script (the
``do_*`` fields, as in `Trainer`), or refused (with the reason).

A refused field keeps its default; any other value is a ValueError at construction naming the
field and the reason, so no setting is silently ignored. ``docs/trainer.md`` holds the table
:func:`field_table` generates from the dataclass (a test keeps the two equal).
"""
from __future__ import annotations

import dataclasses

from transformers.trainer_pt_utils import AcceleratorConfig

HONOURED = "honoured"
PER_NODE = "honoured per node"
_UNREAD_REFUSED = ("away from its default, refused with an optimizer that does not read it, e.g. sgd or adafactor, for "
                   "which transformers drops it)")
#: fields `Trainer` does not read either: the script that builds the trainer does (the recipes refuse them)
SCRIPT = "for the script that builds the trainer, which does not read it (nor does Trainer); the recipes refuse it"

#: what the trainer does with each field; ``"refused: <why>"`` entries must keep their default
POLICY: dict[str, str] = {
    # --- run and data -----------------------------------------------------------------------
    "output_dir": HONOURED,
    "num_train_epochs": HONOURED,
    "max_steps": HONOURED,
    "per_device_train_batch_size": PER_NODE,
    "per_device_eval_batch_size": HONOURED,
    "gradient_accumulation_steps": PER_NODE,
    "seed": HONOURED,
    "data_seed": HONOURED + " (when set, every node's shard, data order and batch seeds come from it instead of seed; "
                 "model initialisation, dropout and gossip randomness stay with seed)",
    "full_determinism": HONOURED,
    "use_cpu": HONOURED + " (set where the default device is an accelerator other than CUDA, e.g. MPS, with a "
                          "warning: the nodes run on CUDA or the CPU; and by the distributed backend on a machine "
                          "without an accelerator: the gloo process group it needs)",
    "local_rank": HONOURED,
    "do_train": SCRIPT,
    "do_eval": SCRIPT,
    "do_predict": SCRIPT,
    "resume_from_checkpoint": HONOURED + " (unlike Trainer, which leaves it to scripts: train() called without its "
                                         "own resume_from_checkpoint resumes from this one)",
    "remove_unused_columns": HONOURED + " (a dataset with a transform it would cut the columns of, or one lacking an "
                                        "argument the model's forward requires, is refused at construction)",
    "label_names": HONOURED + " (evaluate() refuses names its batches lack: Trainer would report no loss and no "
                              "metrics)",
    "dataloader_num_workers": HONOURED + " (each batch is read and collated under a seed of its own, so random "
                                         "transforms draw the same numbers with any number of workers and after a "
                                         "resume)",
    "dataloader_pin_memory": HONOURED,
    "dataloader_persistent_workers": HONOURED,
    "dataloader_prefetch_factor": HONOURED,
    "dataloader_multiprocessing_context": HONOURED,
    "dataloader_drop_last": HONOURED + " (the evaluation and test loaders drop their last partial batch; the training "
                            "shards always do: a node's epoch is whole batches)",
    "dataloader_in_order": "refused: each node's loader yields its shard in its epoch sampler's order",
    "train_sampling_strategy": "refused: each node shuffles its SPEC 6 shard with its own epoch sampler",
    "length_column_name": "refused: used only by length-grouped sampling, which train_sampling_strategy refuses",
    "ignore_data_skip": "refused: a resumed run continues at the checkpoint's exact batch (bit-identical resume)",
    "auto_find_batch_size": "refused: the batch size shapes the shards and the checkpoints of every node",
    # --- optimisation (each node has its own optimizer and schedule) ----------------------------
    "learning_rate": PER_NODE + " (in (0, 1e4]: 0, which Trainer accepts, would train nothing, and quasi-global "
                                "momentum divides by it)",
    "lr_scheduler_type": PER_NODE + " (reduce_lr_on_plateau and greedy step after each evaluation during training on "
                                    "the averaged model's metric_for_best_model, as in Trainer)",
    "lr_scheduler_kwargs": PER_NODE + " (refused with a constant schedule, which takes none)",
    "warmup_steps": PER_NODE + " (refused with a constant schedule and with reduce_lr_on_plateau or greedy, which "
                               "have no warm-up)",
    "optim": PER_NODE + " (LOMO, AdaLomo, schedule-free, GaLore and APOLLO are refused: they update inside backward, "
             "keep weights gossip does not average, or need optim_target_modules)",
    "optim_args": PER_NODE + " (an entry the optimizer does not read, which transformers drops, is refused)",
    "optim_target_modules": "refused: only the GaLore/APOLLO optimizers use it; they are not checked with gossip",
    "weight_decay": PER_NODE,
    "adam_beta1": PER_NODE + " (read by the Adam family and Lion; " + _UNREAD_REFUSED,
    "adam_beta2": PER_NODE + " (read by the Adam family and Lion; " + _UNREAD_REFUSED,
    "adam_epsilon": PER_NODE + " (read by the Adam family; " + _UNREAD_REFUSED,
    "max_grad_norm": PER_NODE + " (default 0: no clipping, as the paper trains; Trainer's default is 1.0)",
    "label_smoothing_factor": PER_NODE + " (refused for a regression or multi-label head, whose targets are not one "
                                         "class per sample)",
    "average_tokens_across_devices": "refused: a node's loss is normalised over its own (accumulated) batch; "
                                     "gradients and token counts never cross nodes",
    "activation_checkpointing": PER_NODE + " (in 8-bit too: the recomputed forward leaves the activation ranges "
                                           "alone)",
    "activation_checkpointing_kwargs": PER_NODE + " (refused without activation_checkpointing)",
    "gradient_checkpointing": PER_NODE + " (transformers' deprecated name of activation_checkpointing)",
    "gradient_checkpointing_kwargs": PER_NODE + " (deprecated name of activation_checkpointing_kwargs)",
    "torch_compile": PER_NODE,
    "torch_compile_backend": PER_NODE,
    "torch_compile_mode": PER_NODE,
    "neftune_noise_alpha": PER_NODE + " (Trainer's NEFTune hook on each node's input embeddings during train(); the "
                           "noise is drawn in the node's RNG stream)",
    "use_liger_kernel": "refused: Liger kernels patch the model class, which the 8-bit surgery also replaces",
    "liger_kernel_config": "refused: use_liger_kernel is refused",
    "use_cache": "refused: the nodes train without a key/value cache; as Trainer does, the model's config.use_cache "
                 "is set to False, and saved so (generate() caches through its generation_config)",
    "torch_empty_cache_steps": HONOURED,
    # --- precision and devices ---------------------------------------------------------------
    "bf16": PER_NODE + " (each node's forward and loss under torch.autocast to bfloat16, in training and "
            "evaluation; master weights, gradients, optimizer states and gossip stay float32, and 8-bit layers keep "
            "float32 GEMMs)",
    "fp16": PER_NODE + " (as bf16, to float16, with a torch.amp.GradScaler per node: a node whose unscaled gradient "
            "overflows skips that update and is counted in overflow_skips)",
    "bf16_full_eval": "refused: evaluation runs in the nodes' own precision",
    "fp16_full_eval": "refused: evaluation runs in the nodes' own precision",
    "tf32": HONOURED,
    "accelerator_config": "refused: the nodes are not prepared by accelerate (no DDP, no sharded loaders)",
    "parallelism_config": "refused: a node is one model on one device; decentralization is the parallelism",
    "ddp_find_unused_parameters": "refused: gradients never cross nodes: the model is never wrapped in DDP",
    "ddp_bucket_cap_mb": "refused: gradients never cross nodes: the model is never wrapped in DDP",
    "ddp_broadcast_buffers": "refused: gradients never cross nodes: the model is never wrapped in DDP",
    "ddp_static_graph": "refused: gradients never cross nodes: the model is never wrapped in DDP",
    "ddp_backend": "refused: backend='distributed' uses the process group the launcher initialised",
    "ddp_timeout": HONOURED + " (the timeout of the process group these arguments create: it bounds the waits outside "
                   "the gossip step, evaluation, logging, checkpoints, final merge; gossip_timeout bounds the gossip "
                   "step; refused with backend='simulated', which has no process group)",
    "fsdp": "refused: every node holds a whole model (no sharding)",
    "fsdp_config": "refused: every node holds a whole model (no sharding)",
    "deepspeed": "refused: every node holds a whole model and its own optimizer",
    "debug": HONOURED + " ('underflow_overflow': transformers' DebugUnderflowOverflow on every node, which stops "
             "at the first inf/nan activation and prints the frames before it; 'tpu_metrics_debug' is refused)",
    # --- logging -----------------------------------------------------------------------------
    "logging_strategy": HONOURED,
    "logging_steps": HONOURED + " (refused with a logging_strategy other than 'steps', which ignores it)",
    "logging_first_step": HONOURED,
    "logging_nan_inf_filter": "refused: must stay True: a non-finite loss never enters the logged loss (the run "
                              "stops naming the node, or skips it with skip_nonfinite)",
    "log_on_each_node": HONOURED,
    "log_level": HONOURED,
    "log_level_replica": HONOURED,
    "disable_tqdm": HONOURED,
    "report_to": HONOURED,
    "run_name": HONOURED,
    "project": HONOURED,
    "trackio_space_id": HONOURED,
    "trackio_bucket_id": HONOURED,
    "trackio_static_space_id": HONOURED,
    "include_num_input_tokens_seen": HONOURED + " (num_input_tokens_seen: the tokens every node read, summed)",
    "skip_memory_metrics": HONOURED + " (False: Trainer's *_mem_* metrics of train, evaluate and predict: this "
                           "process's memory, every local node together)",
    # --- evaluation --------------------------------------------------------------------------
    "eval_strategy": HONOURED,
    "eval_steps": HONOURED + " (refused with an eval_strategy other than 'steps', which ignores it)",
    "eval_delay": HONOURED + " (refused with eval_strategy='no')",
    "eval_on_start": HONOURED + " (not when resuming: the resumed run logs what an uninterrupted one does)",
    "prediction_loss_only": HONOURED,
    "eval_do_concat_batches": HONOURED,
    "eval_use_gather_object": "refused: every process evaluates the whole evaluation set; nothing is gathered",
    "eval_accumulation_steps": HONOURED,
    "include_for_metrics": HONOURED + " (refused without compute_metrics, the one reader)",
    "batch_eval_metrics": HONOURED + " (refused without compute_metrics, the one reader)",
    "metric_for_best_model": HONOURED + " (refused with eval_strategy='no')",
    "greater_is_better": HONOURED + " (refused with eval_strategy='no'; unset: False for consensus_distance, loss_node_<i> and bytes_sent_node_<i> too, "
                         "which Trainer's rule, greater is better unless the name ends in 'loss', would maximise)",
    "load_best_model_at_end": HONOURED,
    # --- saving ------------------------------------------------------------------------------
    "save_strategy": HONOURED,
    "save_steps": HONOURED + " (refused when set with a save_strategy other than 'steps', which ignores it)",
    "save_total_limit": HONOURED + " (refused with save_strategy='no')",
    "save_only_model": HONOURED + " (each node file holds that node's model alone: load_best_model_at_end works, "
                       "resuming from such a checkpoint is refused; refused with save_strategy='no')",
    "save_on_each_node": "refused: rank 0 writes the shared files; every rank writes its own node file",
    "enable_jit_checkpoint": HONOURED + " (SIGTERM to any process: every process writes a checkpoint at the end of "
                             "the same step, then training ends with stopped_by_sigterm=True)",
    "restore_callback_states_from_checkpoint": HONOURED,
    "push_to_hub": HONOURED + " (as Trainer: output_dir with the averaged model at every checkpoint, and with the "
                   "model card at save_model() and push_to_hub(); rank 0 uploads)",
    "hub_token": HONOURED,
    "hub_private_repo": HONOURED,
    "hub_model_id": HONOURED,
    "hub_strategy": HONOURED + " ('checkpoint' / 'all_checkpoints' upload the whole decentralized checkpoint: every "
                    "node file; refused without push_to_hub)",
    "hub_always_push": HONOURED + " (refused without push_to_hub)",
    "hub_revision": HONOURED,
}


def refuse_unsupported(args) -> None:
    """ValueError naming the first refused field of ``args`` that differs from its default."""
    for f in dataclasses.fields(args):
        reason = POLICY.get(f.name, "")
        if f.init and reason.startswith("refused") and not is_default(args, f.name):
            raise ValueError(f"{f.name}={getattr(args, f.name)!r} is not supported by DecentralizedTrainer "
                             f"({reason.removeprefix('refused: ')}); leave it at {field_default(args, f.name)!r}")


def field_default(args, name: str):
    """The default of field ``name`` of the dataclass ``args`` (its class or an instance)."""
    f = next(f for f in dataclasses.fields(args) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def is_default(args, name: str, value=dataclasses.MISSING) -> bool:
    """Whether field ``name`` of ``args`` (an instance, or its class with the `value` to judge)
    holds its default or the form `TrainingArguments.__post_init__` gives an unset default
    (``debug=''`` becomes ``[]``, ``accelerator_config=None`` an ``AcceleratorConfig()``), so a copy
    of processed arguments (``dataclasses.replace``) passes too."""
    value = getattr(args, name) if value is dataclasses.MISSING else value
    default = field_default(args, name)
    if value == default:
        return True
    if default in (None, "") and value in (None, "", [], {}):
        return True
    return default is None and isinstance(value, AcceleratorConfig) and value == AcceleratorConfig()


def field_table(args_class) -> str:
    """Markdown table of every field of ``args_class`` and how the trainer treats it (``POLICY``
    for `TrainingArguments` fields; the decentralized fields are honoured by construction)."""
    own = {f.name for f in dataclasses.fields(args_class)} - {f.name for f in dataclasses.fields(args_class.__mro__[1])}
    rows = ["| field | treatment |", "|---|---|"]
    for f in dataclasses.fields(args_class):
        if not f.init:
            continue
        treatment = POLICY.get(f.name) or ("honoured (decentralized setting)" if f.name in own else None)
        if treatment is None:
            raise KeyError(f"TrainingArguments field {f.name!r} has no entry in field_policy.POLICY")
        rows.append(f"| `{f.name}` | {treatment} |")
    return "\n".join(rows) + "\n"
