"""Tasks, skewed (non-IID) shards and the offline accuracy metric."""
from pathlib import Path as _Path

from .partition import skewed_partition
from .saved import load_saved_dataset
from .tasks import (AG_NEWS_LABELS, SENTLEN_BINS, SENTLEN_LABELS, TASKS, build_sentlen, check_enough_rows, load_task,
                    sentence_length_class)

_ACCURACY_SCRIPT = _Path(__file__).with_name("accuracy.py")


def accuracy_metric():
    """The `evaluate` accuracy metric, loaded from a script shipped with the package (no hub)."""
    import evaluate

    return evaluate.load(str(_ACCURACY_SCRIPT))


__all__ = [
    "AG_NEWS_LABELS",
    "SENTLEN_BINS",
    "SENTLEN_LABELS",
    "TASKS",
    "accuracy_metric",
    "build_sentlen",
    "check_enough_rows",
    "load_saved_dataset",
    "load_task",
    "sentence_length_class",
    "skewed_partition",
]
