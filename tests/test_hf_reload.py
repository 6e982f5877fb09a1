"""A saved 8-bit model reloads through transformers' own entry points (from_pretrained, pipeline)."""
import contextlib
import json
import logging
import re
import warnings

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
    pipeline,
)

from lp_decentral_nlp import LpQuantizationConfig, QuantConfig, quantize_model
from lp_decentral_nlp.quant import QuantModule

TEXTS = ["Stocks rallied after the central bank held rates.", "The striker scored twice in the final."]


@contextlib.contextmanager
def transformers_warnings():
    """Collect the warnings transformers logs (its logger does not propagate to the root) or raises."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
        records.extend(caught)
    finally:
        hf_logger.removeHandler(handler)


def messages(records) -> list[str]:
    return [str(r.getMessage() if isinstance(r, logging.LogRecord) else r.message) for r in records]


def tiny_bert(vocab_size: int) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=4)
    return BertForSequenceClassification(config)


def calibrated(model, batch):
    """`model` after one training-mode forward (sets the activation ranges), in eval mode."""
    model.train()
    with torch.no_grad():
        model(**batch)
    return model.eval()


def module_types(model) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules()}


def check_reload(model, folder, batch):
    """from_pretrained gives the same 8-bit modules, buffers and eval logits, without a load warning."""
    with transformers_warnings() as records:
        reloaded = AutoModelForSequenceClassification.from_pretrained(folder)
    assert messages(records) == []
    assert module_types(reloaded) == module_types(model)
    assert sum(isinstance(m, QuantModule) for m in reloaded.modules()) > 0
    reference, restored = model.state_dict(), reloaded.state_dict()
    assert set(restored) == set(reference)
    assert all(torch.equal(restored[k], reference[k]) for k in reference)
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, model(**batch).logits)
    return reloaded


def test_tiny_bert_reloads_8bit_with_from_pretrained_and_pipeline(tmp_path, tokenizer):
    model = quantize_model(tiny_bert(tokenizer.vocab_size), QuantConfig(grad_granularity="sample"))
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    calibrated(model, batch)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved == {"quant_method": "lp_decentral_nlp", **QuantConfig(grad_granularity="sample").to_dict()}

    reloaded = check_reload(model, tmp_path, batch)
    assert reloaded.config.quantization_config.to_quant_config() == QuantConfig(grad_granularity="sample")
    query = reloaded.bert.encoder.layer[0].attention.self.query
    assert query.act_num_batches.item() == 1 and query.act_running_max > query.act_running_min

    with transformers_warnings() as records:
        classify = pipeline("text-classification", model=str(tmp_path), device="cpu")
    assert messages(records) == []
    assert module_types(classify.model) == module_types(model)
    scores = classify(TEXTS, top_k=None)
    with torch.no_grad():
        expected = model(**batch).logits.softmax(-1)
    for row, text_scores in zip(expected, scores):
        by_label = {s["label"]: s["score"] for s in text_scores}
        got = torch.tensor([by_label[model.config.id2label[i]] for i in range(len(row))])
        assert torch.allclose(got, row, atol=1e-6), (got, row)


def test_packaged_minilm_reloads_8bit(tmp_path, minilm_path, tokenizer):
    with transformers_warnings():  # the fresh classification head is reported as newly initialised
        model = AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=4)
    quantize_model(model)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    calibrated(model, batch)
    model.save_pretrained(tmp_path)
    check_reload(model, tmp_path, batch)


def test_a_reloaded_8bit_model_trains_saves_again_and_dequantizes(tmp_path, tokenizer):
    model = quantize_model(tiny_bert(tokenizer.vocab_size))
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    calibrated(model, batch)
    model.save_pretrained(tmp_path / "first")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "first")
    # Trainer refuses quantized models whose quantizer is not trainable without adapters; ours is.
    Trainer(model=reloaded, args=TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none"))
    reloaded.train()
    reloaded(**batch, labels=torch.tensor([0, 1])).loss.backward()
    assert reloaded.bert.encoder.layer[0].output.dense.weight.grad is not None

    reloaded.eval().save_pretrained(tmp_path / "second")
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "second")
    assert module_types(again) == module_types(model)
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, reloaded(**batch).logits)

    again.dequantize()
    assert not any(isinstance(m, QuantModule) for m in again.modules())
    assert type(again.bert.encoder.layer[0].output.dense) is nn.Linear
    assert not hasattr(again.config, "quantization_config") and not again.is_quantized
    assert {p.dtype for p in again.parameters()} == {torch.float32}
    # a dtype asked for is honoured (it was ignored: float32 came back); none asked for is float32, whatever
    # dtype the config names (transformers' default is the config's)
    half = AutoModelForSequenceClassification.from_pretrained(tmp_path / "second").dequantize(dtype=torch.bfloat16)
    assert type(half.bert.encoder.layer[0].output.dense) is nn.Linear
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    named = AutoModelForSequenceClassification.from_pretrained(tmp_path / "second")
    named.config.dtype = torch.bfloat16  # as a model built from a bfloat16 checkpoint's config says
    assert {p.dtype for p in named.dequantize().parameters()} == {torch.float32}


@pytest.mark.parametrize("as_dict", [False, True], ids=["LpQuantizationConfig", "dict"])
def test_a_float_checkpoint_quantizes_on_load_with_an_lp_quantization_config(tmp_path, tokenizer, as_dict):
    float_model = tiny_bert(tokenizer.vocab_size)
    float_model.save_pretrained(tmp_path)
    fields = dict(bits=6, skip=["classifier", "pooler"])
    qconfig = {"quant_method": "lp_decentral_nlp", **fields} if as_dict else LpQuantizationConfig(**fields)
    with transformers_warnings() as records:
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path, quantization_config=qconfig)
    assert messages(records) == []  # the absent activation ranges are expected, not reported
    expected = quantize_model(tiny_bert(tokenizer.vocab_size), QuantConfig(bits=6, skip=("classifier", "pooler")))
    assert module_types(model) == module_types(expected)
    assert type(model.bert.pooler.dense) is nn.Linear
    dense = model.bert.encoder.layer[1].output.dense
    assert dense.quant_config.bits == 6
    assert dense.act_num_batches.item() == 0 and dense.act_running_min.item() == dense.act_running_max.item() == 0
    assert torch.equal(dense.weight, float_model.bert.encoder.layer[1].output.dense.weight)
    assert model.config.quantization_config.to_quant_config() == QuantConfig(bits=6, skip=("classifier", "pooler"))


@pytest.mark.parametrize("kernel", ["int8", "int8_bf16"])
def test_quantizing_on_load_with_a_named_kernel_judges_it_on_the_real_weights(kernel, tmp_path):
    """transformers builds the model on the meta device before loading the weights: the surgery
    judged the kernel there and warned that no layer could run it ("no int8 GEMM on device type
    'meta'"), though every layer then ran it. The kernel is judged at the first call, on the
    weights' device, and warned only if it really falls back there."""
    from lp_decentral_nlp import kernel_report
    from lp_decentral_nlp.quant.kernels import resolve_kernel
    from lp_decentral_nlp.quant.gemm import LinearGemm

    tiny_bert(100).save_pretrained(tmp_path)
    with transformers_warnings() as records:
        model = AutoModelForSequenceClassification.from_pretrained(
            tmp_path, quantization_config=LpQuantizationConfig(kernel=kernel))
        model(input_ids=torch.randint(0, 100, (2, 8)))
    layer = model.bert.encoder.layer[0].attention.self.query
    fallback = resolve_kernel(kernel, LinearGemm, layer.weight)[1]
    warned = [m for m in messages(records) if "cannot run" in m]
    assert not any("meta" in m for m in warned), warned
    assert set(kernel_report(model).values()) == ({"simulated"} if fallback else {kernel})
    assert len(warned) == (1 if fallback else 0), warned
    meta_built = quantize_model(tiny_bert(100).to("meta"), QuantConfig(kernel=kernel), dry_run=True)
    assert f"kernel {kernel}, chosen on the weight's device at the first call" in str(meta_built)


def test_reload_refuses_a_non_float32_dtype(tmp_path, tokenizer):
    model = quantize_model(tiny_bert(tokenizer.vocab_size))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 is not supported .* master weights are float32"):
        AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16)


def test_lp_quantization_config_checks_its_fields():
    assert LpQuantizationConfig.from_quant_config(QuantConfig(kernel="int8")).to_quant_config() == QuantConfig(
        kernel="int8")
    with pytest.raises(ValueError, match="quant_method must be 'lp_decentral_nlp', got 'gptq'"):
        LpQuantizationConfig(quant_method="gptq")
    with pytest.raises(ValueError, match=r"unknown QuantConfig keys \['group_size'\]"):
        LpQuantizationConfig(group_size=128)
    with pytest.raises(ValueError, match=r"bits must be an integer in \[2, 8\], got 9"):
        LpQuantizationConfig(bits=9)
    with pytest.raises(TypeError, match="config must be a QuantConfig, got dict"):
        LpQuantizationConfig.from_quant_config({"bits": 8})


def test_quantize_model_refuses_a_model_quantized_by_another_method():
    model = tiny_bert(100)
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with pytest.raises(ValueError, match="quantization_config of quant_method 'bitsandbytes'"):
        quantize_model(model)


def test_a_backbone_selected_with_target_reloads_as_saved(tmp_path, tokenizer):
    """The documented way to quantize part of a model that is saved (quantize_model(model.bert)
    would record its config on the config object the task model shares)."""
    model = quantize_model(tiny_bert(tokenizer.vocab_size), QuantConfig(target=("bert",), skip=("pooler",)))
    assert type(model.classifier) is nn.Linear and type(model.bert.pooler.dense) is nn.Linear
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    calibrated(model, batch).save_pretrained(tmp_path)
    check_reload(model, tmp_path, batch)


def test_a_float_checkpoint_quantized_on_load_checks_its_patterns(tmp_path, tokenizer):
    """from_pretrained(float checkpoint, quantization_config=...) skipped quantize_model's pattern
    checks: a misspelt skip pattern quantized the head silently."""
    tiny_bert(tokenizer.vocab_size).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="skip pattern 'clasifier' matches no quantizable layer"):
        AutoModelForSequenceClassification.from_pretrained(
            tmp_path, quantization_config=LpQuantizationConfig(skip=["pooler", "clasifier"]))


def test_a_checkpoint_without_some_activation_ranges_reloads_them_uncalibrated(tmp_path, tokenizer):
    """transformers left the missing range buffers uninitialised memory, which evaluation took as a
    calibrated range (a layer's output moved by 0.57, a different amount each run)."""
    from safetensors.torch import load_file, save_file

    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    model = calibrated(quantize_model(tiny_bert(tokenizer.vocab_size)), batch)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".query.act_" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"no activation range for 2 8-bit layers .*'bert.encoder.layer.0.attention"
                                         r".self.query'\): they start uncalibrated"):
        reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    for name, value in reloaded.state_dict().items():
        if ".query.act_" in name:
            assert value.item() == 0, name
        else:
            assert torch.equal(value, model.state_dict()[name]), name


def test_an_int8_export_saved_as_the_weights_is_refused_by_name(tmp_path, tokenizer):
    """The export's int8 codes loaded as the layers' parameters, and the first forward failed with
    advice that could not be followed (model.float() is refused on a quantized model)."""
    from safetensors.torch import save_file

    from lp_decentral_nlp import export_int8_state_dict

    model = quantize_model(tiny_bert(tokenizer.vocab_size))
    model.save_pretrained(tmp_path)
    save_file(export_int8_state_dict(model), tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"8-bit layer 'bert.encoder.layer.0.attention.self.query' loaded as "
                                         r"torch.int8, not float32 master weights: an export_int8_state_dict file"):
        AutoModelForSequenceClassification.from_pretrained(tmp_path)


def test_a_half_precision_checkpoint_quantized_on_load_is_told_which_dtype_to_pass(tmp_path, tokenizer):
    """transformers' default dtype='auto' takes the checkpoint's: the error said 'or no dtype'."""
    tiny_bert(tokenizer.vocab_size).half().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"pass dtype=torch.float32 to from_pretrained"):
        AutoModelForSequenceClassification.from_pretrained(tmp_path, quantization_config=LpQuantizationConfig())
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path, quantization_config=LpQuantizationConfig(),
                                                               dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("typo", ["{tmp}/modle", "./no/such/run/model", "runs/ag_news/modle"])
def test_a_local_path_that_does_not_exist_is_named(typo, tmp_path):
    """A mistyped folder was transformers' "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'": a path with more than one '/', or starting with '/', '.' or '~', is no
    hub id."""
    from lp_decentral_nlp import load_quantized

    path = typo.format(tmp=tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(path)}: no such folder \(a hub id is 'name' or "
                                                r"'namespace/name'\)$"):
        load_quantized(path)


def test_a_transformers_model_inside_a_module_of_ones_own_warns_that_it_saves_float(tmp_path, tokenizer):
    """quantize_model of a user's module holding a BertModel recorded nothing on the BertModel: its
    save_pretrained wrote a float config.json, from_pretrained loaded it float, and load_quantized
    said it was not saved from a quantize_model model. The surgery warns now, naming the part;
    quantize_model on the part records it."""
    from lp_decentral_nlp import load_quantized

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = tiny_bert(tokenizer.vocab_size).bert, nn.Linear(32, 4)

    with pytest.warns(UserWarning, match=r"^'body' \(BertModel\) of this Wrapper hold 8-bit layers that their "
                                         r"save_pretrained will not record .* call quantize_model on it") as caught:
        wrapped = quantize_model(Wrapper())
    assert caught[0].filename == __file__  # it names the caller's line
    wrapped.body.save_pretrained(tmp_path / "part")
    with pytest.raises(ValueError, match=r"it was saved float, or from a transformers model inside a module of your own"):
        load_quantized(tmp_path / "part")
    part = Wrapper().body
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_model(part)
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    calibrated(part, batch).save_pretrained(tmp_path / "alone")
    assert any(isinstance(m, QuantModule) for m in load_quantized(tmp_path / "alone").modules())


def test_load_quantized_reads_tilde_as_home_and_names_a_file_given_for_its_folder(tmp_path, tokenizer, monkeypatch):
    """load_quantized('~/m') passed its own existence check (it expanded '~') and then gave transformers
    the unexpanded path ("Repo id must use alphanumeric chars"); a config.json given for its folder
    was a hub error too."""
    from lp_decentral_nlp import load_quantized

    model = quantize_model(tiny_bert(tokenizer.vocab_size))
    calibrated(model, tokenizer(TEXTS, return_tensors="pt", padding=True)).save_pretrained(tmp_path / "my model")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert any(isinstance(m, QuantModule) for m in load_quantized("~/my model").modules())
    with pytest.raises(ValueError, match=r"config\.json is a file: give the folder save_pretrained wrote"):
        load_quantized(tmp_path / "my model" / "config.json")
