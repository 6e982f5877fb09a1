"""Text-classification tasks as `datasets.DatasetDict`s with ``text``/``label`` columns.

Two tasks of SPEC section 8, and the user's own:

* ``"ag_news"`` -- AG News topic classification (4 classes: World, Sports, Business, Sci/Tech).
* ``"sentlen"`` -- SentEval's sentence-length probing task (6 classes of token counts).
* ``"text"`` -- any text classification: the user's ``text,label`` data, whose classes are its
  distinct labels (integers in numeric order, else strings in sorted order, as transformers'
  ``run_glue.py`` example orders its ``label_list``).

The first two read the Hugging Face hub by default and a local path when ``data_dir`` is given,
so the same code runs on a laptop with internet and on an offline cluster; ``"text"`` reads
``data_dir``.
"""
from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value, concatenate_datasets, load_dataset

from ..checks import Number, check_data_dir_given, check_field, check_number
from .saved import load_saved_dataset

AG_NEWS_HUB_ID = "ag_news"
DEFAULT_MAX_LENGTH = 128  # tokens (load_task)
AG_NEWS_LABELS = ("World", "Sports", "Business", "Sci/Tech")
# SentEval "Sentlen" bins of token counts, inclusive (Conneau et al. 2018).
SENTLEN_BINS = ((5, 8), (9, 12), (13, 16), (17, 20), (21, 25), (26, 28))
SENTLEN_LABELS = tuple(f"{lo}-{hi}" for lo, hi in SENTLEN_BINS)
SENTEVAL_FILE = "sentence_length.txt"
_SENTEVAL_SPLITS = {"tr": "train", "va": "validation", "te": "test"}
#: the share of a source held out as its test split: its range, and the default
_EVAL_FRACTION = Number(low=0, high=1, low_open=True, high_open=True)
_DEFAULT_EVAL_FRACTION = 0.2
# the splits a folder of CSV files keeps, by file stem (train.csv required), as a saved DatasetDict's
_CSV_SPLITS = ("train", "test", "validation")
_TOKEN = re.compile(r"\w+|[^\w\s]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")

TASKS = ("ag_news", "sentlen", "text")


def load_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    tokenizer=None,
    max_length: int = DEFAULT_MAX_LENGTH,
    eval_fraction: float | None = None,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    seed: int = 0,
) -> DatasetDict:
    """Load a task as a ``DatasetDict`` with ``"train"`` and ``"test"`` splits.

    Args:
        name: ``"ag_news"``, ``"sentlen"`` or ``"text"``.
        data_dir: ``None`` reads the hub (not for ``"text"``). Otherwise a local source:

            * ``ag_news``: a UTF-8 CSV file or a directory of CSV files whose header line names
              the original layout (``label,title,description``, labels 1-4) or ``text,label``
              columns (labels 0-3); a directory with ``train.csv`` (and ``test.csv``,
              ``validation.csv``, no other CSV) keeps those splits (``test.csv`` or ``validation.csv`` without ``train.csv`` is refused); or a directory written by ``DatasetDict.save_to_disk``
              (``text`` strings, ``label`` integers 0-3, a ``train`` split).
            * ``sentlen``: SentEval's ``sentence_length.txt`` (or a directory holding it), or any
              AG News source above, whose sentences are then binned by length (see
              :func:`build_sentlen`). Without ``data_dir`` the sentences come from the hub's AG News.
            * ``text``: as for ``ag_news``, with ``text,label`` columns whose labels are any
              integers or strings (the classes: the distinct labels of all splits, integers in
              numeric order, else strings in sorted order, at least two), or a saved dataset whose
              ``label`` is a ``ClassLabel`` (kept as it is), integers or strings.
        tokenizer: a Hugging Face tokenizer. When given, ``input_ids``/``attention_mask`` are added
            through a cached ``datasets.map`` (truncated to ``max_length`` tokens, padded later by
            the collator) and ``text`` is dropped.
        max_length: longest tokenised sequence, in tokens (with a tokenizer only).
        eval_fraction: share of the data held out as ``test``, stratified by label and seeded,
            when the source has neither a test nor a validation split (0 < eval_fraction < 1;
            default 0.2); refused for a source that has one. Sentlen built from AG News data
            always holds it out (its sentences are pooled).
        max_train_samples, max_eval_samples: keep a seeded random subset of that many rows.
        seed: seed of the held-out split and of the subsets.

    Returns:
        ``DatasetDict`` with ``train`` and ``test``: the source's test split, else its validation
        split (as transformers' ``run_glue.py`` evaluates on it), else ``eval_fraction`` of its
        rows; a validation split beside a test split stays ``validation``. ``label`` is a
        ``ClassLabel`` with values ``0..K-1``.

    Raises:
        FileNotFoundError: ``data_dir`` does not exist.
        ValueError: naming the file (and line) for any unusable local source: not UTF-8, empty,
            header only, missing columns, rows of the wrong width, labels that are not integers or
            not the task's classes, too few rows to hold out a stratified test split. The files
            are only read, never modified. Whether the training split is large enough for the
            nodes and batch size is :func:`check_enough_rows`.
    """
    if name not in TASKS:
        raise ValueError(f"name must be one of {TASKS}, got {name!r}")
    if eval_fraction is not None:
        eval_fraction = check_number("eval_fraction", eval_fraction, _EVAL_FRACTION)
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise ValueError(f"data_dir must be a path (str or os.PathLike) or None, got {type(data_dir).__name__}")
    data_dir = None if data_dir is None else os.path.expanduser(data_dir)
    if tokenizer is not None and (isinstance(tokenizer, type) or not callable(tokenizer)):
        got = f"the class {tokenizer.__name__} (load one: {tokenizer.__name__}.from_pretrained(...))" \
            if isinstance(tokenizer, type) else type(tokenizer).__name__
        raise ValueError(f"tokenizer must be a Hugging Face tokenizer (callable) or None, got {got}")
    max_length = check_field("max_length", max_length)
    seed = check_field("seed", seed)
    limits = {"train": check_field("max_train_samples", max_train_samples),
              "test": check_field("max_eval_samples", max_eval_samples)}
    if tokenizer is None and max_length != DEFAULT_MAX_LENGTH:
        raise ValueError(f"max_length={max_length} is where the tokenizer truncates, and no tokenizer was given: pass "
                         "tokenizer or leave max_length out")
    check_data_dir_given(name, data_dir)
    if data_dir is not None and not Path(data_dir).exists():
        raise FileNotFoundError(f"data_dir {str(data_dir)!r} does not exist")
    if data_dir is not None and not (Path(data_dir).is_file() or Path(data_dir).is_dir()):
        raise ValueError(f"data_dir {str(data_dir)!r} is neither a file nor a directory (a pipe, socket or device): "
                         "save the data to a file and pass its path")

    if name in ("ag_news", "text"):
        ds = _load_classification(name, data_dir, eval_fraction, seed)
    elif data_dir is not None and _senteval_file(Path(data_dir)) is not None:
        ds = _load_senteval(_senteval_file(Path(data_dir)))
        _check_no_eval_fraction(eval_fraction, str(_senteval_file(Path(data_dir))), "its 'te' rows")
    else:
        origin = "the hub's ag_news" if data_dir is None else f"data_dir {str(data_dir)!r}"
        fraction = _DEFAULT_EVAL_FRACTION if eval_fraction is None else eval_fraction
        ds = build_sentlen(_load_classification("ag_news", data_dir, None, seed), fraction, seed, origin=origin)

    for split in list(ds):
        ds[split] = _subset(ds[split], limits["train" if split == "train" else "test"], seed)
    if tokenizer is not None:
        ds = ds.map(
            lambda batch: tokenizer(batch["text"], truncation=True, max_length=max_length),
            batched=True,
            remove_columns=["text"],
            desc="Tokenizing",
        )
    return ds


def _subset(ds: Dataset, limit: int | None, seed: int) -> Dataset:
    if limit is None:
        return ds
    return ds.shuffle(seed=seed).select(range(min(limit, len(ds))))


def check_enough_rows(num_rows: int, num_nodes: int, batch_size: int, source: str) -> None:
    """Refuse a training split too small for ``num_nodes`` nodes of ``batch_size`` rows each.

    Every node trains on its own shard (:func:`~lp_decentral_nlp.data.skewed_partition`, SPEC
    section 6) and drops its last incomplete batch, so every shard needs ``batch_size`` rows. The
    shards of ``N`` rows hold at least ``N // num_nodes`` rows at any skew, hence the rows needed:
    ``num_nodes * batch_size``. A split that passes gives every node at least one batch.

    Args:
        num_rows: rows of the training split.
        num_nodes: number of nodes (``--nodes``).
        batch_size: batch size of each node, in rows (``--batch-size``).
        source: what the rows came from (a file, ``--data-dir ...``), named in the error.

    Raises:
        ValueError: naming ``source``, the rows it has and the rows needed; or naming a bad argument.
    """
    for arg, value, low in (("num_rows", num_rows, 0), ("num_nodes", num_nodes, 1), ("batch_size", batch_size, 1)):
        check_number(arg, value, Number(integer=True, low=low))
    needed = num_nodes * batch_size
    if num_rows < needed:
        raise ValueError(f"{source}: {num_rows} training rows cannot give each of {num_nodes} nodes one batch of "
                         f"{batch_size}: at least {needed} rows are needed; give more data, or lower the batch size "
                         "or the number of nodes")


def _with_test_split(ds: DatasetDict, eval_fraction: float | None, seed: int, source: str) -> DatasetDict:
    """``ds`` (a source's splits: ``data`` or ``train``, maybe ``test`` and ``validation``) with a
    ``test`` split: its own, else its validation split, else :func:`_with_eval_split` of
    ``eval_fraction`` (default 0.2) of the rows (``source``: where they came from, for its errors).
    An ``eval_fraction`` given for a source with a test or validation split is a ValueError."""
    held = next((split for split in ("test", "validation") if split in ds), None)
    split = "data" if "data" in ds else "train"
    others = {name: part for name, part in ds.items() if name not in (split, held)}  # e.g. IMDB's "unsupervised"
    if held is not None:
        _check_no_eval_fraction(eval_fraction, source, f"its {held!r} split")
        return DatasetDict({"train": ds[split], "test": ds[held], **others})
    fraction = _DEFAULT_EVAL_FRACTION if eval_fraction is None else eval_fraction
    return DatasetDict({**_with_eval_split(ds[split], fraction, seed, source), **others})


def _check_no_eval_fraction(eval_fraction: float | None, source: str, held: str) -> None:
    """ValueError when ``eval_fraction`` was given for ``source``, whose test rows are ``held``."""
    if eval_fraction is not None:
        raise ValueError(f"eval_fraction={eval_fraction:g} is the share held out of a source without test rows, and "
                         f"{source} has {held}: leave eval_fraction out")


def _with_eval_split(ds: Dataset, eval_fraction: float, seed: int, source: str) -> DatasetDict:
    """Carve a stratified, seeded held-out ``test`` split from a single split.

    ``test`` gets ``ceil(eval_fraction * N)`` rows; the split needs two rows of every label present
    and at least one row per label present in each part (ValueError naming ``source`` otherwise).
    """
    counts = np.bincount(np.asarray(ds["label"], dtype=np.int64), minlength=1)
    present = int((counts > 0).sum())
    n_test = math.ceil(eval_fraction * len(ds))
    n_train = len(ds) - n_test
    names = ds.features["label"].names
    rare = [names[c] for c in np.flatnonzero((counts > 0) & (counts < 2))]
    if rare or n_test < present or n_train < present:
        per_label = dict(zip(names, counts.tolist()))
        if len(per_label) > 8:  # many classes: the rare ones first (those of one row), at most 8
            shown = (rare or names)[:8]
            per_label = {**{name: per_label[name] for name in shown}, "...": f"{len(names) - len(shown)} more"}
        raise ValueError(f"{source}: {len(ds)} rows are too few to hold out a stratified {eval_fraction:g} as test "
                         f"({present} labels present, per label {per_label}): every label "
                         f"needs at least 2 rows and each part at least {present} rows; give more rows or provide "
                         "a test split (test.csv beside train.csv, or a 'test' split in a saved DatasetDict)")
    return ds.train_test_split(test_size=eval_fraction, stratify_by_column="label", seed=seed)


# --- Reading local files -----------------------------------------------------------------------


def _read_text(file: Path) -> str:
    """The whole of ``file`` decoded as UTF-8 (a leading byte-order mark is dropped).

    ValueError naming the file when it cannot be read, is not UTF-8, or holds only white space.
    """
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise ValueError(f"{file}: cannot be read ({err.strerror or err})") from None
    if raw.startswith(b"\x1f\x8b"):  # gzip's magic number
        raise ValueError(f"{file}: gzip-compressed, not text: decompress it first (gunzip)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{file}: not UTF-8 text (line {line}, byte {err.start}: "
                         f"{raw[err.start:err.start + 1]!r}); re-save the file as UTF-8") from None
    if not text.strip():
        raise ValueError(f"{file}: the file is empty")
    return text


# --- AG News and the user's text classification ------------------------------------------------

# Column layouts of a task's CSV files, each with the number of AG News's first class in it (None:
# the labels are the user's own classes, any integers or strings).
_CSV_LAYOUTS = {"ag_news": ((("label", "title", "description"), 1), (("text", "label"), 0)),
                "text": ((("text", "label"), None),)}
_CSV_COLUMNS = {"ag_news": "label,title,description (labels 1-4) or text,label (labels 0-3)", "text": "text,label"}
# what a folder of the task's data holds
_FOLDER_HOLDS = {"ag_news": "label,title,description CSVs or a save_to_disk directory, and for sentlen also SentEval's "
                            "sentence_length.txt",
                 "text": "text,label CSVs or a save_to_disk directory"}
# the local sources of a task
_SOURCES = {"ag_news": "a CSV file, a directory of CSV files, a DatasetDict.save_to_disk directory, and for sentlen "
                       "also SentEval's sentence_length.txt",
            "text": "a text,label CSV file, a directory of such CSV files (train.csv, test.csv, validation.csv) or a "
                    "save_to_disk directory"}
_INTEGER = re.compile(r"[+-]?\d+")
# a user's label written as an integer, or as a decimal with a zero fraction ("1.0", as a spreadsheet or
# pandas' float column writes it): the class of that integer
_INTEGRAL = re.compile(r"([+-]?\d+)(?:\.0*)?")


def _load_classification(task: str, data_dir, eval_fraction: float | None, seed: int) -> DatasetDict:
    """``task`` ``"ag_news"`` (the hub's where ``data_dir`` is None) or ``"text"`` from
    ``data_dir``, as :func:`load_task` describes."""
    if data_dir is None:
        return _with_test_split(load_dataset(AG_NEWS_HUB_ID), eval_fraction, seed, "the hub's ag_news")
    path = Path(data_dir)
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return _load_saved(task, path, eval_fraction, seed)
    if path.is_file():
        if path.suffix.lower() != ".csv":
            convert = (" (datasets reads it: load_dataset('json' or 'parquet', data_files=...) then save_to_disk a "
                       "folder)" if path.suffix.lower() in (".json", ".jsonl", ".parquet") else
                       " (tab-separated: save it with commas)" if path.suffix.lower() == ".tsv" else "")
            raise ValueError(f"data_dir {str(path)!r} is not a .csv file{convert}: the local sources are "
                             f"{_SOURCES[task]}")
        files = {"data": [path]}
    else:
        csvs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".csv" and p.is_file())  # TRAIN.CSV too
        if not csvs:
            raise ValueError(f"data_dir {str(path)!r} holds no CSV file and no saved dataset "
                             f"(expected {_FOLDER_HOLDS[task]})")
        by_name = {p.stem.lower(): p for p in csvs}
        held_out = [stem for stem in ("test", "validation") if stem in by_name]
        if held_out and "train" not in by_name:
            raise ValueError(f"data_dir {str(path)!r} holds {held_out[0]}.csv but no train.csv: {held_out[0]}.csv is "
                             f"the {held_out[0]} split beside a train.csv, and its rows are never trained on; add "
                             f"train.csv or rename {held_out[0]}.csv")
        if "train" in by_name:
            others = sorted(p.name for p in csvs if p.stem.lower() not in _CSV_SPLITS)
            if others:
                raise ValueError(f"data_dir {str(path)!r} holds train.csv and also {others}: with train.csv only "
                                 "train.csv, test.csv and validation.csv are read; move the other CSV files out")
            files = {split: [by_name[split]] for split in _CSV_SPLITS if split in by_name}
        else:
            files = {"data": csvs}
    ds = DatasetDict({split: concatenate_datasets([_read_csv(f, task) for f in parts])
                      for split, parts in files.items()})
    if task == "text":
        ds = _encode_labels(ds, ", ".join(str(f) for parts in files.values() for f in parts))
    split = "data" if "data" in ds else "train"
    held = "test" in ds or "validation" in ds  # then the message is of the folder holding them
    return _with_test_split(ds, eval_fraction, seed, f"data_dir {str(path)!r}" if held else
                            ", ".join(str(f) for f in files[split]))


def _read_csv(file: Path, task: str) -> Dataset:
    """One CSV file of ``task`` as ``text`` (str) and ``label``: AG News's ClassLabel 0..3, or for
    ``"text"`` the label as written (str, stripped; :func:`_encode_labels` makes the classes).

    A layout of :data:`_CSV_LAYOUTS`, with a header line (names in any case); other columns are
    dropped; blank lines are skipped. Every problem (not UTF-8, empty, header only, missing or
    repeated columns, rows of the wrong width, empty texts or labels, AG News labels that are not
    integers or not classes) is a ValueError naming the file and, for a row, its line.
    """
    text = _read_text(file)
    reader = csv.reader(io.StringIO(text, newline=""))
    rows, line = [], 1
    # the csv module refuses a field over its limit (131,072 characters): a long text is legal CSV
    # (the tokenizer truncates it); the limit is process-wide, so it is put back after the file
    limit = csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    try:
        for fields in reader:
            if any(f.strip() for f in fields):
                rows.append((line, fields))
            line = reader.line_num + 1
    except csv.Error as err:
        raise ValueError(f"{file}:{line}: not valid CSV ({err})") from None
    finally:
        csv.field_size_limit(limit)
    if not rows:
        raise ValueError(f"{file}: every field is empty (no header line, no data rows)")
    names = [name.strip() for name in rows[0][1]]
    header = [name.lower() for name in names]  # column names match whatever their case
    layouts = [(cols, first) for cols, first in _CSV_LAYOUTS[task] if set(cols) <= set(header)]
    if len(layouts) > 1:
        raise ValueError(f"{file}: the header {names} has the columns of both layouts, label,title,description "
                         "(labels 1-4) and text,label (labels 0-3), so which texts and labels it means is unclear: "
                         "keep the columns of one")
    layout = layouts[0] if layouts else None
    if layout is None:
        looks_like_data = bool(header) and _INTEGER.fullmatch(header[0]) is not None
        other_separator = next((name for sep, name in (("\t", "tabs"), (";", "semicolons"))
                                if len(header) == 1 and sep in header[0]), None)
        raise ValueError(f"{file}: expected columns {_CSV_COLUMNS[task]}, found {names}"
                         + (f"; the first line looks like data: add a header line naming the columns "
                            f"{_CSV_COLUMNS[task]}" if looks_like_data else
                            f"; the header is one column of names separated by {other_separator}: save the file "
                            "with commas" if other_separator else
                            "; name the column of texts 'text' (join several into it)" if task == "text"
                            and "label" in header else ""))
    (columns, first), data = layout, rows[1:]
    repeated = sorted({c for c in columns if header.count(c) > 1})
    if repeated:
        raise ValueError(f"{file}: column(s) {repeated} appear more than once in the header {names}")
    if not data:
        raise ValueError(f"{file}: has a header line but no data rows")
    where = {c: header.index(c) for c in columns}
    allowed = None if first is None else f"{first}-{first + len(AG_NEWS_LABELS) - 1}"
    text, label = [], []
    for lineno, fields in data:
        if len(fields) != len(header):
            raise ValueError(f"{file}:{lineno}: {len(fields)} fields, but the header has {len(header)} "
                             f"({','.join(names)}); quote fields that contain commas")
        value = fields[where["label"]].strip()
        if first is None:
            if not value:
                raise ValueError(f"{file}:{lineno}: the label is empty; every row needs one")
            label.append(value)
        elif _INTEGRAL.fullmatch(value) is None:  # "2.0" is 2, as in the text task
            raise ValueError(f"{file}:{lineno}: label {value!r} is not an integer; labels must be {allowed}")
        elif not first <= (number := int(_integer_name(value))) < first + len(AG_NEWS_LABELS):
            raise ValueError(f"{file}:{lineno}: label {number} is not a class; labels must be {allowed}")
        else:
            label.append(number - first)
        parts = [fields[where[c]] for c in (("text",) if "text" in where else ("title", "description"))]
        if not any(part.strip() for part in parts):
            raise ValueError(f"{file}:{lineno}: no text ({' and '.join(c for c in where if c != 'label')} empty); "
                             "every row needs one")
        text.append(parts[0] if "text" in where else f"{_unescape(parts[0])}. {_unescape(parts[1])}")
    classes = Value("string") if first is None else ClassLabel(names=list(AG_NEWS_LABELS))
    return Dataset.from_dict({"text": text, "label": label}, features=Features({"text": Value("string"),
                                                                                "label": classes}))


def _encode_labels(ds: DatasetDict, source: str) -> DatasetDict:
    """``ds`` with its string ``label`` made a ClassLabel over the distinct labels of all splits:
    integers in numeric order (named as integers: ``"07"`` and ``"7.0"`` are ``"7"``), else strings in
    sorted order. ValueError naming `source` when there is one class only, or fewer than two rows per
    class on average (a column of scores or free text taken for classes)."""
    values = sorted({value for part in ds.values() for value in part["label"]})
    numeric = all(_INTEGRAL.fullmatch(value) for value in values)
    names = sorted({_integer_name(v) for v in values}, key=int) if numeric else values
    if len(names) < 2:
        raise ValueError(f"{source}: every row has the label {names[0]!r}, and a classifier needs two classes or more")
    rows = sum(len(part) for part in ds.values())
    if 2 * len(names) > rows:
        raise ValueError(f"{source}: {len(names)} distinct labels over {rows} rows (e.g. {names[:3]}), fewer than two "
                         "rows per class: the label column should name classes, each with several rows (a score to "
                         "predict needs a regression head, which the recipes do not train)")
    index = {name: i for i, name in enumerate(names)}
    features = Features({"text": Value("string"), "label": ClassLabel(names=names)})
    return DatasetDict({split: Dataset.from_dict(
        {"text": part["text"], "label": [index[_integer_name(v) if numeric else v] for v in part["label"]]},
        features=features) for split, part in ds.items()})


def _integer_name(value: str) -> str:
    """The class name of an :data:`_INTEGRAL` label: the integer written plainly ("07", "+7", "7.0": "7")."""
    return str(int(_INTEGRAL.fullmatch(value).group(1)))


def _load_saved(task: str, path: Path, eval_fraction: float | None, seed: int) -> DatasetDict:
    """A ``save_to_disk`` directory (Dataset or DatasetDict with ``train``) checked like a CSV.
    Read into memory: a memory-mapped one would get the cache files of its conversion and
    tokenization written beside its data, into the user's folder."""
    saved = load_saved_dataset(path, keep_in_memory=True)
    parts = saved if isinstance(saved, DatasetDict) else DatasetDict({"data": saved})
    if isinstance(saved, DatasetDict) and "train" not in saved:
        raise ValueError(f"saved dataset at {str(path)!r} has no 'train' split (splits: {list(saved)})")
    parts = {split: _checked_saved_split(part, f"{path} [{split}]", task)  # every split, then the first
             for split, part in parts.items()}
    # a ClassLabel keeps its own names (AG News: 4 of them, the ids the same); plain integers get
    # AG News's names, or for "text" the classes of _encode_labels
    named = {split: part.features["label"].names for split, part in parts.items()
             if isinstance(part.features["label"], ClassLabel)}
    if len({tuple(n) for n in named.values()}) > 1:  # the same id would mean another class in another split
        raise ValueError(f"saved dataset at {str(path)!r}: its splits name the classes otherwise ("
                         + "; ".join(f"{split}: {n}" for split, n in named.items()) + "): give every split the same "
                         "ClassLabel names in the same order")
    classes = next(iter(named.values()), None)
    plain = [split for split in parts if split not in named]
    if task == "text" and classes is not None and plain and all(
            _is_integer(parts[split].features["label"]) for split in plain):
        for split in plain:  # integer ids of the ClassLabel the other splits name
            _check_class_ids(parts[split]["label"], len(classes), f"{path} [{split}]",
                             f"ids of the ClassLabel {list(classes)} of split {next(iter(named))!r}")
        parts = DatasetDict({split: _as_class_label(part, classes) for split, part in parts.items()})
    elif task == "text" and plain:
        parts = _encode_labels(DatasetDict({split: Dataset.from_dict(
            {"text": part["text"], "label": [_label_name(part, value) for value in part["label"]]})
            for split, part in parts.items()}), f"saved dataset at {str(path)!r}")
    else:
        parts = DatasetDict({split: _as_class_label(part, classes or AG_NEWS_LABELS) for split, part in parts.items()})
    return _with_test_split(parts, eval_fraction, seed, f"saved dataset at {str(path)!r}")


def _label_name(part: Dataset, value) -> str:
    """A saved split's label ``value`` as :func:`_encode_labels` reads it: a ClassLabel's name, else
    the value written out."""
    feature = part.features["label"]
    return feature.int2str(value) if isinstance(feature, ClassLabel) else str(value).strip()


def _checked_saved_split(part: Dataset, source: str, task: str) -> Dataset:
    """``text`` (strings) and ``label`` of a saved split, checked (ValueError naming `source`), not
    yet cast to the ClassLabel: for AG News integers 0..3 or a 4-class ClassLabel, for ``"text"``
    a ClassLabel, integers or strings."""
    missing = {"text", "label"} - set(part.column_names)
    if missing:
        raise ValueError(f"{source}: lacks column(s) {sorted(missing)}; expected 'text' and 'label', "
                         f"found {part.column_names}")
    text, label = part.features["text"], part.features["label"]
    if not (isinstance(text, Value) and text.dtype in ("string", "large_string")):
        raise ValueError(f"{source}: column 'text' must hold strings, found {text}")
    own = task == "text"  # the user's classes, not AG News's
    if isinstance(label, ClassLabel):
        if label.num_classes != len(AG_NEWS_LABELS) and not own:
            raise ValueError(f"{source}: label has {label.num_classes} classes {label.names}; ag_news has "
                             f"{len(AG_NEWS_LABELS)}: {list(AG_NEWS_LABELS)}")
    elif not (_is_integer(label) or own and isinstance(label, Value) and label.dtype in ("string", "large_string")):
        raise ValueError(f"{source}: column 'label' must hold " + ("integers or strings" if own else "integers 0-3")
                         + f" (or be a ClassLabel), found {label}")
    if any(value is None or not value.strip() for value in part["text"]):
        raise ValueError(f"{source}: column 'text' has empty values (None or blank); every row needs a text")
    labels = part["label"]
    if any(value is None or isinstance(value, str) and not value.strip() for value in labels):
        raise ValueError(f"{source}: column 'label' has empty " + (
            "(None or blank) values; every row needs a label" if own else "(None) values; every row needs a label 0-3"))
    if isinstance(label, ClassLabel) or not own:  # the user's own integers are any classes
        count = label.num_classes if isinstance(label, ClassLabel) else len(AG_NEWS_LABELS)
        _check_class_ids(labels, count, source, f"ids of its ClassLabel {label.names}" if isinstance(label, ClassLabel)
                         else "AG News's classes")
    if not len(part):
        raise ValueError(f"{source}: has no rows")
    return part.select_columns(["text", "label"])


def _is_integer(feature) -> bool:
    """Whether a ``label`` feature is a plain integer ``Value`` (not a ClassLabel)."""
    return isinstance(feature, Value) and re.fullmatch(r"u?int\d+", feature.dtype) is not None


def _check_class_ids(labels, count: int, source: str, what: str) -> None:
    """ValueError naming `source` unless every label is a class id ``0..count-1`` (``what`` they are
    ids of); -1 is named as what it marks: unlabelled rows (GLUE's test splits)."""
    values = np.asarray(labels, dtype=np.int64)
    bad = sorted(set(values[(values < 0) | (values >= count)].tolist()))
    if bad:
        unlabelled = (f"; -1 marks unlabelled rows ({int((values == -1).sum())} here, as in GLUE's test splits), "
                      "which cannot be trained or evaluated on: drop that split or label its rows"
                      if -1 in bad else "")
        raise ValueError(f"{source}: labels must be 0-{count - 1} ({what}), found {bad[:5]}{unlabelled}")


def _unescape(text: str) -> str:
    # The original CSVs escape '$' as '\$' and write line breaks as a lone backslash.
    return text.replace("\\$", "$").replace("\\", " ").strip()


def _as_class_label(ds: Dataset, names) -> Dataset:
    return ds.cast_column("label", ClassLabel(names=list(names)))


# --- Sentlen -----------------------------------------------------------------------------------


def _senteval_file(path: Path) -> Path | None:
    """SentEval's tab-separated probing file: ``path`` itself (a .txt or .tsv file, any case), or the
    ``sentence_length.txt`` in the folder ``path``; else None."""
    if path.is_file() and path.suffix.lower() in (".txt", ".tsv"):
        return path
    candidate = path / SENTEVAL_FILE
    return candidate if candidate.is_file() else None


def _load_senteval(file: Path) -> DatasetDict:
    """Parse SentEval's probing format: one ``split<TAB>label<TAB>sentence`` per line.

    Blank lines are skipped; every other problem is a ValueError naming the file and the line.
    """
    rows = {split: {"text": [], "label": []} for split in _SENTEVAL_SPLITS.values()}
    last = len(SENTLEN_LABELS) - 1
    for lineno, line in enumerate(_read_text(file).splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3 or parts[0] not in _SENTEVAL_SPLITS:
            raise ValueError(f"{file}:{lineno}: expected 'tr|va|te<TAB>label<TAB>sentence', got {line[:80]!r}")
        value = parts[1].strip()
        if _INTEGER.fullmatch(value) is None:
            raise ValueError(f"{file}:{lineno}: label {value!r} is not an integer; sentence-length labels must be 0-{last}")
        if not 0 <= int(value) <= last:
            raise ValueError(f"{file}:{lineno}: label {int(value)} is not a class; sentence-length labels must be 0-{last}")
        split = _SENTEVAL_SPLITS[parts[0]]
        rows[split]["text"].append(parts[2])
        rows[split]["label"].append(int(value))
    if not rows["train"]["text"] or not rows["test"]["text"]:
        raise ValueError(f"{file}: needs both 'tr' and 'te' rows")
    return DatasetDict(
        {split: _as_class_label(Dataset.from_dict(r), SENTLEN_LABELS) for split, r in rows.items() if r["text"]}
    )


def sentence_length_class(sentence: str) -> int | None:
    """Sentlen class of a sentence (index into :data:`SENTLEN_BINS`), or None outside 5-28 tokens.

    Tokens are words and punctuation marks (``\\w+|[^\\w\\s]``), as in SentEval's tokenised text.
    """
    n = len(_TOKEN.findall(sentence))
    for cls, (lo, hi) in enumerate(SENTLEN_BINS):
        if lo <= n <= hi:
            return cls
    return None


def build_sentlen(source: DatasetDict, eval_fraction: float = _DEFAULT_EVAL_FRACTION, seed: int = 0,
                  origin: str = "the source") -> DatasetDict:
    """Build the Sentlen task from the sentences of another text dataset.

    Every text of every split of ``source`` is split into sentences; each distinct sentence of 5-28
    tokens is labelled by its length bin; classes are balanced by seeded down-sampling to the
    rarest class; a stratified ``eval_fraction`` is held out as ``test``. ``origin`` names where
    ``source`` came from in the ValueError raised when some length class has fewer than 2
    sentences.
    """
    eval_fraction = check_number("eval_fraction", eval_fraction, _EVAL_FRACTION)
    seed = check_field("seed", seed)
    if not isinstance(source, Mapping) or not all(isinstance(part, Dataset) for part in source.values()):
        raise ValueError(f"source must be a DatasetDict of splits with a 'text' column (load_task's), got "
                         f"{type(source).__name__}" + (": wrap it, DatasetDict(train=...)"
                                                        if isinstance(source, Dataset) else ""))
    textless = [split for split, part in source.items() if "text" not in part.column_names]
    if textless:
        raise ValueError(f"source: split {textless[0]!r} has no 'text' column (columns: "
                         f"{source[textless[0]].column_names}); build Sentlen before tokenizing")
    texts = concatenate_datasets([part.select_columns(["text"]) for part in source.values()])["text"]
    sentences = {s.strip() for text in texts for s in _SENTENCE_END.split(text) if s.strip()}
    by_class = [[] for _ in SENTLEN_BINS]
    for sentence in sorted(sentences):
        cls = sentence_length_class(sentence)
        if cls is not None:
            by_class[cls].append(sentence)
    per_class = min(len(members) for members in by_class)
    if per_class < 2:
        counts = dict(zip(SENTLEN_LABELS, map(len, by_class)))
        raise ValueError(f"{origin}: too few sentences to build a balanced Sentlen task (every length class needs "
                         f"at least 2 distinct sentences): per-class counts {counts}")
    rng = np.random.default_rng(seed)
    text, label = [], []
    for cls, members in enumerate(by_class):
        keep = rng.choice(len(members), size=per_class, replace=False)
        text += [members[i] for i in sorted(keep)]
        label += [cls] * per_class
    ds = _as_class_label(Dataset.from_dict({"text": text, "label": label}), SENTLEN_LABELS)
    return _with_eval_split(ds, eval_fraction, seed, f"the Sentlen task built from {origin}")
