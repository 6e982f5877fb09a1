"""Every unusable data file or folder ends in one clear error naming it (issue 24).

Each case writes a small bad source under tmp_path and checks: the error class, a message naming the
file (or argument) and what is allowed, that the error is raised by this package (not a traceback
from datasets, pandas or PIL), and that the user's file is left byte for byte as it was.
"""
import hashlib
import pathlib

import numpy as np
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from lp_decentral_nlp.data import check_enough_rows, load_task

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


def test_saved_dataset_without_train_split_or_unreadable(tmp_path):
    folder = _saved(tmp_path, {"text": ["a"], "label": [0]}, splits=("validation",))
    _expect(ValueError, r"has no 'train' split \(splits: \['validation'\]\)",
            lambda: load_task("ag_news", data_dir=folder), folder)
    broken = _write(tmp_path / "broken" / "dataset_dict.json", "{not json")
    _expect(ValueError, "looks like a save_to_disk directory but cannot be loaded",
            lambda: load_task("ag_news", data_dir=broken.parent), broken.parent)


@pytest.mark.parametrize("line, match", [
    ("tr 0 no tabs\n", "expected 'tr|va|te<TAB>label<TAB>sentence'"),
    ("train\t0\tsplit name spelled out\n", "expected 'tr|va|te<TAB>label<TAB>sentence'"),
    ("tr\t0\ta\textra tab\n", "expected 'tr|va|te<TAB>label<TAB>sentence'"),
])
def test_senteval_lines_of_the_wrong_shape(tmp_path, line, match):
    source = _write(tmp_path / "sentence_length.txt", "tr\t0\tfine sentence\n" + line)
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
    ("original", "", "label '' is not an integer; labels must be 1-4"),
    ("text", "4", "label 4 is not a class; labels must be 0-3"),
    ("text", "sports", "label 'sports' is not an integer; labels must be 0-3"),
])
def test_ag_news_labels(tmp_path, layout, value, match):
    header, bad = (HEADER, f"{value},Odd title,Odd text\n") if layout == "original" else ("text,label\n", f"Odd,{value}\n")
    source = _write(tmp_path / "labels.csv", header + _rows(5, layout) + bad)
    _expect(ValueError, f"labels.csv:7: {match}", lambda: load_task("ag_news", data_dir=source), source)


def test_saved_dataset_labels_out_of_range(tmp_path):
    folder = _saved(tmp_path, {"text": ["a", "b", "c"], "label": [0, 7, -2]})
    _expect(ValueError, r"labels must be 0-3, found \[-2, 7\]", lambda: load_task("ag_news", data_dir=folder), folder)


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


def test_check_enough_rows_agrees_with_a_loaded_split(tmp_path):
    source = _write(tmp_path / "small.csv", HEADER + _rows(80))
    train = load_task("ag_news", data_dir=source)["train"]
    assert len(train) == 64
    check_enough_rows(len(train), 4, 16, str(source))
    with pytest.raises(ValueError, match="small.csv: 64 training rows .* 4 nodes one batch of 17"):
        check_enough_rows(len(train), 4, 17, str(source))
    assert np.bincount(train["label"]).tolist() == [16] * 4
