"""Skewed shards (SPEC 6), task loading and the offline accuracy metric."""
import csv

import numpy as np
import pytest
import transformers
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from lp_decentral_nlp.data import (
    SENTLEN_BINS,
    accuracy_metric,
    build_sentlen,
    load_task,
    sentence_length_class,
    skewed_partition,
)


# --- skewed_partition -------------------------------------------------------------------------


def test_partition_matches_spec_construction_by_hand():
    # 2 classes x 4 samples, interleaved; skew 0.5 -> first 2 of each class to the sorted pool.
    labels = [0, 1, 0, 1, 0, 1, 0, 1]
    shards = skewed_partition(labels, num_nodes=2, skew=0.5, seed=0)
    sorted_pool = [0, 2, 1, 3]  # class 0's first two, then class 1's first two
    random_pool = [4, 6, 5, 7]
    np.random.default_rng(0).shuffle(random_pool)
    assert shards[0].tolist() == sorted_pool[:2] + random_pool[:2]
    assert shards[1].tolist() == sorted_pool[2:] + random_pool[2:]


@pytest.mark.parametrize("skew", [0.0, 0.5, 0.9, 1.0])
def test_partition_is_disjoint_and_complete(skew):
    labels = np.repeat(np.arange(4), 250)
    shards = skewed_partition(labels, num_nodes=4, skew=skew, seed=3)
    joined = np.concatenate(shards)
    assert sorted(joined.tolist()) == list(range(1000))
    assert [len(s) for s in shards] == [250] * 4


def test_shards_differ_in_size_by_at_most_one_and_none_is_empty():
    """Both pools gave their extra samples to the first nodes: with 100 rows on 100 nodes at skew
    0.9, 12 shards were empty; one class of 10 rows on 4 nodes at skew 0.5 gave [4, 2, 2, 2]."""
    sizes = [len(s) for s in skewed_partition(np.repeat(np.arange(4), 25), num_nodes=100, skew=0.9)]
    assert sizes == [1] * 100
    assert sorted(len(s) for s in skewed_partition(np.zeros(10, int), num_nodes=4, skew=0.5)) == [2, 2, 3, 3]


def test_skew_one_gives_each_node_one_class_and_zero_is_mixed():
    labels = np.repeat(np.arange(4), 250)
    for i, shard in enumerate(skewed_partition(labels, 4, 1.0)):
        assert set(labels[shard].tolist()) == {i}
    for shard in skewed_partition(labels, 4, 0.0, seed=1):
        counts = np.bincount(labels[shard], minlength=4)
        assert counts.min() > 30  # IID: every class present in force


def test_partition_is_deterministic_under_seed_and_changes_with_it():
    labels = np.repeat(np.arange(4), 50)
    a = skewed_partition(labels, 4, 0.3, seed=7)
    b = skewed_partition(labels, 4, 0.3, seed=7)
    c = skewed_partition(labels, 4, 0.3, seed=8)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))


@pytest.mark.parametrize("kwargs, word", [
    (dict(skew=1.5), "skew"), (dict(skew=-0.1), "skew"), (dict(num_nodes=0), "num_nodes"),
    (dict(num_nodes=11), "num_nodes"), (dict(skew="0.5"), "skew"), (dict(skew=True), "skew"),
    (dict(seed=-1), r"^seed must be an integer in \[0, 4294967295\], got -1"),
    (dict(seed=1.5), r"^seed must be an integer"),
    (dict(labels=[0, float("nan"), 1, 0, 1, 0, 1, 0, 1, 0]), r"^labels must be class ids, found nan at index 1"),
    (dict(labels=[0, 1, None, 0, 1, 0, 1, 0, 1, 0]), r"^labels must be class ids, found None at index 2"),
    (dict(labels=[0, 2.5, 1, 0]), r"^labels must be class ids, found 2.5 at index 1"),
    (dict(labels=[0, "a", 1, "b"]), r"^labels must be class ids, all integers or all strings, found 'a' \(str\) at "
                                    r"index 1"),
    (dict(labels=[[0, 1], [1], [0]]), r"^labels must be one class id per sample, got lists of different lengths"),
    (dict(labels=(label for label in range(10))), r"^labels must be a one-dimensional sequence of class ids, one per "
                                                  r"sample, got generator"),
    (dict(labels=[]), r"^labels is empty"),
])
def test_partition_rejects_bad_arguments(kwargs, word):
    args = dict(labels=list(range(10)), num_nodes=2, skew=0.5) | kwargs
    with pytest.raises(ValueError, match=word):
        skewed_partition(**args)


def test_partition_refuses_a_dataset_for_its_label_column_and_takes_the_column():
    """The data set itself gave numpy's "'<' not supported between instances of 'dict' and 'dict'"."""
    data = Dataset.from_dict({"label": [0, 1, 2, 3] * 5})
    with pytest.raises(ValueError, match=r"^labels must be one class id per sample, got a Dataset: pass its label "
                                         r"column, e.g. dataset\['label'\]"):
        skewed_partition(data, 2, 0.5)
    shards = skewed_partition(data["label"], 2, 0.5)
    assert sorted(np.concatenate(shards).tolist()) == list(range(20))


def test_partition_of_many_classes_takes_each_class_from_the_label_order():
    """Each class's rows are now cut from the label order at its start (the former scan of all rows
    per class took 8.9 s for 1M rows of 1000 classes, 0.13 s now): the cut is the per-class
    selection of SPEC 6, with hundreds of classes too."""
    labels = np.random.default_rng(0).integers(0, 300, 20_000)
    for skew in (0.0, 0.5, 0.9, 1.0):
        shards = skewed_partition(labels, 8, skew, seed=3)
        order = np.argsort(labels, kind="stable")
        sorted_pool = np.concatenate([order[labels[order] == c][:int(np.floor(skew * (labels == c).sum() + 1e-9))]
                                      for c in np.unique(labels)])
        assert np.array_equal(np.concatenate([s[:len(b)] for s, b in zip(shards, np.array_split(sorted_pool, 8))]),
                              sorted_pool)
        assert sorted(np.concatenate(shards).tolist()) == list(range(len(labels)))


# --- load_task: AG News ------------------------------------------------------------------------


def test_ag_news_csv_is_mapped_and_split_stratified(ag_news_csv):
    ds = load_task("ag_news", data_dir=ag_news_csv, eval_fraction=0.2, seed=0)
    assert set(ds) == {"train", "test"}
    assert ds["train"].column_names == ["text", "label"]
    assert len(ds["train"]) == 4800 and len(ds["test"]) == 1200
    assert np.bincount(ds["test"]["label"]).tolist() == [300] * 4  # 1,500 rows per class
    assert ds["train"].features["label"].names == ["World", "Sports", "Business", "Sci/Tech"]
    # the first CSV row is label 1 (World) about a shark attack
    with open(ag_news_csv, newline="", encoding="utf-8") as fh:
        first = next(csv.DictReader(fh))
    hits = [r for r in ds["train"].to_list() + ds["test"].to_list() if r["text"].startswith(first["title"])]
    assert len(hits) == 1 and hits[0]["label"] == int(first["label"]) - 1
    assert all("\\" not in t for t in ds["train"]["text"][:500])


def test_ag_news_split_is_seeded(ag_news_csv):
    a = load_task("ag_news", data_dir=ag_news_csv, seed=1)["test"]["text"]
    b = load_task("ag_news", data_dir=ag_news_csv, seed=1)["test"]["text"]
    c = load_task("ag_news", data_dir=ag_news_csv, seed=2)["test"]["text"]
    assert list(a) == list(b) and list(a) != list(c)


def _write_csv(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)


def test_ag_news_directory_with_train_and_test_and_text_layout(tmp_path):
    rows = [(f"story {i}", i % 4) for i in range(40)]
    _write_csv(tmp_path / "train.csv", ["text", "label"], rows)
    _write_csv(tmp_path / "test.csv", ["text", "label"], rows[:8])
    ds = load_task("ag_news", data_dir=tmp_path, max_train_samples=10)
    assert len(ds["train"]) == 10 and len(ds["test"]) == 8
    assert sorted(set(ds["test"]["label"])) == [0, 1, 2, 3]


def test_a_folder_of_upper_case_csv_files_is_read_as_a_csv_file_is(tmp_path):
    """A .CSV file was read, but a folder of TRAIN.CSV and TEST.CSV "held no CSV file"."""
    rows = [(f"story {i}", i % 4) for i in range(40)]
    _write_csv(tmp_path / "TRAIN.CSV", ["text", "label"], rows)
    _write_csv(tmp_path / "Test.csv", ["text", "label"], rows[:8])
    ds = load_task("ag_news", data_dir=tmp_path)
    assert len(ds["train"]) == 40 and len(ds["test"]) == 8


def test_ag_news_saved_dataset_directory(tmp_path):
    DatasetDict({
        "train": Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}),
        "test": Dataset.from_dict({"text": ["c"], "label": [2]}),
    }).save_to_disk(tmp_path / "saved")
    ds = load_task("ag_news", data_dir=tmp_path / "saved")
    assert ds["test"]["text"] == ["c"]
    assert ds["train"].features["label"].names == ["World", "Sports", "Business", "Sci/Tech"]  # plain ids


def test_a_saved_class_label_keeps_its_names(tmp_path):
    label = ClassLabel(names=["a", "b", "c", "d"])
    part = Dataset.from_dict({"text": ["w", "x", "y", "z"], "label": [0, 1, 2, 3]},
                             features=Features({"text": Value("string"), "label": label}))
    DatasetDict({"train": part, "test": part}).save_to_disk(tmp_path / "saved")
    ds = load_task("ag_news", data_dir=tmp_path / "saved")
    assert ds["train"].features["label"].names == ds["test"].features["label"].names == ["a", "b", "c", "d"]
    assert ds["train"]["label"] == [0, 1, 2, 3]


def test_the_text_task_takes_its_classes_from_the_users_labels(tmp_path):
    """A text,label CSV of the user's own classes: AG News's loader refused string labels and trained
    a binary CSV as a 4-class classifier named World/Sports/Business/Sci/Tech."""
    _write_csv(tmp_path / "reviews.csv", ["Text", "label", "stars"],
               [(f"review {i}", ("pos", "neg", "mixed")[i % 3], i) for i in range(30)])
    ds = load_task("text", data_dir=tmp_path / "reviews.csv")
    assert ds["train"].features["label"].names == ["mixed", "neg", "pos"]  # sorted, as run_glue.py's label_list
    assert ds["train"].column_names == ["text", "label"] and len(ds["train"]) + len(ds["test"]) == 30
    labels = {row["text"]: row["label"] for split in ds.values() for row in split}
    assert ds["train"].features["label"].int2str(labels["review 4"]) == "neg"
    # integers in numeric order, named as written (07 is 7); a class found only in test.csv is a class
    (tmp_path / "ints").mkdir()
    _write_csv(tmp_path / "ints" / "train.csv", ["text", "label"], [(f"t{i}", (10, 7, 2)[i % 3]) for i in range(9)])
    _write_csv(tmp_path / "ints" / "test.csv", ["text", "label"], [("u", "07"), ("v", 30)])
    ds = load_task("text", data_dir=tmp_path / "ints")
    assert ds["train"].features["label"].names == ["2", "7", "10", "30"]
    assert ds["test"]["label"] == [1, 3]
    # a saved ClassLabel keeps its order; saved strings are sorted
    names = ["positive", "negative"]
    part = Dataset.from_dict({"text": ["a", "b"] * 4, "label": [0, 1] * 4},
                             features=Features({"text": Value("string"), "label": ClassLabel(names=names)}))
    DatasetDict({"train": part, "test": part}).save_to_disk(tmp_path / "saved")
    assert load_task("text", data_dir=tmp_path / "saved")["train"].features["label"].names == names
    Dataset.from_dict({"text": ["a", "b"] * 4, "label": names * 4}).save_to_disk(tmp_path / "strings")
    ds = load_task("text", data_dir=tmp_path / "strings")
    assert ds["train"].features["label"].names == ["negative", "positive"] and len(ds["test"]) == 2


def test_a_text_longer_than_the_csv_modules_field_limit_is_read(tmp_path):
    """A 160,000-character text (legal CSV; the tokenizer truncates it) was refused as "not valid
    CSV (field larger than field limit (131072))"; the module's limit stays as it was."""
    import csv

    _write_csv(tmp_path / "long.csv", ["text", "label"],
               [("word " * 32000, "a")] + [(f"t{i}", "ab"[i % 2]) for i in range(19)])
    before = csv.field_size_limit()
    ds = load_task("text", data_dir=tmp_path / "long.csv")
    assert max(len(row["text"]) for split in ds.values() for row in split) == len("word " * 32000)
    assert csv.field_size_limit() == before


def test_the_text_tasks_labels_mean_one_class_whatever_their_spelling_or_split(tmp_path):
    """'1' and '1.0' (a spreadsheet's float column) were two classes; a saved test split of plain
    integers beside a train ClassLabel got classes of its own (no test row could be right); a
    ClassLabel's -1 (GLUE's unlabelled test rows) became a class."""
    _write_csv(tmp_path / "mixed.csv", ["text", "label"], [(f"t{i}", ("1", "2.0", "3", "1.00", "+2")[i % 5])
                                                           for i in range(20)])
    ds = load_task("text", data_dir=tmp_path / "mixed.csv")
    assert ds["train"].features["label"].names == ["1", "2", "3"]
    names = ["w", "s", "b", "t"]
    train = Dataset.from_dict({"text": ["a", "b", "c", "d"] * 2, "label": [0, 1, 2, 3] * 2},
                              features=Features({"text": Value("string"), "label": ClassLabel(names=names)}))
    DatasetDict(train=train, test=Dataset.from_dict({"text": ["x", "y"], "label": [3, 0]})).save_to_disk(tmp_path / "a")
    ds = load_task("text", data_dir=tmp_path / "a")
    assert ds["test"].features["label"].names == names and ds["test"]["label"] == [3, 0]
    DatasetDict(train=train, test=Dataset.from_dict({"text": ["x"], "label": [4]})).save_to_disk(tmp_path / "b")
    with pytest.raises(ValueError, match=r"b \[test\]: labels must be 0-3 \(ids of the ClassLabel \['w', 's', 'b', "
                                         r"'t'\] of split 'train'\), found \[4\]$"):
        load_task("text", data_dir=tmp_path / "b")
    unlabelled = Dataset.from_dict({"text": ["x", "y"], "label": [-1, -1]},
                                   features=Features({"text": Value("string"), "label": ClassLabel(names=names)}))
    DatasetDict(train=train, test=unlabelled).save_to_disk(tmp_path / "glue")
    with pytest.raises(ValueError, match=r"glue \[test\]: labels must be 0-3 \(ids of its ClassLabel .*\), found "
                                         r"\[-1\]; -1 marks unlabelled rows \(2 here, as in GLUE's test splits\), which "
                                         r"cannot be trained or evaluated on: drop that split or label its rows$"):
        load_task("text", data_dir=tmp_path / "glue")


@pytest.mark.parametrize("name, content, message", [
    ("reviews.tsv", "text\tlabel\na\tx\n", r"is not a .csv file \(tab-separated: save it with commas\): the local "
                                           r"sources are a text,label CSV file"),
    ("reviews.jsonl", '{"text": "a"}\n', r"is not a .csv file \(datasets reads it: load_dataset\('json' or 'parquet'"),
    ("semi.csv", "text;label\na;x\n", r"found \['text;label'\]; the header is one column of names separated by "
                                      r"semicolons: save the file with commas$"),
    ("news.csv", "label,title,description\n1,a,b\n", r"expected columns text,label, found \['label', 'title', "
                                                      r"'description'\]; name the column of texts 'text'"),
])
def test_the_text_tasks_file_errors_say_what_to_do(name, content, message, tmp_path):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_task("text", data_dir=tmp_path / name)


@pytest.mark.parametrize("content, message", [
    (None, r"^data_dir: the text task trains on your own data: give a CSV file with text,label columns"),
    ([("a", "x"), ("b", "x")], r"one.csv: every row has the label 'x', and a classifier needs two classes or more$"),
    ([("a", "x"), ("b", " ")], r"one.csv:3: the label is empty; every row needs one$"),
    # a column of scores taken for classes: every row a class of its own
    ([(f"t{i}", f"{i / 3:.2f}") for i in range(9)], r"one.csv: 9 distinct labels over 9 rows \(e.g. \['0.00', "
                                                     r"'0.33', '0.67'\]\), fewer than two rows per class"),
    # many classes, some of one row: the rare ones are named, not all 20
    ([(f"t{i}", "c00" if i < 21 else f"c{i - 20:02d}") for i in range(40)],
     r"one.csv: 40 rows are too few to hold out a stratified 0.2 as test \(20 labels present, per label \{'c01': 1, "
     r"'c02': 1, 'c03': 1, 'c04': 1, 'c05': 1, 'c06': 1, 'c07': 1, 'c08': 1, '...': '12 more'\}\)"),
])
def test_the_text_task_refuses_data_it_cannot_classify(content, message, tmp_path):
    if content is not None:
        _write_csv(tmp_path / "one.csv", ["text", "label"], content)
    with pytest.raises(ValueError, match=message):
        load_task("text", data_dir=None if content is None else tmp_path / "one.csv")


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_dir=5), r"^data_dir must be a path \(str or os.PathLike\) or None, got int"),
    (dict(eval_fraction="0.2"), r"^eval_fraction must be a number in \(0, 1\), got '0.2'"),
    (dict(tokenizer=42), r"^tokenizer must be a Hugging Face tokenizer \(callable\) or None, got int"),
    # a class is callable: it failed inside the tokenizing bar with a Rust extraction error
    (dict(tokenizer=transformers.BertTokenizer), r"^tokenizer must be a Hugging Face tokenizer \(callable\) or None, "
                                                 r"got the class BertTokenizer \(load one: "
                                                 r"BertTokenizer.from_pretrained\(...\)\)$"),
])
def test_load_task_refuses_arguments_of_the_wrong_kind_in_one_line(kwargs, message):
    """They were raw TypeErrors from deep inside (the tokenizer's behind a "Tokenizing" bar)."""
    with pytest.raises(ValueError, match=message):
        load_task("ag_news", **kwargs)
    if "eval_fraction" in kwargs:
        with pytest.raises(ValueError, match=message):
            build_sentlen(None, **kwargs)
    with pytest.raises(ValueError, match=r"^eval_fraction must be a number in \(0, 1\), got None"):
        build_sentlen(None, eval_fraction=None)  # load_task's None: the default, where it applies


def test_max_length_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^max_length=32 is where the tokenizer truncates, and no tokenizer was given"):
        load_task("ag_news", data_dir=tmp_path, max_length=32)


def test_ag_news_bad_sources_are_named(tmp_path, ag_news_csv):
    with pytest.raises(FileNotFoundError, match="data_dir"):
        load_task("ag_news", data_dir=tmp_path / "nope")
    with pytest.raises(ValueError, match="no CSV"):
        load_task("ag_news", data_dir=tmp_path)
    _write_csv(tmp_path / "x.csv", ["sentence", "category"], [("a", 1)])
    with pytest.raises(ValueError, match="expected columns"):
        load_task("ag_news", data_dir=tmp_path / "x.csv")
    _write_csv(tmp_path / "y.csv", ["label", "title", "description"], [(5, "t", "d"), (1, "t", "d")])
    with pytest.raises(ValueError, match="labels must be 1-4"):
        load_task("ag_news", data_dir=tmp_path / "y.csv")
    with pytest.raises(ValueError, match="name must be one of"):
        load_task("imdb")
    with pytest.raises(ValueError, match="max_train_samples"):
        load_task("ag_news", data_dir=ag_news_csv, max_train_samples=0)


def test_tokenized_task_has_model_inputs(ag_news_csv, minilm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    ds = load_task("ag_news", data_dir=ag_news_csv, tokenizer=tok, max_length=16,
                   max_train_samples=64, max_eval_samples=32)
    assert {"label", "input_ids", "attention_mask"} <= set(ds["train"].column_names)
    assert "text" not in ds["train"].column_names
    assert max(len(ids) for ids in ds["train"]["input_ids"]) == 16
    assert len(ds["train"]) == 64 and len(ds["test"]) == 32


# --- load_task: Sentlen ------------------------------------------------------------------------


def test_sentence_length_bins():
    assert sentence_length_class("one two three four") is None
    assert sentence_length_class("one two three four five") == 0
    assert sentence_length_class("a , b , c , d .") == 0  # punctuation counts: 8 tokens
    assert sentence_length_class("a , b , c , d , e") == 1  # 9 tokens
    assert sentence_length_class(" ".join(["w"] * 28)) == 5
    assert sentence_length_class(" ".join(["w"] * 29)) is None
    assert [hi for _, hi in SENTLEN_BINS] == [8, 12, 16, 20, 25, 28]


def test_senteval_file_is_parsed(tmp_path):
    lines = [f"{split}\t{i % 6}\tsentence number {i}\n" for i, split in enumerate(["tr"] * 12 + ["va"] * 6 + ["te"] * 6)]
    (tmp_path / "sentence_length.txt").write_text("".join(lines))
    ds = load_task("sentlen", data_dir=tmp_path)
    assert set(ds) == {"train", "validation", "test"}
    assert len(ds["train"]) == 12 and ds["train"].features["label"].names[0] == "5-8"
    (tmp_path / "probe.TSV").write_text("".join(lines))  # it was "not a .csv file (tab-separated: save it with commas)"
    assert len(load_task("sentlen", data_dir=tmp_path / "probe.TSV")["train"]) == 12
    (tmp_path / "bad.txt").write_text("tr\tseven\tx\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        load_task("sentlen", data_dir=tmp_path / "bad.txt")


def test_sentlen_built_from_ag_news_is_balanced_and_correctly_labelled(ag_news_csv):
    ds = load_task("sentlen", data_dir=ag_news_csv, seed=0)
    counts = np.bincount(list(ds["train"]["label"]) + list(ds["test"]["label"]), minlength=6)
    assert counts.min() == counts.max() > 100
    for row in ds["test"].to_list()[:200]:
        assert sentence_length_class(row["text"]) == row["label"]
    assert not set(ds["train"]["text"]) & set(ds["test"]["text"])


def test_build_sentlen_names_a_source_it_cannot_read():
    """A Dataset gave AttributeError 'no attribute values', a tokenized DatasetDict datasets' own
    "Column name ['text'] not in the dataset"."""
    texts = Dataset.from_dict({"text": ["One two three four five six."] * 4, "label": [0] * 4})
    with pytest.raises(ValueError, match=r"^source must be a DatasetDict of splits with a 'text' column \(load_task's\), "
                                         r"got Dataset: wrap it, DatasetDict\(train=\.\.\.\)"):
        build_sentlen(texts)
    with pytest.raises(ValueError, match=r"^source: split 'train' has no 'text' column \(columns: \['label'\]\)"):
        build_sentlen(DatasetDict(train=texts.remove_columns("text")))
    with pytest.raises(ValueError, match="too few sentences"):  # a plain dict of splits is read as a DatasetDict
        build_sentlen({"train": texts})


def test_build_sentlen_needs_enough_sentences():
    tiny = DatasetDict({"train": Dataset.from_dict({"text": ["Too short."], "label": [0]})})
    with pytest.raises(ValueError, match="too few sentences"):
        build_sentlen(tiny)


def test_accuracy_metric_loads_offline():
    metric = accuracy_metric()
    assert metric.compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2])["accuracy"] == pytest.approx(0.75)
    # the hub metric's sample_weight and normalize (sklearn's accuracy_score), which raised TypeError
    assert metric.compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2], sample_weight=[1, 1, 0, 2])["accuracy"] \
        == pytest.approx(1.0)
    assert metric.compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2], sample_weight=[1, 1, 3, 2],
                          normalize=False)["accuracy"] == pytest.approx(4.0)
    assert np.isnan(metric.compute(predictions=[], references=[])["accuracy"])  # no samples: NaN, as before


@pytest.mark.parametrize("predictions, message", [
    ([0.9, 1.0, 2.0, 2.0], r"^predictions must be class ids \(whole numbers\), got 0.9 at index 0: take the argmax"),
    ([0, 1, float("nan"), 2], r"^predictions must be class ids \(whole numbers\), got nan at index 2"),
])
def test_accuracy_metric_refuses_predictions_that_are_not_class_ids(predictions, message):
    """Probabilities or unrounded regression outputs were cast to int64 (0.9 -> 0) and scored
    as class ids: [0.9, 1.7, 2.2] against [0, 1, 2] gave accuracy 1.0."""
    with pytest.raises(ValueError, match=message):
        accuracy_metric().compute(predictions=predictions, references=[0, 1, 1, 2])
    assert accuracy_metric().compute(predictions=np.array([0, 1, 2]), references=[0.0, 1.0, 1.0])["accuracy"] == \
        pytest.approx(2 / 3)
