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
    sample_weight (list of float): weight of each sample (default: 1 each), as the hub's metric.
Returns:
    accuracy (float): fraction (or count) of correct predictions, weighted by sample_weight.
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                # float64, not int64: datasets would truncate a float prediction (0.9 -> 0) silently;
                # _compute refuses values that are not whole numbers instead
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        for name, values in (("predictions", predictions), ("references", references)):
            values = np.asarray(values, dtype=np.float64)
            fractional = np.flatnonzero(values != np.round(values))
            if fractional.size:
                raise ValueError(f"{name} must be class ids (whole numbers), got {float(values[fractional[0]])!r} at index "
                                 f"{int(fractional[0])}: take the argmax of the logits (or threshold a probability)")
        correct = (np.asarray(predictions) == np.asarray(references)).astype(np.float64)
        weights = np.ones_like(correct) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if weights.shape != correct.shape:
            raise ValueError(f"sample_weight must hold one weight per prediction ({len(correct)}), got shape "
                             f"{weights.shape}")
        score = float((correct * weights).sum())
        if not normalize:
            return {"accuracy": score}
        return {"accuracy": score / float(weights.sum()) if weights.sum() else float("nan")}  # no samples: NaN
