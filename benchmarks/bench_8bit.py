"""8-bit training (SPEC 4) against fp32 on the two paths users run, side by side in one process.

* DistilBERT-base shape (random weights), batch 8 x 128, full step with the fused AdamW the NLP
  recipes' nodes run (``bench_quant.trainer_adamw``): fp32, the default
  8-bit model (``QuantConfig()``, kernel ``"auto"``) and the simulated kernel (the paper's float
  fake quantization). Goals: default / fp32 <= 0.5, simulated / fp32 <= 1.05.
* ResNet-20, batch 32 x 3 x 32 x 32, SGD with momentum: fp32 with EvoNorm-S0 against the default
  8-bit model with Range EvoNorm (SPEC 5 pairs each precision with its norm). Goal: <= 0.8.
  VGG-11 the same way (no goal: the vision path's widest convolutions, 64 to 512 channels), and
  ResNet-20 on 8 x 8 images (no goal: the vision recipes' default data, scikit-learn's digits).

For each: step time (the variants' steps interleaved, median of ``--repeats``; on the CPU also the
process CPU time, which other jobs disturb far less), bytes autograd holds for backward after one
forward (``quant.saved_tensor_bytes``, parameters included as the goals count them; goals: 8-bit
<= 0.35x fp32), the same without the parameters' storages (what the forward pass allocates for
backward: a float layer's saved weight is the parameter itself) and the peak tensor memory of a
whole step (``bench_quant.peak_step_memory``), plus the kernel each 8-bit layer ran
(``kernel_report``), and for DistilBERT two floors: the bytes fp32 saves outside its Linear
layers, which 8-bit Linear layers leave as they are (``saved_bytes_floor``), and on the CPU the
time fp32 weight-gradient GEMMs put under any 8-bit step (``timing.weight_gradient_floor``). On the CPU freed memory is kept between steps, as ``DecentralizedTrainer`` does
(``--default-malloc``: glibc's policy). Results go to ``benchmarks/results/bench_8bit.json``
(``bench_8bit_cuda.json`` with ``--device cuda``: ``record.device_record_name``).

    python benchmarks/bench_8bit.py --threads 2            # a few minutes on 2 CPU cores
    python benchmarks/bench_8bit.py --threads 2 --conv-sweep   # and one Conv2d per width: where int8 pays
    python benchmarks/bench_8bit.py --smoke                 # tiny shapes, checks the script runs; saves nothing
"""
from __future__ import annotations

import collections
import copy
import sys

import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from bench_quant import malloc_as_trainer, peak_step_memory, train_step, trainer_adamw
from lp_decentral_nlp.commands import (Range, add_default_malloc_flag,
                                       add_device_flag, add_threads_flag, ranged)
from lp_decentral_nlp.quant import QuantConfig, kernel_report, quantize_model, saved_tensor_bytes
from lp_decentral_nlp.vision import build_vision_model
from record import benchmark_parser, check_results_dir, device_record_name, load_average, save_results
from timing import add_step_timing_flags, interleaved_times, medians, weight_gradient_floor

POSITIVE = ranged(int, Range(1))
SEQ_LEN = ranged(int, Range(1, DistilBertConfig().max_position_embeddings))  # the model's positions
GOALS = {  # result key -> largest ratio to fp32 that meets issue 23's goal
    "distilbert.time_ratio.default": 0.5,
    "distilbert.time_ratio.simulated": 1.05,
    "distilbert.saved_bytes_ratio.default": 0.35,
    "resnet20.time_ratio.default": 0.8,
    "resnet20.saved_bytes_ratio.default": 0.35,
}


def distilbert_variants(args, device):
    """fp32, default 8-bit and simulated DistilBERT, the same weights; one batch."""
    if args.smoke:
        config = DistilBertConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=2, hidden_dim=256, num_labels=4)
    else:
        config = DistilBertConfig(num_labels=4)  # DistilBERT-base: 6 layers, dim 768, FFN 3072
    torch.manual_seed(0)
    fp32 = DistilBertForSequenceClassification(config).to(device)
    models = {
        "fp32": fp32,
        "default": quantize_model(copy.deepcopy(fp32), QuantConfig()),
        "simulated": quantize_model(copy.deepcopy(fp32), QuantConfig(kernel="simulated")),
    }
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device),
        "labels": torch.randint(0, 4, (args.batch_size,), device=device),
    }
    variants = {}
    for name, model in models.items():
        model.train()
        optimizer = trainer_adamw(model)

        def forward(model=model):
            return model(**batch).loss

        variants[name] = (model, optimizer, forward)
    return variants


def vision_variants(arch, image_size=32):
    """The builder of fp32 `arch` (``vision.build_vision_model``) with EvoNorm-S0 and the default
    8-bit one with Range EvoNorm, SGD with momentum, one batch of `image_size` square images."""

    def build(args, device):
        torch.manual_seed(0)
        models = {
            "fp32": build_vision_model(arch, num_classes=10, norm="evonorm"),
            "default": quantize_model(build_vision_model(arch, num_classes=10, norm="range_evonorm"), QuantConfig()),
        }
        size = 8 if args.smoke and arch != "vgg11" else image_size  # VGG's five poolings need 32 x 32
        images = torch.randn(args.image_batch_size, 3, size, size, device=device)
        labels = torch.randint(0, 10, (args.image_batch_size,), device=device)
        variants = {}
        for name, model in models.items():
            model.to(device).train()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

            def forward(model=model):
                return torch.nn.functional.cross_entropy(model(images), labels)

            variants[name] = (model, optimizer, forward)
        return variants

    return build


def profiled_weight_gradient_floor(model, optimizer, forward) -> dict:
    """``timing.weight_gradient_floor`` of one fp32 step of `model` under ``torch.profiler`` (CPU),
    after one unprofiled step."""
    from torch.profiler import ProfilerActivity, profile

    train_step(model, optimizer, forward)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, optimizer, forward)
    return weight_gradient_floor(prof.key_averages())


def saved_bytes_floor(model, forward, saved_bytes: int) -> dict:
    """How few bytes an 8-bit forward can keep for backward when only the Linear layers are 8-bit
    (SPEC 4): what fp32 `model` keeps outside its Linear layers, whose inputs and weights the
    8-bit layers replace by codes. `saved_bytes`: all the fp32 forward keeps (parameters included,
    as the goal counts them; ``measure``'s count); ``outside_linear_bytes``: less the Linear
    layers' inputs and weights (attention, GELU, LayerNorm, dropout and embedding tensors);
    ``floor_ratio``: their ratio, the saved-bytes ratio of an 8-bit model whose Linear layers kept
    nothing."""
    linear_operands = []  # every Linear's input and weight, filled during the forward (read after it)
    hooks = [module.register_forward_pre_hook(lambda module, args: linear_operands.extend((args[0], module.weight)))
             for module in model.modules() if isinstance(module, torch.nn.Linear)]
    try:
        loss, outside = saved_tensor_bytes(forward, exclude=linear_operands)
    finally:
        for hook in hooks:
            hook.remove()
    del loss
    return {"saved_bytes": saved_bytes, "outside_linear_bytes": outside, "floor_ratio": outside / saved_bytes}


def measure(variants, args, device) -> dict:
    """Interleaved step times, saved-for-backward bytes and whole-step peak memory per variant."""
    times = interleaved_times({name: (lambda v=v: train_step(*v)) for name, v in variants.items()},
                              args.repeats, args.warmup, device)
    out = {"median_s": medians(times["wall_s"]), "median_cpu_s": medians(times["cpu_s"]), "saved_bytes": {},
           "saved_activation_bytes": {}, "peak_step_bytes": {}, "kernels": {}}
    for name, (model, optimizer, forward) in variants.items():
        for key, exclude in (("saved_bytes", ()), ("saved_activation_bytes", model.parameters())):
            loss, out[key][name] = saved_tensor_bytes(forward, exclude=exclude)
            del loss
        out["peak_step_bytes"][name] = peak_step_memory(lambda v=variants[name]: train_step(*v), model, optimizer, device)
        if name != "fp32":
            out["kernels"][name] = dict(collections.Counter(kernel_report(model).values()))  # kernel: layers
    for key, label in (("median_s", "time_ratio"), ("median_cpu_s", "cpu_time_ratio"),
                       ("saved_bytes", "saved_bytes_ratio"), ("saved_activation_bytes", "saved_activation_bytes_ratio"),
                       ("peak_step_bytes", "peak_step_ratio")):
        out[label] = {n: out[key][n] / out[key]["fp32"] for n in variants if n != "fp32"}
    return out


def conv_sweep(args, device, widths=(16, 32, 64, 128, 256, 512), sizes=(2, 4, 8, 16, 32)) -> dict:
    """Forward + backward of one ``Conv2d(w, w, 3, padding=1)`` per width and input size on
    ``32 x w x s x s`` inputs, fp32 vs simulated vs int8 (``QuantConfig(kernel=...)``), interleaved
    medians, keyed ``"w@s"`` with the call's forward multiply-adds: the data for
    ``kernels.AUTO_MIN_CONV_CHANNELS`` and ``AUTO_MIN_CONV_MACS``. 32 x 32 (ResNet's first stage)
    up to 64 channels, and widths of 256 and more only at 16 x 16: larger calls are far above the
    thresholds and slow."""
    out = {}
    for width in widths:
        for size in (sizes if width <= 64 else sizes[:-1] if width < 256 else (16,)):
            size = min(size, 4) if args.smoke else size
            base = torch.nn.Conv2d(width, width, 3, padding=1).to(device)
            layers = {"fp32": base}
            for kernel in ("simulated", "int8"):
                layers[kernel] = quantize_model(torch.nn.Sequential(copy.deepcopy(base)), QuantConfig(kernel=kernel))
            x = torch.randn(args.image_batch_size, width, size, size, device=device, requires_grad=True)
            med = medians(interleaved_times({name: (lambda layer=layer: layer(x).sum().backward())
                                             for name, layer in layers.items()}, args.repeats, args.warmup,
                                            device)["wall_s"])
            key = f"{width}@{size}"
            out[key] = {"macs": args.image_batch_size * size * size * base.weight.numel(), "fp32_s": med["fp32"],
                        "simulated_ratio": med["simulated"] / med["fp32"], "int8_ratio": med["int8"] / med["fp32"]}
            print(f"Conv2d {width:4d} channels at {size:2d} x {size:<2d} ({out[key]['macs'] / 1e6:8.1f}M multiply-adds): "
                  f"fp32 {med['fp32'] * 1e3:7.2f} ms   simulated {out[key]['simulated_ratio']:.2f}x   "
                  f"int8 {out[key]['int8_ratio']:.2f}x fp32")
    return out


def main(argv=None):
    p = benchmark_parser(__doc__)
    add_step_timing_flags(p)
    p.add_argument("--batch-size", type=POSITIVE, default=8, help="DistilBERT batch (default %(default)s)")
    p.add_argument("--seq-len", type=SEQ_LEN, default=128,
                   help="DistilBERT sequence length (at most DistilBERT's 512 positions; default %(default)s)")
    p.add_argument("--image-batch-size", type=POSITIVE, default=32,
                   help="batch of the vision steps: ResNet-20, VGG-11 and the conv sweep (default %(default)s)")
    add_device_flag(p)
    add_threads_flag(p, torch.get_num_threads(), "torch intra-op threads (default: torch's, here %(default)s)")
    p.add_argument("--conv-sweep", action="store_true",
                   help="also time single Conv2d layers of several widths (fp32, simulated, int8)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models and images to check the script runs; prints, saves no results")
    add_default_malloc_flag(p)
    args = p.parse_args(argv)
    if not args.smoke:  # a smoke run saves nothing
        check_results_dir(p)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    malloc = malloc_as_trainer(args, device)
    results = {"settings": {**vars(args), "malloc": malloc}, "goals": GOALS}
    builds = (("distilbert", distilbert_variants), ("resnet20", vision_variants("resnet20")),
              ("vgg11", vision_variants("vgg11")), ("resnet20_8x8", vision_variants("resnet20", image_size=8)))
    for model_name, build in builds:
        print(f"timing {model_name} ...", file=sys.stderr, flush=True)  # a few minutes in all: progress on stderr
        variants = build(args, device)
        results[model_name] = measure(variants, args, device)
        if model_name == "distilbert" and device.type == "cpu":
            results[model_name]["fp32_weight_gradient_floor"] = profiled_weight_gradient_floor(*variants["fp32"])
        if model_name == "distilbert":
            fp32_model, _, fp32_forward = variants["fp32"]
            results[model_name]["saved_bytes_floor"] = saved_bytes_floor(
                fp32_model, fp32_forward, results[model_name]["saved_bytes"]["fp32"])
    if args.conv_sweep:
        print("timing the conv sweep ...", file=sys.stderr, flush=True)
        results["conv_sweep"] = conv_sweep(args, device)
    met = {}
    for key, bound in GOALS.items():
        model_name, metric, variant = key.split(".")
        met[key] = {"ratio": results[model_name][metric][variant], "goal": bound,
                    "met": results[model_name][metric][variant] <= bound}
    results["goals_met"] = met
    load = load_average()
    print(f"device {device}, torch threads {torch.get_num_threads()}, {args.repeats} interleaved repeats, "
          f"malloc {malloc}, load average {load}{', SMOKE (tiny shapes)' if args.smoke else ''}")
    for model_name, _ in builds:
        r = results[model_name]
        for label in ("time_ratio", "cpu_time_ratio", "saved_bytes_ratio", "saved_activation_bytes_ratio",
                      "peak_step_ratio"):
            print(f"{model_name:<10} {label:<29}" + "".join(f"  {n} {x:.2f}x fp32" for n, x in r[label].items()))
        print(f"{model_name:<10} fp32 step {r['median_s']['fp32'] * 1e3:.1f} ms; kernels {r['kernels']}")
        if "fp32_weight_gradient_floor" in r:
            floor = r["fp32_weight_gradient_floor"]
            print(f"{model_name:<10} fp32 step in the profiler {floor['step_s'] * 1e3:.0f} ms, Linear GEMMs "
                  f"{floor['linear_gemm_s'] * 1e3:.0f} ms: with fp32 weight gradients no 8-bit step beats "
                  f"{floor['floor_ratio']:.2f}x fp32")
        if "saved_bytes_floor" in r:
            floor = r["saved_bytes_floor"]
            print(f"{model_name:<10} fp32 saves {floor['saved_bytes'] / 2**20:.0f} MiB for backward, "
                  f"{floor['outside_linear_bytes'] / 2**20:.0f} MiB outside its Linear layers: with 8-bit Linear "
                  f"layers only, no 8-bit model saves less than {floor['floor_ratio']:.2f}x fp32")
    for key, m in met.items():
        print(f"goal {key} <= {m['goal']}: {m['ratio']:.2f} {'met' if m['met'] else 'NOT met'}")
    if args.smoke:
        print("smoke run: results not saved")
    else:
        print(f"wrote {save_results(device_record_name('bench_8bit', device), results)}")


if __name__ == "__main__":
    main()
