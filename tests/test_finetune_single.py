"""recipes/finetune_single.py's command line: the progress bar, --threads, --data-dir's message, --help and Ctrl-C."""
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from helpers import saved_decoder_only_model, saved_encoder_decoder_model

from lp_decentral_nlp import load_quantized
from lp_decentral_nlp.quant import QuantModule

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune_single.py"


def load_recipe():
    spec = importlib.util.spec_from_file_location("finetune_single", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_argv(model_dir, csv, out):
    return ["--model", str(model_dir), "--data-dir", str(csv), "--max-train-samples", "32", "--max-eval-samples", "16",
            "--max-length", "16", "--batch-size", "16", "--output-dir", str(out)]


def test_decoder_only_and_encoder_decoder_models_train(minilm_path, ag_news_csv, tmp_path):
    """A GPT-2 (no padding token) was refused naming --batch-size; a BART's evaluation, whose
    predictions are a tuple (logits, the encoder's states), failed in the accuracy metric."""
    for name, save in (("gpt2", saved_decoder_only_model), ("bart", saved_encoder_decoder_model)):
        folder = save(tmp_path / name, minilm_path)
        results = load_recipe().main(tiny_argv(folder, ag_news_csv, tmp_path / f"run_{name}"))
        assert 0 <= results["accuracy"] <= 1 and results["precision"] == "8-bit", name


def test_task_text_trains_on_the_users_own_classes(tiny_model_dir, tmp_path, capsys):
    """The single-model baseline of recipes/text_*.py: it read AG News only."""
    data = tmp_path / "reviews.csv"
    data.write_text("text,label\n" + "".join(f"review {i},{('bad', 'good')[i % 2]}\n" for i in range(40)))
    results = load_recipe().main(["--task", "text", *tiny_argv(tiny_model_dir, data, tmp_path / "run")])
    assert 0 <= results["accuracy"] <= 1
    assert load_quantized(tmp_path / "run" / "model").config.id2label == {0: "bad", 1: "good"}
    with pytest.raises(SystemExit) as exc:
        load_recipe().main(["--task", "text", "--output-dir", str(tmp_path / "refused")])
    assert exc.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "finetune_single.py: error: argument --data-dir: the text task trains on your own data: give a CSV file with "
        "text,label columns, a folder of train.csv (and test.csv, validation.csv), or a DatasetDict.save_to_disk folder")


def test_progress_bar_threads_and_the_saved_8bit_model(tiny_model_dir, ag_news_csv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # --threads wins over it
    torch.set_num_threads(2)
    results = load_recipe().main([*tiny_argv(tiny_model_dir, ag_news_csv, tmp_path / "run"), "--threads", "1"])
    assert torch.get_num_threads() == 1 and results["args"]["threads"] == 1
    assert json.loads((tmp_path / "run" / "results.json").read_text())["args"]["threads"] == 1
    assert re.search(r"100%\|[^\n]*\| 2/2 \[", capsys.readouterr().err)  # transformers' training bar, 2 steps
    # what the docstring says reloads the 8-bit layers
    assert any(isinstance(m, QuantModule) for m in load_quantized(tmp_path / "run" / "model").modules())
    # and trains on as it was made; --full-precision or another --kernel with it is one line, exit 2
    capsys.readouterr()
    saved = tmp_path / "run" / "model"
    for flags, message in ((["--full-precision"], f"argument --full-precision: {saved} has 8-bit layers (an 8-bit "
                                                  "checkpoint), and --full-precision trains in full precision"),
                           (["--kernel", "int8"], f"argument --kernel: {saved} has 8-bit layers made with kernel "
                                                  "auto: leave --kernel at auto")):
        with pytest.raises(SystemExit) as exc:
            load_recipe().main([*tiny_argv(saved, ag_news_csv, tmp_path / "refused"), *flags])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exc.value.code == 2 and err.startswith(f"finetune_single.py: error: {message}"), err
    again = load_recipe().main(tiny_argv(saved, ag_news_csv, tmp_path / "again"))
    assert again["precision"] == "8-bit" and again["quant_config"] == results["quant_config"]


@pytest.mark.parametrize("argv, environment, message", [
    (["--threads", "0"], {}, "argument --threads: must be in [1, "),
    ([], {"OMP_NUM_THREADS": "abc"}, "environment variable OMP_NUM_THREADS='abc' must be a whole number >= 1"),
    # OpenMP reads the variable as torch loads, whatever --threads says (it advised --threads, then libgomp warned)
    (["--threads", "1"], {"OMP_NUM_THREADS": "abc"}, "environment variable OMP_NUM_THREADS='abc' must be a whole "
                                                     "number >= 1\n"),
])
def test_bad_thread_settings_are_one_line(argv, environment, message, tmp_path, monkeypatch, capsys):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        load_recipe().parse_args([*argv, "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith(f"finetune_single.py: error: {message}"), err


def test_overwrite_output_dir_removes_the_previous_runs_outputs(tiny_model_dir, ag_news_csv, tmp_path, capsys):
    """A --full-precision run over an 8-bit one's folder kept the 8-bit run's model card, kernels and
    checkpoints beside the new weights; files the user put there stay. --output_dir is also accepted."""
    out = tmp_path / "run"
    load_recipe().main(tiny_argv(tiny_model_dir, ag_news_csv, out))
    (out / "model" / "README.md").write_text("an 8-bit run's card")
    (out / "checkpoint-7").mkdir()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    argv = [a if a != "--output-dir" else "--output_dir" for a in tiny_argv(tiny_model_dir, ag_news_csv, out)]
    results = load_recipe().main([*argv, "--full-precision", "--overwrite_output_dir"])
    assert results["precision"] == "fp32" and results["wall_time_s"] > results["train_runtime_s"]
    assert "notice: --overwrite-output-dir removed the previous run's checkpoint-7, model, results.json from" \
        in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["model", "notes.txt", "results.json"]
    assert not (out / "model" / "README.md").exists() or "8-bit run" not in (out / "model" / "README.md").read_text()


def test_data_dir_message_names_what_this_recipe_reads(tmp_path, capsys):
    text = tmp_path / "sentence_length.txt"
    text.write_text("tr\t0\tA sentence .\n")
    with pytest.raises(SystemExit) as exc:
        load_recipe().parse_args(["--data-dir", str(text), "--output-dir", str(tmp_path / "run")])
    assert exc.value.code == 2 and capsys.readouterr().err == (
        f"finetune_single.py: error: argument --data-dir: {text} is not a .csv file: the data is read from a CSV file, "
        "a folder of CSV files or a DatasetDict.save_to_disk folder\n")


def test_help_states_every_flag_and_its_default(capsys):
    with pytest.raises(SystemExit) as exc:
        load_recipe().parse_args(["--help"])
    assert exc.value.code == 0
    entries = re.split(r"\n(?=  -)", capsys.readouterr().out.split("\noptions:\n")[1])[1:]  # after -h
    for entry in entries:
        flag_and_metavar = 1 if "--full-precision" in entry or "--overwrite" in entry else 2
        help_text, _, default = " ".join(entry.split()).partition("(default")
        assert default and len(help_text.split()) > flag_and_metavar + 1, entry
    assert any(entry.split()[0] == "--threads" for entry in entries)


def test_ctrl_c_is_one_line_and_exit_130(tiny_model_dir, ag_news_csv, tmp_path):
    code = ("import sys, transformers, importlib.util\n"
            "def interrupted(self, *args, **kwargs):\n"
            "    raise KeyboardInterrupt\n"
            "transformers.Trainer.train = interrupted\n"
            f"spec = importlib.util.spec_from_file_location('finetune_single', {str(RECIPE)!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "module.main(sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-c", code, *tiny_argv(tiny_model_dir, ag_news_csv, tmp_path / "run")],
                          capture_output=True, text=True)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.endswith("finetune_single.py: interrupted: the run did not finish: run it again (with "
                                "--overwrite-output-dir if --output-dir holds files of it)\n")


def test_flags_take_the_transformers_spelling_as_the_decentralized_recipes_do(ag_news_csv, tmp_path):
    """Only --output_dir and --overwrite_output_dir had an underscore twin: --learning_rate,
    --num_train_epochs, --per_device_train_batch_size, --max_length, --data_dir ... were unrecognized,
    while the README said the recipes take the transformers spelling."""
    short = ["--lr", "1e-4", "--epochs", "2", "--batch-size", "8", "--max-length", "32", "--data-dir", str(ag_news_csv),
             "--max-train-samples", "64", "--max-eval-samples", "16", "--kernel", "simulated", "--output-dir",
             str(tmp_path / "run")]
    spelled = ["--learning_rate", "1e-4", "--num_train_epochs", "2", "--per_device_train_batch_size", "8",
               "--max_length", "32", "--data_dir", str(ag_news_csv), "--max_train_samples", "64", "--max_eval_samples",
               "16", "--quant_kernel", "simulated", "--output_dir", str(tmp_path / "run")]
    recipe = load_recipe()
    assert vars(recipe.parse_args(spelled)) == vars(recipe.parse_args(short))
    assert recipe.parse_args(["--full_precision", "--output_dir", str(tmp_path / "run")]).full_precision
    hyphenated = [flag.replace("_", "-") if flag.startswith("--") else flag for flag in spelled]
    assert vars(recipe.parse_args(hyphenated)) == vars(recipe.parse_args(short))


def test_paths_after_flag_equals_read_tilde_as_home(ag_news_csv, tmp_path, monkeypatch, tiny_model_dir):
    """--output-dir=~/ftout (the shell leaves '~' after '=') put model/ and results.json in ./~/ftout
    while transformers made $HOME/ftout; --data-dir=~/... and --model=~/... were refused."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(ag_news_csv, tmp_path / "ag.csv")
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    args = load_recipe().parse_args(["--output-dir=~/ftout", "--data-dir=~/ag.csv", "--model=~/model"])
    assert (args.output_dir, args.data_dir, args.model) == (
        str(tmp_path / "ftout"), str(tmp_path / "ag.csv"), str(tmp_path / "model"))
