"""NumPy numbers (a sweep over ``np.arange``, a value read from an array) are numbers wherever the
library takes one, and are stored as Python's own int and float, so configurations still write
as JSON; NumPy's bool, NaN and out-of-range values are refused as Python's are. A NumPy bool is
a switch's True or False, stored as Python's."""
import json
import math

import numpy as np
import pytest
import torch

from lp_decentral_nlp.checks import Number, check_number
from lp_decentral_nlp.cost import communication_cost, estimate_cost
from lp_decentral_nlp.data import check_enough_rows, skewed_partition
from lp_decentral_nlp.gossip import QSGD, ChocoSGD, GossipConfig, Identity, RandomK, TopK, make_topology
from lp_decentral_nlp.quant import QuantConfig, dequantize_int8_state_dict, export_int8_state_dict
from lp_decentral_nlp.trainer import DecentralizedTrainingArguments
from lp_decentral_nlp.utils.cpu_malloc import MAX_MMAP_THRESHOLD, keep_freed_memory
from lp_decentral_nlp import quantize_model
from lp_decentral_nlp.vision import EvoNormS0, norm_act, resnet20, vision_transform


def _plain(value, kind):
    return type(value) is kind


def test_training_arguments_store_numpy_numbers_as_python_numbers(tmp_path):
    args = DecentralizedTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, num_nodes=np.int64(4), per_device_train_batch_size=np.int32(8),
        learning_rate=np.float32(1e-3), max_steps=np.int64(5), skew=np.float64(0.9), compression=np.int64(99),
        consensus_lr=np.float32(0.5), drop_prob=np.float32(0.1), seed=np.uint32(3),
        lr_scheduler_type="constant", lr_milestones=[np.int64(1), np.float32(2.5)])
    assert _plain(args.num_nodes, int) and _plain(args.per_device_train_batch_size, int)
    assert _plain(args.max_steps, int) and _plain(args.seed, int) and _plain(args.compression, int)
    assert _plain(args.learning_rate, float) and math.isclose(args.learning_rate, 1e-3, rel_tol=1e-6)
    assert _plain(args.skew, float) and _plain(args.consensus_lr, float) and _plain(args.drop_prob, float)
    assert args.lr_milestones == [1, 2.5] and [type(m) for m in args.lr_milestones] == [int, float]
    written = json.loads(args.to_json_string())
    assert written["num_nodes"] == 4 and written["lr_milestones"] == [1, 2.5]
    assert args.gossip_config.num_nodes == 4 and _plain(args.gossip_config.num_nodes, int)


def test_configs_store_numpy_numbers_as_python_numbers():
    config = GossipConfig(num_nodes=np.int64(8), compression=np.float64(90), seed=np.int16(2))
    assert (config.num_nodes, config.compression, config.seed) == (8, 90.0, 2)
    assert _plain(config.num_nodes, int) and _plain(config.compression, float) and _plain(config.seed, int)
    quant = QuantConfig(bits=np.int64(8), grad_bits=np.uint8(6), act_momentum=np.float32(0.5))
    assert (quant.bits, quant.grad_bits, quant.act_momentum) == (8, 6, 0.5) and _plain(quant.bits, int)


def test_gossip_objects_take_numpy_numbers():
    assert QSGD(np.int64(4)).levels == 4 and _plain(QSGD(np.int64(4)).levels, int)
    assert TopK(np.float32(0.25)).keep == 0.25
    gossip = ChocoSGD(make_topology("directed_ring", 4), Identity(), gamma=np.float64(0.5), seed=np.int64(1))
    assert gossip.gamma == 0.5 and _plain(gossip.seed, int)


def test_data_functions_take_numpy_numbers():
    labels = np.repeat(np.arange(4), 10)
    shards = skewed_partition(labels, np.int64(4), np.float32(0.5), seed=np.int64(0))
    assert all(np.array_equal(a, b) for a, b in zip(shards, skewed_partition(labels, 4, 0.5, seed=0), strict=True))
    check_enough_rows(np.int64(40), np.int32(4), np.int64(10), "the sample")


def test_vision_and_cost_take_numpy_numbers():
    model = resnet20(num_classes=np.int64(3), norm="range_evonorm", groups=np.int64(2))
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 3)
    assert norm_act("evonorm", np.int64(16), groups=np.int8(4)).groups == 4
    report = estimate_cost(model, input_shape=(np.int64(3), 8, 8), batch_size=np.int64(2))
    assert report.to_dict() == estimate_cost(model, input_shape=(3, 8, 8), batch_size=2).to_dict()
    gossip = ChocoSGD(make_topology("directed_ring", 4), Identity(), gamma=1.0)
    assert communication_cost(model, gossip, batch_size=np.int64(2), samples_per_node=np.int64(10)) == \
        communication_cost(model, gossip, batch_size=2, samples_per_node=10)


def test_cpu_malloc_takes_numpy_numbers():
    keep_freed_memory(mmap_threshold=np.int64(MAX_MMAP_THRESHOLD), trim_threshold=np.int64(1 << 30),
                      top_pad=np.int64(256 << 20))  # glibc's mallopt takes them (ctypes refuses np.int64)


@pytest.mark.parametrize("value", [np.bool_(True), True, np.float64("nan"), np.float32(1.5), np.int64(0), "4"])
def test_refused_values_name_the_setting(value):
    with pytest.raises(ValueError, match=r"^num_nodes must be an integer in \[1, 65536\], got "):
        GossipConfig(num_nodes=value)


def test_check_number_returns_python_numbers():
    assert check_number("x", np.float32(0.5), Number(low=0)) == 0.5
    assert type(check_number("x", np.float32(0.5), Number(low=0))) is float
    assert type(check_number("x", np.int8(3), Number(low=0))) is int  # a NumPy int for a float setting stays int
    assert check_number("x", None, Number(optional=True)) is None
    with pytest.raises(ValueError, match=r"^x must be a number >= 0, got None"):
        check_number("x", None, Number(low=0))


@pytest.mark.parametrize("build, name", [
    (lambda v: DecentralizedTrainingArguments(output_dir="unused", final_merge=v), "final_merge"),
    (lambda v: DecentralizedTrainingArguments(output_dir="unused", qgm=v), "qgm"),
    (lambda v: DecentralizedTrainingArguments(output_dir="unused", skip_nonfinite=v), "skip_nonfinite"),
    (lambda v: DecentralizedTrainingArguments(output_dir="unused", tune_cpu_malloc=v), "tune_cpu_malloc"),
    (lambda v: vision_transform("digits", train=v), "train"),
    (lambda v: EvoNormS0(8, apply_act=v), "apply_act"),
    (lambda v: quantize_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), dry_run=v), "dry_run"),
    (lambda v: QuantConfig(stochastic_grad_rounding=v), "stochastic_grad_rounding"),
    (lambda v: QuantConfig(embeddings=v), "embeddings"),
    (lambda v: QSGD(4, scaled=v), "scaled"),
    (lambda v: RandomK(0.1, unbiased=v), "unbiased"),
    (lambda v: export_int8_state_dict(quantize_model(torch.nn.Sequential(torch.nn.Linear(4, 4))), embeddings=v),
     "embeddings"),
    (lambda v: dequantize_int8_state_dict({}, activation_ranges=v), "activation_ranges"),
])
def test_a_switch_takes_only_true_or_false(build, name):
    """A string switch is truthy: final_merge="no" merged, tune_cpu_malloc="false" tuned the
    allocator, train="no" augmented, dry_run="no" changed nothing and returned the report."""
    for value in ("no", 1, None):
        with pytest.raises(ValueError, match=rf"^{name} must be True or False, got "):
            build(value)
    build(np.bool_(False))  # a value read from an array, as NumPy numbers are taken


def test_a_numpy_bool_in_a_quant_config_or_compressor_is_stored_as_pythons():
    config = QuantConfig(embeddings=np.bool_(True), stochastic_grad_rounding=np.bool_(False))
    assert type(config.embeddings) is bool and type(config.stochastic_grad_rounding) is bool
    json.dumps(config.to_dict())
    assert type(QSGD(4, scaled=np.bool_(True)).scaled) is bool
    assert type(RandomK(0.1, unbiased=np.bool_(True)).unbiased) is bool


@pytest.mark.parametrize("name", ["qgm", "final_merge", "skip_nonfinite", "tune_cpu_malloc", "low_precision"])
def test_a_numpy_bool_switch_is_stored_as_pythons(name):
    args = DecentralizedTrainingArguments(output_dir="unused", **{name: np.bool_(True)})
    assert type(getattr(args, name)) is bool and getattr(args, name) is True
    json.dumps(args.to_dict())  # np.bool_ is not JSON
    assert type(GossipConfig(num_nodes=2, low_precision=np.bool_(True)).low_precision) is bool
