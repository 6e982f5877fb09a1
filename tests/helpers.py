"""Small builders shared by several test modules."""
import importlib.util
import os
import pathlib
import signal
import socket
import sys

import numpy as np
import pytest
import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification, TrainerCallback

from lp_decentral_nlp.data import load_task
from lp_decentral_nlp.gossip import Topology
from lp_decentral_nlp.quant.functional import mean_sample_range


def free_port() -> str:
    """A TCP port on localhost that nothing listens on now, for a launcher's rendezvous (a fixed
    port fails when another run of the suite, or any program, holds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


class SigtermAt(TrainerCallback):
    """Sends this process SIGTERM at the end of step ``step`` (a preempted job's notice)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def saved_decoder_only_model(folder, minilm_path):
    """Save to ``folder`` a tiny random GPT-2 language model with the MiniLM tokenizer made as a
    GPT-2's is: an end-of-sequence token ([SEP]) and no padding token. Returns ``folder``."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    tokenizer.pad_token, tokenizer.eos_token = None, "[SEP]"
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                               eos_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
    return folder


def saved_encoder_decoder_model(folder, minilm_path):
    """Save to ``folder`` a tiny random BART (an encoder-decoder, whose classifier reads the
    end-of-sequence token [SEP]) with the MiniLM tokenizer. Returns ``folder``."""
    from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    BartForConditionalGeneration(BartConfig(
        vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
        decoder_start_token_id=tokenizer.sep_token_id, forced_eos_token_id=None)).save_pretrained(folder)
    return folder


def tiny_distilbert(seed=0, dropout=0.0, num_labels=4):
    """A 2-layer, dim-32 DistilBERT classifier over the uncased BERT vocabulary (random weights)."""
    torch.manual_seed(seed)
    cfg = DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64,
                           dropout=dropout, attention_dropout=dropout, seq_classif_dropout=dropout, num_labels=num_labels)
    return DistilBertForSequenceClassification(cfg)


def agnews_sample(tokenizer, max_length, max_train_samples, max_eval_samples):
    """The real AG News sample from ../shared, tokenized and cut (the test is skipped without it)."""
    from conftest import AG_NEWS_CSV

    if not AG_NEWS_CSV.exists():
        pytest.skip("AG News sample not available")
    return load_task("ag_news", data_dir=AG_NEWS_CSV, tokenizer=tokenizer, max_length=max_length,
                     max_train_samples=max_train_samples, max_eval_samples=max_eval_samples, seed=0)


def irregular_digraph() -> Topology:
    """5 nodes, out-degrees 2,1,1,2,1: column stochastic but not doubly stochastic, so w_i != 1."""
    edges = {0: [1, 2], 1: [2], 2: [3], 3: [4, 0], 4: [0]}
    W = np.zeros((5, 5))
    for i, outs in edges.items():
        W[[i, *outs], i] = 1 / (len(outs) + 1)
    return Topology.from_matrix(W, name="irregular")


def check_running_range(q, batches, rel):
    """Feed two training `batches` to the 8-bit layer `q` and check its running input range (SPEC 4:
    batch mean of per-sample min/max, momentum 0.1, the first batch initialises it)."""
    for b in batches:
        q(b)
    (lo1, hi1), (lo2, hi2) = (mean_sample_range(b, batched=True) for b in batches)
    assert q.act_num_batches.item() == 2
    assert q.act_running_min.item() == pytest.approx((0.9 * lo1 + 0.1 * lo2).item(), rel=rel)
    assert q.act_running_max.item() == pytest.approx((0.9 * hi1 + 0.1 * hi2).item(), rel=rel)


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` imported as a module (the benchmarks are scripts, not a
    package), with ``benchmarks/`` importable as when the script runs (``record``, ``timing``)."""
    folder = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
