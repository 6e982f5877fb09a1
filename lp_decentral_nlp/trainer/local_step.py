"""One SPEC 2 iteration of the local nodes: each node's gradient, NaN/Inf check, clipping and
optimizer update, then one gossip step."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.utils import logging

from ..gossip import QuasiGlobalAdam

logger = logging.get_logger(__name__)


class NonFiniteError(FloatingPointError):
    """A node's loss or gradient is NaN or infinite; raised before that node's update is applied or gossiped.

    Attributes:
        node: the graph node.
        step: the training step (1-based: the ``global_step`` the step would have reached).
    """

    def __init__(self, message: str, node: int, step: int):
        super().__init__(message)
        self.node, self.step = node, step


class LocalStepMixin:
    """`DecentralizedTrainer`'s iteration: local steps node by node, then gossip (SPEC 2)."""

    def _iteration(self, batches) -> None:
        """One SPEC 2 iteration of every local node.

        Step 1 (gradient at z_i on a local batch, optimizer update) runs node by node
        (:meth:`_local_step`); steps 2-5 are one gossip step. With QGM the momentum, driven by the
        change of z_i across the whole iteration, enters the update: SGD adds ``beta * m`` to the
        gradient before ``optimizer.step()``; Adam/AdamW steps with
        :class:`~lp_decentral_nlp.gossip.QuasiGlobalAdam` (the quasi-global buffer as the first
        moment, the second moment local) instead of ``optimizer.step()``, at the LR of the
        optimizer's schedule. An iteration at LR 0 (the first of a linear warm-up) moves no
        parameter and leaves the QGM state as it is (the momentum is recovered from
        ``(z(t) - z(t+1)) / lr``). A node absent under the fault plan takes no step and its QGM
        state does not move; its LR schedule still advances (a metric-driven schedule steps after
        evaluations instead: :meth:`_step_schedules_on_metric`).
        """
        t = self.state.global_step
        self._average_is_current = False  # the nodes move: self.model is no longer their average
        absent = self.fault_plan.absent(t) if self.fault_plan else frozenset()
        lr = self._step_lr = self.node_optimizers[0].param_groups[0]["lr"]
        qgm = self.qgm if self.qgm is not None and lr > 0 else None
        if qgm is not None:
            qgm.begin_iteration()
        per_step_schedule = not self._schedule_steps_on_metric()  # else stepped after evaluations
        for k, (i, node, micro_batches, optimizer, scheduler) in enumerate(
                zip(self.node_ids, self.nodes, batches, self.node_optimizers, self.node_schedulers)):
            if i not in absent:
                self._local_step(k, node, micro_batches, optimizer, t + 1, qgm)
                self.current_flos += sum(float(self.floating_point_ops(batch)) for batch in micro_batches)
                if self.args.include_num_input_tokens_seen != "no":
                    self._input_tokens += self._count_input_tokens(micro_batches)
            if per_step_schedule:
                scheduler.step()
        stats = self.gossip.step(self.node_params)
        self.bytes_sent += torch.as_tensor(stats.bytes_sent, dtype=torch.int64)
        if self.fault_plan is not None:  # an absent node sent nothing; a present one's lost messages count
            for k, i in enumerate(self.node_ids):
                if i in absent:
                    self.absent_steps[k] += 1
                else:
                    self.lost_messages[k] += sum(1 for sender, _ in stats.lost_edges if sender == i)
        if isinstance(qgm, QuasiGlobalAdam):  # updates the nodes that stepped
            qgm.end_iteration(lr)
        elif qgm is not None:  # an absent node's momentum does not move either
            qgm.end_iteration(lr, skip={k for k, i in enumerate(self.node_ids) if i in absent})

    def _local_step(self, k: int, node, micro_batches: list, optimizer, step: int, qgm=None) -> None:
        """SPEC 2 step 1 of local node ``k``: gradient, NaN/Inf check, clipping, optimizer update
        (with ``qgm``, the iteration's quasi-global momentum or None, as :meth:`_iteration` says).

        The gradient is that of the loss over all ``micro_batches`` together
        (``gradient_accumulation_steps`` of them, weighted by :meth:`_accumulation_weights`: the
        mean over every label of the node's batch, as one batch of them all would give), and the
        logged loss is that loss. Callbacks see the node's substeps and update (:meth:`_node_event`).

        The node's gradients are freed right after its update, so only one node's gradients exist
        at a time and the next node's backward reuses their memory (with all ``n`` alive until
        every backward had run, each backward of a simulated round page-faulted in fresh memory on
        the CPU and ran 24-38% slower than a plain step). A non-finite node raises
        :class:`NonFiniteError` before its own update (nodes earlier in this iteration have taken
        theirs, as other ranks have in the distributed backend) or, with ``skip_nonfinite``, keeps
        its parameters and running statistics.

        With float16 mixed precision the node's loss is scaled by its own ``GradScaler``
        (``node_scalers[k]``) before each backward and its gradients unscaled before the check, so
        clipping, QGM and the logged ``grad_norm`` see the true gradient. A finite loss with a
        non-finite gradient is the scaler's overflow: the node skips this update (counted in
        ``overflow_skips``, no error) and its scale backs off, as ``GradScaler.step`` does; a
        non-finite loss is treated as above.
        """
        # the forward also updates running statistics (8-bit activation ranges, norm statistics):
        # a skipped step must leave them as they were, or one NaN batch poisons them for good
        buffers = [b.clone() for b in node.buffers()] if self.args.skip_nonfinite else None
        weights, num_items = self._accumulation_weights(micro_batches)
        scaler = self.node_scalers[k] if self.node_scalers is not None else None
        loss = 0.0
        for j, (batch, weight) in enumerate(zip(micro_batches, weights)):
            micro_loss = self._backward(k, node, batch, weight, num_items, scaler)
            if weight:  # a micro-batch without a label has a NaN mean loss and no say
                loss = loss + weight * micro_loss
            if j < len(micro_batches) - 1:
                self._node_event("on_substep_end", k)
        # unscale_ and update need a gradient to inspect: a node whose micro-batches all lack labels
        # (weight 0: no backward) has none, and nothing to learn: it takes no update this step
        scaled = scaler is not None and any(weights)
        if scaled:
            scaler.unscale_(optimizer)
        if any(weights):
            outcome = self._finite_then_clip(k, loss, step, overflow_possible=scaled)
        else:
            outcome = "unlabelled"
            logger.info(f"node {self.node_ids[k]}, step {step}: no label in its batch (all -100); no update")
        if outcome == "step":
            self._node_event("on_pre_optimizer_step", k)
            if qgm is None:
                optimizer.step()
            else:
                # a parameter the loss does not reach has no gradient: a zero one (SGD's step skips
                # it, the momentum added goes nowhere; QuasiGlobalAdam moves it by momentum and decay)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in node.parameters()
                         if p.requires_grad]  # qgm's parameters: the gossiped ones
                if isinstance(qgm, QuasiGlobalAdam):
                    qgm.step(k, grads, optimizer.param_groups[0]["lr"])
                else:
                    qgm.add_momentum(k, grads)
                    optimizer.step()
            self._node_event("on_optimizer_step", k)
        elif outcome == "skip" and buffers is not None:  # an overflow's forward was finite: its statistics stand
            torch._foreach_copy_(list(node.buffers()), buffers)
        if outcome in ("step", "overflow"):  # an overflow's loss is the node's true one (else the logs read NaN)
            self._loss_sum[k] += loss  # device-side adds: no host-to-device copy (a sync) per step
            self._loss_count[k] += 1
        if scaled:
            scaler.update()  # backs off after an overflow unscale_ found, grows after growth_interval clean steps
        optimizer.zero_grad(set_to_none=True)

    def _count_input_tokens(self, micro_batches: list) -> int:
        """Tokens of a node's micro-batches as ``include_num_input_tokens_seen`` counts them, as
        Trainer does: ``"all"`` every position of the model's main input (``main_input_name``,
        ``(batch, seq_len)``), ``"non_padding"`` the ones of ``attention_mask`` (without one, the
        ids that are not the tokenizer's pad id). Read from the loader's CPU tensors: no device
        sync. ValueError when the batches lack the main input."""
        name = getattr(self.nodes[0], "main_input_name", "input_ids")
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        total = 0
        for batch in micro_batches:
            if name not in batch:
                raise ValueError(f"include_num_input_tokens_seen={self.args.include_num_input_tokens_seen!r} counts "
                                 f"the model's main input {name!r}, which the training batches lack "
                                 f"(they hold {sorted(batch)}): set it to 'no'")
            if self.args.include_num_input_tokens_seen == "all":
                total += batch[name].numel()
            elif "attention_mask" in batch:
                total += int(batch["attention_mask"].sum())
            elif pad_id is not None:
                total += int((batch[name] != pad_id).sum())
            else:
                raise ValueError("include_num_input_tokens_seen='non_padding' needs an attention_mask in the batches or "
                                 "a processing_class with a pad_token_id to tell padding apart: use 'all'")
        return total

    def floating_point_ops(self, inputs) -> int:
        """`Trainer.floating_point_ops` (``6 * tokens * non-embedding parameters``, 0 without the
        model's main input), with Trainer's per-token count taken once: transformers counts the
        parameters at every call (about 0.7 ms on MiniLM), and this runs per node and micro-batch."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs:
            return 0
        if self._flos_per_token is None:
            self._flos_per_token = super().floating_point_ops({main_input: torch.empty(1)})
        return self._flos_per_token * inputs[main_input].numel()

    def store_flos(self) -> None:
        """Add every process's floating-point operations since the last call (Trainer's
        ``floating_point_ops`` of each node's micro-batches: ``6 * tokens * parameters`` for a
        transformers model) to ``state.total_flos``, as Trainer does at logs, checkpoints and the
        end of training (a collective in the distributed backend: every rank calls it)."""
        pending = torch.tensor([self.current_flos], dtype=torch.float64)
        self.state.total_flos += float(self.node_group.gather(pending).sum())
        self.current_flos = 0.0

    def _collect_input_tokens(self) -> None:
        """Add every process's tokens read since the last call to ``state.num_input_tokens_seen``
        (a collective in the distributed backend: every rank calls it, at each log and checkpoint)."""
        pending = torch.tensor([self._input_tokens], dtype=torch.int64)
        self.state.num_input_tokens_seen += int(self.node_group.gather(pending).sum())
        self._input_tokens = 0

    def _node_event(self, event: str, k: int) -> None:
        """`Trainer`'s per-update callback ``event`` (``on_substep_end`` after each micro-batch but
        the last, ``on_pre_optimizer_step`` after clipping, ``on_optimizer_step`` after the update)
        for local node ``k``: the callbacks get that node's model, optimizer and LR schedule as
        ``model``, ``optimizer`` and ``lr_scheduler`` (its gradients are there until the update
        ends), and its graph index as ``node``. So they run once per node per step."""
        handler = self.callback_handler
        kept = handler.model, handler.optimizer, handler.lr_scheduler
        handler.model, handler.optimizer, handler.lr_scheduler = \
            self.nodes[k], self.node_optimizers[k], self.node_schedulers[k]
        try:
            self.control = handler.call_event(event, self.args, self.state, self.control, node=self.node_ids[k])
        finally:
            handler.model, handler.optimizer, handler.lr_scheduler = kept

    def _finite_then_clip(self, k: int, loss: torch.Tensor, step: int, overflow_possible: bool = False) -> str:
        """``"step"`` when local node ``k``'s loss and gradients are all finite: their total L2 norm
        is then kept for the logs (``grad_norm``) and they are clipped to ``max_grad_norm`` (when > 0),
        as ``clip_grad_norm_`` does; otherwise ``"skip"`` or ``"overflow"`` (below).

        One ``_foreach_norm`` over the gradients serves both: a NaN/Inf entry makes its tensor's
        norm non-finite, and the total of those norms is what clipping scales by. Checking first
        keeps one bad entry from spreading to every gradient before it is named. One host sync.
        A flagged node is confirmed entry by entry (a norm can also overflow on finite entries),
        then raises :class:`NonFiniteError`, or gives ``"skip"`` and is counted in
        ``nonfinite_skips`` under ``args.skip_nonfinite``. With ``overflow_possible`` (gradients
        unscaled by a float16 loss scaler), a finite loss with a non-finite gradient gives
        ``"overflow"`` and is counted in ``overflow_skips``: the scaler's overflow, not the model's.
        """
        params = [p for p in self.nodes[k].parameters() if p.grad is not None]
        norms = torch._foreach_norm([p.grad for p in params]) if params else []
        finite = torch.isfinite(torch.stack([loss.float(), *[n.float() for n in norms]])).all()
        if not (bool(finite) or self._all_finite(k, loss)):
            if overflow_possible and bool(torch.isfinite(loss)):
                self.overflow_skips[k] += 1
                logger.info(f"node {self.node_ids[k]}, step {step}: float16 gradient overflow; update skipped and the "
                            f"loss scale lowered")
                return "overflow"
            if not self.args.skip_nonfinite:
                raise NonFiniteError(self._nonfinite_message(k, step, loss) + ": stopped before the update and before "
                                     "gossip; pass skip_nonfinite=True (--skip-nonfinite) to skip such steps, or lower "
                                     "the learning rate", self.node_ids[k], step)
            self.nonfinite_skips[k] += 1
            logger.warning(self._nonfinite_message(k, step, loss) + "; skipped (skip_nonfinite)")
            return "skip"
        if params:
            total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))  # = get_total_norm
            self._grad_norm[k] = total  # before clipping, as Trainer logs it; on the device: no sync
            if self.args.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, total)
        return "step"

    def _all_finite(self, k: int, loss: torch.Tensor) -> bool:
        """Entry-by-entry check of local node ``k``'s loss and gradients (slow; flagged nodes only)."""
        return bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(p.grad).all())
                                                        for p in self.nodes[k].parameters() if p.grad is not None)

    def _nonfinite_message(self, k: int, step: int, loss: torch.Tensor) -> str:
        where = f"node {self.node_ids[k]}, step {step}"
        if not torch.isfinite(loss):
            return f"{where}: non-finite loss ({float(loss)})"
        for name, p in self.nodes[k].named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                kind = "nan" if torch.isnan(p.grad).any() else "inf"
                return f"{where}: non-finite gradient ({kind}) in {name}"
        return f"{where}: non-finite gradient"

    def _accumulation_weights(self, micro_batches: list) -> tuple[list[float], torch.Tensor | None]:
        """``(weights, num_items_in_batch)`` of one node's ``micro_batches``: each micro-batch's loss
        (a mean over its labels) enters the node's loss times its weight, its share of the labels
        that are not ``-100`` (of ``labels[..., 1:]`` for a causal LM, whose loss shifts them; of
        ``shift_labels`` when the collator gives them), so the node's loss is the mean over every
        label of the accumulated batch, the loss `Trainer` normalises by ``num_items_in_batch``.
        Without a label tensor each weighs ``1 / len(micro_batches)``; a micro-batch whose labels
        are all ``-100`` weighs 0 and is not back-propagated (its mean loss is NaN), and when all
        do the node takes no update (:meth:`_local_step`). Labels are counted on the loader's
        tensors, before they move to the device: no device sync.

        With ``compute_loss_func`` (or a subclass's ``loss_is_scaled_for_ga = True``) the loss is
        the function's, normalised by the ``num_items_in_batch`` it is given (Trainer's contract):
        each weighs 1. The model is never given ``num_items_in_batch``: a model whose forward takes
        ``**kwargs`` but computes its own mean loss (DistilBERT's classifiers) would be scaled twice."""
        k = len(micro_batches)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers >= 5
        if scaled is None:
            scaled = getattr(self, "compute_loss_func", None) is not None  # transformers >= 4.46
        counts = [self._label_count(batch) for batch in micro_batches]
        total = None if None in counts else sum(counts)
        if scaled:
            items = None if total is None else torch.tensor(total, device=self.args.device)
            return [0.0 if total == 0 else 1.0] * k, items
        if total is None:
            return [1.0 / k] * k, None
        return [count / total if total else 0.0 for count in counts], None

    def _label_count(self, batch) -> int | None:
        """Labels of ``batch`` a loss averages over (not ``-100``; see :meth:`_accumulation_weights`),
        or None when it holds no label tensor."""
        if not isinstance(batch, Mapping):  # a dict, or a collator's BatchEncoding
            return None
        labels = batch.get("shift_labels")
        if labels is None:
            labels = batch.get("labels")
            if torch.is_tensor(labels) and self._loss_shifts_labels and labels.dim() >= 2:
                labels = labels[..., 1:]
        return int(labels.ne(-100).sum()) if torch.is_tensor(labels) else None

    def _backward(self, k: int, node, batch, scale: float = 1.0, num_items_in_batch: torch.Tensor | None = None,
                  scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
        """Loss of local node ``k`` at z_k on ``batch``; its gradient times ``scale`` is added to
        the node's ``.grad`` (in that node's RNG stream), times the loss scale of ``scaler`` too
        when given (float16). ``num_items_in_batch`` goes to ``compute_loss`` when given
        (:meth:`_accumulation_weights`)."""
        node.train()
        with self._rng.activate(self.node_ids[k]):
            batch = self._prepare_inputs(batch)
            with self.compute_loss_context_manager(), self._checking_output_form(node):
                if num_items_in_batch is None:
                    loss = self.compute_loss(node, batch)
                else:
                    loss = self.compute_loss(node, batch, num_items_in_batch=num_items_in_batch)
            if scale:  # weight 0: no label to learn from (the forward still runs, as Trainer's would)
                weighted = loss * scale if scale != 1.0 else loss
                (weighted if scaler is None else scaler.scale(weighted)).backward()
        return loss.detach()

