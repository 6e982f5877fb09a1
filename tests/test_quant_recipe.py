"""recipes/finetune_single.py end to end on a tiny model and the real AG News sample."""
import importlib.util
import json
import pathlib

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from lp_decentral_nlp.data import load_task
from lp_decentral_nlp.quant import QuantModule

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_recipe():
    spec = importlib.util.spec_from_file_location("finetune_single", REPO / "recipes" / "finetune_single.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module




@pytest.mark.parametrize("full_precision", [False, True])
def test_finetune_single_writes_results(full_precision, tiny_model_dir, ag_news_csv, tmp_path):
    out = tmp_path / "run"
    argv = ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples", "64",
            "--max-eval-samples", "32", "--max-length", "16", "--batch-size", "16", "--output-dir", str(out)]
    returned = load_recipe().main(argv + (["--full-precision"] if full_precision else []))
    results = json.loads((out / "results.json").read_text())
    assert results == json.loads(json.dumps(returned))
    assert results["precision"] == ("fp32" if full_precision else "8-bit")
    assert (results["quant_config"] is None) == full_precision
    # the kernel each 8-bit layer trained with: the tiny model's narrow layers run simulated under auto
    assert results["layer_kernels"] == ({} if full_precision else {name: "simulated" for name in results["layer_kernels"]})
    assert results["kernels"] == ({} if full_precision else {"simulated": len(results["layer_kernels"])})
    assert full_precision or len(results["layer_kernels"]) == 2 * 6  # 2 blocks x (q, k, v, out, 2 FFN)
    assert results["steps"] == 4 and results["train_samples"] == 64 and results["eval_samples"] == 32
    assert 0.0 <= results["accuracy"] <= 1.0 and results["wall_time_s"] > 0
    # model/: the fine-tuned model (8-bit layers re-made on load) and its tokenizer, which score what was evaluated
    model = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    assert any(isinstance(m, QuantModule) for m in model.modules()) != full_precision
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    test = load_task("ag_news", data_dir=str(ag_news_csv), tokenizer=tokenizer, max_length=16, max_train_samples=64,
                     max_eval_samples=32, seed=0)["test"]
    with torch.no_grad():
        predicted = [model(**{k: torch.tensor([row[k]]) for k in tokenizer.model_input_names if k in row})
                     .logits.argmax(-1).item() for row in test]
    assert sum(p == row["label"] for p, row in zip(predicted, test)) / len(test) == pytest.approx(results["accuracy"])
    assert sorted(p.name for p in out.iterdir()) == ["model", "results.json"]


def test_finetune_single_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        load_recipe().parse_args(["--lr", "0", "--output-dir", "x"])
    assert capsys.readouterr().err.endswith("error: argument --lr: must be in (0, inf), got 0\n")


def test_finetune_single_kernel_flag(tiny_model_dir, ag_news_csv, tmp_path, capsys):
    recipe = load_recipe()
    argv = ["--model", str(tiny_model_dir), "--data-dir", str(ag_news_csv), "--max-train-samples", "32",
            "--max-eval-samples", "16", "--max-length", "16", "--batch-size", "16", "--output-dir", str(tmp_path)]
    results = recipe.main(argv + ["--kernel", "int8"])  # honoured in every layer, narrow or not
    assert results["quant_config"]["kernel"] == "int8" and results["kernels"] == {"int8": 12}
    for bad, message in ((["--kernel", "int9"], "argument --kernel: must be one of ('auto', 'simulated', 'int8', "
                                                "'int8_bf16'), got 'int9'"),
                         (["--kernel", "int8", "--full-precision"], "argument --kernel: 'int8' is a kernel of 8-bit "
                          "training, and --full-precision trains in fp32: drop one of them")):
        with pytest.raises(SystemExit) as exit_:
            recipe.parse_args(["--output-dir", "x", *bad])
        assert exit_.value.code == 2 and capsys.readouterr().err.endswith(f"error: {message}\n")


def test_finetune_single_answers_bad_inputs_in_one_line(tiny_model_dir, ag_news_csv, tmp_path, capsys):
    recipe = load_recipe()
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "results.json").write_text('{"accuracy": 0.9}')
    header_only = tmp_path / "header.csv"
    header_only.write_text("label,title,description\n")
    def argv(**changes):
        flags = {"--model": tiny_model_dir, "--data-dir": ag_news_csv, "--max-length": 16,
                 "--output-dir": tmp_path / "run", **{f"--{k.replace('_', '-')}": v for k, v in changes.items()}}
        return [str(part) for flag, value in flags.items() for part in (flag, value)]

    for flags, message in (
            (argv(output_dir=finished),
             f"argument --output-dir: {finished} already holds another run's results (results.json): pass "
             "--overwrite_output_dir to write over them, or choose another folder"),
            (argv(data_dir=header_only), f"argument --data-dir: {header_only}: has a header line but no data rows"),
            (argv(max_length=1), "argument --max-length: must be in [2, inf), got 1"),
            (argv(max_length=200),
             f"argument --max-length: 200 exceeds the 128 positions of {tiny_model_dir} (max_position_embeddings): "
             "use at most 128"),
            (argv(model=tmp_path), f"argument --model: {tmp_path} is not a model folder (no config.json)"),
            ([*argv(), "--lr", "1e-3", "--lr", "1e-4"],
             "argument --lr: given more than once (--lr and --lr): give it once")):
        with pytest.raises(SystemExit) as exit_:
            recipe.main(flags)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err and err.endswith(f"finetune_single.py: error: {message}\n")
    assert (finished / "results.json").read_text() == '{"accuracy": 0.9}'
    assert not (tmp_path / "run").exists()
