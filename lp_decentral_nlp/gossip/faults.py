"""Fault injection for robustness studies: lost messages, stragglers, nodes that leave and rejoin.

Everything here is off by default (``FaultPlan()`` injects nothing) and deterministic: what is
lost at gossip step ``t`` is a function of ``(seed, t, sender, receiver)`` only, so every process
of the distributed backend and the simulation draw the same faults.

Rules (they keep SPEC 1's push-sum mass ``sum_i x_i`` and ``sum_i w_i`` exactly conserved):

* **Lost message (SGP, Deep-Squeeze).** Each message ``j -> i`` (``i != j``; self-loops are never
  lost) at step ``t`` is lost with probability ``drop_prob``. The sender learns of the loss (no
  acknowledgement) and keeps the share it meant to give: for that step the mixing matrix is
  ``W'`` with ``W'[i, j] = 0`` and ``W'[j, j] = W[j, j] + W[i, j]``. ``W'`` is still column
  stochastic, so the mass is conserved as for any column-stochastic matrix.
* **Lost message (Choco-SGD).** The consensus step mixes the public copies ``x^_j``, not the
  messages, and ``x^_j`` (held by ``j`` and all its out-neighbours) must stay identical
  everywhere. A message ``q_j`` is therefore *committed* (added to every copy of ``x^_j``, the
  sender's own included) only when it reached all of ``j``'s out-neighbours; otherwise no holder
  applies it, and the difference it carried stays in ``x~_j - x^_j``, to be sent again in ``j``'s
  next message. With sparse or random messages (top-k, random-k, QSGD) the mixing matrix stays
  ``W`` (a receiver mixes its unchanged copy), so the graph stays static and Choco keeps
  converging to the exact average, if its step allows for the messages that are not committed:
  the default step (``step_size.default_consensus_lr``) is scaled by the chance ``(1 -
  drop_prob) ** outdeg`` that a message is committed (at the loss-free step Choco's consensus
  diverged from about 30% loss). With dense messages (exact or 8-bit: a committed
  copy is the sender's model) the share of an uncommitted message returns to its sender, ``W'``
  as for SGP: mixing the stale copy drove push-sum weights to 0 at 50% loss.
* **Deep-Squeeze error memory** is updated as usual (the compression error does not depend on
  delivery).
* **Absent node** ``a`` during iterations ``[start, end)``: every message to and from ``a`` is
  lost and, for every algorithm, its share returns to its sender (``W'`` as above: ``a`` keeps
  all its mass, ``W'[a, a] = 1``, and nobody mixes ``a``'s copy). ``a`` does nothing: its model,
  push-sum weight, error memory and Choco copies do not change, and its ``bytes_sent`` is 0 (in the
  distributed backend its stale buffer, and its neighbours' messages to it, still travel, unread:
  the transport's exchange is fixed per edge). (The
  trainer also skips its local step and batches and keeps its optimizer state and QGM buffer;
  its learning-rate schedule keeps counting, so it rejoins in step with the others.)
* **Straggler** ``node: seconds``: the node sleeps that long before each send (in the simulated
  backend the sleeps of all stragglers add up, one after the other).

Iteration ``t`` is the one that takes the trainer's ``global_step`` from ``t`` to ``t + 1``; it
runs gossip step ``t``.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass

import numpy as np

from ..checks import check_field, check_fields, parse_absence, parse_straggler
from .topology import Topology

# Separates the drop draws from every other use of the run's seed.
_DROP_STREAM = 0x6C6F7374  # "lost"


_ENTRY_FORMS = {"stragglers": "a (node, seconds) pair or a 'NODE:SECONDS' string",
                "absences": "a (node, start, end) triple of integers or a 'NODE:START:END' string"}


def _entries(name: str, value, parse, kinds: tuple[type, ...]) -> tuple[tuple, ...]:
    """The entries of the :class:`FaultPlan` field `name` as checked tuples of Python numbers: each
    a tuple of numbers of `kinds` (an integer node or step, no bool) or the command line's string,
    both checked by `parse` (``checks.parse_straggler`` / ``parse_absence``); ValueError naming the
    entry otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of entries, each {_ENTRY_FORMS[name]}, got {type(value).__name__}")
    entries = []
    for i, entry in enumerate(value):
        if not isinstance(entry, str):
            if (not isinstance(entry, (list, tuple)) or len(entry) != len(kinds)
                    or any(isinstance(v, bool) or not isinstance(v, kind) for v, kind in zip(entry, kinds))):
                raise ValueError(f"{name}[{i}] must be {_ENTRY_FORMS[name]}, got {entry!r}")
            entry = ":".join(str(int(v) if kind is numbers.Integral else float(v)) for v, kind in zip(entry, kinds))
        try:
            entries.append(parse(entry))
        except ValueError as err:
            raise ValueError(f"{name}[{i}]: {err}") from None
    return tuple(entries)


@dataclass(frozen=True)
class FaultPlan:
    """Which faults to inject (see the module docstring for the rules).

    Args:
        drop_prob: probability in ``[0, 1)`` that a message between two nodes is lost.
        seed: seed of the drop draws (the run's seed).
        stragglers: ``((node, seconds), ...)``: delay before each of that node's sends; an entry
            may also be the command line's ``"NODE:SECONDS"`` string.
        absences: ``((node, start, end), ...)``: the node is absent for iterations ``[start, end)``;
            or ``"NODE:START:END"`` strings.
    """

    drop_prob: float = 0.0
    seed: int = 0
    stragglers: tuple[tuple[int, float], ...] = ()
    absences: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self):
        check_fields(self, ("drop_prob", "seed"))
        object.__setattr__(self, "stragglers", _entries("stragglers", self.stragglers, parse_straggler,
                                                        (numbers.Integral, numbers.Real)))
        object.__setattr__(self, "absences", _entries("absences", self.absences, parse_absence,
                                                      (numbers.Integral,) * 3))
        nodes = [n for n, _ in self.stragglers]
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"stragglers: each node may be listed once, got {list(self.stragglers)}")
        for node in {n for n, _, _ in self.absences}:
            spans = sorted((a, b) for n, a, b in self.absences if n == node)
            if any(a2 < b1 for (_, b1), (a2, _) in zip(spans, spans[1:])):
                raise ValueError(f"absences: node {node}'s absences overlap: {spans}")

    @property
    def active(self) -> bool:
        """Whether this plan injects anything."""
        return self.drop_prob > 0 or bool(self.stragglers) or bool(self.absences)

    def check_nodes(self, num_nodes: int) -> None:
        """ValueError unless every node named by the plan is in ``[0, num_nodes)`` (and
        ``num_nodes`` is a node count)."""
        num_nodes = check_field("num_nodes", num_nodes)
        for what, node in [("stragglers", n) for n, _ in self.stragglers] + [("absences", n) for n, _, _ in self.absences]:
            if node >= num_nodes:
                raise ValueError(f"{what}: node {node} does not exist (nodes are 0..{num_nodes - 1})")

    def absent(self, step: int) -> frozenset[int]:
        """Nodes absent at iteration (gossip step) ``step``."""
        return frozenset(n for n, a, b in self.absences if a <= step < b)

    def lost_edges(self, step: int, topology: Topology) -> frozenset[tuple[int, int]]:
        """``{(sender, receiver)}`` of the messages lost at gossip step ``step``.

        A message is lost when its uniform draw (an ``(n, n)`` matrix drawn from a generator
        seeded by ``(seed, step)``, entry ``[sender, receiver]``) is below ``drop_prob``, or when
        either end is absent.
        """
        n = topology.num_nodes
        absent = self.absent(step)
        draws = np.random.default_rng([self.seed, step, _DROP_STREAM]).random((n, n)) if self.drop_prob else None
        lost = set()
        for j in range(n):
            for i in topology.out_neighbors(j, step):
                if j in absent or i in absent or (draws is not None and draws[j, i] < self.drop_prob):
                    lost.add((j, i))
        return frozenset(lost)

    def straggle(self, nodes) -> None:
        """Sleep the delay of every straggler among ``nodes`` (before they send)."""
        delays = dict(self.stragglers)
        for node in nodes:
            if delays.get(node):
                time.sleep(delays[node])

    def __repr__(self):
        return (f"FaultPlan(drop_prob={self.drop_prob!r}, seed={self.seed}, stragglers={list(self.stragglers)}, "
                f"absences={list(self.absences)})")
