"""Text-classification tasks as `datasets.DatasetDict`s with ``text``/``label`` columns.

Two tasks of SPEC section 8:

* ``"ag_news"`` -- AG News topic classification (4 classes: World, Sports, Business, Sci/Tech).
* ``"sentlen"`` -- SentEval's sentence-length probing task (6 classes of token counts).

Every loader reads the Hugging Face hub by default and a local path when ``data_dir`` is given,
so the same code runs on a laptop with internet and on an offline cluster.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk

AG_NEWS_HUB_ID = "ag_news"
AG_NEWS_LABELS = ("World", "Sports", "Business", "Sci/Tech")
# SentEval "Sentlen" bins of token counts, inclusive (Conneau et al. 2018).
SENTLEN_BINS = ((5, 8), (9, 12), (13, 16), (17, 20), (21, 25), (26, 28))
SENTLEN_LABELS = tuple(f"{lo}-{hi}" for lo, hi in SENTLEN_BINS)
SENTEVAL_FILE = "sentence_length.txt"
_SENTEVAL_SPLITS = {"tr": "train", "va": "validation", "te": "test"}
_TOKEN = re.compile(r"\w+|[^\w\s]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")

TASKS = ("ag_news", "sentlen")


def load_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    tokenizer=None,
    max_length: int = 128,
    eval_fraction: float = 0.2,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    seed: int = 0,
) -> DatasetDict:
    """Load a task as a ``DatasetDict`` with ``"train"`` and ``"test"`` splits.

    Args:
        name: ``"ag_news"`` or ``"sentlen"``.
        data_dir: ``None`` reads the hub. Otherwise a local source:

            * ``ag_news``: a CSV file or a directory of CSV files in the original layout
              (``label,title,description``, labels 1-4) or with ``text,label`` columns (labels
              0-3); a directory with ``train.csv``/``test.csv`` keeps those splits; or a directory
              written by ``DatasetDict.save_to_disk``.
            * ``sentlen``: SentEval's ``sentence_length.txt`` (or a directory holding it), or any
              AG News source above, whose sentences are then binned by length (see
              :func:`build_sentlen`). Without ``data_dir`` the sentences come from the hub's AG News.
        tokenizer: a Hugging Face tokenizer. When given, ``input_ids``/``attention_mask`` are added
            through a cached ``datasets.map`` (truncated to ``max_length`` tokens, padded later by
            the collator) and ``text`` is dropped.
        max_length: longest tokenised sequence, in tokens.
        eval_fraction: share of the data held out, stratified by label and seeded, when the source
            has no test split (0 < eval_fraction < 1).
        max_train_samples, max_eval_samples: keep a seeded random subset of that many rows.
        seed: seed of the held-out split and of the subsets.

    Returns:
        ``DatasetDict`` with ``train`` and ``test`` (and ``validation`` where the source has one);
        ``label`` is a ``ClassLabel`` with values ``0..K-1``.
    """
    if name not in TASKS:
        raise ValueError(f"name must be one of {TASKS}, got {name!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
    if data_dir is not None and not Path(data_dir).exists():
        raise FileNotFoundError(f"data_dir {str(data_dir)!r} does not exist")

    if name == "ag_news":
        ds = _load_ag_news(data_dir, eval_fraction, seed)
    elif data_dir is not None and _senteval_file(Path(data_dir)) is not None:
        ds = _load_senteval(_senteval_file(Path(data_dir)))
    else:
        ds = build_sentlen(_load_ag_news(data_dir, eval_fraction, seed), eval_fraction, seed)

    for split in list(ds):
        arg, limit = ("max_train_samples", max_train_samples) if split == "train" else ("max_eval_samples", max_eval_samples)
        ds[split] = _subset(ds[split], limit, seed, arg)
    if tokenizer is not None:
        ds = ds.map(
            lambda batch: tokenizer(batch["text"], truncation=True, max_length=max_length),
            batched=True,
            remove_columns=["text"],
            desc="Tokenizing",
        )
    return ds


def _subset(ds: Dataset, limit: int | None, seed: int, arg: str) -> Dataset:
    if limit is None:
        return ds
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{arg} must be a positive integer or None, got {limit!r}")
    return ds.shuffle(seed=seed).select(range(min(limit, len(ds))))


def _with_eval_split(ds: Dataset, eval_fraction: float, seed: int) -> DatasetDict:
    """Carve a stratified, seeded held-out ``test`` split from a single split."""
    return ds.train_test_split(test_size=eval_fraction, stratify_by_column="label", seed=seed)


# --- AG News -----------------------------------------------------------------------------------


def _load_ag_news(data_dir, eval_fraction: float, seed: int) -> DatasetDict:
    if data_dir is None:
        return load_dataset(AG_NEWS_HUB_ID)
    path = Path(data_dir)
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        saved = load_from_disk(str(path))
        for part in saved.values() if isinstance(saved, DatasetDict) else [saved]:
            missing = {"text", "label"} - set(part.column_names)
            if missing:
                raise ValueError(f"saved dataset at {str(path)!r} lacks column(s) {sorted(missing)}; "
                                 f"expected 'text' and 'label', found {part.column_names}")
        if isinstance(saved, Dataset):
            saved = _with_eval_split(_as_class_label(saved, AG_NEWS_LABELS), eval_fraction, seed)
        return saved

    if path.is_file():
        files = {"data": [str(path)]}
    else:
        csvs = sorted(path.glob("*.csv"))
        if not csvs:
            raise ValueError(f"data_dir {str(path)!r} holds no CSV file and no saved dataset "
                             "(expected label,title,description CSVs or a save_to_disk directory)")
        by_name = {p.stem: str(p) for p in csvs}
        if "train" in by_name:
            files = {split: [by_name[split]] for split in ("train", "test") if split in by_name}
        else:
            files = {"data": [str(p) for p in csvs]}
    raw = load_dataset("csv", data_files=files)
    ds = DatasetDict({split: _normalise_ag_news_csv(part, files[split][0]) for split, part in raw.items()})
    if "test" not in ds:
        ds = _with_eval_split(ds["data"] if "data" in ds else ds["train"], eval_fraction, seed)
    return ds


def _normalise_ag_news_csv(ds: Dataset, source: str) -> Dataset:
    """Map either CSV layout to ``text`` (str) and ``label`` (ClassLabel 0..3)."""
    cols = set(ds.column_names)
    if {"label", "title", "description"} <= cols:
        offset = 1  # the original distribution numbers classes 1-4

        def to_text(batch):
            return {"text": [f"{_unescape(t)}. {_unescape(d)}" for t, d in zip(batch["title"], batch["description"])]}

        ds = ds.map(to_text, batched=True, remove_columns=sorted(cols - {"label"}))
    elif {"text", "label"} <= cols:
        offset = 0
        ds = ds.remove_columns(sorted(cols - {"text", "label"}))
    else:
        raise ValueError(f"{source}: expected columns label,title,description (labels 1-4) or "
                         f"text,label (labels 0-3), found {ds.column_names}")
    labels = np.asarray(ds["label"]) - offset
    bad = sorted(set(labels[(labels < 0) | (labels >= len(AG_NEWS_LABELS))].tolist()))
    if bad:
        allowed = "1-4" if offset else "0-3"
        raise ValueError(f"{source}: labels must be {allowed}, found {[b + offset for b in bad]}")
    ds = ds.remove_columns("label").add_column("label", labels.tolist())
    return _as_class_label(ds, AG_NEWS_LABELS)


def _unescape(text: str | None) -> str:
    # The original CSVs escape '$' as '\$' and write line breaks as a lone backslash.
    return (text or "").replace("\\$", "$").replace("\\", " ").strip()


def _as_class_label(ds: Dataset, names) -> Dataset:
    return ds.cast_column("label", ClassLabel(names=list(names)))


# --- Sentlen -----------------------------------------------------------------------------------


def _senteval_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".txt":
        return path
    candidate = path / SENTEVAL_FILE
    return candidate if candidate.is_file() else None


def _load_senteval(file: Path) -> DatasetDict:
    """Parse SentEval's probing format: one ``split<TAB>label<TAB>sentence`` per line."""
    rows = {split: {"text": [], "label": []} for split in _SENTEVAL_SPLITS.values()}
    with open(file, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3 or parts[0] not in _SENTEVAL_SPLITS or not parts[1].strip().isdigit():
                raise ValueError(f"{file}:{lineno}: expected 'tr|va|te<TAB>label<TAB>sentence', got {line[:80]!r}")
            split = _SENTEVAL_SPLITS[parts[0]]
            rows[split]["text"].append(parts[2])
            rows[split]["label"].append(int(parts[1]))
    bad = sorted({lab for r in rows.values() for lab in r["label"]} - set(range(len(SENTLEN_LABELS))))
    if bad:
        raise ValueError(f"{file}: sentence-length labels must be 0-{len(SENTLEN_LABELS) - 1}, found {bad}")
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


def build_sentlen(source: DatasetDict, eval_fraction: float = 0.2, seed: int = 0) -> DatasetDict:
    """Build the Sentlen task from the sentences of another text dataset.

    Every text of every split of ``source`` is split into sentences; each distinct sentence of 5-28
    tokens is labelled by its length bin; classes are balanced by seeded down-sampling to the
    rarest class; a stratified ``eval_fraction`` is held out as ``test``.
    """
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
        raise ValueError(f"too few sentences to build a balanced Sentlen task: per-class counts {counts}")
    rng = np.random.default_rng(seed)
    text, label = [], []
    for cls, members in enumerate(by_class):
        keep = rng.choice(len(members), size=per_class, replace=False)
        text += [members[i] for i in sorted(keep)]
        label += [cls] * per_class
    ds = _as_class_label(Dataset.from_dict({"text": text, "label": label}), SENTLEN_LABELS)
    return _with_eval_split(ds, eval_fraction, seed)
