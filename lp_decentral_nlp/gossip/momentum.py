"""Quasi-global momentum (QGM, Lin et al. 2021; SPEC 2), an option for the trainer.

Local momentum drifts apart on non-IID shards; QGM instead drives each node's buffer with the
model change over the *whole* iteration (local step plus gossip), an estimate of the global
update direction:

    m_i <- beta * m_i + (1 - beta) * (z_i(t) - z_i(t+1)) / lr
    local step direction d = grad + beta * m_i        (Nesterov-style)

:class:`QuasiGlobalMomentum` is for SGD: use it with an optimiser without its own momentum (e.g.
``SGD(momentum=0)``). :class:`QuasiGlobalAdam` is the Adam/AdamW form (the quasi-global buffer is
Adam's first moment, the second moment stays local) and replaces the optimiser. QGM for SGD, per
iteration::

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

from ..checks import NUMBER_FIELDS, Number, check_number
from .push_sum import check_node_params

ParamList = list[torch.Tensor]
#: the allowed learning rate of an iteration, and of a beta of the moments (Adam's betas, QGM's beta)
_LR, _BETA = Number(low=0, low_open=True, what="a learning rate"), NUMBER_FIELDS["qgm_beta"]


class QuasiGlobalMomentum:
    """QGM buffers for the local nodes.

    Args:
        nodes: per local node, its parameter tensors (references kept; updated by the trainer).
        beta: momentum factor in [0, 1).
    State: ``m`` (one buffer per parameter) and the snapshot ``z(t)``; memory 2x the parameters.
    """

    def __init__(self, nodes: list[ParamList], beta: float = 0.9):
        beta = check_number("beta", beta, _BETA)
        check_node_params(nodes)
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
        node = _checked_node(node, len(self._momentum))
        _check_grads(grads, self._momentum[node])
        with torch.no_grad():
            torch._foreach_add_(list(grads), self._momentum[node], alpha=self.beta)

    def end_iteration(self, lr: float, skip=frozenset()) -> None:
        """``m <- beta * m + (1 - beta) * (z(t) - z(t+1)) / lr`` (call after the gossip step); the
        momentum of the local nodes in ``skip`` stays as it is (they took no step)."""
        if not self._open:
            raise RuntimeError("end_iteration() without begin_iteration() in this iteration")
        lr = check_number("lr", lr, _LR)
        skip = {_checked_node(node, len(self._momentum)) for node in skip}
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
        """``beta`` and the buffers ``m`` per local node (lists of live tensors)."""
        return {"beta": self.beta, "momentum": [list(m) for m in self._momentum]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s buffers; ValueError when its ``beta`` is another."""
        if state_dict["beta"] != self.beta:
            raise ValueError(f"state_dict has beta={state_dict['beta']}, this object beta={self.beta}")
        with torch.no_grad():
            for m, saved in zip(self._momentum, state_dict["momentum"], strict=True):
                torch._foreach_copy_(m, list(saved))


class QuasiGlobalAdam:
    """Adam/AdamW whose first moment is quasi-global (SPEC 2 "Quasi-global momentum", Lin et al.
    2021): the second moment ``v`` stays local (from the raw gradients); the first moment ``m`` is
    Adam's, and after every iteration it is moved toward the one that would have produced the
    node's *whole* model change (local step plus gossip) with weight ``1 - beta1``, the EMA of
    SPEC 2's QGM. Use it instead of the node's optimiser.

    Per local node ``k`` at its ``c``-th step (``lr`` the iteration's learning rate, ``g`` the raw
    gradient at ``z(t)``), Adam with bias correction and decoupled weight decay ``wd`` (AdamW)::

        v <- beta2 * v + (1 - beta2) * g^2                              (local)
        m <- beta1 * m + (1 - beta1) * g                                (Adam's recursion)
        z~ = z(t) - lr * wd * z(t) - lr * u,   u = (m / (1 - beta1^c)) / (sqrt(v / (1 - beta2^c)) + eps)
        ... gossip: z~ -> z(t+1) ...
        m_implied = (1 - beta1^c) * (sqrt(v / (1 - beta2^c)) + eps) * ((z(t) - z(t+1)) / lr - wd * z(t))
        m <- m + (1 - beta1) * (m_implied - m)

    Without gossip ``m_implied = m`` (in exact arithmetic), so the last line changes nothing and a
    lone node runs plain Adam/AdamW. With gossip, ``m_implied - m = (1 - beta1^c) * (sqrt(v/(1 -
    beta2^c)) + eps) * (z~ - z(t+1)) / lr``: the consensus move enters ``m`` with weight
    ``1 - beta1``, as the whole-iteration change enters QGM-SGD's buffer (:class:`QuasiGlobalMomentum`),
    so a gossip move is not re-applied as a heavy-ball step at ``~beta1``. Per iteration::

        qg.begin_iteration()                 # snapshot z(t), before the local step
        loss.backward()
        qg.step(k, grads, lr)                # local Adam step of node k (in place), for each node that steps
        gossip.step(nodes)
        qg.end_iteration(lr)                 # m of the nodes that stepped, toward m_implied

    Args:
        nodes: per local node, its parameter tensors (references kept; the de-biased ``z``).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the root of ``v``, > 0.
        weight_decay: decoupled weight decay (AdamW), >= 0; 0 is Adam. A number for every
            parameter, or one number per parameter (e.g. 0 for biases and LayerNorm weights, as
            Hugging Face's trainer groups them).
    State: ``m``, ``v`` and the snapshot ``z(t)`` (3x the parameters) and each node's step count.
    Attributes ``betas``, ``eps``, ``weight_decay`` (a list, one per parameter).

    ``m_implied`` is recovered from a difference of models, ``z(t) - z(t+1)``, so in float32 it
    carries rounding of relative size ``~1e-7 * |z| / |z(t) - z(t+1)|`` (``~1e-3`` for ``|z| ~ 0.1``
    and a change of ``1e-5`` per step); it enters ``m`` scaled by ``1 - beta1``.
    """

    def __init__(self, nodes: list[ParamList], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | list[float] = 0.0):
        check_node_params(nodes)
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(_BETA.admits(b) for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        eps = check_number("eps", eps, Number(low=0, low_open=True))
        self._nodes = [list(params) for params in nodes]
        count = len(self._nodes[0])
        decays = list(weight_decay) if isinstance(weight_decay, (list, tuple)) else [weight_decay] * count
        if len(decays) != count or not all(Number(low=0).admits(d) for d in decays):
            raise ValueError(f"weight_decay must be a number >= 0 or {count} such numbers (one per parameter), "
                             f"got {weight_decay!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = [float(d) for d in decays]
        self._exp_avg = [[torch.zeros_like(p) for p in params] for params in self._nodes]
        self._exp_avg_sq = [[torch.zeros_like(p) for p in params] for params in self._nodes]
        self._snapshot = [[torch.zeros_like(p) for p in params] for params in self._nodes]
        self._steps = [0] * len(self._nodes)
        self._stepped: set[int] = set()
        self._open = False

    def begin_iteration(self) -> None:
        """Remember ``z_k(t)`` for every local node (call before the local steps)."""
        with torch.no_grad():
            for snap, params in zip(self._snapshot, self._nodes):
                torch._foreach_copy_(snap, params)
        self._stepped = set()
        self._open = True

    def step(self, node: int, grads: ParamList, lr: float) -> None:
        """The local Adam/AdamW step of local node ``node`` from its raw gradients ``grads`` (one
        tensor per parameter, in the order given at construction), in place on its parameters."""
        if not self._open:
            raise RuntimeError("step() outside an iteration: call begin_iteration() first")
        node = _checked_node(node, len(self._nodes))
        _check_grads(grads, self._nodes[node])
        lr = check_number("lr", lr, _LR)
        beta1, beta2 = self.betas
        self._steps[node] += 1
        c = self._steps[node]
        params, m, v = self._nodes[node], self._exp_avg[node], self._exp_avg_sq[node]
        with torch.no_grad():
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, list(grads), list(grads), value=1 - beta2)
            torch._foreach_lerp_(m, list(grads), 1 - beta1)  # m <- beta1 m + (1 - beta1) g
            denom = self._denominator(node)
            if any(self.weight_decay):
                torch._foreach_mul_(params, [1 - lr * d for d in self.weight_decay])
            torch._foreach_addcdiv_(params, m, denom, value=-lr / (1 - beta1 ** c))
        self._stepped.add(node)

    def end_iteration(self, lr: float) -> None:
        """Move ``m`` of every node that stepped this iteration toward the first moment implied by
        its whole model change ``z(t) - z(t+1)``, with weight ``1 - beta1`` (call after the gossip
        step, with the ``lr`` of :meth:`step`); nodes that took no step keep ``m``, ``v`` and their
        step count."""
        if not self._open:
            raise RuntimeError("end_iteration() without begin_iteration() in this iteration")
        lr = check_number("lr", lr, _LR)
        beta1 = self.betas[0]
        with torch.no_grad():
            for k in sorted(self._stepped):
                snap, m = self._snapshot[k], self._exp_avg[k]
                # implied update u = (z(t) - z(t+1)) / lr - wd * z(t)
                torch._foreach_mul_(snap, [1.0 / lr - d for d in self.weight_decay])
                torch._foreach_sub_(snap, torch._foreach_div(self._nodes[k], lr))
                torch._foreach_mul_(snap, self._denominator(k))
                torch._foreach_mul_(snap, 1 - beta1 ** self._steps[k])  # snap = m_implied
                torch._foreach_lerp_(m, snap, 1 - beta1)  # m <- m + (1 - beta1) (m_implied - m)
        self._open = False

    def _denominator(self, k: int) -> ParamList:
        """``sqrt(v_k / (1 - beta2^c)) + eps``, new tensors."""
        denom = torch._foreach_sqrt(self._exp_avg_sq[k])
        torch._foreach_div_(denom, (1 - self.betas[1] ** self._steps[k]) ** 0.5)
        torch._foreach_add_(denom, self.eps)
        return denom

    @property
    def exp_avg(self) -> list[ParamList]:
        """The quasi-global first moments ``m``, per local node (live tensors)."""
        return self._exp_avg

    @property
    def exp_avg_sq(self) -> list[ParamList]:
        """The local second moments ``v``, per local node (live tensors)."""
        return self._exp_avg_sq

    def state_dict(self) -> dict:
        """The settings (``betas``, ``eps``, ``weight_decay``) and, per local node, its step count
        and moments ``exp_avg``/``exp_avg_sq`` (lists of live tensors)."""
        return {"betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay, "steps": list(self._steps),
                "exp_avg": [list(m) for m in self._exp_avg], "exp_avg_sq": [list(v) for v in self._exp_avg_sq]}

    def node_state_dict(self, node: int) -> dict:
        """Local node ``node``'s part of the state (for a per-node checkpoint file): its ``exp_avg``
        and ``exp_avg_sq`` (lists of live tensors, one per parameter) and its step count ``steps``."""
        return {"exp_avg": list(self._exp_avg[node]), "exp_avg_sq": list(self._exp_avg_sq[node]),
                "steps": self._steps[node]}

    def load_node_state_dict(self, node: int, state: dict) -> None:
        """Restore what :meth:`node_state_dict` returned into local node ``node``; ValueError when the
        number of tensors differs (RuntimeError from the copy when a shape differs)."""
        with torch.no_grad():
            for buffers, saved in ((self._exp_avg[node], state["exp_avg"]), (self._exp_avg_sq[node], state["exp_avg_sq"])):
                if len(saved) != len(buffers):
                    raise ValueError(f"state holds {len(saved)} tensors, node {node} has {len(buffers)} parameters")
                torch._foreach_copy_(buffers, list(saved))
        self._steps[node] = int(state["steps"])

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s moments and steps; ValueError when a setting differs."""
        for key in ("betas", "eps", "weight_decay"):
            saved = state_dict[key]
            saved = tuple(saved) if key == "betas" else list(saved) if key == "weight_decay" else saved
            if saved != getattr(self, key):
                raise ValueError(f"state_dict has {key}={state_dict[key]!r}, this object {key}={getattr(self, key)!r}")
        if len(state_dict["steps"]) != len(self._nodes):
            raise ValueError(f"state_dict holds {len(state_dict['steps'])} nodes, this object {len(self._nodes)}")
        with torch.no_grad():
            for mine, saved in ((self._exp_avg, state_dict["exp_avg"]), (self._exp_avg_sq, state_dict["exp_avg_sq"])):
                for buffers, saved_buffers in zip(mine, saved, strict=True):
                    torch._foreach_copy_(buffers, list(saved_buffers))
        self._steps = [int(c) for c in state_dict["steps"]]


def _check_grads(grads, params: list[torch.Tensor]) -> None:
    """ValueError unless ``grads`` holds one floating tensor per parameter, shaped like it, checked
    before any state is written."""
    if not isinstance(grads, (list, tuple)) or len(grads) != len(params):
        got = len(grads) if isinstance(grads, (list, tuple)) else type(grads).__name__
        raise ValueError(f"grads must hold {len(params)} tensors (one per parameter), got {got}")
    for i, (g, p) in enumerate(zip(grads, params)):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.shape != p.shape:
            got = type(g).__name__ if not isinstance(g, torch.Tensor) else f"{g.dtype} of shape {tuple(g.shape)}"
            raise ValueError(f"grads[{i}] must be a floating-point tensor of shape {tuple(p.shape)}, got {got}")


def _checked_node(node, count: int) -> int:
    """``node`` as an int; ValueError unless it indexes one of ``count`` local nodes."""
    return check_number("node", node, Number(integer=True, low=0, high=count - 1, what="a local node index"))
