"""The package is lazy (docs/design.md, "Lazy imports"): importing it, or the recipes' command-line
package, loads neither torch nor transformers; its public names still work, and a saved 8-bit model
reloads with ``from_pretrained`` whichever of transformers and lp_decentral_nlp is imported first.
Every check runs in a fresh interpreter, since this one has long imported everything."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

import lp_decentral_nlp
from lp_decentral_nlp import QuantConfig, quantize_model

REPO = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "numpy", "datasets", "accelerate")


def run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this checkout; fails the test on a nonzero exit."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_every_source_file_compiles_without_a_warning():
    """An invalid escape such as ``"\\ "`` in a docstring is a SyntaxWarning on Python 3.12, printed
    on the first import of the module (seen on the GPU machine's Python 3.12)."""
    import warnings

    for path in sorted(p for folder in ("lp_decentral_nlp", "benchmarks", "recipes", "tests")
                       for p in (REPO / folder).rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(encoding="utf-8"), str(path), "exec")


def loaded_after(statement: str) -> list[str]:
    """The heavy libraries (:data:`HEAVY`) in ``sys.modules`` after running ``statement``."""
    proc = run_python(f"import sys, json\n{statement}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("statement", [
    "import lp_decentral_nlp",
    "import lp_decentral_nlp.quant",
    "import lp_decentral_nlp.checks",
    "import lp_decentral_nlp.commands",
    "from lp_decentral_nlp.commands import ALIASES, OneLineParser, Range, check_flags, ranged, recipe_main",
])
def test_importing_the_package_loads_no_heavy_library(statement):
    assert loaded_after(statement) == []


def test_public_names_import_their_subpackage_on_first_use():
    proc = run_python("import sys, lp_decentral_nlp\n"
                      "assert 'lp_decentral_nlp.quant.surgery' not in sys.modules\n"
                      "from lp_decentral_nlp import QuantConfig, quantize_model\n"
                      "from lp_decentral_nlp.quant.surgery import quantize_model as defined\n"
                      "assert quantize_model is defined and QuantConfig().bits == 8\n"
                      "print(sorted(set(lp_decentral_nlp.__all__) - set(dir(lp_decentral_nlp))))\n"
                      "print(lp_decentral_nlp.gossip.__name__)")
    assert proc.stdout.splitlines() == ["[]", "lp_decentral_nlp.gossip"]
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        lp_decentral_nlp.no_such_name  # noqa: B018
    assert set(lp_decentral_nlp.__all__) <= set(dir(lp_decentral_nlp))
    # what __init__ imported to work is not listed (dir showed annotations, importlib, sys, lazy_namespace)
    assert not {"annotations", "importlib", "sys", "lazy_namespace"} & set(dir(lp_decentral_nlp))
    assert "lazy_namespace" not in dir(lp_decentral_nlp.quant) and "Path" not in dir(lp_decentral_nlp.data)


@pytest.fixture(scope="module")
def saved_8bit(tmp_path_factory):
    """A tiny 8-bit BERT saved with save_pretrained (its config names the "lp_decentral_nlp" quantizer)."""
    folder = tmp_path_factory.mktemp("bert8")
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=2))
    quantize_model(model, QuantConfig())
    model.train()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (2, 8)))  # sets the activation ranges
    model.eval().save_pretrained(folder)
    return folder


RELOAD = """
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
print("registered" if "lp_decentral_nlp" in AUTO_QUANTIZER_MAPPING else "not registered")
from transformers import AutoModelForSequenceClassification
model = AutoModelForSequenceClassification.from_pretrained({folder!r})
print(sorted({{type(m).__name__ for m in model.modules() if type(m).__module__.startswith("lp_decentral_nlp")}}))
"""


@pytest.mark.parametrize("first", [
    "import lp_decentral_nlp\nimport sys\nassert 'torch' not in sys.modules and 'transformers' not in sys.modules",
    "import transformers\nimport lp_decentral_nlp",
    "import transformers.quantizers\nimport lp_decentral_nlp",  # the registry already loaded: registers at once
])
def test_a_saved_8bit_model_reloads_whichever_library_is_imported_first(first, saved_8bit):
    lines = run_python(first + RELOAD.format(folder=str(saved_8bit))).stdout.splitlines()
    assert lines[0] == "registered"
    assert lines[-1] == "['QuantLinear']"  # the 8-bit layers of the surgery, not nn.Linear


def test_without_the_package_transformers_does_not_know_the_quantizer(saved_8bit):
    """The reload above is the package's doing: without importing it the method is unknown."""
    proc = run_python("from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING\n"
                      "print('lp_decentral_nlp' in AUTO_QUANTIZER_MAPPING)")
    assert proc.stdout.splitlines()[-1] == "False"
