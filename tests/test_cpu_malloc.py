"""glibc malloc settings for CPU training: freed memory is kept for the next step, the trainer
sets them on the CPU unless told not to, bad settings are named."""
import subprocess
import sys

import pytest

from lp_decentral_nlp.commands import build_nlp_parser
from lp_decentral_nlp.utils import cpu_malloc

glibc = pytest.mark.skipif(not cpu_malloc.glibc_available(), reason="needs glibc")

# A fresh process frees 256 MiB of 8 MiB tensors and allocates them again; prints the minor page
# faults of the second allocation, in pages.
_REFAULTS = """
import resource, sys, torch
from lp_decentral_nlp.utils.cpu_malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def fill():
    return [torch.ones(2 << 20) for _ in range(32)]
blocks = fill()
del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = fill()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def refaults(policy: str) -> int:
    out = subprocess.run([sys.executable, "-c", _REFAULTS, policy], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


@glibc
def test_kept_memory_is_reused_without_page_faults_where_glibc_gives_it_back():
    pages = (256 << 20) // 4096
    assert refaults("default") > pages // 2  # glibc trimmed the freed heap: faulted in again
    assert refaults("keep") < pages // 10  # the same blocks come back from the heap


@pytest.mark.parametrize("kwargs,match", [
    (dict(mmap_threshold=64 << 20), r"mmap_threshold must be an int of bytes in \[131072, 33554432\]"),
    (dict(mmap_threshold=1.5e6), "mmap_threshold must be an int"),
    (dict(trim_threshold=1 << 20), r"trim_threshold must be an int of bytes in \[33554432, 2147483647\]"),
    (dict(top_pad=-1), r"top_pad must be an int of bytes in \[0, 2147483647\]"),
    (dict(top_pad=True), "top_pad must be an int"),
])
def test_bad_settings_are_named_with_their_allowed_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cpu_malloc.keep_freed_memory(**kwargs)


def test_settings_say_whether_they_were_applied():
    assert cpu_malloc.keep_freed_memory() is cpu_malloc.glibc_available()
    assert cpu_malloc.tune_process_for_training("cpu", False) is False
    assert cpu_malloc.tune_process_for_training("meta", True) is False  # not the CPU: nothing to tune


@pytest.mark.parametrize("flags,tuned", [([], True), (["--default-malloc"], False)])
def test_recipes_keep_freed_memory_unless_default_malloc_is_asked_for(flags, tuned, tmp_path):
    parsed = build_nlp_parser("ag_news", "choco").parse(["--output-dir", str(tmp_path), *flags])
    assert parsed.training.tune_cpu_malloc is tuned


@pytest.mark.parametrize("tune", [True, False])
def test_trainer_sets_the_policy_when_it_trains_on_the_cpu(tune, tmp_path):
    from datasets import Dataset
    from helpers import tiny_distilbert

    from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments

    data = Dataset.from_dict({"input_ids": [[101, 2000 + i, 102] for i in range(8)], "attention_mask": [[1] * 3] * 8,
                              "label": [i % 4 for i in range(8)]})
    args = DecentralizedTrainingArguments(
        output_dir=str(tmp_path), num_nodes=2, per_device_train_batch_size=4, max_steps=1, save_strategy="no",
        use_cpu=True, disable_tqdm=True, low_precision=False, tune_cpu_malloc=tune)
    trainer = DecentralizedTrainer(model=tiny_distilbert(), args=args, train_dataset=data)
    trainer.train()
    assert trainer.cpu_malloc_tuned is (tune and cpu_malloc.glibc_available())
