"""Callbacks of the decentralized trainer."""
from __future__ import annotations

import csv
import os
from collections.abc import Callable

from transformers import TrainerCallback


class MetricsCSVCallback(TrainerCallback):
    """Append every logged dict as a row of a CSV file: one column per metric, ``step`` first and the
    others in alphabetical order, so that a run resumed from a checkpoint (whose log history
    ``TrainerState`` stores with sorted keys) writes the columns of the uninterrupted run. A row
    is appended; the file is written whole only when a row brings a new column (the first few
    logs of a run, evaluations), so a long run's logging stays a constant cost per row."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[dict] = []
        self.columns: list[str] | None = None  # the header of the file on disk (None: not written yet)

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run starts from the rows logged before its checkpoint (``state.log_history``)."""
        if not self.rows and state.log_history:
            self.rows = [{"step": h["step"], **{k: v for k, v in h.items() if k != "step"}} for h in state.log_history]

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add ``logs`` as a row (the main process writes the file)."""
        if not state.is_world_process_zero or logs is None:
            return
        row = {"step": state.global_step, **logs}
        self.rows.append(row)
        if self.columns is not None and set(row) <= set(self.columns):
            with open(self.path, "a", newline="", encoding="utf-8") as fh:
                csv.DictWriter(fh, fieldnames=self.columns).writerow(row)
            return
        self.columns = ["step", *sorted({k for r in self.rows for k in r} - {"step"})]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)


class TrainingKernelsCallback(TrainerCallback):
    """Keep the GEMM kernel every 8-bit layer of `model` ran in the latest training step
    (:func:`lp_decentral_nlp.quant.kernel_report` after each step, in ``kernels``; None before
    the first step).

    Read after training, this is what the layers trained with. ``kernel_report`` alone gives the
    kernel of each layer's last forward, an evaluation's if one came after the last step, or for
    a layer never called a prediction from its shape; under ``kernel="auto"`` a convolution picks
    its kernel per call from the call's size, so neither need be the training kernel.

    `model`: the model whose forwards train; under :class:`DecentralizedTrainer` a node,
    ``trainer.nodes[0]`` (``trainer.model``, the average, runs no training forward).
    """

    def __init__(self, model):
        self.model = model
        self.kernels: dict[str, str] | None = None

    def on_step_end(self, args, state, control, **kwargs):
        """Read the kernels the step's forwards ran."""
        from ..quant import kernel_report

        self.kernels = kernel_report(self.model)



class OnTrainBeginCallback(TrainerCallback):
    """Call ``action()`` when training begins, on the main process only: after a resumed run's
    checkpoint was read and accepted (``train()`` restores it before ``on_train_begin``), so what
    ``action`` writes is left as it was when the resume is refused. The recipes write their
    "running" ``results.json`` and ``cost_report.json`` this way."""

    def __init__(self, action: Callable[[], None]):
        self.action = action

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.action()
