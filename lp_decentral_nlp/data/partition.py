"""Non-IID shards: the skew partition of SPEC section 6."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..checks import POSITIVE_INT, check_field, check_number


def skewed_partition(labels: Sequence[int], num_nodes: int, skew: float, seed: int = 0) -> list[np.ndarray]:
    """Split sample indices into ``num_nodes`` disjoint shards with a degree of label skew.

    Implements SPEC section 6: sort the samples by label (stable, so dataset order is kept within a
    class); from every class the first ``floor(skew * n_c)`` samples go to a *sorted pool* (label
    order) and the rest to a *random pool* shuffled with ``seed``. Node ``i`` receives the ``i``-th
    contiguous block of the sorted pool plus the ``i``-th block of the random pool. Every sample is
    used; a pool that does not divide evenly gives its extra samples to the first nodes (the sorted
    pool, as :func:`numpy.array_split`) or to the last ones (the random pool), so the shards differ
    in size by at most one: every shard holds at least ``N // num_nodes`` samples.

    Args:
        labels: label of every sample, length ``N``.
        num_nodes: number of shards ``n`` (>= 1, <= N).
        skew: degree of skew ``s`` in ``[0, 1]``; 0 is IID, 1 gives each node a few classes only.
        seed: seed of the random pool's shuffle; the same seed gives the same shards everywhere.

    Returns:
        ``num_nodes`` int64 arrays of sample indices into ``labels``; disjoint, together a
        permutation of ``range(N)``.
    """
    labels = _class_ids(labels)
    num_nodes = check_number("num_nodes", num_nodes, POSITIVE_INT)
    if not len(labels):
        raise ValueError("labels is empty: there are no samples to split")
    if num_nodes > len(labels):
        raise ValueError(f"num_nodes={num_nodes} exceeds the number of samples ({len(labels)}): some shards would be empty")
    skew = check_field("skew", skew)
    seed = check_field("seed", seed)

    order = np.argsort(labels, kind="stable")
    starts = np.unique(labels[order], return_index=True)[1]  # where each class begins in label order
    sorted_pool, random_pool = [], []
    for members in np.split(order, starts[1:]):
        take = int(np.floor(float(skew) * len(members) + 1e-9))
        sorted_pool.append(members[:take])
        random_pool.append(members[take:])
    sorted_pool = np.concatenate(sorted_pool)
    random_pool = np.concatenate(random_pool)
    np.random.default_rng(seed).shuffle(random_pool)

    sorted_blocks = np.array_split(sorted_pool, num_nodes)
    random_blocks = _split_extra_last(random_pool, num_nodes)
    return [np.concatenate([s, r]).astype(np.int64) for s, r in zip(sorted_blocks, random_blocks)]


def _class_ids(labels) -> np.ndarray:
    """``labels`` as a one-dimensional array of class ids: integers, whole-number floats or
    strings, one per sample. ValueError naming what was given otherwise (a dataset instead of its
    label column, a generator, per-sample lists, a missing or fractional value, mixed types)."""
    if hasattr(labels, "column_names") or isinstance(labels, dict):
        raise ValueError(f"labels must be one class id per sample, got a {type(labels).__name__}: pass its label "
                         "column, e.g. dataset['label']")
    try:
        array = np.asarray(labels)
    except ValueError:  # lists of different lengths: several labels per sample
        raise ValueError("labels must be one class id per sample, got lists of different lengths (several labels per "
                         "sample): pass one class column to skew on") from None
    if array.ndim != 1:
        given = type(labels).__name__ if array.ndim == 0 else f"shape {array.shape}"
        raise ValueError(f"labels must be a one-dimensional sequence of class ids, one per sample, got {given}")
    if array.dtype == object or (array.dtype.kind == "U" and not isinstance(labels, np.ndarray)):
        # objects: None, mixed or odd types; strings from a list: numpy writes integers among them as strings
        missing = next((i for i, value in enumerate(array) if value is None), None)
        if missing is not None:
            raise ValueError(f"labels must be class ids, found None at index {missing}")
        values = array if array.dtype == object else labels
        family = str if isinstance(values[0], str) else (int, np.integer)
        odd = next((i for i, value in enumerate(values) if not isinstance(value, family)), None)
        if odd is not None:
            raise ValueError(f"labels must be class ids, all integers or all strings, found {values[odd]!r} "
                             f"({type(values[odd]).__name__}) at index {odd}")
        array = array.astype(str if family is str else np.int64)
    if array.dtype.kind == "f":
        odd = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if odd.size:
            raise ValueError(f"labels must be class ids, found {array[odd[0]]} at index {int(odd[0])}")
    elif array.dtype.kind not in "iubUS":  # integers, booleans, strings
        raise ValueError(f"labels must be class ids (integers or strings), got values of type {array.dtype}")
    return array


def _split_extra_last(pool: np.ndarray, num_nodes: int) -> list[np.ndarray]:
    """``num_nodes`` contiguous blocks of ``pool`` whose sizes differ by at most one, the larger
    ones last (:func:`numpy.array_split` puts them first): beside the sorted pool's blocks no shard
    gets two extra samples while another gets none. A pool that divides evenly is cut as before."""
    base, extra = divmod(len(pool), num_nodes)
    sizes = [base + (i >= num_nodes - extra) for i in range(num_nodes)]
    return np.split(pool, np.cumsum(sizes)[:-1])
