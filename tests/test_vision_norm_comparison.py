"""benchmarks/vision_norm_comparison.py: what --skip-existing reuses and redoes, flags and outputs refused
before any run, the published comparison's outputs, and Ctrl-C."""
import json
import pathlib
import re

import pytest
from helpers import load_benchmark

from lp_decentral_nlp.commands import run_config, threads_to_use

REPO = pathlib.Path(__file__).resolve().parents[1]
# a run of a few steps: 2 nodes, batch 8, 5% of an epoch of digits
TINY = ["--runs", "evonorm:fp32", "--nodes", "2", "--batch-size", "8", "--epochs", "0.05", "--eval-steps", "100"]


@pytest.fixture
def comparison(tmp_path, monkeypatch):
    """The script, its records sent to tmp_path/records (the repository's stay as they are)."""
    module = load_benchmark("vision_norm_comparison")
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path / "records")
    return module


def outputs(out):
    """Flags naming a comparison's own outputs in `out` (a subset of the runs must name its plot)."""
    return ["--output-dir", str(out), "--plot", str(out / "plot.png")]


def finished_run(comparison, out, *argv, status="done"):
    """A results.json as the vision recipe writes it for the run `flags` ask for (no training)."""
    from lp_decentral_nlp.vision.recipe import parse_vision_args

    args = comparison.parse_args(["--runs", "evonorm:fp32", *outputs(out), "--skip-existing", *argv])
    folder = out / "evonorm_fp32"
    parsed = parse_vision_args("choco", [*comparison.recipe_argv(args, "evonorm", "fp32", str(folder)),
                                         "--overwrite_output_dir"])
    folder.mkdir(parents=True)
    config = {**run_config(parsed), "threads": threads_to_use(parsed.recipe)}  # recorded as run
    (folder / "results.json").write_text(json.dumps({"status": status, "config": config}))
    return args, folder


def test_a_diverged_run_is_a_row_of_the_table(comparison):
    """A run whose gossip diverged records a NaN consensus distance as null (JSON has no NaN); the
    table says so in its row instead of failing on it."""
    results = {"accuracy": 0.1, "node_accuracy": [0.1, 0.1], "consensus_distance": None, "wall_time_s": 3.0}
    table = comparison.markdown_table([{"norm": "evonorm", "precision": "fp32", "results": results}])
    assert table.splitlines()[-1] == f"| {comparison.LABELS['evonorm']} | fp32 | 10.0% | 10.0% | diverged | 3 |"


def test_skip_existing_reuses_only_a_run_of_the_same_settings(comparison, tmp_path, capsys):
    args, folder = finished_run(comparison, tmp_path)
    assert comparison.reusable_results(args, "evonorm", "fp32", str(folder))["status"] == "done"
    other = comparison.parse_args(["--runs", "evonorm:fp32", *outputs(tmp_path), "--seed", "7", "--skip-existing"])
    with pytest.raises(SystemExit) as exc:
        comparison.reusable_results(other, "evonorm", "fp32", str(folder))
    assert exc.value.code == 2 and capsys.readouterr().err == (
        f"vision_norm_comparison.py: error: argument --skip-existing: {folder} holds a run of other settings "
        "(seed=0 (this run: 7)): pass --overwrite-output-dir to run it again, or choose another --output-dir\n")
    rerun = comparison.parse_args(["--runs", "evonorm:fp32", *outputs(tmp_path), "--seed", "7",
                                   "--skip-existing", "--overwrite-output-dir"])
    assert comparison.reusable_results(rerun, "evonorm", "fp32", str(folder)) is None
    (folder / "results.json").write_text('{"status": "do')
    with pytest.raises(SystemExit):
        comparison.reusable_results(other, "evonorm", "fp32", str(folder))
    assert f"argument --skip-existing: {folder / 'results.json'} is not a run's results" in capsys.readouterr().err


def test_skip_existing_does_not_reuse_a_run_of_another_thread_count(comparison, tmp_path, capsys, monkeypatch):
    """8-bit training carries the float sums' order into its results (docs/design.md): a run at one
    thread was reused under OMP_NUM_THREADS=2."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args, folder = finished_run(comparison, tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.raises(SystemExit):
        comparison.reusable_results(args, "evonorm", "fp32", str(folder))
    assert "holds a run of other settings (threads=1 (this run: 2)): set OMP_NUM_THREADS=1 to reuse it, pass " \
        "--overwrite-output-dir" in capsys.readouterr().err


def test_without_matplotlib_the_comparison_is_refused_before_its_runs(comparison, tmp_path, capsys, monkeypatch):
    """It trained every run, then stopped on an import traceback when it drew the plot."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exc:
        comparison.parse_args([*TINY, *outputs(tmp_path)])
    assert exc.value.code == 2 and capsys.readouterr().err == (
        'vision_norm_comparison.py: error: matplotlib is not installed, and this benchmark draws its figure after its '
        'runs: pip install "lp-decentral-nlp[plot]"\n')


def test_settings_of_another_run_are_shown_without_float_noise(comparison, tmp_path, capsys):
    args, folder = finished_run(comparison, tmp_path, "--epochs", "0.2")  # LR milestones at 0.1, 0.15000000000000002
    other = comparison.parse_args(["--runs", "evonorm:fp32", *outputs(tmp_path), "--epochs", "0.3", "--skip-existing"])
    with pytest.raises(SystemExit):
        comparison.reusable_results(other, "evonorm", "fp32", str(folder))
    err = capsys.readouterr().err
    assert "lr_milestones=[0.1, 0.15] (this run: [0.15, 0.225])" in err
    assert "num_train_epochs=0.2 (this run: 0.3)" in err
    assert "0000" not in err and "9999" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["--plot", "/proc/no/plot.png"], "argument --plot: cannot write '/proc/no/plot.png'"),
    (["--plot", "/proc/plot.png"], "argument --plot: cannot write '/proc/plot.png'"),
    (["--output-dir", "/proc/no/runs"], "argument --output-dir: /proc/no/runs cannot be created"),
    (["--runs", "layernorm:fp32"], "argument --runs: 'layernorm:fp32' is not norm:precision"),
    (["--runs", "evonorm:fp32", "evonorm:fp32"], "argument --runs: evonorm:fp32 evonorm:fp32 names a run twice"),
    (["--seed", "1", "--seed", "2"], "argument --seed: given more than once"),
    (["--epochs", "abc"], "argument --epochs: expected a number, got 'abc'"),
    (["--skew", "1.5"], "argument --skew: must be in [0, 1], got 1.5"),
    (["--nodes", "2.5"], "argument --nodes: expected an integer, got '2.5'"),
    (["--arch", "resnet99"], "argument --arch: invalid choice: 'resnet99'"),
])
def test_bad_flags_are_one_line_before_any_run(argv, message, comparison, capsys):
    with pytest.raises(SystemExit) as exc:
        comparison.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_the_record_folder_is_checked_before_any_run(comparison, tmp_path, monkeypatch, capsys):
    import record

    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path / "a_file" / "records")
    with pytest.raises(SystemExit) as exc:
        comparison.parse_args(outputs(tmp_path))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "cannot write the benchmark record" in err, err


def test_the_defaults_are_the_published_comparison(tmp_path, monkeypatch, capsys):
    comparison = load_benchmark("vision_norm_comparison")
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", REPO / "benchmarks" / "results")
    monkeypatch.chdir(tmp_path)  # the plot is the repository's, wherever the command runs
    published = comparison.parse_args(["--skew", "0.8", "--epochs", "20"])
    assert pathlib.Path(published.plot) == REPO / "docs" / "vision_norm_comparison.png"
    record_file = REPO / "benchmarks" / "results" / "vision_norm_comparison_skew0.8.json"
    for argv, message in (
            (["--runs", "evonorm:fp32"],
             f"argument --runs: --runs evonorm:fp32 is not the published comparison, whose outputs are the defaults: "
             f"name this run's own with --plot FILE and LP_BENCHMARK_RESULTS_DIR=FOLDER, or it would replace "
             f"{REPO / 'docs' / 'vision_norm_comparison.png'} and {record_file}"),
            (["--epochs", "5", "--plot", str(tmp_path / "plot.png")],
             f"argument --epochs: --epochs 5 is not the published comparison, whose outputs are the defaults: name "
             f"this run's own with LP_BENCHMARK_RESULTS_DIR=FOLDER, or it would replace {record_file}"),
            (["--skew", "0.4"], f"argument --skew: the default --plot {REPO / 'docs' / 'vision_norm_comparison.png'} "
                                "is the published comparison at skew 0.8: name a --plot FILE for skew 0.4")):
        with pytest.raises(SystemExit) as exc:
            comparison.parse_args(argv)
        assert exc.value.code == 2 and capsys.readouterr().err == f"vision_norm_comparison.py: error: {message}\n"
    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path / "records")  # a trial's record goes elsewhere
    trial = comparison.parse_args(["--epochs", "5", "--plot", "plot.png"])
    assert trial.epochs == 5 and trial.plot == "plot.png"
    # ... and its plot too, by default: it replaced the published docs/vision_norm_comparison.png
    for argv in ([], ["--runs", "evonorm:fp32"], ["--skew", "0.4"]):
        assert pathlib.Path(comparison.parse_args(argv).plot) == tmp_path / "records" / "vision_norm_comparison.png"


def test_help_states_every_flag_and_its_default(comparison, capsys):
    with pytest.raises(SystemExit) as exc:
        comparison.parse_args(["--help"])
    assert exc.value.code == 0
    entries = re.split(r"\n(?=  -)", capsys.readouterr().out.split("\noptions:\n")[1])
    by_flag = {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}
    for flag in ("--runs", "--dataset", "--arch", "--nodes", "--topology", "--skew", "--comp", "--epochs",
                 "--batch-size", "--eval-steps", "--seed", "--output-dir", "--plot", "--skip-existing"):
        help_text, _, default = by_flag[flag].partition("(default:")
        assert default and len(help_text.split()) > 4, by_flag[flag]  # the flag, its metavar, what it means


def test_a_folder_with_results_is_refused_naming_skip_existing(comparison, tmp_path, capsys):
    finished_run(comparison, tmp_path, status="running")
    with pytest.raises(SystemExit) as exc:
        comparison.main([*TINY, *outputs(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"vision_norm_comparison.py: error: argument --output-dir: {tmp_path / 'evonorm_fp32'} "
                          "already holds a run's results (results.json): pass --skip-existing")


def test_skip_existing_redoes_a_stopped_run(comparison, tmp_path):
    _, folder = finished_run(comparison, tmp_path, *TINY[2:], status="running")  # what Ctrl-C leaves
    table = comparison.main([*TINY, *outputs(tmp_path), "--skip-existing"])
    assert json.loads((folder / "results.json").read_text())["status"] == "done"
    assert "| EvoNorm-S0 | fp32 |" in table and (tmp_path / "plot.png").is_file()
    saved = json.loads((tmp_path / "records" / "vision_norm_comparison_skew0.8.json").read_text())
    assert saved["results"]["setup"]["epochs"] == 0.05
    assert [r["norm"] for r in saved["results"]["runs"]] == ["EvoNorm-S0"]


def test_ctrl_c_in_training_advises_skip_existing(comparison, tmp_path, monkeypatch, capsys):
    from lp_decentral_nlp.trainer import DecentralizedTrainer

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(DecentralizedTrainer, "train", interrupted)
    with pytest.raises(SystemExit) as exc:
        comparison.main([*TINY, *outputs(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 130 and err.count("\n") == 1, err
    assert "interrupted at step 0: the comparison did not finish: run it again with --skip-existing" in err
    assert "--save_steps" not in err


def test_ctrl_c_outside_training_is_one_line(comparison, tmp_path, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(comparison, "plan", interrupted)
    with pytest.raises(SystemExit) as exc:
        comparison.main([*TINY, *outputs(tmp_path)])
    assert exc.value.code == 130 and capsys.readouterr().err == (
        "vision_norm_comparison.py: interrupted: the comparison did not finish: run it again with --skip-existing "
        "(finished runs are reused, the stopped one is redone)\n")


def test_a_local_copy_of_the_dataset_reaches_every_run(comparison, tmp_path, capsys):
    """Offline, the runs' error said "pass --data-dir with a local copy", a flag this script did not have."""
    from lp_decentral_nlp.vision.recipe import parse_vision_args

    (tmp_path / "cifar").mkdir()  # the data folder, apart from the runs' (a run inside it is refused)
    args = comparison.parse_args(["--dataset", "cifar10", "--data-dir", str(tmp_path / "cifar"), *outputs(tmp_path)])
    argv = comparison.recipe_argv(args, "evonorm", "fp32", str(tmp_path / "run"))
    recipe = parse_vision_args("choco", argv).recipe
    assert recipe.dataset == "cifar10" and recipe.data_dir == str(tmp_path / "cifar")
    for flags, message in ((["--data-dir", str(tmp_path)], "argument --data-dir: digits is bundled with "
                                                            "scikit-learn and takes no data directory"),
                           (["--dataset", "cifar10", "--data-dir", str(tmp_path / "none")], "argument --data-dir: ")):
        with pytest.raises(SystemExit):
            comparison.parse_args([*flags, *outputs(tmp_path)])
        assert message in capsys.readouterr().err


def test_flags_take_the_recipes_spellings(comparison, tmp_path):
    """--num-nodes, --compression and --output_dir were unrecognized (the recipes take them)."""
    short = ["--runs", "evonorm:fp32", "--nodes", "2", "--comp", "50", "--batch-size", "8", "--epochs", "0.05",
             "--output-dir", str(tmp_path), "--plot", str(tmp_path / "plot.png")]
    spelled = ["--runs", "evonorm:fp32", "--num_nodes", "2", "--compression", "50", "--per_device_train_batch_size",
               "8", "--num_train_epochs", "0.05", "--output_dir", str(tmp_path), "--plot", str(tmp_path / "plot.png")]
    assert vars(comparison.parse_args(spelled)) == vars(comparison.parse_args(short))
    assert comparison.parse_args([*short[:2], "--num-nodes", "2", *short[4:]]).nodes == 2


def test_a_run_folder_holding_files_no_run_recorded_is_refused_before_any_run(comparison, tmp_path, capsys):
    """The recipe refused such a folder only at its own turn, after the runs before it had trained."""
    (tmp_path / "evonorm_fp32").mkdir()
    (tmp_path / "evonorm_fp32" / "metrics.csv").write_text("mine\n")
    args = comparison.parse_args(["--runs", "batchnorm:fp32", "evonorm:fp32", *outputs(tmp_path)])
    with pytest.raises(SystemExit):
        comparison.plan(args)
    assert "evonorm_fp32 holds metrics.csv, which no run recorded" in capsys.readouterr().err
