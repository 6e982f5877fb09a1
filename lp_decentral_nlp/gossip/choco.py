"""Choco-SGD with push-sum (Koloskova et al. 2019/2020; directed form of Taheri et al. 2020), SPEC 2:
nodes send compressed *differences* to public copies that every holder keeps identical."""
from __future__ import annotations

import torch

from .compressors import Compressor, Identity, Quantize
from .faults import FaultPlan
from .push_sum import PushSumGossip
from .topology import Topology

#: entries per column chunk of Choco's CPU update (4 nodes' chunks and 4 copies' stay in cache)
_CHUNK = 1 << 18


class ChocoSGD(PushSumGossip):
    """Choco-SGD with push-sum (Koloskova et al. 2019; directed form of Taheri et al. 2020), SPEC 2.

    Sends ``q_i = C(x~_i - x^_i)`` (model *differences*); every holder of ``x^_i`` adds ``q_i``;
    ``x_i <- x~_i + gamma * (sum_j W_ij x^_j - x^_i)``. Public copies start at 0 (at the
    ``reference``, if one is given: the engine gossips the offsets from it). Without
    compression and with ``gamma=1`` this is SGP. Needs a static topology: the copies of
    in-neighbours are only kept current by messages from a fixed set of in-neighbours.

    Args:
        topology: a static graph (``period == 1``).
        compressor: ``C`` (default ``Identity()``), a contraction (``QSGD`` only scaled).
        gamma: consensus step size in (0, 1]; None (default): ``default_consensus_lr(compressor,
            "choco", topology, faults)`` (:mod:`.step_size`): 2 times the compressor's quality (5 times
            on the 4-node directed ring), times the chance a message is committed under message loss;
            for ``TopK(0.01)`` 0.02 (0.05 on that ring), 1 for exact or 8-bit messages; 0.5 times
            the quality with ``RandomK``.
        transport, seed, faults, reference: as in :class:`PushSumGossip`. Under faults a message is committed
            to the public copies only when it reached every out-neighbour (:mod:`.faults`).
    State: ``"public"``, the copies ``x^_j`` of the local nodes and of their in-neighbours (all
    ``n`` nodes in simulation, ``{rank} + in-neighbours`` on a rank).
    """

    _state_names = ("public",)
    algorithm = "choco"

    def __init__(self, topology: Topology, compressor: Compressor | None = None, gamma: float | None = None,
                 transport=None, seed: int = 0, faults: FaultPlan | None = None, reference=None):
        super().__init__(topology, compressor if compressor is not None else Identity(), gamma, transport, seed,
                         faults, reference)  # checks the arguments' types first
        if topology.period != 1:
            raise ValueError(f"ChocoSGD needs a static topology, but {topology!r} changes every step "
                             f"(period {topology.period}); use DeepSqueeze or SGP on time-varying graphs")
        held = set(self._node_ids).union(*(topology.in_neighbors(i) for i in self._node_ids))
        self._state_nodes["public"] = sorted(held)
        self._public_row = {j: r for r, j in enumerate(self._state_nodes["public"])}
        self._chunks: dict[bool, list[list[tuple[int, int, int]]]] = {}

    def _public(self, node: int) -> torch.Tensor:
        return self._state["public"][self._public_row[node]]

    def _held_nodes(self, name, node):
        if name != "public":
            return super()._held_nodes(name, node)
        return sorted({node, *self.topology.in_neighbors(node)})

    def _committed(self, node: int) -> bool:
        """Whether ``node``'s message of this step reached all its out-neighbours (always without
        faults): only then is it added to the copies of ``x^_node`` (:mod:`.faults`)."""
        return not self._lost or not any((node, o) in self._lost for o in self.topology.out_neighbors(node))

    def _returned_edges(self, absent):
        """The edges whose share returns to the sender this step (:mod:`.faults`). With dense
        messages (``Identity``, ``Quantize``: a committed copy is the sender's model, and Choco at
        ``gamma = 1`` is SGP) every edge of a node whose message is not committed: its receivers do
        not mix that copy this step, as a lost SGP message. Mixing the stale copy instead keeps the
        mass too, but a push-sum weight reached 0 within a few steps at 50% loss (``z = x / w``
        then fails). With sparse or random messages only an absent node's edges: the receivers mix
        their unchanged copy and ``W`` stays static, which Choco needs to reach the exact average
        (returning the shares left it 0.8% off the optimum at 30% loss)."""
        if isinstance(self.compressor, (Identity, Quantize)):
            senders = {j for j, _ in self._lost}
            return frozenset((j, o) for j in senders for o in self.topology.out_neighbors(j))
        return frozenset((j, i) for j, i in self._lost if j in absent or i in absent)

    def _encode_message(self, k, params, msg, generator):
        # q_k = C(v_k), v_k = x~_k - x^_k = w_k [z~_k, 1] - x^_k, encoded segment by segment as x~_k
        # minus x^_k: TopK on the CPU reads both and never writes v_k (Compressor.encode_difference).
        # On regular graphs w_k stays exactly 1 and x~_k is the parameters themselves (the same bits
        # as scaling by 1.0, one pass less): layer-wise codecs read the tensors; Identity (one
        # segment) and non-contiguous tensors get v_k written tensor by tensor. Otherwise
        # self._flat holds x~_k first.
        node = self._node_ids[k]
        public = self._public(node)
        unit_weight = self._exact_scaling and self._device.type == "cpu" and self._w[k] == 1.0
        tensors_are_segments = self.compressor.layerwise and all(p.is_contiguous() for p in params)
        if unit_weight and not tensors_are_segments:
            row = self._state_views["public"][self._public_row[node]]
            for view, p, copy in zip(self._flat_views, params, row):
                torch.sub(p, copy, out=view)
            torch.sub(1.0, public[self._P:], out=self._flat[self._P:])
            self._encode(self._by_segment(self._flat), msg, generator, self._own_commit(k))
            return
        if unit_weight:  # the segments of x~_k: the non-empty tensors, then w_k
            x = [p.view(-1) for p in params if p.numel() > 0] + [self._w[k:k + 1]]
        else:
            x = self._by_segment(self._scaled_copy(k, params))
        self._encode(x, msg, generator, self._own_commit(k), minus=self._by_segment(public))

    def _own_commit(self, k):
        node = self._node_ids[k]
        return (self._public(node), 1.0) if self._committed(node) else None  # x^_k += q_k

    def _on_receive(self, received):
        # Copies of in-neighbours run by another process (distributed): x^_j += q_j, once each.
        remote = {j: msg for pairs in received.values() for j, msg in pairs if j not in self._node_ids}
        for j, msg in sorted(remote.items()):
            if self._committed(j):
                self._decode_add(msg, self._public(j), 1.0)

    def _update(self, updates, nodes):
        # SPEC 2 step 5 with d_k = sum_j c_kj x^_j (c_kk = W_kk - 1, c_kj = W_kj), folded into the
        # parameters without materialising d_k:
        #   z_k <- (w_old / w_new) z~_k + sum_j (gamma / w_new) c_kj x^_j,  w_new = w_old + gamma d_k[P].
        # All present nodes are updated together, one column chunk at a time (CPU: ~256K entries,
        # in cache): each chunk of a public copy is read from memory once for every node mixing
        # it, instead of once per (node, copy). Copies are added in node order on every backend.
        public = self._state["public"]
        ratios, terms = [], {}  # terms: public row -> [(position in updates, coefficient)]
        for u, (k, contributions) in enumerate(updates):
            coefficients = {}
            for n, (w, j, _) in enumerate(contributions):
                r = self._public_row[j]
                coefficients[r] = coefficients.get(r, 0.0) + (w - 1.0 if n == 0 else w)
            w_old = self._w[k]
            w_new = w_old + self.gamma * sum(c * public[r, self._P] for r, c in sorted(coefficients.items()))
            ratios.append(w_old / w_new)
            for r, c in coefficients.items():
                terms.setdefault(r, []).append((u, self.gamma / w_new * c))
            self._w[k] = w_new
        params = [nodes[k] for k, _ in updates]
        whole = not all(p.is_contiguous() for z in params for p in z)  # (only contiguous tensors split)
        # on regular graphs w stays exactly 1: scaling by w_old / w_new == 1.0 changes no bit (CPU check)
        rescaled = [u for u, r in enumerate(ratios) if self._device.type != "cpu" or r != 1.0]
        for chunk in self._column_chunks(whole):
            zs = [[self._chunk_piece(z[t], t, a, b) for t, a, b in chunk] for z in params]
            if rescaled:
                torch._foreach_mul_([p for u in rescaled for p in zs[u]], [ratios[u] for u in rescaled for _ in chunk])
            for r in sorted(terms):
                copy = [self._chunk_piece(self._state_views["public"][r][t], t, a, b) for t, a, b in chunk]
                users = terms[r]
                torch._foreach_addcmul_([p for u, _ in users for p in zs[u]], copy * len(users),
                                        [c for _, c in users for _ in copy])

    def _column_chunks(self, whole: bool) -> list[list[tuple[int, int, int]]]:
        """The parameter columns in update order, as chunks of pieces ``(tensor, start, stop)``:
        on the CPU (unless ``whole``) about ``_CHUNK`` entries a chunk, large tensors split and
        small ones grouped; on other devices, or ``whole``, one chunk of whole tensors."""
        key = whole or self._device.type != "cpu"
        if key not in self._chunks:
            if key:
                self._chunks[key] = [[(t, 0, n) for t, (_, n, _) in enumerate(self._param_slices)]]
            else:
                chunks, current, size = [], [], 0
                for t, (_, n, _) in enumerate(self._param_slices):
                    for a in range(0, n, _CHUNK):
                        b = min(n, a + _CHUNK)
                        current.append((t, a, b))
                        size += b - a
                        if size >= _CHUNK:
                            chunks.append(current)
                            current, size = [], 0
                self._chunks[key] = chunks + ([current] if current else [])
        return self._chunks[key]

    def _chunk_piece(self, tensor: torch.Tensor, t: int, a: int, b: int) -> torch.Tensor:
        """Entries ``a:b`` of parameter-shaped ``tensor`` (parameter ``t``): the tensor itself when
        the piece is whole, else a slice of its flat (contiguous) view."""
        return tensor if a == 0 and b == self._param_slices[t][1] else tensor.view(-1)[a:b]
