"""Decentralized training of Hugging Face models (SPEC 1-2): :class:`DecentralizedTrainer` and
:class:`DecentralizedTrainingArguments`. See ``docs/trainer.md`` for how every `TrainingArguments`
field is treated."""
from ..gossip.factory import COMPRESSORS, TOPOLOGIES
from ..gossip.step_size import ALGORITHMS
from .arguments import BACKENDS, PROCESS_LOCAL_FIELDS, DecentralizedTrainingArguments
from .callbacks import MetricsCSVCallback, OnTrainBeginCallback, TrainingKernelsCallback
from .checkpointing import CheckpointError, check_resumable, resume_config
from .local_step import NonFiniteError
from .model_card import fault_settings
from .node_group import CollectiveError, NodeGroup
from .optimizers import cost_optimizer
from .rng import EpochSampler, node_seed
from .trainer import UNCALLED_TRAINER_METHODS, DecentralizedTrainer, check_model_precision

__all__ = ["ALGORITHMS", "BACKENDS", "COMPRESSORS", "TOPOLOGIES", "CheckpointError", "CollectiveError", "DecentralizedTrainer",
           "DecentralizedTrainingArguments", "EpochSampler", "MetricsCSVCallback", "NodeGroup", "NonFiniteError",
           "OnTrainBeginCallback", "PROCESS_LOCAL_FIELDS", "check_resumable", "cost_optimizer", "fault_settings", "node_seed",
           "resume_config", "TrainingKernelsCallback", "UNCALLED_TRAINER_METHODS", "check_model_precision"]
