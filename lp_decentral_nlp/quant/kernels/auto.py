"""``QuantConfig(kernel="auto")`` and per-layer fallback: which kernel a layer runs."""
from __future__ import annotations

import torch

from ..gemm import Conv2dGemm
from .base import AUTO, KERNELS, Kernel, get_kernel
from .int8 import cpu_has_int8_dot, onednn_conv_available

# kernel="auto" takes int8 for layers at least this wide (in and out features). From
# `benchmarks/bench_quant.py --threads 2 --layer-sweep --repeats 3` on a 2-core CPU whose
# torch._int_mm ran oneDNN (it had AVX512-VNNI: the 0.71x fp32 DistilBERT step of the same day is
# out of reach of the scalar loop), no other job running (forward + backward of one square Linear,
# 1,024 rows, time relative to fp32): width 128 int8 2.79x vs simulated 2.48x; 256: 1.21x vs 1.50x;
# 512: 0.84x vs 1.34x; 768: 0.63x vs 1.18x.
# On a CPU without AVX512-VNNI, torch._int_mm is a scalar loop (1,024 x 768 x 768: 300-400 ms
# against 26 ms for the fp32 GEMM on the 2-core AVX2 EPYC; a DistilBERT-base step with
# kernel="int8" took 14.4x fp32), so the int8 kernel runs fp32 GEMMs of the codes there
# (int8.int8_gemm): the same GEMM as the simulated kernel, plus the code conversions and
# zero-point terms. Measured on that CPU, busy (load 4-6 on 2 cores), 3 interleaved steps of
# DistilBERT-base, batch 8 x 128, AdamW, wall time relative to fp32: int8 1.19x, simulated 1.28x,
# int8_bf16 1.30x; a second run int8 1.62x, simulated 2.01x (process CPU time 1.73x and 1.48x).
# Not faster than fp32, and no steady gap to simulated: auto keeps the simulated kernel (the
# paper's method, bit for bit) on such CPUs.
# On a 2-core Xeon with AMX (the same command, quiet; the record in
# benchmarks/results/bench_quant_layer_sweep.json): width 64 int8 2.44x vs simulated 3.04x;
# 128: 1.84x vs 1.89x; 256: 1.29x vs 1.69x; 512: 0.92x vs 1.34x; 768: 0.75x vs 1.32x. Below 256
# the gain there is small and the other CPU has int8 slower at 128, so the threshold is 256.
AUTO_MIN_FEATURES = 256
NO_INT8_GEMM_REASON = "CPU without AVX512-VNNI: no int8 GEMM, int8 would run fp32 GEMMs, not faster"
# On CUDA the int8 kernel is slower than the simulated one: `bench_8bit.py --device cuda --repeats 7
# --conv-sweep` on an NVIDIA H200 (torch 2.11, the record in benchmarks/results/bench_8bit_cuda.json)
# timed a DistilBERT-base step at 5.52x fp32 with every Linear layer int8 (torch._int_mm) against
# 4.39x simulated, and every swept Conv2d at 3.9-6.5x fp32 int8 against 2.4-4.1x simulated. Both
# are launch bound there: a layer's quantize passes are tens of small torch ops each, on the CPU
# one compiled pass (fused.py), and the int8 kernel adds its code conversions and zero-point
# terms while the GEMM it saves is a small part of the step. So auto keeps the simulated kernel
# on every device but the CPU.
NOT_CPU_REASON = "not a CPU: the int8 kernel's extra passes cost more than its GEMM saves (slower on CUDA)"
# Convolutions: on a CPU with oneDNN's int8 convolution (int8.onednn_conv_available) the int8
# Conv2d runs it on the codes; the passes around it (sign flip, channels-last copy of row-major
# codes, zero-point sums, the epilogue) cost more per call than the simulated kernel's quantize
# passes, so int8 pays on large calls only. `bench_8bit.py --threads 1 --conv-sweep` (forward +
# backward of Conv2d(w, w, 3) on a row-major input, batch 32, w x s x s inputs) on a 2-core AMD
# EPYC with AVX512-VNNI had int8 faster than the simulated kernel in every call of 75M (about
# 2**26) forward multiply-adds or more, from 16 channels up (16 at 32 x 32: 1.19x fp32 against
# 1.28x; 32 at 16 x 16: 1.24x against 1.34x; 64 at 8 x 8: 1.09x against 1.22x; 128 at 4 x 4:
# 1.35x against 1.38x), and slower in every call of 19M or fewer at any width. On a 2-core Intel
# Xeon with AMX (the record in bench_8bit.json) the two are level at 75M (16 at 32 x 32: 1.44x
# against 1.38x; 32 at 16 x 16: 1.35x against 1.43x; 64 at 8 x 8: 1.25x against 1.36x), int8
# ahead from 302M, behind at 19M or fewer. Inside a network the int8 layers pass channels-last
# tensors on and skip the input copy the sweep pays: in a scratch A/B on the Xeon (interleaved
# steps, batch 32 at 32 x 32) ResNet-20 took 0.78x fp32 with its 75M convolutions int8 and 0.86x
# with every convolution simulated, VGG-11 0.84x and 0.90x. So auto runs a convolution int8 when
# the call has at least AUTO_MIN_CONV_MACS multiply-adds and at least AUTO_MIN_CONV_CHANNELS in
# and out channels (the narrowest width measured; a 3-channel image layer stays simulated), where
# oneDNN's int8 convolution runs. Elsewhere the int8 Conv2d is an im2col of the codes in torch ops plus one
# int8 GEMM, slower than the simulated kernel up to 256 channels and no faster at 512 on the
# Xeon, and slower at every width swept on CUDA (NOT_CPU_REASON below).
AUTO_MIN_CONV_CHANNELS = 16
AUTO_MIN_CONV_MACS = 2**26
CONV_REASON = "no oneDNN int8 convolution here: the im2col int8 Conv2d is not faster than the simulated kernel"


def resolve_kernel(name: str, gemm_type: type, weight: torch.Tensor, groups: int = 1,
                   output_pixels: int | None = None) -> tuple[Kernel, str | None]:
    """The kernel a layer runs for ``QuantConfig.kernel == name``, and why it is not the one asked
    for (None when it is). Cheap and sync-free: called on every forward, so a layer moved to
    another device, or called on other shapes, re-decides. `groups`: a Conv2d's groups (1 for
    other layers); `output_pixels`: a Conv2d call's ``N * Ho * Wo`` (None: not known, as in a dry
    run). ``"auto"`` picks int8 where it is supported and faster, on the CPU only (``NOT_CPU_REASON``):
    a Linear or Conv1D layer of at least ``AUTO_MIN_FEATURES`` in and out features on a CPU where
    ``torch._int_mm`` is a real int8 GEMM (AVX512-VNNI: ``int8.cpu_has_int8_dot``), and a Conv2d call of at
    least ``AUTO_MIN_CONV_CHANNELS`` in and out channels and ``AUTO_MIN_CONV_MACS`` multiply-adds
    (``output_pixels * weight.numel()``; not checked when unknown) where oneDNN's int8
    convolution runs (``int8.onednn_conv_available``); the simulated kernel otherwise."""
    if name != AUTO:
        kernel = get_kernel(name)
        reason = kernel.unsupported_reason(gemm_type, weight, groups)
        return (kernel, None) if reason is None else (KERNELS["simulated"], reason)
    int8 = KERNELS["int8"]
    reason = int8.unsupported_reason(gemm_type, weight, groups)
    if reason is None and gemm_type is Conv2dGemm:
        if not onednn_conv_available(weight.device):
            reason = CONV_REASON
        elif min(weight.shape[:2]) < AUTO_MIN_CONV_CHANNELS:
            reason = f"Conv2d {tuple(weight.shape)} narrower than {AUTO_MIN_CONV_CHANNELS} channels: int8 not faster"
        elif output_pixels is not None and output_pixels * weight.numel() < AUTO_MIN_CONV_MACS:
            reason = (f"Conv2d call of {output_pixels * weight.numel():,} multiply-adds, fewer than "
                      f"{AUTO_MIN_CONV_MACS:,}: int8 not faster")
    elif reason is None and min(weight.shape[:2]) < AUTO_MIN_FEATURES:
        reason = f"layer {tuple(weight.shape)} narrower than {AUTO_MIN_FEATURES} features: int8 not faster"
    if reason is None and weight.device.type != "cpu":
        reason = NOT_CPU_REASON
    if reason is None and not cpu_has_int8_dot():
        reason = NO_INT8_GEMM_REASON
    return (KERNELS["simulated"], reason) if reason else (int8, None)


def describe_kernel(name: str, gemm_type: type, weight: torch.Tensor, groups: int = 1) -> str:
    """What a dry run says about a layer's kernel before any call: ``"kernel <name>"``, why the
    kernel asked for falls back, and for an ``"auto"`` int8 convolution the call size it needs. A
    weight on the meta device (a model ``from_pretrained`` is building) has no device to decide on
    yet: the kernel is chosen at the first call."""
    if weight.is_meta:
        return f"kernel {name}, chosen on the weight's device at the first call"
    kernel, fallback = resolve_kernel(name, gemm_type, weight, groups)
    text = f"kernel {kernel.name}" + (f" ({name} falls back: {fallback})" if fallback else "")
    if name == AUTO and gemm_type is Conv2dGemm and kernel.name != "simulated":
        text += f" for calls of at least {AUTO_MIN_CONV_MACS:,} multiply-adds, simulated below"
    return text
