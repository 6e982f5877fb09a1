"""Every unusable data file or folder ends in one clear error naming it (issue 24).

Each case writes a small bad source under tmp_path and checks: the error class, a message naming the
file (or argument) and what is allowed, that the error is raised by this package (not a traceback
from datasets, pandas or PIL), and that the user's file is left byte for byte as it was.
"""
import hashlib
import os
import pathlib

import datasets
import numpy as np
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from lp_decentral_nlp.data import AG_NEWS_LABELS, check_enough_rows, load_task, skewed_partition

HEADER = "label,title,description\n"


def _rows(n, layout="original"):
    """``n`` well-formed CSV rows cycling through the four classes."""
    if layout == "original":
        return "".join(f"{i % 4 + 1},Title {i},Description number {i}.\n" for i in range(n))
    return "".join(f"Story number {i}.,{i % 4}\n" for i in range(n))


def _fingerprint(path: pathlib.Path) -> dict:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _expect(exc, match, call, source: pathlib.Path):
    """``call()`` raises ``exc`` matching ``match`` from inside lp_decentral_nlp; ``source`` is unchanged."""
    before = _fingerprint(source)
    with pytest.raises(exc, match=match) as info:
        call()
    assert "lp_decentral_nlp" in str(info.traceback[-1].path), f"raised outside the package: {info.traceback[-1]}"
    assert info.value.__context__ is None or info.value.__suppress_context__, "chained to a library traceback"
    assert _fingerprint(source) == before
    return info.value


def _write(path: pathlib.Path, content, encoding="utf-8") -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding=encoding)
    return path


# --- missing path ------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["ag_news", "sentlen"])
@pytest.mark.parametrize("name", ["nope.csv", "no_such_dir", "sentence_length.txt"])
def test_missing_path(tmp_path, task, name):
    missing = tmp_path / name
    err = _expect(FileNotFoundError, "does not exist", lambda: load_task(task, data_dir=missing), missing)
    assert str(missing) in str(err)


# --- empty file or folder ----------------------------------------------------------------------


@pytest.mark.parametrize("task, name, content, match", [
    ("ag_news", "empty.csv", b"", "empty.csv: the file is empty"),
    ("ag_news", "blank.csv", "\n  \n\n", "blank.csv: the file is empty"),
    ("ag_news", "commas.csv", ",,\n , ,\n", r"commas.csv: every field is empty \(no header line, no data rows\)"),
    ("sentlen", "empty.csv", b"", "empty.csv: the file is empty"),
    ("sentlen", "sentence_length.txt", b"", "sentence_length.txt: the file is empty"),
    ("sentlen", "probe.txt", "\n\n", "probe.txt: the file is empty"),
])
def test_empty_file(tmp_path, task, name, content, match):
    source = _write(tmp_path / name, content)
    _expect(ValueError, match, lambda: load_task(task, data_dir=source), source)


@pytest.mark.parametrize("task", ["ag_news", "sentlen"])
def test_empty_folder_and_folder_without_csv(tmp_path, task):
    _expect(ValueError, "holds no CSV file", lambda: load_task(task, data_dir=tmp_path), tmp_path)
    _write(tmp_path / "notes.md", "# not data\n")
    _expect(ValueError, "holds no CSV file", lambda: load_task(task, data_dir=tmp_path), tmp_path)


def test_file_that_is_not_csv(tmp_path):
    source = _write(tmp_path / "data.json", '{"text": "a", "label": 0}\n')
    _expect(ValueError, r"data\.json.* is not a \.csv file", lambda: load_task("ag_news", data_dir=source), source)


# --- header only -------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [HEADER, "text,label\n", HEADER + "\n\n", "\ufefftext,label"])
@pytest.mark.parametrize("task", ["ag_news", "sentlen"])
def test_header_only(tmp_path, task, content):
    source = _write(tmp_path / "head.csv", content)
    _expect(ValueError, "head.csv: has a header line but no data rows", lambda: load_task(task, data_dir=source), source)


def test_header_only_test_csv_in_folder(tmp_path):
    _write(tmp_path / "train.csv", HEADER + _rows(40))
    _write(tmp_path / "test.csv", HEADER)
    _expect(ValueError, "test.csv: has a header line but no data rows", lambda: load_task("ag_news", data_dir=tmp_path),
            tmp_path)


# --- wrong or missing columns ------------------------------------------------------------------


@pytest.mark.parametrize("content, match", [
    ("sentence,category\nhello,1\n", r"expected columns label,title,description .* found \['sentence', 'category'\]"),
    ("label,title\n1,a\n", r"found \['label', 'title'\]"),
    ("text\nonly text\n", r"found \['text'\]"),
    ('"3","Wall St. Bears","Short-sellers..."\n' + _rows(8), "the first line looks like data: add a header line"),
    ("label,title,description,label\n1,a,b,2\n", r"column\(s\) \['label'\] appear more than once"),
])
def test_wrong_or_missing_columns(tmp_path, content, match):
    source = _write(tmp_path / "cols.csv", content)
    _expect(ValueError, "cols.csv: .*" + match, lambda: load_task("ag_news", data_dir=source), source)


@pytest.mark.parametrize("row, match", [
    ("1,title only\n", "cols.csv:4: 2 fields, but the header has 3"),
    ("1,a,b,extra\n", "cols.csv:4: 4 fields, but the header has 3"),
    ('1,"unterminated,b\n', "cols.csv:4: 2 fields"),
])
def test_rows_of_the_wrong_width(tmp_path, row, match):
    source = _write(tmp_path / "cols.csv", HEADER + _rows(2) + row + _rows(2))
    _expect(ValueError, match, lambda: load_task("ag_news", data_dir=source), source)


def test_folder_with_unexpected_csv_next_to_train(tmp_path):
    _write(tmp_path / "train.csv", HEADER + _rows(40))
    _write(tmp_path / "val.csv", HEADER + _rows(8))
    _expect(ValueError, r"holds train.csv and also \['val.csv'\]", lambda: load_task("ag_news", data_dir=tmp_path),
            tmp_path)


def test_a_validation_split_is_the_test_split_of_a_source_without_one(tmp_path):
    """validation.csv beside train.csv was refused, then kept unused while 20% of train.csv was held
    out as test; as run_glue.py, the evaluation is on the validation split when there is no test
    split, and eval_fraction, which then holds nothing out, is refused."""
    _write(tmp_path / "train.csv", HEADER + _rows(40))
    _write(tmp_path / "validation.csv", HEADER + _rows(8))
    assert {split: len(part) for split, part in load_task("ag_news", data_dir=str(tmp_path)).items()} == {
        "train": 40, "test": 8}
    with pytest.raises(ValueError, match=r"^eval_fraction=0.5 is the share held out of a source without test rows, "
                                         r"and data_dir '.*' has its 'validation' split: leave eval_fraction out$"):
        load_task("ag_news", data_dir=tmp_path, eval_fraction=0.5)
    saved = tmp_path / "saved"
    DatasetDict(train=Dataset.from_dict({"text": ["a", "b"] * 4, "label": [0, 1] * 4}),
                validation=Dataset.from_dict({"text": ["c", "d"], "label": [1, 0]})).save_to_disk(saved)
    assert {split: len(part) for split, part in load_task("text", data_dir=saved).items()} == {"train": 8, "test": 2}
    _write(tmp_path / "test.csv", HEADER + _rows(12))
    assert {split: len(part) for split, part in load_task("ag_news", data_dir=tmp_path).items()} == {
        "train": 40, "test": 12, "validation": 8}


def test_load_saved_dataset_names_a_missing_path_and_a_file(tmp_path):
    """Both were "looks like a save_to_disk folder but cannot be loaded (FileNotFoundError: ...)"."""
    from lp_decentral_nlp.data import load_saved_dataset

    with pytest.raises(FileNotFoundError, match=r"^data_dir '.*no-such' does not exist$"):
        load_saved_dataset(tmp_path / "no-such")
    csv_file = _write(tmp_path / "reviews.csv", "text,label\na,b\n")
    _expect(ValueError, r"^data_dir '.*reviews.csv' is a file, not a save_to_disk folder \(a folder holding "
            r"dataset_dict.json or state.json\)$", lambda: load_saved_dataset(csv_file), csv_file)


def test_data_dir_may_start_with_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / "news.csv", HEADER + _rows(40))
    assert len(load_task("ag_news", data_dir="~/news.csv")["train"]) == 32


def test_folder_with_test_csv_and_no_train_csv(tmp_path):
    _write(tmp_path / "test.csv", HEADER + _rows(40))
    _expect(ValueError, "holds test.csv but no train.csv: test.csv is the test split beside a train.csv, and its rows "
            "are never trained on", lambda: load_task("ag_news", data_dir=tmp_path), tmp_path)


def test_a_bad_seed_is_named(tmp_path):
    source = _write(tmp_path / "data.csv", HEADER + _rows(40))
    _expect(ValueError, r"^seed must be an integer in \[0, 4294967295\], got -1",
            lambda: load_task("ag_news", data_dir=source, seed=-1), source)


def _saved(tmp_path, columns, features=None, splits=("train", "test")):
    folder = tmp_path / "saved"
    part = Dataset.from_dict(columns, features=features)
    DatasetDict({s: part for s in splits}).save_to_disk(folder)
    return folder


@pytest.mark.parametrize("columns, features, match", [
    ({"sentence": ["a", "b"], "label": [0, 1]}, None, r"lacks column\(s\) \['text'\]"),
    ({"text": ["a", "b"], "target": [0, 1]}, None, r"lacks column\(s\) \['label'\]"),
    ({"text": [1, 2], "label": [0, 1]}, None, "column 'text' must hold strings"),
    ({"text": ["a", "b"], "label": ["World", "Sports"]}, None, "column 'label' must hold integers 0-3"),
    ({"text": ["a", "b"], "label": [0.0, 1.0]}, None, "column 'label' must hold integers 0-3"),
    ({"text": ["a", "b"], "label": [0, 1]},
     Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])}), "label has 2 classes"),
])
def test_saved_dataset_with_wrong_columns(tmp_path, columns, features, match):
    folder = _saved(tmp_path, columns, features)
    _expect(ValueError, r"saved \[train\]: " + match, lambda: load_task("ag_news", data_dir=folder), folder)


def test_a_bad_saved_split_is_refused_before_any_split_is_converted(tmp_path, capfd):
    """The error is the only output: no progress bar of converting the good split comes before it."""
    folder = tmp_path / "saved"
    good = Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    DatasetDict(train=good, test=Dataset.from_dict({"text": ["a"], "label": [9]})).save_to_disk(folder)
    capfd.readouterr()
    _expect(ValueError, r"saved \[test\]: labels must be 0-3 \(AG News's classes\), found \[9\]$", lambda: load_task("ag_news", data_dir=folder),
            folder)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("content, message", [
    (HEADER + _rows(8) + "2,,\n", r"empty.csv:10: no text \(title and description empty\); every row needs one"),
    ("text,label\n" + "".join(f"t{i},{i % 4}\n" for i in range(8)) + "  ,1\n",
     r"empty.csv:10: no text \(text empty\); every row needs one"),
])
def test_a_row_without_text_is_refused(content, message, tmp_path):
    """It was read as "" (or ". " from an empty title and description) and trained on."""
    source = _write(tmp_path / "empty.csv", content)
    _expect(ValueError, message, lambda: load_task("ag_news", data_dir=source), source)
    folder = _saved(tmp_path, {"text": ["a", " "], "label": [0, 1]})
    _expect(ValueError, r"saved \[train\]: column 'text' has empty values \(None or blank\)",
            lambda: load_task("ag_news", data_dir=folder), folder)


def test_saved_splits_that_name_the_classes_otherwise_are_refused(tmp_path):
    """A test row saved as "Sports" (id 0 of its split) was read as "World" (id 0 of train's)."""
    from datasets import ClassLabel, Features, Value

    def split(names, labels):
        return Dataset.from_dict({"text": [f"t{i}" for i in range(len(labels))], "label": labels},
                                 features=Features({"text": Value("string"), "label": ClassLabel(names=names)}))

    folder = tmp_path / "saved"
    DatasetDict(train=split(["World", "Sports", "Business", "Sci/Tech"], [0, 1, 2, 3] * 2),
                test=split(["Sports", "World", "Business", "Sci/Tech"], [0])).save_to_disk(folder)
    _expect(ValueError, r"its splits name the classes otherwise \(train: \['World', 'Sports', 'Business', "
                        r"'Sci/Tech'\]; test: \['Sports', 'World', 'Business', 'Sci/Tech'\]\)",
            lambda: load_task("ag_news", data_dir=folder), folder)


def test_saved_dataset_without_train_split_or_unreadable(tmp_path):
    folder = _saved(tmp_path, {"text": ["a"], "label": [0]}, splits=("validation",))
    _expect(ValueError, r"has no 'train' split \(splits: \['validation'\]\)",
            lambda: load_task("ag_news", data_dir=folder), folder)
    broken = _write(tmp_path / "broken" / "dataset_dict.json", "{not json")
    _expect(ValueError, "looks like a save_to_disk folder but cannot be loaded",
            lambda: load_task("ag_news", data_dir=broken.parent), broken.parent)


@pytest.mark.parametrize("line, match", [
    ("tr 0 no tabs\n", "expected 'tr|va|te<TAB>label<TAB>sentence'"),
    ("train\t0\tsplit name spelled out\n", "expected 'tr|va|te<TAB>label<TAB>sentence'"),
    ("tr\t0\ta\textra tab\n", "expected 'tr|va|te<TAB>label<TAB>sentence'"),
])
def test_senteval_lines_of_the_wrong_shape(tmp_path, line, match):
    _write(tmp_path / "sentence_length.txt", "tr\t0\tfine sentence\n" + line)
    _expect(ValueError, "sentence_length.txt:2: " + match, lambda: load_task("sentlen", data_dir=tmp_path), tmp_path)


def test_senteval_needs_train_and_test_rows(tmp_path):
    source = _write(tmp_path / "sentence_length.txt", "\n".join(f"tr\t{i % 6}\ts {i}" for i in range(12)) + "\n\n")
    _expect(ValueError, "needs both 'tr' and 'te' rows", lambda: load_task("sentlen", data_dir=source), source)


# --- labels outside the classes or not integers ------------------------------------------------


@pytest.mark.parametrize("layout, value, match", [
    ("original", "5", "label 5 is not a class; labels must be 1-4"),
    ("original", "0", "label 0 is not a class; labels must be 1-4"),
    ("original", "-1", "label -1 is not a class; labels must be 1-4"),
    ("original", "World", "label 'World' is not an integer; labels must be 1-4"),
    ("original", "1.5", "label '1.5' is not an integer; labels must be 1-4"),
    ("original", "5.0", "label 5 is not a class; labels must be 1-4"),  # an integer written as a float is that integer
    ("original", "", "label '' is not an integer; labels must be 1-4"),
    ("text", "4", "label 4 is not a class; labels must be 0-3"),
    ("text", "sports", "label 'sports' is not an integer; labels must be 0-3"),
])
def test_ag_news_labels(tmp_path, layout, value, match):
    header, bad = (HEADER, f"{value},Odd title,Odd text\n") if layout == "original" else ("text,label\n", f"Odd,{value}\n")
    source = _write(tmp_path / "labels.csv", header + _rows(5, layout) + bad)
    _expect(ValueError, f"labels.csv:7: {match}", lambda: load_task("ag_news", data_dir=source), source)


def test_ag_news_labels_written_as_floats_are_their_integers(tmp_path):
    """A spreadsheet's 2.0 was refused as "not an integer" in the AG News task, read as 2 in the text task."""
    source = _write(tmp_path / "floats.csv", HEADER + "".join(f"{i % 4 + 1}.0,Title {i},Text {i}.\n" for i in range(40)))
    assert load_task("ag_news", data_dir=source)["train"].features["label"].names == list(AG_NEWS_LABELS)
    assert sorted(set(load_task("ag_news", data_dir=source)["train"]["label"])) == [0, 1, 2, 3]


def test_saved_dataset_with_empty_labels_or_texts_or_an_empty_split(tmp_path):
    folder = _saved(tmp_path, {"text": ["a", "b"], "label": [0, None]})
    _expect(ValueError, r"saved \[train\]: column 'label' has empty \(None\) values; every row needs a label 0-3",
            lambda: load_task("ag_news", data_dir=folder), folder)
    folder = _saved(tmp_path / "texts", {"text": ["a", None], "label": [0, 1]})
    _expect(ValueError, r"saved \[train\]: column 'text' has empty values \(None or blank\); every row needs a text",
            lambda: load_task("ag_news", data_dir=folder), folder)
    part = Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    empty_test = tmp_path / "empty_test"
    DatasetDict({"train": part, "test": part.select([])}).save_to_disk(empty_test)
    _expect(ValueError, "is a save_to_disk folder with a split of no rows, which datasets saves without a data file "
                        "and cannot read back: save it without the empty split",
            lambda: load_task("ag_news", data_dir=empty_test), empty_test)


def test_saved_dataset_labels_out_of_range(tmp_path):
    folder = _saved(tmp_path, {"text": ["a", "b", "c"], "label": [0, 7, -2]})
    _expect(ValueError, r"labels must be 0-3 \(AG News's classes\), found \[-2, 7\]$", lambda: load_task("ag_news", data_dir=folder), folder)


@pytest.mark.parametrize("label, match", [
    ("6", "label 6 is not a class; sentence-length labels must be 0-5"),
    ("-1", "label -1 is not a class"),
    ("seven", "label 'seven' is not an integer"),
])
def test_senteval_labels(tmp_path, label, match):
    source = _write(tmp_path / "probe.txt", f"tr\t0\tfine\nte\t1\tfine too\ntr\t{label}\tbad\n")
    _expect(ValueError, f"probe.txt:3: {match}", lambda: load_task("sentlen", data_dir=source), source)


# --- non-UTF-8 text ----------------------------------------------------------------------------


@pytest.mark.parametrize("task, name, content, match", [
    ("ag_news", "latin1.csv", (HEADER + _rows(3) + "2,Café,Crème brûlée\n").encode("latin-1"), "line 5"),
    ("ag_news", "utf16.csv", (HEADER + _rows(8)).encode("utf-16"), "line 1"),
    ("ag_news", "cp1252.csv", (HEADER + "1,\u201cQuoted\u201d,text\n").encode("cp1252"), "line 2"),
    ("sentlen", "latin1.txt", "tr\t0\tfine\nte\t0\tna\u00efve\n".encode("latin-1"), "line 2"),
])
def test_non_utf8_text(tmp_path, task, name, content, match):
    source = _write(tmp_path / name, content)
    _expect(ValueError, f"{name}: not UTF-8 text \\({match}", lambda: load_task(task, data_dir=source), source)


def test_a_pipe_is_named_as_such(tmp_path):
    """A named pipe (or bash's <(...)) was "holds no CSV file and no saved dataset", as if a folder."""
    pipe = tmp_path / "data.csv"
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match=r"is neither a file nor a directory \(a pipe, socket or device\): save the "
                                         r"data to a file and pass its path$"):
        load_task("ag_news", data_dir=pipe)


def test_a_gzip_file_is_named_as_such(tmp_path):
    """It was "not UTF-8 text (line 1, byte 1: b'\\x8b')"."""
    import gzip

    source = _write(tmp_path / "data.csv", gzip.compress((HEADER + _rows(8)).encode()))
    _expect(ValueError, "data.csv: gzip-compressed, not text: decompress it first \\(gunzip\\)",
            lambda: load_task("ag_news", data_dir=source), source)


def test_header_names_match_whatever_their_case(tmp_path):
    source = _write(tmp_path / "caps.csv", "Label,Title,DESCRIPTION\n" + _rows(40))
    assert load_task("ag_news", data_dir=source)["train"].features["label"].names[0] == "World"
    bad = _write(tmp_path / "caps_bad.csv", "Label,Headline\n1,a\n")
    _expect(ValueError, r"found \['Label', 'Headline'\]", lambda: load_task("ag_news", data_dir=bad), bad)


def test_header_with_both_layouts_is_refused(tmp_path):
    """``label,title,description,text`` read as the original layout (labels 1-4), its text column
    silently unused; which texts and which label convention it means is the user's to say."""
    source = _write(tmp_path / "both.csv", "label,title,description,text\n" +
                    "".join(f"{i % 4 + 1},Title {i},Description {i}.,Story {i}.\n" for i in range(40)))
    _expect(ValueError, r"both.csv: the header \['label', 'title', 'description', 'text'\] has the columns of both "
            r"layouts, label,title,description \(labels 1-4\) and text,label \(labels 0-3\)",
            lambda: load_task("ag_news", data_dir=source), source)


def test_utf8_with_byte_order_mark_is_read(tmp_path):
    source = _write(tmp_path / "bom.csv", "\ufeff" + HEADER + _rows(40))
    ds = load_task("ag_news", data_dir=source)
    assert len(ds["train"]) + len(ds["test"]) == 40 and ds["train"].column_names == ["text", "label"]


# --- too few rows ------------------------------------------------------------------------------


@pytest.mark.parametrize("content, match", [
    (HEADER + _rows(3), "3 rows are too few to hold out a stratified 0.2 as test"),
    (HEADER + _rows(1), "1 rows are too few"),
    ("text,label\n" + _rows(10, "text"), r"10 rows are too few .*each part at least 4 rows"),
])
def test_too_few_rows_to_hold_out_a_test_split(tmp_path, content, match):
    source = _write(tmp_path / "few.csv", content)
    _expect(ValueError, "few.csv: " + match, lambda: load_task("ag_news", data_dir=source), source)


def test_a_label_with_a_single_row_cannot_be_stratified(tmp_path):
    source = _write(tmp_path / "single.csv", HEADER + "".join(f"{i % 3 + 1},T{i},D{i}\n" for i in range(30))
                    + "4,Lonely,The only Sci/Tech story\n")
    err = _expect(ValueError, "every label needs at least 2 rows", lambda: load_task("ag_news", data_dir=source), source)
    assert "'Sci/Tech': 1" in str(err)


def test_check_enough_rows_for_nodes_and_batch_size():
    check_enough_rows(64, num_nodes=4, batch_size=16, source="train.csv")
    with pytest.raises(ValueError, match="train.csv: 63 training rows cannot give each of 4 nodes one batch of 16: "
                                         "at least 64 rows"):
        check_enough_rows(63, num_nodes=4, batch_size=16, source="train.csv")
    with pytest.raises(ValueError, match="--data-dir x.csv: 0 training rows"):
        check_enough_rows(0, 1, 1, "--data-dir x.csv")
    for kwargs, word in ((dict(num_rows=-1), "num_rows"), (dict(num_nodes=0), "num_nodes"),
                         (dict(batch_size=2.0), "batch_size"), (dict(num_nodes=True), "num_nodes")):
        with pytest.raises(ValueError, match=word):
            check_enough_rows(**(dict(num_rows=10, num_nodes=2, batch_size=2, source="s") | kwargs))


@pytest.mark.parametrize("skew", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_check_enough_rows_is_exact_for_the_shards_at_any_skew(skew):
    """check_enough_rows passes exactly when every skewed shard holds a full batch: the shards
    differ in size by at most one (two pools cut with their extra rows at both ends)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        nodes, batch = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        rows = int(rng.integers(nodes, nodes * (batch + 2)))
        labels = rng.integers(0, int(rng.integers(1, 7)), rows)
        sizes = [len(s) for s in skewed_partition(labels, nodes, skew, seed=1)]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) == rows // nodes
        try:
            check_enough_rows(rows, nodes, batch, "s")
        except ValueError:
            assert min(sizes) < batch
        else:
            assert min(sizes) >= batch


def test_check_enough_rows_agrees_with_a_loaded_split(tmp_path):
    source = _write(tmp_path / "small.csv", HEADER + _rows(80))
    train = load_task("ag_news", data_dir=source)["train"]
    assert len(train) == 64
    check_enough_rows(len(train), 4, 16, str(source))
    with pytest.raises(ValueError, match="small.csv: 64 training rows .* 4 nodes one batch of 17"):
        check_enough_rows(len(train), 4, 17, str(source))
    assert np.bincount(train["label"]).tolist() == [16] * 4


# --- vision sources (load_vision_dataset) ------------------------------------------------------

TEN = [f"class{i}" for i in range(10)]


def _png(path: pathlib.Path, seed=0) -> pathlib.Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)
    return path


def _image_tree(root: pathlib.Path, splits=("train", "test"), classes=TEN, per_class=1) -> pathlib.Path:
    for split in splits:
        for c in classes:
            for k in range(per_class):
                _png(root / split / c / f"{k}.png", seed=k)
    return root


def _load_vision(folder, name="cifar10"):
    from lp_decentral_nlp.vision.data import load_vision_dataset

    return lambda: load_vision_dataset(name, data_dir=folder)


def test_vision_seed_is_named():
    from lp_decentral_nlp.vision.data import load_vision_dataset

    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, 4294967295\], got -1"):
        load_vision_dataset("digits", seed=-1)


@pytest.mark.parametrize("name", ["cifar10", "imagenette"])
def test_vision_missing_path(tmp_path, name):
    missing = tmp_path / "no_images"
    err = _expect(FileNotFoundError, "does not exist", _load_vision(missing, name), missing)
    assert str(missing) in str(err)


def test_vision_file_instead_of_folder(tmp_path):
    source = _png(tmp_path / "one.png")
    _expect(ValueError, "one.png' is a file: expected a DatasetDict.save_to_disk folder or an image folder tree",
            _load_vision(source), source)


@pytest.mark.parametrize("make, match", [
    (lambda root: root.mkdir(), r"has no train folder \(found none\)"),
    (lambda root: _image_tree(root, splits=("train",)), r"has no test folder \(found \['train'\]\)"),
    (lambda root: _image_tree(root, splits=("training", "pictures")), r"has no test folder"),
    (lambda root: (_image_tree(root, splits=("test",)), (root / "train").mkdir()), "train: holds no class folder"),
    (lambda root: (_image_tree(root), (root / "train" / "extra").mkdir()), "extra: class folder holds no image"),
])
def test_vision_folder_layout(tmp_path, make, match):
    root = tmp_path / "tree"
    make(root)
    _expect(ValueError, match, _load_vision(root), root)


@pytest.mark.parametrize("stray, match", [
    ("train/loose.png", "loose.png: a file outside a class folder"),
    ("train/class3/notes.txt", r"notes.txt: not an image file \(extension '.txt'\)"),
    ("test/class1/labels", "labels: not an image file"),
    ("train/class2/nested/x.png", "nested: a folder inside class folder 'class2'"),
])
def test_vision_stray_files(tmp_path, stray, match):
    root = _image_tree(tmp_path / "tree")
    target = root / stray
    if target.suffix == ".png":
        _png(target)
    else:
        _write(target, "not an image\n")
    _expect(ValueError, match, _load_vision(root), root)


def test_vision_hidden_and_file_manager_files_are_skipped(tmp_path):
    root = _image_tree(tmp_path / "tree")
    _write(root / "train" / "class0" / ".DS_Store", b"\x00\x01")
    _write(root / "train" / "class3" / "Thumbs.db", b"\x00\x01")
    _write(root / "test" / "desktop.ini", b"[.ShellClassInfo]\n")
    _write(root / "train" / ".cache", b"")
    dsd = _load_vision(root)()
    assert (dsd["train"].num_rows, dsd["test"].num_rows) == (10, 10)


@pytest.mark.parametrize("content", [b"", b"plain text, not a PNG", None])
def test_vision_unreadable_image(tmp_path, content):
    root = _image_tree(tmp_path / "tree")
    bad = root / "test" / "class7" / "0.png"
    bad.write_bytes(bad.read_bytes()[:40] if content is None else content)  # None: a truncated PNG
    _expect(ValueError, r"class7/0.png: not a readable image", _load_vision(root), root)


def _damaged_pixels_png(path: pathlib.Path) -> None:
    """Rewrite the PNG at ``path`` with its compressed pixel data scrambled (past the zlib header)
    and the chunk's checksum recomputed: PIL's ``verify`` passes it, decoding it fails."""
    import struct
    import zlib

    data = bytearray(path.read_bytes())
    start = data.index(b"IDAT")
    length = struct.unpack(">I", data[start - 4:start])[0]
    for i in range(start + 6, start + 4 + length):
        data[i] ^= 0x5A
    data[start + 4 + length:start + 8 + length] = struct.pack(">I", zlib.crc32(data[start:start + 4 + length]))
    path.write_bytes(bytes(data))


def test_vision_image_with_damaged_pixel_data_or_16_bits(tmp_path):
    """Every image is decoded whole before training (a damaged one failed the final evaluation,
    after training, with a traceback); 16-bit images are refused (their RGB conversion clips them)."""
    from PIL import Image

    root = _image_tree(tmp_path / "tree")
    damaged = root / "test" / "class4" / "0.png"
    _damaged_pixels_png(damaged)
    with Image.open(damaged) as im:
        im.verify()  # passes: the damage is in the pixel data
    _expect(ValueError, r"class4/0.png: not a readable image \(OSError", _load_vision(root), root)
    wide = _image_tree(tmp_path / "wide")
    Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16)).save(wide / "train" / "class2" / "0.png")
    _expect(ValueError, r"class2/0.png: a 16-bit image \(PIL mode I;16\): the transforms take 8-bit images",
            _load_vision(wide), wide)


def test_vision_classes_that_do_not_match(tmp_path):
    root = _image_tree(tmp_path / "tree")
    _png(root / "test" / "zebra" / "0.png")
    _expect(ValueError, r"test: class folder\(s\) \['zebra'\] are not in", _load_vision(root), root)
    two = _image_tree(tmp_path / "two", classes=["a", "b"])
    _expect(ValueError, "cifar10 has 10 classes but the 'train' split of the source .*two has 2", _load_vision(two), two)


def _saved_images(folder, images, labels, label_feature=None):
    from datasets import Image

    features = Features({"image": Image(), "label": label_feature or ClassLabel(num_classes=10)})
    part = Dataset.from_dict({"image": images, "label": labels}, features=features)
    DatasetDict(train=part, test=part).save_to_disk(folder)
    return folder


def test_loading_a_saved_dataset_writes_nothing_into_its_folder(tmp_path, tokenizer):
    """datasets writes the results of converting or tokenizing a memory-mapped saved dataset as
    cache files beside its data, in the user's folder; loading must leave that folder as it was."""
    from PIL import Image

    from lp_decentral_nlp.vision.data import load_vision_dataset

    text = tmp_path / "text"
    part = Dataset.from_dict({"text": [f"story {i}" for i in range(40)], "label": [i % 4 for i in range(40)]})
    DatasetDict(train=part, test=part).save_to_disk(text)
    images = _saved_images(tmp_path / "images", [Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8))] * 20,
                           [i % 10 for i in range(20)])
    png = tmp_path / "black.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(png)
    paths = tmp_path / "paths"  # an image column of file paths (strings): converted to images on loading
    part = Dataset.from_dict({"image": [str(png)] * 20, "label": [i % 10 for i in range(20)]},
                             features=Features({"image": Value("string"), "label": ClassLabel(num_classes=10)}))
    DatasetDict(train=part, test=part).save_to_disk(paths)
    for folder, load in ((text, lambda: load_task("ag_news", data_dir=text, tokenizer=tokenizer, max_length=16)),
                         (images, lambda: load_vision_dataset("cifar10", data_dir=images)),
                         (paths, lambda: load_vision_dataset("cifar10", data_dir=paths))):
        before = _fingerprint(folder)
        assert len(load()["train"]) > 0
        assert _fingerprint(folder) == before, folder


def test_vision_saved_dataset_problems(tmp_path):
    from PIL import Image

    good = [Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8))] * 2
    single = tmp_path / "single"
    Dataset.from_dict({"image": [0], "label": [0]}).save_to_disk(single)
    _expect(ValueError, "holds a single saved Dataset", _load_vision(single), single)
    broken = _write(tmp_path / "broken" / "dataset_dict.json", "{not json").parent
    _expect(ValueError, "looks like a save_to_disk folder but cannot be loaded", _load_vision(broken), broken)
    empty_test = tmp_path / "empty_test"  # (an IndexError traceback from datasets)
    images = Dataset.from_dict({"image": good, "label": [0, 1]},
                               features=Features({"image": datasets.Image(), "label": ClassLabel(num_classes=10)}))
    DatasetDict(train=images, test=images.select([])).save_to_disk(empty_test)
    _expect(ValueError, "is a save_to_disk folder with a split of no rows", _load_vision(empty_test), empty_test)
    ints = tmp_path / "ints"
    part = Dataset.from_dict({"image": [1, 2], "label": [0, 1]},
                             features=Features({"image": Value("int64"), "label": ClassLabel(num_classes=10)}))
    DatasetDict(train=part, test=part).save_to_disk(ints)
    _expect(ValueError, r"ints \[train\]: column 'image' holds Value\('int64'\), not images", _load_vision(ints), ints)
    corrupt = _saved_images(tmp_path / "corrupt", [good[0], {"bytes": b"garbage", "path": None}], [0, 1])
    err = _expect(ValueError, r"corrupt \[train\] row 1: not a readable image", _load_vision(corrupt), corrupt)
    assert "cannot identify image file from its bytes" in str(err) and "0x" not in str(err)  # no memory address
    reordered = tmp_path / "reordered"  # the same classes, listed in another order by the test split
    split = {names[0]: Dataset.from_dict({"image": good, "label": [0, 1]}, features=Features(
        {"image": datasets.Image(), "label": ClassLabel(names=names)})) for names in (TEN, TEN[::-1])}
    DatasetDict(train=split["class0"], test=split["class9"]).save_to_disk(reordered)
    _expect(ValueError, r"reordered\): the 'test' split's classes \['class9', .* are not the 'train' split's "
                        r"\['class0', .*in the same order", _load_vision(reordered), reordered)
    twelve = _saved_images(tmp_path / "twelve", good, [0, 1], ClassLabel(num_classes=12))
    _expect(ValueError, "cifar10 has 10 classes but the 'train' split .* has 12", _load_vision(twelve), twelve)
    no_label = tmp_path / "no_label"
    DatasetDict(train=Dataset.from_dict({"img": good}), test=Dataset.from_dict({"img": good})).save_to_disk(no_label)
    _expect(ValueError, r"no_label\) \[train\]: no label column found", _load_vision(no_label), no_label)


def test_vision_saved_labels_outside_the_classes(tmp_path):
    from datasets import Image as ImageFeature
    from PIL import Image

    images = [Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8))] * 3
    part = Dataset.from_dict({"image": images, "label": [3, 12, -1]},
                             features=Features({"image": ImageFeature(), "label": Value("int64")}))
    folder = tmp_path / "labels"
    part = part.cast_column("label", ClassLabel(num_classes=10))  # casting does not check the values
    DatasetDict(train=part, test=part).save_to_disk(folder)
    _expect(ValueError, r"the 'train' split has labels \[-1, 12\] outside its classes 0-9", _load_vision(folder), folder)


def test_sentlen_from_a_csv_with_too_few_sentences(tmp_path):
    source = _write(tmp_path / "short.csv", HEADER + _rows(40))
    err = _expect(ValueError, r"data_dir '.*short.csv': too few sentences to build a balanced Sentlen task",
                  lambda: load_task("sentlen", data_dir=source), source)
    assert "per-class counts {'5-8': 0, '9-12': 0" in str(err)  # 'Title i.' and 'Description number i.' are 3-4 tokens


@pytest.mark.parametrize("relative", [b"train/caf\xe9", b"test/class4/\xff.png"])
def test_vision_names_that_are_not_utf8(tmp_path, relative):
    import os

    root = _image_tree(tmp_path / "tree")
    target = os.fsencode(root) + b"/" + relative
    if target.endswith(b".png"):
        with open(target, "wb") as fh:
            fh.write((root / "train" / "class0" / "0.png").read_bytes())
    else:
        os.mkdir(target)
        with open(target + b"/0.png", "wb") as fh:
            fh.write((root / "train" / "class0" / "0.png").read_bytes())
    _expect(ValueError, r"the name is not UTF-8; rename it", _load_vision(root), root)
