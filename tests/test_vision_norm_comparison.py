"""benchmarks/vision_norm_comparison.py: what --skip-existing reuses, and flags refused before any run."""
import json

import pytest
from helpers import load_benchmark

from lp_decentral_nlp.commands import run_config


def finished_run(comparison, out, *argv):
    """A results.json as the vision recipe writes it for the run `flags` ask for (no training)."""
    from lp_decentral_nlp.vision.recipe import parse_vision_args

    args = comparison.parse_args(["--runs", "evonorm:fp32", "--output-dir", str(out), "--skip-existing", *argv])
    folder = out / "evonorm_fp32"
    parsed = parse_vision_args("choco", [*comparison.recipe_argv(args, "evonorm", "fp32", str(folder)),
                                         "--overwrite_output_dir"])
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"status": "done", "config": run_config(parsed)}))
    return args, folder


def test_skip_existing_reuses_only_a_run_of_the_same_settings(tmp_path, capsys):
    comparison = load_benchmark("vision_norm_comparison")
    args, folder = finished_run(comparison, tmp_path)
    assert comparison.reusable_results(args, "evonorm", "fp32", str(folder))["status"] == "done"
    other = comparison.parse_args(["--runs", "evonorm:fp32", "--output-dir", str(tmp_path), "--seed", "7",
                                   "--skip-existing"])
    with pytest.raises(SystemExit) as exc:
        comparison.reusable_results(other, "evonorm", "fp32", str(folder))
    assert exc.value.code == 2 and capsys.readouterr().err == (
        f"vision_norm_comparison.py: error: argument --skip-existing: {folder} holds a run of other settings "
        "(seed=0 (this run: 7)): pass --overwrite-output-dir to run it again, or choose another --output-dir\n")
    rerun = comparison.parse_args(["--runs", "evonorm:fp32", "--output-dir", str(tmp_path), "--seed", "7",
                                   "--skip-existing", "--overwrite-output-dir"])
    assert comparison.reusable_results(rerun, "evonorm", "fp32", str(folder)) is None
    (folder / "results.json").write_text('{"status": "do')
    with pytest.raises(SystemExit):
        comparison.reusable_results(other, "evonorm", "fp32", str(folder))
    assert f"argument --skip-existing: {folder / 'results.json'} is not a run's results" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--plot", "/proc/no/plot.png"], "argument --plot: cannot write '/proc/no/plot.png'"),
    (["--runs", "layernorm:fp32"], "argument --runs: 'layernorm:fp32' is not norm:precision"),
    (["--seed", "1", "--seed", "2"], "argument --seed: given more than once"),
])
def test_bad_flags_are_one_line_before_any_run(argv, message, capsys):
    comparison = load_benchmark("vision_norm_comparison")
    with pytest.raises(SystemExit) as exc:
        comparison.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err
