"""Each node's data (SPEC 6): the column its shards are skewed on, the shards, and one loader per
local node whose order is a pure function of ``(seed, epoch)`` (:class:`~.rng.EpochSampler`) and
whose batches are read under seeds of their own (:class:`~.rng.EpochBatchSampler`)."""
from __future__ import annotations

import hashlib
import inspect
import json
import reprlib
from collections.abc import Hashable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers.trainer_utils import unwrap_peft_model

from ..data import skewed_partition
from .rng import EpochBatchSampler, EpochSampler, node_seed, seeded_host_rngs


class SeededBatches(torch.utils.data.Dataset):
    """A node's shard of `dataset` (rows `indices`), read and collated a batch at a time under the
    batch's seed: the loader's items are the lists of ``(shard position, batch seed)`` of an
    :class:`~.rng.EpochBatchSampler`, and each comes out collated (``collate_fn``), so the loader's
    own collate function passes it on (:func:`collated`). Random transforms (``with_transform``)
    and collators draw from torch's CPU generator, ``random`` and NumPy seeded by the batch
    (:func:`~.rng.seeded_host_rngs`), the same in the main process and in any worker."""

    def __init__(self, dataset, indices: list[int], collate_fn):
        self.dataset, self.indices, self.collate_fn = dataset, indices, collate_fn

    def __len__(self) -> int:
        return len(self.indices)

    def __getitems__(self, batch: list[tuple[int, int]]):
        rows = [self.indices[i] for i, _ in batch]
        with seeded_host_rngs(batch[0][1]):
            samples = (self.dataset.__getitems__(rows) if hasattr(self.dataset, "__getitems__")
                       else [self.dataset[r] for r in rows])
            return self.collate_fn(samples)

    def __getitem__(self, item: tuple[int, int]):
        return self.__getitems__([item])


def collated(batch):
    """The loader's collate function over :class:`SeededBatches`: the batch comes collated."""
    return batch


class NodeDataMixin:
    """`DecentralizedTrainer`'s shards and per-node loaders."""

    def _shards(self) -> list:
        """SPEC 6 shards of the training set (indices per node, drawn with ``args.data_order_seed``),
        the same on every rank; random (skew 0) when the training set has no class column."""
        labels = self._shard_labels if self._shard_labels is not None else [0] * len(self.train_dataset)
        return skewed_partition(labels, self.args.num_nodes, self.args.skew, seed=self.args.data_order_seed)

    def _checked_shards(self) -> list:
        """:meth:`_shards`, refused (ValueError) when the smallest cannot fill one batch of
        ``per_device_train_batch_size`` (its loader drops the last incomplete batch: no step)."""
        shards = self._shards()
        bs, smallest = self.args.per_device_train_batch_size, min(len(s) for s in shards)
        if smallest < bs:
            raise ValueError(f"per_device_train_batch_size={bs} exceeds the smallest shard ({smallest} samples): lower "
                             "the batch size or the number of nodes")
        return shards

    def _loader_options(self, dataset, description: str) -> dict:
        """DataLoader options for ``dataset`` from ``args``: the dataset without the columns the
        model's forward does not take (``remove_unused_columns``: a ``datasets.Dataset`` drops
        them, any other dataset's samples lose those keys in the collator, as in `Trainer`),
        workers, pinned memory on an accelerator."""
        args = self.args
        if isinstance(dataset, Dataset):
            dataset, collate_fn = self._remove_unused_columns(dataset, description=description), self.data_collator
        else:
            collate_fn = self._get_collator_with_removed_columns(self.data_collator, description=description)
        options = {"dataset": dataset, "collate_fn": collate_fn, "num_workers": args.dataloader_num_workers,
                   "pin_memory": args.dataloader_pin_memory and args.device.type != "cpu"}
        if args.dataloader_num_workers > 0:
            options.update(persistent_workers=args.dataloader_persistent_workers,
                           prefetch_factor=args.dataloader_prefetch_factor,
                           multiprocessing_context=args.dataloader_multiprocessing_context)
        return options

    def node_dataloaders(self) -> list[DataLoader]:
        """One loader per local node over its skewed shard, shuffled by an :class:`EpochSampler`
        of its own (``loader.batch_sampler.sampler.set_epoch(epoch, start)`` picks the epoch and
        position), each batch read under its own seed (:class:`SeededBatches`)."""
        if self.train_dataset is None:
            raise ValueError("DecentralizedTrainer.train() needs a train_dataset")
        shards = self._checked_shards()
        options = self._loader_options(self.train_dataset, "training")
        dataset, collate_fn = options.pop("dataset"), options.pop("collate_fn")
        bs = self.args.per_device_train_batch_size
        loaders = []
        for i in self.node_ids:
            shard = SeededBatches(dataset, shards[i].tolist(), collate_fn)
            batches = EpochBatchSampler(EpochSampler(len(shard), node_seed(self.args.data_order_seed, i)), bs)
            # the loader's own generator seeds worker processes (the batches bring their own seeds):
            # without one, starting the workers would draw from torch's global generator
            loaders.append(DataLoader(shard, batch_sampler=batches, collate_fn=collated, generator=torch.Generator(),
                                      **options))
        return loaders

    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch of training: every node steps in lock-step (SPEC 2), so the
        smallest shard's full batches of ``per_device_train_batch_size`` (its last incomplete batch
        is dropped), over ``gradient_accumulation_steps`` (leftover micro-batches are dropped too).
        An epoch of ``lr_milestones`` or ``num_train_epochs`` is this many steps. ValueError when
        the smallest shard cannot fill one batch, or holds fewer batches than one step needs."""
        if self.train_dataset is None:
            raise ValueError("DecentralizedTrainer needs a train_dataset to count its steps per epoch")
        accumulation = self.args.gradient_accumulation_steps
        batches = min(len(s) for s in self._checked_shards()) // self.args.per_device_train_batch_size
        if batches < accumulation:
            raise ValueError(f"gradient_accumulation_steps={accumulation} exceeds the batches per epoch of the smallest "
                             f"shard ({batches}): lower it, the batch size or the number of nodes")
        return batches // accumulation

    @staticmethod
    def _start_epoch(loaders, epoch: int, batches_done: int) -> list:
        """Iterators over epoch ``epoch`` of every loader, from batch ``batches_done`` on."""
        for loader in loaders:
            batches = loader.batch_sampler
            batches.sampler.set_epoch(epoch, batches_done * batches.batch_size)
            loader.generator.manual_seed(batches.sampler.epoch_seed())
        return [iter(loader) for loader in loaders]

    def _next_batches(self, iterators) -> list[list]:
        """The next ``gradient_accumulation_steps`` micro-batches of every local node (each read
        under its own seed: :class:`SeededBatches`)."""
        return [[next(it) for _ in range(self.args.gradient_accumulation_steps)] for it in iterators]


def read_shard_labels(dataset, args, num_labels: int | None) -> list[int] | None:
    """The class id of every training sample that the SPEC 6 shards are skewed on, read from
    ``args.shard_column`` (default: ``label``, else ``labels`` when it holds one class id per
    sample; a ``shard_column`` of category names gives their ids in sorted order); None when there
    is no such column (then ``skew`` must be 0: random shards).
    ``num_labels``: the model's number of classes, the bound of the ``label``/``labels`` ids.
    ValueError naming the column or argument that is wrong."""
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty")
    if len(dataset) < args.num_nodes:
        raise ValueError(f"train_dataset has {len(dataset)} rows, fewer than num_nodes={args.num_nodes}: every node "
                         "trains on a shard of its own (spec 6)")
    check_labels(dataset, num_labels, "train_dataset")  # whatever the shards are skewed on
    # the stored rows: no formatting transform (e.g. image decoding, or with_transform's label -> labels)
    stored = dataset.with_format(None) if hasattr(dataset, "with_format") else dataset
    first = stored[0]
    columns = list(dataset.column_names) if hasattr(dataset, "column_names") else \
        (list(first) if isinstance(first, dict) else [])
    name = args.shard_column
    if name is None:
        name = next((c for c in ("label", "labels") if c in columns and _is_class_id(first[c])), None)
    elif name not in columns:
        raise ValueError(f"shard_column={name!r} is not a column of train_dataset (columns: {columns})")
    if name is None:
        if args.skew > 0:
            present = [c for c in ("label", "labels") if c in columns]
            found = (f"its {present[0]!r} column holds {first[present[0]]!r} ({type(first[present[0]]).__name__}), "
                     "not one integer class id per sample" if present else
                     f"train_dataset has no 'label' or 'labels' column (columns: {columns})")
            raise ValueError(f"skew={args.skew} needs a column of class ids to skew the shards on, and {found}: name "
                             "one with shard_column, or use skew=0")
        return None
    values = stored[name] if hasattr(dataset, "with_format") else [dataset[i][name] for i in range(len(dataset))]
    values = [int(v) if torch.is_tensor(v) and v.dim() == 0 else v for v in values]
    what = "labels" if name in ("label", "labels") else f"shard_column {name!r}"
    missing = next((row for row, value in enumerate(values) if value is None), None)
    if missing is not None:
        raise ValueError(f"train_dataset: {what} has no value (None) at row {missing}: every sample needs one to be "
                         "sharded on")
    if what != "labels" and values and all(isinstance(v, str) for v in values):  # category names: ids in sorted order
        ids = {category: i for i, category in enumerate(sorted(set(values)))}
        return [ids[v] for v in values]
    unhashable = next((v for v in values if not isinstance(v, Hashable)), None)
    if unhashable is not None:  # e.g. token classification's per-token labels
        raise ValueError(f"train_dataset: {what} holds {type(unhashable).__name__}s such as {reprlib.repr(unhashable)}, "
                         "not one integer class id per sample: name a column of class ids with shard_column"
                         + (", or use skew=0" if args.skew > 0 else " (or leave it unset: skew=0 splits at random)"))
    num_labels = num_labels if name in ("label", "labels") and num_labels and num_labels > 1 else None
    bad = sorted({v for v in values if not _is_class_id(v) or v < 0 or (num_labels and v >= num_labels)}, key=repr)
    if bad:
        allowed = (f"class ids 0..{num_labels - 1} (the model has num_labels={num_labels})" if num_labels
                   else "integer class ids >= 0" + ("" if what == "labels" else " or category names (strings)"))
        raise ValueError(f"train_dataset: {what} must be {allowed}, found {bad[:5]}")
    return values


def check_columns(dataset, model, args, what: str, collator_given: bool) -> None:
    """ValueError, before training, when the batches of ``dataset`` (a ``datasets.Dataset``) cannot
    hold what the model's ``forward`` needs; ``what`` names the argument:

    - it makes its samples with a transform (``with_transform``, ``set_transform``: e.g. the vision
      images' :func:`~lp_decentral_nlp.vision.with_vision_transforms`) and ``remove_unused_columns``
      would drop, before the transform runs, columns ``forward`` does not take (the transform reads
      them: a KeyError at the first batch, as in Trainer);
    - it has no transform, the user passed no ``data_collator`` (``collator_given``), and it lacks
      an argument ``forward`` requires (one without a default, e.g. `ImageClassifier`'s
      ``pixel_values`` beside a column of PIL images), which Trainer's default collators do not
      make (they pad, and rename ``label``/``label_ids`` to ``labels``): a TypeError in
      ``forward`` at the first step, as in Trainer."""
    if not isinstance(dataset, Dataset):
        return
    parameters = inspect.signature(unwrap_peft_model(model).forward).parameters
    takes = set(parameters) | {"label", "label_ids", *(args.label_names or ())}
    if dataset.format["type"] == "custom":
        dropped = [column for column in dataset.column_names if column not in takes]
        if args.remove_unused_columns and dropped:
            raise ValueError(f"{what} makes its samples with a transform (with_transform/set_transform), and "
                             f"remove_unused_columns=True would drop {dropped} before it runs ({type(model).__name__}"
                             ".forward does not take them): pass remove_unused_columns=False")
        return
    batch_keys = set(dataset.column_names)
    if batch_keys & {"label", "label_ids"}:  # the collators rename them
        batch_keys.add("labels")
    required = [name for name, p in parameters.items() if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in batch_keys]
    if required and not collator_given:
        raise ValueError(f"{what} has no column {required[0]!r}, which {type(model).__name__}.forward requires "
                         f"(columns: {dataset.column_names}): make it with a transform (with_transform; for images "
                         "lp_decentral_nlp.vision.with_vision_transforms), or pass a data_collator that makes it")


def check_labels(dataset, num_labels: int | None, what: str) -> None:
    """The labels of a data set for a classifier of ``num_labels`` classes: one class id per sample
    in ``label`` or ``labels`` (an integer in ``0..num_labels - 1``), or per token in ``labels`` (a
    tag id or -100, ignored); ValueError naming `what` (``train_dataset``, ``eval_dataset``, ...),
    the values found and the allowed ones, instead of an error deep in the loss at the first
    training step or evaluation (a float, bool or string label reaches the loss too: transformers
    reads a float as a multi-label target). Checked on a ``datasets.Dataset`` for a model of two
    classes or more (one: a regression head, whose labels are numbers); lists of floats
    (multi-label targets) are not class ids and pass."""
    if not num_labels or num_labels < 2 or not isinstance(dataset, Dataset) or len(dataset) == 0:
        return
    _check_tag_ids(dataset, num_labels, what)
    column = next((c for c in ("label", "labels") if c in dataset.column_names), None)
    if column is None:
        return
    values = [v for v in dataset.with_format(None)[column] if not isinstance(v, (list, tuple))]
    bad = sorted({v for v in values if not _is_class_id(v) or not 0 <= v < num_labels}, key=repr)
    if bad:
        raise ValueError(f"{what}: labels must be class ids 0..{num_labels - 1} (the model has num_labels="
                         f"{num_labels}), found {bad[:5]}")


def _check_tag_ids(dataset, num_labels: int, what: str) -> None:
    """Per-token labels (token classification: a list of tag ids per row in ``labels``) must be
    ids of the model's ``num_labels`` tags or -100 (ignored); ValueError naming `what`, the first
    other value and its row, instead of an IndexError in the first training step. Checked on a
    ``datasets.Dataset`` with integer lists (other labels are not tag ids)."""
    if "labels" not in dataset.column_names:
        return
    column = dataset.with_format("arrow")["labels"]
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_list(column.type) or not pa.types.is_integer(column.type.value_type):
        return
    values, rows = pc.list_flatten(column), pc.list_parent_indices(column)
    bad = pc.and_(pc.not_equal(values, -100), pc.or_(pc.less(values, 0), pc.greater_equal(values, num_labels)))
    if pc.any(bad).as_py():
        first = pc.indices_nonzero(bad)[0].as_py()
        raise ValueError(f"{what}: labels must be tag ids 0..{num_labels - 1} (the model has "
                         f"num_labels={num_labels}) or -100, found {values[first].as_py()} in row {rows[first].as_py()}")


def _is_class_id(value) -> bool:
    """Whether ``value`` is one integer class id (a Python/numpy int or a 0-d integer tensor)."""
    if torch.is_tensor(value):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def rows_digest(dataset, rows: int = 17) -> str | None:
    """A fingerprint of a ``datasets.Dataset``'s content: a SHA-256 (16 hex digits) of `rows` rows
    spread evenly over it, the last included, as stored (the format's transform not applied), so
    another data file, tokenizer or ``max_length`` gives another one. None for other datasets,
    whose rows may be drawn anew on every read."""
    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        return None
    n = len(dataset)
    indices = sorted({round(i * (n - 1) / (rows - 1)) for i in range(rows)})
    stored = dataset.with_format("arrow")[indices].to_pylist()
    return hashlib.sha256(json.dumps(stored, sort_keys=True, default=repr).encode()).hexdigest()[:16]
