"""Fine-tune one model on AG News (or your own data, --task text) with plain `transformers.Trainer`, 8-bit or fp32.

The optimiser is SPEC 8's (AdamW, betas 0.9/0.9, weight decay 1e-4); the rest is `TrainingArguments`'
defaults, which differ from the decentralized recipes': gradients clipped at norm 1.0 (they train
unclipped, as the paper), and this script's own epochs and batch size (see --help).

8-bit means the surgery of SPEC section 4 (`lp_decentral_nlp.quantize_model`): 8-bit weights and
input activations, 8-bit stochastically rounded layer gradients, fp32 weight gradients and master
weights; the classification head stays full precision.

    python recipes/finetune_single.py --data-dir ../shared/data/ag_news/ag_news_6000.csv \
        --max-train-samples 3000 --max-eval-samples 1000 --max-length 64 --output-dir runs/8bit
    python recipes/finetune_single.py ... --full-precision --output-dir runs/fp32
    python recipes/finetune_single.py --task text --data-dir reviews.csv --output-dir runs/reviews  # text,label

Writes to ``--output-dir`` ``results.json`` (accuracy, configuration, the kernel each 8-bit layer
trained with, wall time) and ``model/``, the fine-tuned model and its tokenizer. An 8-bit run's
model reloads with its 8-bit layers through ``lp_decentral_nlp.load_quantized(folder)`` (or
``AutoModelForSequenceClassification.from_pretrained`` once ``lp_decentral_nlp`` is imported;
without that import it builds plain ``Linear`` layers); a ``--full-precision`` run's with
``from_pretrained``. Training shows transformers' progress bar; torch runs ``--threads`` threads
(default ``OMP_NUM_THREADS``, else 1, as the decentralized recipes). Ctrl-C stops with one line.
"""
from __future__ import annotations

import collections
import pathlib
import sys
import time

from lp_decentral_nlp.checks import check_data_dir_given
from lp_decentral_nlp.commands import (DEFAULT_MODEL, DefaultsHelpFormatter, OneLineParser, Range, add_threads_flag,
                                       existing_path, ranged, strict_json, user_path, write_json)

PROG = "finetune_single.py"
#: what to do after Ctrl-C (results.json says "running" until the run finishes)
AFTER_INTERRUPT = ("the run did not finish: run it again (with --overwrite-output-dir if --output-dir holds files "
                   "of it)")


def parse_args(argv=None):
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                      formatter_class=DefaultsHelpFormatter)
    positive_int, positive_float = ranged(int, Range(1)), ranged(float, Range(0, None, low_open=True))
    p.add_argument("--model", type=user_path, default=DEFAULT_MODEL,
                   help="hub id or local folder (default %(default)s; offline, the packaged MiniLM)")
    p.add_argument("--task", choices=("ag_news", "text"), default="ag_news",
                   help="ag_news, or text: your own text,label data (--data-dir), whose distinct labels are the classes")
    p.add_argument("--data-dir", "--data_dir", type=existing_path, default=None,
                   help="a CSV file (AG News: header label,title,description or text,label; text: text,label), a folder "
                        "of CSV files or a DatasetDict.save_to_disk folder; omit to read AG News from the hub")
    p.add_argument("--max-train-samples", "--max_train_samples", type=positive_int, default=None,
                   help="train on a seeded random subset of this many rows (default: None, every row)")
    p.add_argument("--max-eval-samples", "--max_eval_samples", type=positive_int, default=None,
                   help="evaluate on a seeded random subset of this many test rows (default: None, every row)")
    p.add_argument("--max-length", "--max_length", type=ranged(int, Range(2)), default=128, help="tokens per example")
    p.add_argument("--epochs", "--num_train_epochs", "--num-train-epochs",
                   type=positive_float, default=1.0, help="training epochs")
    p.add_argument("--lr", "--learning_rate", "--learning-rate",
                   type=positive_float, default=3e-5, help="Adam learning rate (SPEC 8: 3e-5)")
    p.add_argument("--batch-size", "--per_device_train_batch_size", "--per-device-train-batch-size",
                   type=positive_int, default=16,
                   help="training batch size (evaluation: twice this)")
    p.add_argument("--seed", type=ranged(int, Range(0, 2**32 - 1)), default=0,
                   help="random seed of the run (transformers.set_seed: the held-out test rows of data without a test "
                        "split, subsets, head initialisation, batch order)")
    p.add_argument("--full-precision", "--full_precision", action="store_true", help="train in fp32 instead of 8-bit")
    p.add_argument("--kernel", "--quant_kernel", "--quant-kernel", default="auto",
                   help="GEMM kernel of the 8-bit layers (QuantConfig.kernel): auto, simulated, int8 or int8_bf16")
    add_threads_flag(p, None, "torch intra-op threads (default: OMP_NUM_THREADS if set, else 1, as the "
                              "decentralized recipes: docs/design.md)")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", type=user_path, required=True,
                   help="folder of results.json and model/ (default: none: it is required)")
    p.add_argument("--overwrite-output-dir", "--overwrite_output_dir", action="store_true",
                   help="write over the results of another run in --output-dir (its results.json, model/, "
                        "checkpoints ... are removed first; other files stay)")
    args = p.parse_args(argv)
    if args.data_dir is not None and pathlib.Path(args.data_dir).is_file() and \
            pathlib.Path(args.data_dir).suffix.lower() != ".csv":
        p.error(f"argument --data-dir: {args.data_dir} is not a .csv file: the data is read from a CSV file, a folder "
                "of CSV files or a DatasetDict.save_to_disk folder")
    try:
        check_data_dir_given(args.task, args.data_dir)
    except ValueError as err:
        p.error(f"argument --data-dir: {str(err).removeprefix('data_dir: ')}")
    from lp_decentral_nlp.commands import environment_problem

    problem = environment_problem()  # OpenMP reads OMP_NUM_THREADS as torch loads (and complains), --threads or not
    if problem:
        p.error(problem)
    if args.kernel != "auto":  # the registry imports torch: only for a kernel named on the command line
        from lp_decentral_nlp.quant.kernels import AUTO, kernel_names

        choices = (AUTO, *(name for name in kernel_names() if name != AUTO))
        if args.kernel not in choices:
            p.error(f"argument --kernel: must be one of {choices}, got {args.kernel!r}")
    if args.full_precision and args.kernel != "auto":
        p.error(f"argument --kernel: {args.kernel!r} is a kernel of 8-bit training, and --full-precision trains "
                f"in fp32: drop one of them")
    from lp_decentral_nlp.commands import model_flag_problem, output_dir_problem, output_in_data_problem

    for flag, problem in (("--model", model_flag_problem(args.model)),
                          ("--output-dir", output_dir_problem(args.output_dir, args.overwrite_output_dir)
                           or output_in_data_problem(args.output_dir, args.data_dir))):
        if problem:
            p.error(f"argument {flag}: {problem}")
    return args


def main(argv=None) -> dict:
    from lp_decentral_nlp.commands import stop_on_interrupt

    args = parse_args(argv)  # before the heavy imports: a bad flag is answered at once
    with stop_on_interrupt(PROG, AFTER_INTERRUPT):
        return run(args)


def run(args) -> dict:
    """Fine-tune, evaluate and save as the parsed flags ``args`` say; returns the results."""
    import numpy as np
    import torch
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments, set_seed

    from lp_decentral_nlp import QuantConfig, kernel_report, quantize_model
    from lp_decentral_nlp.commands import load_classifier, load_task_data, load_tokenizer, resolve_model
    from lp_decentral_nlp.commands import exit_with_error, print_notice, remove_run_outputs, set_threads
    from lp_decentral_nlp.quant import QuantModule
    from lp_decentral_nlp.data import accuracy_metric

    out = pathlib.Path(args.output_dir)
    start = time.perf_counter()
    args.threads = set_threads(args)  # results.json records the count it ran with
    set_seed(args.seed)

    model_path, notice = resolve_model(args.model, PROG)
    if notice:
        print(notice, file=sys.stderr)
    tokenizer = load_tokenizer(model_path, args.max_length, PROG)
    data = load_task_data(args, tokenizer, args.seed, PROG)
    # a head for other labels is refused
    model = load_classifier(model_path, data["train"].features["label"].names, PROG, tokenizer.pad_token_id)
    # an 8-bit checkpoint trains as it was made: not in full precision, nor with another kernel
    made = [m.quant_config for m in model.modules() if isinstance(m, QuantModule)]
    made_kernels = sorted({config.kernel for config in made})
    if made and args.full_precision:
        exit_with_error(PROG, f"{model_path} has 8-bit layers (an 8-bit checkpoint), and --full-precision trains in "
                              "full precision: give the float model", "--full-precision")
    if made and args.kernel != "auto" and made_kernels != [args.kernel]:
        exit_with_error(PROG, f"{model_path} has 8-bit layers made with kernel {' and '.join(made_kernels)}: leave "
                              "--kernel at auto or give the float model", "--kernel")
    if made:
        quant_config = made[0]
    elif not args.full_precision:
        quant_config = QuantConfig(kernel=args.kernel)
        quantize_model(model, quant_config)
    else:
        quant_config = None

    metric = accuracy_metric()

    def compute_metrics(eval_pred):
        logits, labels = eval_pred
        if isinstance(logits, tuple):  # an encoder-decoder (BART, T5) returns its encoder's states too
            logits = logits[0]
        return metric.compute(predictions=np.argmax(logits, axis=-1), references=labels)

    training_args = TrainingArguments(
        output_dir=str(out), num_train_epochs=args.epochs, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=2 * args.batch_size,
        adam_beta1=0.9, adam_beta2=0.9, weight_decay=1e-4,  # SPEC 8 NLP optimiser
        seed=args.seed, data_seed=args.seed, eval_strategy="no", save_strategy="no", logging_steps=20,
        report_to="none", disable_tqdm=False, dataloader_pin_memory=torch.cuda.is_available(),
    )
    removed = remove_run_outputs(str(out)) if args.overwrite_output_dir and out.is_dir() else []
    if removed:  # the model card, weights and results of another run must not stay beside this one's
        print_notice(f"notice: --overwrite-output-dir removed the previous run's {', '.join(removed)} from {out}")
    # the folder is a run's before any other file of it (a stop mid-run leaves it to --overwrite-output-dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(str(out), "results.json", {"status": "running", "args": vars(args)})
    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["test"],
                      processing_class=tokenizer, data_collator=DataCollatorWithPadding(tokenizer),
                      compute_metrics=compute_metrics)
    train = trainer.train()
    layer_kernels = kernel_report(model)  # the last forward was a training step's (no evaluation during training)
    evaluation = trainer.evaluate()

    results = {
        "precision": "fp32" if quant_config is None else "8-bit",
        "accuracy": evaluation["eval_accuracy"],
        "eval_loss": evaluation["eval_loss"],
        "train_loss": train.training_loss,
        "steps": train.global_step,
        "train_samples": len(data["train"]),
        "eval_samples": len(data["test"]),
        "train_runtime_s": train.metrics["train_runtime"],
        "quant_config": None if quant_config is None else quant_config.to_dict(),
        "kernels": dict(collections.Counter(layer_kernels.values())),  # kernel: 8-bit layers that trained with it
        "layer_kernels": layer_kernels,
        "model_used": model_path,
        "args": vars(args),
    }
    trainer.save_model(str(out / "model"))
    results["wall_time_s"] = time.perf_counter() - start  # loading, training, evaluation and saving
    write_json(str(out), "results.json", results)  # a diverged loss (NaN) as null: JSON readers read it
    print(strict_json({k: results[k] for k in ("precision", "accuracy", "steps", "wall_time_s")}))
    return results


if __name__ == "__main__":
    main()
