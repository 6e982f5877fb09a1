"""Quasi-global momentum (QGM, Lin et al. 2021; SPEC 2), an option for the trainer.

Local momentum drifts apart on non-IID shards; QGM instead drives each node's buffer with the
model change over the *whole* iteration (local step plus gossip), an estimate of the global
update direction:

    m_i <- beta * m_i + (1 - beta) * (z_i(t) - z_i(t+1)) / lr
    local step direction d = grad + beta * m_i        (Nesterov-style)

Use with an optimiser without its own momentum (e.g. ``SGD(momentum=0)``). Per iteration::

    qgm.begin_iteration()                     # snapshot z_i(t), before the local step
    loss.backward()
    qgm.add_momentum(k, grads)                # grads[p] += beta * m_k[p], in place, per node k
    optimizer.step()
    gossip.step(nodes)
    qgm.end_iteration(lr)                     # m update from z_i(t) - z_i(t+1)

``nodes`` are per-local-node lists of tensors, as for the gossip engine (``n`` lists
in simulation, ``[my_params]`` on a rank). ``z`` are the de-biased models the trainer holds.
"""
from __future__ import annotations

import torch

ParamList = list[torch.Tensor]


class QuasiGlobalMomentum:
    """QGM buffers for the local nodes.

    Args:
        nodes: per local node, its parameter tensors (references kept; updated by the trainer).
        beta: momentum factor in [0, 1).
    State: ``m`` (one buffer per parameter) and the snapshot ``z(t)``; memory 2x the parameters.
    """

    def __init__(self, nodes: list[ParamList], beta: float = 0.9):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {beta!r}")
        if not isinstance(nodes, (list, tuple)) or not nodes or not all(isinstance(p, (list, tuple)) for p in nodes):
            raise TypeError("nodes must be a non-empty list of parameter lists (one per local node)")
        self.beta = float(beta)
        self._nodes = [list(params) for params in nodes]
        self._momentum = [[torch.zeros_like(p) for p in params] for params in self._nodes]
        self._snapshot = [[torch.zeros_like(p) for p in params] for params in self._nodes]
        self._open = False

    def begin_iteration(self) -> None:
        """Remember ``z_i(t)`` for every local node (call before the local optimiser step)."""
        with torch.no_grad():
            for snap, params in zip(self._snapshot, self._nodes):
                torch._foreach_copy_(snap, params)
        self._open = True

    def add_momentum(self, node: int, grads: ParamList) -> None:
        """``g += beta * m`` in place for local node ``node``'s gradients (SPEC 2 QGM), one tensor per
        parameter in the order given at construction. Call it for each node that steps."""
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < len(self._momentum):
            raise ValueError(f"node must be a local node index in [0, {len(self._momentum) - 1}], got {node!r}")
        if len(grads) != len(self._momentum[node]):
            raise ValueError(f"grads must hold {len(self._momentum[node])} tensors (one per parameter), got {len(grads)}")
        with torch.no_grad():
            torch._foreach_add_(list(grads), self._momentum[node], alpha=self.beta)

    def end_iteration(self, lr: float, skip=frozenset()) -> None:
        """``m <- beta * m + (1 - beta) * (z(t) - z(t+1)) / lr`` (call after the gossip step); the
        momentum of the local nodes in ``skip`` stays as it is (they took no step)."""
        if not self._open:
            raise RuntimeError("end_iteration() without begin_iteration() in this iteration")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"lr must be a positive number (the learning rate of this iteration), got {lr!r}")
        with torch.no_grad():
            for k, (m, snap, params) in enumerate(zip(self._momentum, self._snapshot, self._nodes)):
                if k in skip:
                    continue
                torch._foreach_sub_(snap, params)  # snap = z(t) - z(t+1)
                torch._foreach_mul_(m, self.beta)
                torch._foreach_add_(m, snap, alpha=(1.0 - self.beta) / lr)
        self._open = False

    @property
    def momentum(self) -> list[ParamList]:
        """The buffers ``m``, per local node (live tensors)."""
        return self._momentum

    def state_dict(self) -> dict:
        return {"beta": self.beta, "momentum": [list(m) for m in self._momentum]}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["beta"] != self.beta:
            raise ValueError(f"state_dict has beta={state_dict['beta']}, this object beta={self.beta}")
        with torch.no_grad():
            for m, saved in zip(self._momentum, state_dict["momentum"], strict=True):
                torch._foreach_copy_(m, list(saved))
