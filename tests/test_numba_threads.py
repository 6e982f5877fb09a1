"""The compiled CPU kernels' serial and parallel builds (``utils.numba_threads``) stay apart in
numba's disk cache, so a one-thread run stays on one thread whatever ran before it."""
import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]

QUANTIZE_AND_COUNT = textwrap.dedent("""
    import sys
    import torch
    from lp_decentral_nlp.quant.functional import quantize_uint8, tensor_range
    threads = int(sys.argv[1])
    torch.set_num_threads(threads)
    x = torch.randn(8, 160, 640) if threads > 1 else torch.randn(8, 16, 64)  # parallel build, serial build
    quantize_uint8(x, *tensor_range(x), 8)
    print(torch.get_num_threads())
""")


def test_a_cached_parallel_build_is_not_loaded_as_the_serial_one(tmp_path):
    """Two fresh processes sharing a fresh cache: the first, on two threads, compiles and caches the
    quantizer's parallel build; the second, on one thread, must run the serial build and leave
    torch on one thread (the parallel code would start numba's pool on every core)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    counts = []
    for threads in (2, 1):
        proc = subprocess.run([sys.executable, "-c", QUANTIZE_AND_COUNT, str(threads)], capture_output=True,
                              text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        counts.append(int(proc.stdout.strip().splitlines()[-1]))
    assert counts == [2, 1]
    assert any(tmp_path.rglob("*__serial*.nbi")) and any(tmp_path.rglob("*__parallel*.nbi"))
