"""Accuracy as a local `evaluate` metric module, so it loads without the hub.

`evaluate.load("accuracy")` fetches its script from the hub and fails offline; `evaluate.load`
on the path of this file works anywhere. Load it through
:func:`lp_decentral_nlp.data.accuracy_metric`. This file is imported by `evaluate` as a standalone
script: keep it free of package-relative imports.
"""
import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy: the fraction of predictions equal to the reference labels."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool): if False, return the number of correct predictions instead of the fraction.
Returns:
    accuracy (float): fraction (or count) of correct predictions.
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True):
        correct = np.asarray(predictions) == np.asarray(references)
        return {"accuracy": float(correct.mean() if normalize else correct.sum())}
