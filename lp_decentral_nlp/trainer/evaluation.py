"""Evaluation of a decentralized run: the averaged model ``mean_i z_i`` (SPEC 1) and every node."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm


class EvaluationMixin:
    """`DecentralizedTrainer`'s averaged model, consensus distance and evaluation."""


    def _float_state(self, model):
        return [t for t in model.state_dict().values() if t.is_floating_point()]

    @torch.no_grad()
    def _refresh_average_model(self):
        """``self.model`` <- mean_i z_i over parameters and float buffers (SPEC 1 evaluation model)."""
        sums = self.node_group.sum([self._float_state(node) for node in self.nodes])
        for dst, s in zip(self._float_state(self.model), sums):
            dst.copy_(s / self.args.num_nodes)
        # counters (e.g. act_num_batches, which switches 8-bit layers to their running range in
        # eval) advance in lock-step on every node: take the first local node's
        for dst, src in zip(self.model.state_dict().values(), self.nodes[0].state_dict().values()):
            if not dst.is_floating_point():
                dst.copy_(src)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """``1/n * sum_i ||z_i - mean z||^2`` over all parameters (SPEC 1)."""
        self._refresh_average_model()
        mean = list(self.model.parameters())
        local = torch.zeros(len(self.nodes), dtype=torch.float64)
        for k, node in enumerate(self.nodes):
            diffs = torch._foreach_sub(list(node.parameters()), mean)
            local[k] = sum(torch.linalg.vector_norm(d, dtype=torch.float64) ** 2 for d in diffs)
        return float(self.node_group.gather(local).mean())



    @torch.no_grad()
    def _eval_model(self, model, dataloader, desc: str) -> tuple[float, float]:
        """Mean loss and accuracy of ``model`` over ``dataloader``."""
        model.eval()
        metric = self._accuracy_metric()
        loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        for batch in tqdm(dataloader, desc=desc, leave=False, disable=self.args.disable_tqdm):
            batch = self._prepare_inputs(batch)
            out = model(**batch)
            n = batch["labels"].shape[0]
            loss_sum += out.loss.double() * n
            count += n
            metric.add_batch(predictions=out.logits.argmax(-1).cpu(), references=batch["labels"].cpu())
        return float(loss_sum) / max(count, 1), metric.compute()["accuracy"]

    def _accuracy_metric(self):
        from ..data import accuracy_metric

        if not hasattr(self, "_metric"):
            self._metric = accuracy_metric()
        return self._metric

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Accuracy and loss of the averaged model and of every node, consensus distance, bytes sent.

        Logged through `Trainer.log` (so callbacks and ``report_to`` integrations see it) and
        returned as a dict with keys ``{prefix}_accuracy``, ``{prefix}_loss``,
        ``{prefix}_accuracy_node_{i}``, ``{prefix}_loss_node_{i}``, ``{prefix}_consensus_distance``,
        ``bytes_sent_node_{i}``.
        """
        dataloader = self.get_eval_dataloader(eval_dataset)
        p = metric_key_prefix
        metrics = {f"{p}_consensus_distance": self.consensus_distance()}  # also refreshes self.model
        metrics[f"{p}_loss"], metrics[f"{p}_accuracy"] = self._eval_model(self.model, dataloader, "eval: average")
        node_metrics = torch.tensor([self._eval_model(node, dataloader, f"eval: node {i}")
                                     for i, node in zip(self.node_ids, self.nodes)], dtype=torch.float64)
        for i, (loss, acc) in enumerate(self.node_group.gather(node_metrics).tolist()):
            metrics[f"{p}_loss_node_{i}"], metrics[f"{p}_accuracy_node_{i}"] = loss, acc
        metrics.update({f"bytes_sent_node_{i}": int(v) for i, v in enumerate(self.node_group.gather(self.bytes_sent))})
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """A plain (unsharded) loader: every process evaluates on the whole evaluation set."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        dataset = self._remove_unused_columns(dataset, description="evaluation")
        return DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator,
                          num_workers=self.args.dataloader_num_workers)

