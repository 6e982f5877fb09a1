"""The kinds of the objects `DecentralizedTrainer` is built with, checked before anything is built.

A wrong one (a class for the model, a name for the tokenizer or metric, one callback for a list,
a DatasetDict for a split) failed deep inside transformers or torch, some only after training: a
string ``processing_class`` at ``save_model``. Each is refused in one line naming the argument and
what it must be. The data sets' contents (labels, columns) are checked by :mod:`.node_data`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import IterableDataset
from transformers import TrainerCallback

from ..quant import QuantConfig

#: the trainer's arguments that are functions, or None
CALLABLE_ARGUMENTS = ("data_collator", "compute_metrics", "preprocess_logits_for_metrics", "compute_loss_func")


def check_trainer_inputs(model, quant_config, kwargs: dict) -> None:
    """ValueError naming the first of `model`, `quant_config` and the `Trainer` keyword arguments
    `kwargs` that is not of its kind: a ``torch.nn.Module`` instance; a ``QuantConfig`` or None;
    a ``processing_class`` that saves itself (``save_pretrained``); functions for
    :data:`CALLABLE_ARGUMENTS`; ``optimizer_cls_and_kwargs`` an (optimizer class, dict) pair;
    ``callbacks`` a list (or tuple) of ``TrainerCallback`` instances or classes; ``train_dataset``
    one map-style data set whose samples are dicts (unless a ``data_collator`` reads them);
    ``eval_dataset`` one data set (map-style or iterable), or a dict of them by name."""
    if not isinstance(model, nn.Module):
        built = " (a class: build it, e.g. Cls.from_pretrained(...) or Cls(config))" if isinstance(model, type) else ""
        raise ValueError(f"model must be a torch.nn.Module, got {_kind(model)}{built}")
    if quant_config is not None and not isinstance(quant_config, QuantConfig):
        raise ValueError(f"quant_config must be a QuantConfig or None, got {_kind(quant_config)}"
                         + (": QuantConfig(**quant_config)" if isinstance(quant_config, Mapping) else ""))
    processing_class = kwargs.get("processing_class")
    if processing_class is not None and not callable(getattr(processing_class, "save_pretrained", None)):
        raise ValueError(f"processing_class must be a tokenizer or processor (it is saved with the model: "
                         f"save_pretrained), got {_kind(processing_class)}"
                         + (": AutoTokenizer.from_pretrained(...)" if isinstance(processing_class, str) else ""))
    for name in CALLABLE_ARGUMENTS:
        if kwargs.get(name) is not None and not callable(kwargs[name]):
            raise ValueError(f"{name} must be a function or None, got {_kind(kwargs[name])}")
    pair = kwargs.get("optimizer_cls_and_kwargs")
    if pair is not None and not (isinstance(pair, (tuple, list)) and len(pair) == 2 and callable(pair[0])
                                 and isinstance(pair[1], Mapping)):
        raise ValueError(f"optimizer_cls_and_kwargs must be an (optimizer class, keyword arguments dict) pair, e.g. "
                         f"(torch.optim.SGD, {{'momentum': 0.9}}), got {_kind(pair)}")
    callbacks = kwargs.get("callbacks")
    if callbacks is not None:
        if not isinstance(callbacks, (list, tuple)):
            raise ValueError(f"callbacks must be a list of TrainerCallback instances or classes, got {_kind(callbacks)}"
                             + (": [callback]" if _is_callback(callbacks) else ""))
        odd = next((c for c in callbacks if not _is_callback(c)), None)
        if odd is not None:
            raise ValueError(f"callbacks must hold TrainerCallback instances or classes, got {_kind(odd)}")
    _check_train_dataset(kwargs.get("train_dataset"), kwargs.get("data_collator") is not None)
    _check_eval_dataset(kwargs.get("eval_dataset"))


def _check_train_dataset(dataset, collator_given: bool) -> None:
    """One map-style data set of known length (the SPEC 6 shards are index sets over it) whose
    samples the default collators read: dicts (or objects with attributes)."""
    if dataset is None:
        return
    if isinstance(dataset, dict):  # a DatasetDict: Trainer fails at the first batch with a KeyError
        raise ValueError(f"train_dataset must be one data set, got a {type(dataset).__name__} of splits "
                         f"{list(dataset)}: pass one of them, e.g. data['train']")
    _refuse_non_data_set(dataset, "train_dataset")
    if isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError("train_dataset must be map-style (a datasets.Dataset, or a torch Dataset with __len__ and "
                         "__getitem__): the SPEC 6 shards are index sets over a dataset of known length, got "
                         f"{_kind(dataset)}")
    if not collator_given and not hasattr(dataset, "column_names") and len(dataset):
        first = dataset[0]
        if not isinstance(first, Mapping) and not hasattr(first, "__dict__"):
            raise ValueError(f"train_dataset's samples must be dicts of the model's inputs (as a datasets.Dataset's "
                             f"rows, e.g. {{'input_ids': ..., 'labels': ...}}), got {_kind(first)} at index 0; or "
                             "pass a data_collator that batches them")


def eval_sets(eval_dataset) -> list[tuple[str, object]]:
    """``(how messages name it, data set)`` of each evaluation set of ``eval_dataset``: one data set
    (``"eval_dataset"``), or a dict of them by name (``"eval_dataset['name']"``); none for None.
    ValueError for an empty dict: it names no set, so evaluation would silently report nothing."""
    if eval_dataset is None:
        return []
    if not isinstance(eval_dataset, dict):
        return [("eval_dataset", eval_dataset)]
    if not eval_dataset:
        raise ValueError("eval_dataset is an empty dict: it names no evaluation set, so evaluate() would report "
                         "nothing; pass {name: dataset, ...}, one data set, or None for no evaluation")
    return [(f"eval_dataset[{name!r}]", part) for name, part in eval_dataset.items()]


def _check_eval_dataset(dataset) -> None:
    """None, one data set (map-style, or iterable: evaluation reads it once), or a dict of them by
    name (``str`` keys: metrics carry them)."""
    odd = next((name for name in dataset if not isinstance(name, str)), None) if isinstance(dataset, dict) else None
    if odd is not None:
        raise ValueError(f"eval_dataset's names must be strings (they prefix its metrics), got {odd!r}")
    for what, part in eval_sets(dataset):
        _refuse_non_data_set(part, what)
        if isinstance(part, dict) or not (hasattr(part, "__iter__") or hasattr(part, "__getitem__")):
            raise ValueError(f"{what} must be a data set (a datasets.Dataset, or a torch Dataset), got {_kind(part)}")


def _refuse_non_data_set(value, what: str) -> None:
    """ValueError for what is often passed where a data set goes: a path or text, a pandas frame."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{what} must be a data set, got a str: load it first (datasets.load_dataset, or "
                         "lp_decentral_nlp.data.load_task)")
    if type(value).__module__.startswith("pandas"):
        raise ValueError(f"{what} must be a data set, got a pandas {type(value).__name__}: pass "
                         "datasets.Dataset.from_pandas(df)")


def _is_callback(value) -> bool:
    return isinstance(value, TrainerCallback) or (isinstance(value, type) and issubclass(value, TrainerCallback))


def _kind(value) -> str:
    """``value``'s type, said as a user would write it (a class is named, not ``type``)."""
    return f"the class {value.__name__}" if isinstance(value, type) else type(value).__name__


@contextlib.contextmanager
def refusing_misread_outputs(model: nn.Module, labels_withheld: bool):
    """While open, every forward of `model` refuses an output Trainer would misread (ValueError):
    a bare tensor (a plain module's logits), whose first row Trainer reads as the loss, or as the
    only logits' row, or drops in evaluation (``outputs[1:]``); and, when `labels_withheld` (a
    ``compute_loss_func`` or label smoothing computes the loss: Trainer gives the model no labels),
    a tuple, whose first item evaluation reads as the loss."""

    def check(module, args, output):
        if torch.is_tensor(output):
            raise ValueError(f"{type(module).__name__} returned a bare tensor of shape {tuple(output.shape)}: Trainer "
                             "reads a dict's or ModelOutput's 'loss' and 'logits', or a tuple as (loss, logits, ...), "
                             "and would misread it; return a dict or ModelOutput, e.g. {'loss': ..., 'logits': ...} "
                             "(with compute_loss_func, which gets that output: {'logits': ...})")
        if labels_withheld and isinstance(output, (tuple, list)):
            raise ValueError(f"{type(module).__name__} returned a tuple, and with compute_loss_func or label smoothing "
                             "(the model is given no labels) evaluation would read its first item as the loss and the "
                             "rest as the logits: return a dict or ModelOutput (a transformers model: leave "
                             "config.return_dict True), e.g. {'logits': ...}")

    handle = model.register_forward_hook(check)
    try:
        yield
    finally:
        handle.remove()
