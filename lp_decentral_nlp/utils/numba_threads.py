"""Numba's compiled CPU kernels on torch's intra-op threads: the one place where they meet.

Numba's OpenMP threading layer shares the OpenMP runtime with torch, and launching it (the first
parallel call in a process) sets the runtime's thread count to ``NUMBA_NUM_THREADS`` (every core),
which is torch's intra-op count too. A run that had set one thread (``--threads``, the recipes'
default) would train on every core from that call on, and its results would depend on when the
first call came (torch's reductions split their work by thread count, so a resumed run would no
longer repeat a straight one bit for bit). Hence each kernel has a serial and a parallel build:
the serial one whenever torch runs one thread or the tensor is small (numba's pool never starts),
the parallel one on torch's thread count, which is set back after the call if numba changed it.
"""
from __future__ import annotations

import functools
import types

import numba
import torch

# below this many elements a parallel call costs more than it saves
PARALLEL_MIN_ELEMENTS = 2**16


def compile_serial_and_parallel(kernel, **options) -> tuple:
    """``(serial, parallel)`` builds of the Python function `kernel` (its ``numba.prange`` loops
    run over numba's threads in the parallel one); `options`: more ``numba.njit`` options, e.g.
    ``fastmath``. Both are cached on disk, each under its own name (:func:`_build_named`)."""
    return (numba.njit(cache=True, nogil=True, boundscheck=False, **options)(_build_named(kernel, "serial")),
            numba.njit(cache=True, nogil=True, boundscheck=False, parallel=True,
                       **options)(_build_named(kernel, "parallel")))


def _build_named(kernel, build: str):
    """A copy of the function `kernel` whose qualified name ends in ``__<build>``.

    Numba's disk cache files a compiled function under its module, qualified name and first line,
    keyed by signature and bytecode, not by its options: the serial and parallel builds of one
    function shared an entry, so whichever compiled first was loaded for both. Once the parallel
    code was cached (a run on two threads), every later one-thread run loaded it as its "serial"
    build, started numba's pool and went on with torch on every core."""
    named = types.FunctionType(kernel.__code__, kernel.__globals__, f"{kernel.__name__}__{build}",
                               kernel.__defaults__, kernel.__closure__)
    named.__qualname__ = f"{kernel.__qualname__}__{build}"
    named.__module__ = kernel.__module__
    return named


def eager_under_compile(fn):
    """``fn`` run eagerly, outside the graph (a graph break), when called while ``torch.compile``
    traces: Dynamo cannot trace numba's dispatcher (whose first call in a process compiles or loads
    the kernel), and would trace the numpy scalars of a kernel's arguments into 0-d arrays the
    kernel cannot type. Eager calls go straight to ``fn`` (the disabled wrapper costs microseconds
    per call)."""
    outside = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return outside(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)

    return call


@eager_under_compile
def run_kernel(kernels: tuple, numel: int, *args):
    """Call the serial or the parallel build of ``kernels`` (:func:`compile_serial_and_parallel`)
    on ``args`` for work over `numel` elements: parallel only with at least
    ``PARALLEL_MIN_ELEMENTS`` elements and more than one torch thread, then on as many threads as
    torch's intra-op pool (at most ``NUMBA_NUM_THREADS``), leaving torch's thread count as it was.
    Under ``torch.compile`` it runs outside the compiled graph (:func:`eager_under_compile`)."""
    if numel < PARALLEL_MIN_ELEMENTS:
        return kernels[0](*args)
    torch_threads = torch.get_num_threads()
    threads = min(torch_threads, numba.config.NUMBA_NUM_THREADS)
    if threads == 1:
        return kernels[0](*args)
    try:
        numba.set_num_threads(threads)
        return kernels[1](*args)
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
