"""Communication graphs and their column-stochastic mixing matrices (SPEC 1).

A :class:`Topology` is a cycle of ``period`` mixing matrices ``W(t)`` of shape ``(n, n)``:
``W[i, j]`` is the weight node ``i`` gives to what it receives from node ``j``, so node ``j``
*sends* to every ``i != j`` with ``W[i, j] > 0`` (its out-neighbours) and keeps ``W[j, j]``.
Every column sums to 1 (each sender splits its whole mass: push-sum), every diagonal entry is
positive (self-loops), and the union of the graphs over one period is strongly connected.
Static graphs have ``period == 1``; the exponential graph of Stochastic Gradient Push cycles
through ``ceil(log2 n)`` one-peer graphs.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ..checks import NONNEGATIVE_INT, POSITIVE_INT, TOPOLOGY_FILE_SUFFIXES, Number, check_number

TOPOLOGIES = ("directed_ring", "ring", "torus", "exponential", "complete")

# Column sums may differ from 1 by float32 rounding of user-built matrices, no more.
_STOCHASTIC_ATOL = 1e-6


class Topology:
    """A (possibly time-varying) directed graph with its push-sum mixing matrices.

    Build one with :func:`make_topology`, :meth:`Topology.from_matrix` or
    :meth:`Topology.from_file`. Immutable: its
    attributes are read-only (a graph a gossip engine holds must not change under it).

    Attributes:
        num_nodes: ``n``.
        period: number of distinct matrices; step ``t`` uses ``W(t mod period)``.
        name: a short description (``"directed_ring"``, ``"torus(4x4)"``, ``"custom"``...).
    """

    num_nodes = property(lambda self: self._num_nodes, doc="``n``, the number of nodes.")
    period = property(lambda self: len(self._mats), doc="Distinct matrices; step ``t`` uses ``W(t mod period)``.")
    name = property(lambda self: self._name, doc="A short description (``\"directed_ring\"``, ``\"custom\"``...).")

    def __init__(self, matrices: Sequence, name: str = "custom"):
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not isinstance(matrices, (Sequence, np.ndarray, torch.Tensor)) or isinstance(matrices, (str, bytes)):
            raise TypeError(f"matrices must be an (n, n) array-like (array, tensor, nested lists) or a list of them, "
                            f"got {type(matrices).__name__}")
        if _is_single_matrix(matrices):
            matrices = [matrices]
        if len(matrices) == 0:
            raise ValueError("matrices: need at least one (n, n) mixing matrix, got an empty sequence")
        mats = [_as_float64(m, f"matrices[{t}]") for t, m in enumerate(matrices)]
        n = mats[0].shape[0]
        for t, m in enumerate(mats):
            if m.shape != (n, n):
                raise ValueError(
                    f"matrices[{t}]: every mixing matrix must have shape ({n}, {n}) like matrices[0], "
                    f"got {tuple(m.shape)}"
                )
            _check_mixing_matrix(m, f"matrices[{t}]")
        _check_strongly_connected(mats)
        self._mats, self._num_nodes, self._name = mats, n, name
        # Neighbour lists per phase, computed once: the gossip hot path only reads them.
        self._out = [[_nonzero_others(m[:, i], i) for i in range(n)] for m in mats]
        self._in = [[_nonzero_others(m[i, :], i) for i in range(n)] for m in mats]

    @classmethod
    def from_matrix(cls, W, name: str = "custom") -> "Topology":
        """A topology from a user's mixing matrix ``W`` (``(n, n)``) or a list of them (time-varying).

        Raises:
            ValueError: unless every matrix is square, nonnegative, column stochastic (columns sum to
                1 within 1e-6), has a positive diagonal (self-loops), and the union of the graphs is
                strongly connected. The message names the offending column, entry or node.
        """
        return cls(W, name=name)

    @classmethod
    def from_file(cls, path) -> "Topology":
        """A topology from a file of mixing matrices, named after the file.

        Args:
            path: (``~`` expanded) a ``.npy`` file (``numpy.save`` of an array of shape ``(n, n)``, or
                ``(T, n, n)`` for a graph that cycles through ``T`` matrices) or a ``.json`` file
                (nested lists of those shapes); ``W[i, j]`` as in :class:`Topology`.

        Raises:
            ValueError: naming the file: it cannot be read, or its matrices fail the checks of
                :meth:`from_matrix`.
        """
        path = os.path.expanduser(os.fspath(path))
        if not path.lower().endswith(TOPOLOGY_FILE_SUFFIXES):
            raise ValueError(f"topology file {path!r}: a file of mixing matrices ends in .npy or .json")
        try:
            if path.lower().endswith(".npy"):
                matrices = np.load(path, allow_pickle=False)
            else:
                with open(path, encoding="utf-8") as f:
                    matrices = json.load(f)
        except (OSError, ValueError, EOFError) as err:  # json's and numpy's format errors are ValueErrors
            # numpy reads a file that is no .npy as a pickle, and offers to load it unsafely: never
            why = "not a .npy file (numpy.save writes one)" if "pickled" in str(err) else " ".join(str(err).split())
            raise ValueError(f"topology file {path!r}: cannot read it ({why or type(err).__name__})") from None
        try:
            shape = np.shape(matrices)
        except ValueError:  # ragged nesting (matrices of different sizes): the checks below name the one
            shape = None
        if shape is not None and len(shape) not in (2, 3):
            raise ValueError(f"topology file {path!r}: holds an array of shape {shape}; a graph is a mixing matrix "
                             "(n, n), or (T, n, n) for one that cycles through T")
        try:
            return cls(matrices, name=os.path.basename(path))
        except (TypeError, ValueError) as err:
            raise ValueError(f"topology file {path!r}: {err}") from None

    # -- queries ---------------------------------------------------------------------------------
    def mixing_matrix(self, step: int = 0) -> torch.Tensor:
        """``W(step)`` as a float64 tensor of shape ``(n, n)`` (a copy)."""
        return torch.from_numpy(self._mats[self._phase(step)].copy())

    def out_neighbors(self, i: int, step: int = 0) -> list[int]:
        """Nodes ``i`` sends to at ``step`` (sorted, excluding ``i`` itself)."""
        return list(self._out[self._phase(step)][self._node(i)])

    def in_neighbors(self, i: int, step: int = 0) -> list[int]:
        """Nodes ``i`` receives from at ``step`` (sorted, excluding ``i`` itself)."""
        return list(self._in[self._phase(step)][self._node(i)])

    def weight(self, i: int, j: int, step: int = 0) -> float:
        """``W(step)[i, j]`` as a Python float."""
        return float(self._mats[self._phase(step)][self._node(i), self._node(j)])

    def spectral_gap(self, step: int = 0) -> float:
        """``1 - |lambda_2(W(step))|``, the second largest eigenvalue modulus of one step's matrix.

        For a time-varying graph a single step is usually not connected (gap 0); see
        :meth:`period_spectral_gap` for the rate over a whole period.
        """
        return max(0.0, 1.0 - _second_eigenvalue_modulus(self._mats[self._phase(step)]))  # not -2e-16

    @functools.cached_property
    def _period_gap(self) -> float:
        """:meth:`period_spectral_gap`, computed once (an eigendecomposition of an ``(n, n)``
        matrix; a run reports it in several places)."""
        prod = np.eye(self.num_nodes)
        for m in self._mats:
            prod = m @ prod
        return max(0.0, 1.0 - _second_eigenvalue_modulus(prod) ** (1.0 / self.period))

    def period_spectral_gap(self) -> float:
        """Per-step gap of the product over one period: ``1 - |lambda_2(W(T-1)...W(0))|^(1/T)``.

        Equals :meth:`spectral_gap` for static graphs. The 8-node exponential graph averages
        exactly in one period (its product is ``J/8``), so its period gap is 1.
        """
        return self._period_gap

    def fingerprint(self) -> int:
        """A 63-bit hash of the matrices over one period (used to check that ranks agree)."""
        h = hashlib.sha256()
        for m in self._mats:
            h.update(np.ascontiguousarray(m).tobytes())
        return int.from_bytes(h.digest()[:8], "little") >> 1

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, num_nodes={self.num_nodes}, period={self.period})"

    # -- helpers ---------------------------------------------------------------------------------
    def _phase(self, step: int) -> int:
        return check_number("step", step, NONNEGATIVE_INT) % self.period

    def _node(self, i: int) -> int:
        return check_number("node index", i, Number(integer=True, low=0, high=self.num_nodes, high_open=True))


def make_topology(name: str, num_nodes: int, *, rows: int | None = None, cols: int | None = None) -> Topology:
    """One of the standard graphs with default push-sum mixing (SPEC 1).

    Every node splits its mass equally among itself and its out-neighbours:
    ``W[j, i] = 1 / (outdeg(i) + 1)`` for each out-neighbour ``j`` of ``i`` and ``j = i``.

    Args:
        name: ``"directed_ring"`` (``i -> i+1``), ``"ring"`` (undirected, ``i <-> i+-1``),
            ``"torus"`` (2-D wrap-around grid, ``rows x cols``, up to 4 peers), ``"exponential"``
            (time-varying: at step ``t`` node ``i`` sends to ``i + 2^(t mod K)`` with
            ``K = ceil(log2 n)``), ``"complete"`` (everyone to everyone).
        num_nodes: ``n >= 1``.
        rows, cols: torus shape, ``rows * cols == num_nodes``; either one alone fixes the other,
            and without both the most square shape is taken (``rows <= cols``; a warning where it
            is ``1 x n``, the ring: a prime number of nodes). Not allowed for the other graphs.
    """
    n = check_number("num_nodes", num_nodes, POSITIVE_INT)
    if name not in TOPOLOGIES:
        raise ValueError(f"name must be one of {TOPOLOGIES}, got {name!r}")
    if name != "torus" and (rows is not None or cols is not None):
        raise ValueError(f"rows/cols only apply to name='torus', got them for {name!r}")
    if name == "directed_ring":
        return Topology(_uniform_split(n, lambda i: [(i + 1) % n]), name=name)
    if name == "ring":
        return Topology(_uniform_split(n, lambda i: [(i - 1) % n, (i + 1) % n]), name=name)
    if name == "complete":
        return Topology(_uniform_split(n, lambda i: range(n)), name=name)
    if name == "exponential":
        hops = [2**k for k in range(max(1, math.ceil(math.log2(n))))] if n > 1 else [1]
        mats = [_uniform_split(n, lambda i, h=h: [(i + h) % n]) for h in hops]
        return Topology(mats, name=name)
    # torus
    rows, cols = (check_number(arg, v, POSITIVE_INT._replace(optional=True))
                  for arg, v in (("rows", rows), ("cols", cols)))
    if rows is None and cols is None:
        rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
        if rows == 1 and n > 3:
            warnings.warn(f"a torus of {n} nodes is 1 x {n}, the ring ({n} is prime): a 2-D torus needs a number of "
                          "nodes with a factor other than 1 (e.g. 4, 6, 9)", stacklevel=2)
    if rows is None or cols is None:
        given, other = ("rows", "cols") if cols is None else ("cols", "rows")
        if n % (rows or cols):
            raise ValueError(f"{given}={rows or cols} does not divide num_nodes={n}: a torus needs "
                             f"rows * cols == num_nodes")
        rows, cols = (rows, n // rows) if cols is None else (n // cols, cols)
    if rows * cols != n:
        raise ValueError(f"rows * cols must equal num_nodes: {rows} * {cols} != {n}")

    def torus_peers(i):
        r, c = divmod(i, cols)
        return [((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
                r * cols + (c - 1) % cols, r * cols + (c + 1) % cols]

    return Topology(_uniform_split(n, torus_peers), name=f"torus({rows}x{cols})")


def _uniform_split(n: int, peers) -> np.ndarray:
    """Column-stochastic ``W`` where node ``i`` splits equally over ``{i} | peers(i)``."""
    W = np.zeros((n, n))
    for i in range(n):
        targets = sorted({i, *(int(p) for p in peers(i))})
        W[targets, i] = 1.0 / len(targets)
    return W


def _is_single_matrix(obj) -> bool:
    """True for one (n, n) array-like (tensor, array, nested lists), False for a list of them."""
    try:
        return np.ndim(obj) == 2
    except ValueError:  # ragged nesting: a list of matrices of different sizes
        return False


def _as_float64(m, what: str) -> np.ndarray:
    if isinstance(m, torch.Tensor):
        if m.is_complex():
            raise ValueError(f"{what}: a mixing matrix must hold real numbers, got {m.dtype}")
        m = m.detach().cpu().double().numpy()
    if np.iscomplexobj(m):  # np.array(..., float64) would drop the imaginary parts with a warning
        raise ValueError(f"{what}: a mixing matrix must hold real numbers, got complex ones")
    try:
        arr = np.array(m, dtype=np.float64)
    except (TypeError, ValueError) as err:  # strings, ragged rows
        raise ValueError(f"{what}: a mixing matrix must hold numbers ({err})") from None
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] < 1:
        raise ValueError(f"{what}: a mixing matrix must be square (n, n) with n >= 1, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what}: entries must be finite")
    return arr


def _check_mixing_matrix(W: np.ndarray, what: str) -> None:
    neg = np.argwhere(W < 0)
    if len(neg):
        i, j = neg[0]
        raise ValueError(f"{what}: entries must be nonnegative, W[{i}, {j}] = {W[i, j]}")
    sums = W.sum(axis=0)
    bad = np.flatnonzero(np.abs(sums - 1.0) > _STOCHASTIC_ATOL)
    if len(bad):
        j = bad[0]
        raise ValueError(
            f"{what}: must be column stochastic (W[i, j] = weight node i gives to node j's message, "
            f"every column sums to 1), column {j} sums to {float(sums[j])!r}"
        )
    diag = np.flatnonzero(np.diag(W) <= 0)
    if len(diag):
        raise ValueError(f"{what}: every node needs a self-loop (W[i, i] > 0), W[{diag[0]}, {diag[0]}] = 0")


def _check_strongly_connected(mats: list[np.ndarray]) -> None:
    adj = np.zeros_like(mats[0], dtype=bool)
    for m in mats:
        adj |= m > 0  # adj[i, j]: edge j -> i
    n = adj.shape[0]
    # BFS from node 0 along the edges, then against them.
    for A, problem in ((adj, "node 0 cannot reach node {}"), (adj.T, "node {} cannot reach node 0")):
        seen = np.zeros(n, dtype=bool)
        seen[0] = True
        frontier = [0]
        while frontier:
            nxt = np.flatnonzero(A[:, frontier].any(axis=1) & ~seen)
            seen[nxt] = True
            frontier = list(nxt)
        if not seen.all():
            missing = int(np.flatnonzero(~seen)[0])
            raise ValueError("the graph must be strongly connected (union over one period): "
                             + problem.format(missing))


def _nonzero_others(vec: np.ndarray, i: int) -> tuple[int, ...]:
    return tuple(int(j) for j in np.flatnonzero(vec > 0) if j != i)


def _second_eigenvalue_modulus(W: np.ndarray) -> float:
    """``|lambda_2(W)|``; a modulus within the eigensolver's rounding (``n * eps * ||W||_1``) is 0.

    (LAPACK returns ~1e-17 for the exactly rank-one ``J/8`` of the exponential graph's period,
    and :meth:`Topology.period_spectral_gap` takes its T-th root: 1e-17 would become 2e-6.)
    """
    if W.shape[0] == 1:
        return 0.0
    mods = np.sort(np.abs(np.linalg.eigvals(W)))[::-1]
    tolerance = W.shape[0] * np.finfo(W.dtype).eps * np.abs(W).sum(axis=0).max()
    return float(mods[1]) if mods[1] > tolerance else 0.0
