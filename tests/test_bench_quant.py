"""benchmarks/bench_quant.py's layer sweep on tiny widths: the JSON record behind kernel="auto"'s width."""
import argparse
import json

import torch
from helpers import load_benchmark


def test_layer_sweep_record(tmp_path, monkeypatch):
    bench_quant = load_benchmark("bench_quant")
    import record

    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    args = argparse.Namespace(batch_size=2, seq_len=8, repeats=2, warmup=1)
    bench_quant.layer_sweep(args, torch.device("cpu"), widths=(16, 32))
    saved = json.loads((tmp_path / "bench_quant_layer_sweep.json").read_text())
    assert saved["benchmark"] == "bench_quant_layer_sweep"
    results = saved["results"]
    assert results["settings"]["rows"] == 16 and results["settings"]["int8_gemm"]
    assert [row["width"] for row in results["widths"]] == [16, 32]
    for row in results["widths"]:
        assert set(row) == {"width", "fp32_s", "simulated_ratio", "int8_ratio", "int8_bf16_ratio"}
        assert row["fp32_s"] > 0 and all(row[k] > 0 for k in row if k.endswith("_ratio"))
