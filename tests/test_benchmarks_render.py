"""benchmarks/render.py: a synthetic results directory rendered into the benchmarks page."""
import json
import pathlib
import re
import subprocess
import sys

import pytest
from helpers import load_benchmark

REPO = pathlib.Path(__file__).resolve().parents[1]
MACHINE = {"cpu": "Test CPU 9000", "cores": 2, "memory_gib": 15.6, "gpu": None, "python": "3.11.9", "torch": "2.13.0"}


render = load_benchmark("render")


def write(results_dir, name, results, command=None):
    record = {"benchmark": name, "command": command or f"python benchmarks/{name}.py --threads 1",
              "date": "2026-11-24", "machine": MACHINE, "results": results}
    (results_dir / f"{name}.json").write_text(json.dumps(record))


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    write(d, "bench_gossip", {
        "setup": {"nodes": 8, "graph": "directed_ring", "parameters": 66955010, "malloc": "freed memory kept"},
        "gossip_step": [
            {"configuration": "SGP (fp32, exact)", "step_s": 1.08, "bytes_per_node": 267826196,
             "times_s": [1.1, 1.0, 1.08, 1.2, 0.9]},
            {"configuration": "Choco TopK(1%)", "step_s": 0.9, "bytes_per_node": 5355511, "times_s": [0.9]},
        ],
        "training_round": {"configuration": "Choco TopK(1%)", "round_s": 45.7, "gossip_share": 0.0164},
    })
    write(d, "vision_norm_comparison_skew0.8", {"runs": [{"norm": "BatchNorm", "precision": "fp32", "accuracy": 0.981,
                                                                    "node_accuracy": [0.9, 0.95, 0.5, 0.7]}]})
    write(d, "zz_new_benchmark", {"speedup": 1.5, "variants": [{"name": "a|b", "time_s": 0.25, "ok": True}],
                                  "per_repeat": {"fp32": {"round_s": [3.0, 1.0, 2.0, 5.0]}}})
    return d


def sections(page):
    """Section title line -> the section's text."""
    parts = page.split("\n## ")[1:]
    return {p.splitlines()[0]: p for p in parts}


def test_render_known_unknown_and_order(results_dir):
    page = render.render(results_dir)
    found = sections(page)
    titles = list(found)
    assert titles == ["Gossip engine (`bench_gossip`)",
                      "Normalisation under label skew (vision) (`vision_norm_comparison_skew0.8`)",
                      "zz_new_benchmark (`zz_new_benchmark`)"]
    gossip = found[titles[0]]
    assert "One gossip step of 8 simulated nodes" in gossip            # what it measures
    assert "- command: `python benchmarks/bench_gossip.py --threads 1`" in gossip
    assert "- machine: Test CPU 9000, 2 cores, 15.6 GiB memory, no GPU, python 3.11.9, torch 2.13.0" in gossip
    assert "- date: 2026-11-24" in gossip
    # a list of dicts is a table with units from the key suffixes; long number lists are summarised
    assert "| configuration | step (s) | bytes per node | times (s) |" in gossip
    assert "| SGP (fp32, exact) | 1.08 | 267,826,196 | 5 values: median 1.08, 0.9 to 1.2 |" in gossip
    assert "| Choco TopK(1%) | 0.9 | 5,355,511 | 0.9 |" in gossip
    # a dict of plain values is a two-column table; shares are percentages
    assert "| parameters | 66,955,010 |" in gossip
    assert "| gossip share | 1.64% |" in gossip
    assert "| round (s) | 45.7 |" in gossip
    vision = found[titles[1]]
    assert "The file name carries the skew;" in vision                   # described by its prefix
    assert "| BatchNorm | fp32 | 98.10% | 4 values: median 80.00%, 50.00% to 95.00% |" in vision
    # the unknown benchmark: no description, generic rendering, '|' escaped, nested dicts as sub-sections
    new = found[titles[2]]
    assert "**speedup**: 1.5" in new
    assert "| name | time (s) | ok |" in new and "| a\\|b | 0.25 | yes |" in new
    assert "### per repeat" in new and "#### fp32" in new
    assert "| round (s) | 4 values: median 2.5, 1 to 5 |" in new


def test_a_gpu_run_keeps_the_cpu_record_and_renders_beside_it(results_dir):
    import torch

    record = load_benchmark("record")
    names = [record.device_record_name("bench_8bit", device) for device in ("cpu", torch.device("cuda"), "cuda:1")]
    assert names == ["bench_8bit", "bench_8bit_cuda", "bench_8bit_cuda"]
    for name in ("bench_8bit_cuda", "bench_round", "bench_8bit"):
        write(results_dir, name, {"ratio": 1.0})
    titles = re.findall(r"^## (.*)$", render.render(results_dir), flags=re.M)
    assert titles[1] == titles[0].replace("`bench_8bit`", "`bench_8bit_cuda`"), "the GPU record after the CPU one"


def test_cli_writes_the_page(results_dir, tmp_path):
    out = tmp_path / "docs" / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "render.py"), "--results-dir", str(results_dir),
                           "--output", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == render.render(results_dir)
    assert out.read_text().startswith("# Benchmarks\n")


def test_bad_results_dirs(tmp_path):
    with pytest.raises(FileNotFoundError, match="argument --results-dir: .* is not a directory"):
        render.render(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.json results"):
        render.render(empty)
    (empty / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        render.render(empty)
    (empty / "broken.json").write_text(json.dumps({"benchmark": "x", "results": {}}))
    lacks = r"broken.json: not a benchmark record .* lacks \['command', 'date', 'machine'\]"
    with pytest.raises(ValueError, match=lacks):
        render.render(empty)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "render.py"), "--results-dir",
                           str(tmp_path / "missing"), "--output", str(tmp_path / "out.md")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr and not (tmp_path / "out.md").exists()


def render_cli(results_dir, output):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "render.py"), "--results-dir", str(results_dir),
                           "--output", str(output)], capture_output=True, text=True)


@pytest.mark.parametrize("benchmark, results, problem", [
    (5, {"x": 1}, "not a benchmark record (benchmarks/record.py): its benchmark is a name (a non-empty string), "
                  "got 5"),
    (None, {"x": 1}, "not a benchmark record (benchmarks/record.py): its benchmark is a name (a non-empty "
                     "string), got null"),
    ("x", {"rows": [{}]}, 'results["rows"][0] is empty'),
    ("x", {"times_s": []}, 'results["times_s"] is empty'),
    ("x", {"setup": {"nested": {}}}, 'results["setup"]["nested"] is empty'),
    ("x", {}, "results is empty"),
])
def test_a_damaged_record_is_one_line_naming_its_file(benchmark, results, problem, tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    record = {"benchmark": benchmark, "command": "c", "date": "2026-11-24", "machine": MACHINE, "results": results}
    (d / "damaged.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=re.escape(f"damaged.json: {problem}")):
        render.render(d)
    proc = render_cli(d, tmp_path / "out.md")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{d / 'damaged.json'}: {problem}" in proc.stderr and not (tmp_path / "out.md").exists()


def test_nan_among_repeats_is_shown(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    write(d, "zz_nan", {"round_s": [3.0, float("nan"), 1.0, 5.0], "all_s": [float("nan")] * 4,
                        "few_s": [1.0, float("nan")], "accuracy": [0.5, float("nan")]})
    section = sections(render.render(d))["zz_nan (`zz_nan`)"]
    assert "**round (s)**: 4 values, 1 NaN; the other 3: median 3, 1 to 5" in section
    assert "**all (s)**: 4 values, all NaN" in section
    assert "**few (s)**: 1, nan" in section and "**accuracy**: 50.00%, nan" in section


@pytest.mark.parametrize("output, message", [
    ("/proc/x.md", "argument --output: cannot write /proc/x.md ("),
    ("", "argument --output: the file name is empty"),
])
def test_an_output_that_cannot_be_written_is_one_line_before_rendering(output, message, results_dir):
    proc = render_cli(results_dir, output)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"render.py: error: {message}")


def test_the_output_is_checked_before_the_records(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    (d / "broken.json").write_text("{not json")
    proc = render_cli(d, "/proc/x.md")  # both are wrong: the output is named, before any record is read
    assert proc.returncode == 2 and "argument --output" in proc.stderr and "broken.json" not in proc.stderr


def test_a_trial_run_renders_its_own_folder_into_its_own_page(results_dir, tmp_path):
    """render.py ignored LP_BENCHMARK_RESULTS_DIR: it rendered the published records over
    docs/benchmarks.md, and seeing a trial's figures needed --results-dir."""
    import os

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "render.py")], capture_output=True, text=True,
                          env={**os.environ, "LP_BENCHMARK_RESULTS_DIR": str(results_dir)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote {results_dir / 'benchmarks.md'}\n"
    assert (results_dir / "benchmarks.md").read_text() == render.render(results_dir)


def test_a_trial_folder_that_does_not_exist_is_named_by_its_variable(tmp_path):
    """It said "argument --results-dir", a flag not given, and that benchmarks write to
    benchmarks/results/, which a trial run does not."""
    import os

    missing = tmp_path / "never-written"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "render.py")], capture_output=True, text=True,
                          env={**os.environ, "LP_BENCHMARK_RESULTS_DIR": str(missing)}, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f"error: LP_BENCHMARK_RESULTS_DIR: {missing} is not a directory: run a benchmark first (each one writes "
        f"<name>.json in {missing})")


def test_a_trial_run_renders_the_published_records_to_the_published_page_not_among_them(tmp_path, monkeypatch):
    """With LP_BENCHMARK_RESULTS_DIR set, --results-dir benchmarks/results wrote
    benchmarks/results/benchmarks.md, among the records."""
    monkeypatch.setattr(render, "RESULTS_DIR", tmp_path / "trial")
    monkeypatch.setattr(render, "OUTPUT", tmp_path / "trial" / "benchmarks.md")
    assert render.default_output(REPO / "benchmarks" / "results") == REPO / "docs" / "benchmarks.md"
    assert render.default_output(tmp_path / "trial") == tmp_path / "trial" / "benchmarks.md"
    assert render.default_output(tmp_path / "other") == tmp_path / "other" / "benchmarks.md"
