"""benchmarks/bench_round.py on a tiny model: the recipe settings it times, and its JSON record."""
import json

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench_round():
    return load_benchmark("bench_round")


def test_times_the_headline_recipe_settings(bench_round, ag_news_csv, tmp_path):
    from lp_decentral_nlp.commands import build_nlp_parser

    args = bench_round.parse(["--data-dir", str(ag_news_csv), "--model", "m", "--rounds", "3", "--warmup", "1"])
    parser = build_nlp_parser("ag_news", "choco")
    runs = {p: parser.parse(bench_round.recipe_flags(args, p, str(tmp_path / p))) for p in ("8-bit", "fp32")}
    for precision, run in runs.items():
        training = run.training
        assert (training.skew, training.compression, training.algorithm, training.num_nodes) == (0.9, 99.0, "choco", 4)
        assert (training.per_device_train_batch_size, run.recipe.max_length, run.recipe.model) == (16, 64, "m")
        assert training.max_steps == 4 and training.low_precision is (precision == "8-bit")
        assert training.consensus_lr is None and training.quant_kernel == "auto"


def test_record(bench_round, tiny_model_dir, ag_news_csv, tmp_path, monkeypatch):
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    results = bench_round.main(["--data-dir", str(ag_news_csv), "--model", str(tiny_model_dir), "--repeats", "2",
                                "--rounds", "2", "--warmup", "1"])
    saved = json.loads((tmp_path / "bench_round_quick.json").read_text())["results"]  # fewer repeats: a quick look
    assert not (tmp_path / "bench_round.json").exists()
    assert saved == json.loads(json.dumps(results))
    assert all(len(rounds) == 4 and min(rounds) > 0 for rounds in results["per_round_s"].values())
    assert results["met"] is (results["ratio_8bit_over_fp32"] <= results["goal"] == 0.6)
    # the model and data trained on (a record named the --model given, which falls back when offline)
    assert (results["settings"]["model"], results["settings"]["data"]) == (str(tiny_model_dir), str(ag_news_csv))
    assert len(results["ratio_per_repeat"]) == 2 and results["kernels_8bit"] == {"simulated": 12}  # 2 layers x 6 Linear
    assert results["ratio_8bit_over_fp32"] == pytest.approx(
        sorted(results["ratio_per_repeat"])[0] / 2 + sorted(results["ratio_per_repeat"])[1] / 2)
    floor = results["fp32_weight_gradient_floor"]  # from the profiled fp32 round: its Linear GEMMs are in it
    assert 0 < floor["linear_gemm_s"] < floor["step_s"]
    assert floor["floor_ratio"] == pytest.approx(1 - 2 / 3 * floor["linear_gemm_s"] / floor["step_s"])


def test_missing_data_file(bench_round, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_round.parse(["--data-dir", str(tmp_path / "none.csv")])
    assert exit_.value.code == 2 and "argument --data-dir" in capsys.readouterr().err
