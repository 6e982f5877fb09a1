"""Hugging Face models through the surgery: several architectures, save/load, int8 export, Trainer."""
import copy
import csv
import json
import logging

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    BertPreTrainedModel,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    Trainer,
    TrainingArguments,
)
from transformers.pytorch_utils import Conv1D

from lp_decentral_nlp import QuantConfig, dequantize_model, export_int8_state_dict, load_quantized, quantize_model
from lp_decentral_nlp.quant import (
    QuantConv1D,
    QuantConv2d,
    QuantEmbedding,
    QuantLinear,
    QuantModule,
    dequantize_int8_state_dict,
    kernel_report,
)
from lp_decentral_nlp.quant.export import state_dict_nbytes
from lp_decentral_nlp.quant.functional import fake_quantize, tensor_range

VOCAB = 120
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
ARCHITECTURES = {
    "distilbert": lambda: DistilBertForSequenceClassification(
        DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=2, num_labels=3)),
    "bert": lambda: BertForSequenceClassification(BertConfig(**TEXT, num_labels=3)),
    "roberta": lambda: RobertaForSequenceClassification(RobertaConfig(**TEXT, num_labels=3)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                               eos_token_id=0)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**{**TEXT, "num_attention_heads": 4}, num_key_value_heads=2)),
    "resnet": lambda: ResNetForImageClassification(
        ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)),
}
HEADS = ("classifier", "pre_classifier", "score", "lm_head")
FLOAT_TYPES = (nn.Linear, Conv1D, nn.Conv2d)


def example_inputs(arch):
    if arch == "resnet":
        return {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 0])}
    ids = torch.randint(3, VOCAB, (4, 10))
    labels = ids if arch in ("gpt2", "llama") else torch.tensor([0, 1, 2, 0])
    return {"input_ids": ids, "labels": labels}


def output_of(model, inputs):
    out = model(**{k: v for k, v in inputs.items() if k != "labels"})
    return out.logits


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architectures_quantize_train_and_stay_close_to_float(arch):
    model = ARCHITECTURES[arch]()
    inputs = example_inputs(arch)
    model.eval()
    with torch.no_grad():
        float_out = output_of(model, inputs)
    expected = sorted(
        n for n, m in model.named_modules()
        if type(m) in FLOAT_TYPES and not any(n == h or n.startswith(h + ".") for h in HEADS)
    )
    quantize_model(model)
    assert sorted(n for n, m in model.named_modules() if isinstance(m, QuantModule)) == expected
    assert {type(m) for m in model.modules() if isinstance(m, QuantModule)} == {
        "gpt2": {QuantConv1D}, "resnet": {QuantConv2d}}.get(arch, {QuantLinear})

    model.train()
    loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name in expected:
        layer = model.get_submodule(name)
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0, name
        assert layer.act_num_batches.item() == 1

    model.eval()
    with torch.no_grad():
        q_out = output_of(model, inputs)
    cos = nn.functional.cosine_similarity(q_out.flatten(1), float_out.flatten(1)).min()
    assert cos > 0.95, f"8-bit {arch} output too far from fp32 (cosine {cos:.4f})"


def train_steps(model, steps=2, seed=0):
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        model(**example_inputs("distilbert")).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def test_save_pretrained_and_load_quantized_round_trip(tmp_path, caplog):
    model = train_steps(quantize_model(ARCHITECTURES["distilbert"](), QuantConfig(grad_granularity="sample")))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"] == {"quant_method": "lp_decentral_nlp",
                                            **QuantConfig(grad_granularity="sample").to_dict()}

    with caplog.at_level(logging.WARNING):
        loaded = load_quantized(tmp_path)  # the class config.json names: the classifier, head included
    assert caplog.records == [], "loading a quantized checkpoint should not warn"
    assert type(loaded) is type(model)
    assert loaded.config.quantization_config.to_dict() == saved["quantization_config"]
    assert {n: type(m) for n, m in loaded.named_modules()} == {n: type(m) for n, m in model.named_modules()}
    reference, restored = model.state_dict(), loaded.state_dict()
    assert set(restored) == set(reference)
    for key in reference:
        assert torch.equal(restored[key], reference[key]), key
    q_lin = loaded.distilbert.transformer.layer[0].attention.q_lin
    assert q_lin.act_num_batches.item() == 2 and q_lin.act_running_max > q_lin.act_running_min
    inputs = example_inputs("distilbert")
    with torch.no_grad():
        assert torch.equal(output_of(loaded, inputs), output_of(model, inputs))

    # The base model can be loaded from the task checkpoint: buffers keep their prefix-less names.
    base = load_quantized(tmp_path, auto_class=AutoModel)
    assert torch.equal(base.transformer.layer[0].attention.q_lin.act_running_min, q_lin.act_running_min)


def test_a_task_checkpoint_of_a_targeted_base_model_reloads_as_the_base_model(tmp_path):
    """QuantConfig(target=("bert",)), the README's way to quantize the base of a task model, named
    nothing in BertModel: AutoModel.from_pretrained of the checkpoint raised "target pattern 'bert'
    matches no quantizable layer"."""
    model = quantize_model(ARCHITECTURES["bert"](), QuantConfig(target=("bert",)))
    train_steps(model)
    model.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path)
    assert {n for n, m in base.named_modules() if isinstance(m, QuantLinear)} == {
        n.removeprefix("bert.") for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.equal(base.eval()(ids).last_hidden_state, model.bert.eval()(ids).last_hidden_state)
    base.save_pretrained(tmp_path / "base")  # and the base model's own checkpoint reloads again
    assert type(load_quantized(tmp_path / "base").encoder.layer[0].output.dense) is QuantLinear
    # on a base model the pattern names the whole of it, as in its task models
    bert = BertModel(BertConfig(**TEXT))
    assert quantize_model(bert, QuantConfig(target=("bert",)), dry_run=True).quantized == [
        n for n, m in bert.named_modules() if type(m) is nn.Linear]


class CustomClassifier(BertPreTrainedModel):
    """A user's own task model: a class transformers does not define."""

    def __init__(self, config):
        super().__init__(config)
        self.bert, self.classifier = BertModel(config), nn.Linear(config.hidden_size, 3)
        self.post_init()

    def forward(self, input_ids):
        return self.classifier(self.bert(input_ids).last_hidden_state[:, 0])


def test_load_quantized_asks_for_the_class_of_a_custom_model(tmp_path):
    """load_quantized fell back to AutoModel for a class transformers does not define, returning
    a BertModel without the saved classifier head."""
    model = quantize_model(CustomClassifier(BertConfig(**TEXT)))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"names the class 'CustomClassifier', which transformers does not define "
                                         r"\(your own model class, or remote code\): pass it as auto_class"):
        load_quantized(tmp_path)
    with pytest.raises(TypeError, match=r"^auto_class must be a transformers model class .*, got 'CustomClassifier'$"):
        load_quantized(tmp_path, auto_class="CustomClassifier")  # was "'str' object has no attribute 'from_pretrained'"
    loaded = load_quantized(tmp_path, auto_class=CustomClassifier)
    inputs = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(inputs), model.eval()(inputs))


def test_load_quantized_passes_trust_remote_code_to_the_config(tmp_path, monkeypatch):
    """AutoConfig.from_pretrained got only the file-locating arguments: a remote-code model failed
    with transformers' "contains custom code ... pass trust_remote_code=True" although it was passed."""
    import transformers.dynamic_module_utils as dynamic_modules

    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not the user's cache
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "configuration_lpdn_remote.py").write_text(
        "from transformers import PretrainedConfig\n\n"
        "class RemoteConfig(PretrainedConfig):\n"
        "    model_type = 'lpdn_remote'\n\n"
        "    def __init__(self, hidden=8, **kwargs):\n"
        "        self.hidden = hidden\n"
        "        super().__init__(**kwargs)\n")
    (folder / "modeling_lpdn_remote.py").write_text(
        "from torch import nn\nfrom transformers import PreTrainedModel\n"
        "from .configuration_lpdn_remote import RemoteConfig\n\n"
        "class RemoteModel(PreTrainedModel):\n"
        "    config_class = RemoteConfig\n\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        self.a, self.b = nn.Linear(config.hidden, config.hidden), nn.Linear(config.hidden, 2)\n"
        "        self.post_init()\n\n"
        "    def forward(self, x):\n"
        "        return self.b(self.a(x).relu())\n")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "lpdn_remote", "hidden": 8, "architectures": ["RemoteModel"],
        "auto_map": {"AutoConfig": "configuration_lpdn_remote.RemoteConfig",
                     "AutoModel": "modeling_lpdn_remote.RemoteModel"}}))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = quantize_model(AutoModel.from_config(config, trust_remote_code=True), QuantConfig(skip=("b",)))
    model.save_pretrained(folder)
    loaded = load_quantized(folder, auto_class=AutoModel, trust_remote_code=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert type(loaded.a) is QuantLinear and torch.equal(loaded.eval()(x), model.eval()(x))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_load_quantized_names_the_folder_of_weights_it_cannot_read(tmp_path, damage):
    """safetensors' "Error while deserializing header" named no file."""
    quantize_model(ARCHITECTURES["distilbert"]()).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000] if damage == "truncated" else b"\xff" * 1000)
    with pytest.raises(ValueError, match=f"the weights of {tmp_path} cannot be read .*save the model again"):
        load_quantized(tmp_path)


def test_load_quantized_refuses_a_part_class_that_would_load_float(tmp_path):
    """CLIPVisionModel of a saved 8-bit CLIPModel reads vision_config, which holds no
    quantization_config: it came back a float model without a word."""
    from transformers import CLIPConfig, CLIPModel, CLIPVisionModel

    config = CLIPConfig(text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=16),
                        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8), projection_dim=16)
    quantize_model(CLIPModel(config)).save_pretrained(tmp_path)
    assert any(isinstance(m, QuantModule) for m in load_quantized(tmp_path).modules())
    with pytest.raises(ValueError, match=r"^CLIPVisionModel loaded from .* has no 8-bit layer: the quantization_config "
                                         r"is the whole saved model's, .* load CLIPModel, the saved class"):
        load_quantized(tmp_path, auto_class=CLIPVisionModel)
    model, info = load_quantized(tmp_path, output_loading_info=True)  # from_pretrained's (model, info), as given
    assert any(isinstance(m, QuantModule) for m in model.modules()) and "missing_keys" in info


def test_load_quantized_refuses_a_float_checkpoint(tmp_path):
    ARCHITECTURES["distilbert"]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no quantization_config with quant_method 'lp_decentral_nlp'"):
        load_quantized(tmp_path, auto_class=AutoModelForSequenceClassification)


def test_int8_export_is_4x_smaller_and_reproduces_the_8bit_model():
    model = train_steps(quantize_model(ARCHITECTURES["distilbert"]()))
    exported = export_int8_state_dict(model)
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for name in quantized:
        codes = exported[f"{name}.weight"]
        assert codes.dtype == torch.int8 and codes.min() >= -128 and codes.max() <= 127
        weight = model.get_submodule(name).weight.detach()
        restored = codes.float() * exported[f"{name}.weight_scale"] + exported[f"{name}.weight_offset"]
        assert torch.allclose(restored, fake_quantize(weight, *tensor_range(weight), 8), atol=1e-6)
    assert exported["classifier.weight"].dtype == torch.float32  # heads stay full precision
    fp32_bytes = sum(model.get_submodule(n).weight.nbytes for n in quantized)
    int8_bytes = sum(exported[f"{n}.weight"].nbytes for n in quantized)
    assert fp32_bytes == 4 * int8_bytes
    assert state_dict_nbytes(exported) < state_dict_nbytes(model.state_dict())

    # Loading the dequantized export into a fresh copy gives the same 8-bit model outputs.
    clone = copy.deepcopy(model)
    for p in clone.parameters():
        p.data.zero_()
    clone.load_state_dict(dequantize_int8_state_dict(exported))
    inputs = example_inputs("distilbert")
    with torch.no_grad():
        assert torch.allclose(output_of(clone, inputs), output_of(model, inputs), atol=1e-5)


@pytest.mark.parametrize("kernel", ["simulated", "int8"])
def test_int8_export_reproduces_each_kernel(kernel):
    """This weight has a value on a .5 tie of its grid, which the int8 kernel's forward used to
    round the other way from the export (logits of the real MiniLM moved by up to 0.012). The
    export's ``c * scale + offset`` is the forward's ``q * scale + min`` up to fp32 rounding."""
    torch.manual_seed(3)
    model = quantize_model(nn.Sequential(nn.Linear(256, 512)), QuantConfig(kernel=kernel)).eval()
    assert kernel_report(model) == {"0": kernel}
    clone = copy.deepcopy(model)
    clone.load_state_dict(dequantize_int8_state_dict(export_int8_state_dict(model)))
    x = torch.randn(64, 256)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), model(x), rtol=1e-6, atol=1e-6)


def test_the_int8_export_file_writes_a_tied_weight_once_and_loads_it_under_every_key(tmp_path):
    """safetensors refuses tensors that share memory ("Some tensors share memory"): GPT-2's lm_head
    and wte, BART's shared embedding under three keys. The file holds the tensor once and names
    the other keys; loading restores them."""
    from safetensors import safe_open

    from lp_decentral_nlp import load_int8_export, save_int8_export
    from lp_decentral_nlp.quant.export import TIED_KEYS

    model = quantize_model(ARCHITECTURES["gpt2"]())
    model(**example_inputs("gpt2"))  # a training forward: the activation ranges
    model.eval()
    exported = export_int8_state_dict(model)
    assert exported["lm_head.weight"].data_ptr() == exported["transformer.wte.weight"].data_ptr()
    save_int8_export(model, tmp_path / "int8.safetensors")
    with safe_open(tmp_path / "int8.safetensors", framework="pt") as file:
        assert "lm_head.weight" not in file.keys() and "transformer.wte.weight" in file.keys()
        # one entry: safetensors orders several differently in each process (identical runs' files differed)
        assert file.metadata() == {TIED_KEYS: '{"lm_head.weight": "transformer.wte.weight"}'}
    loaded = load_int8_export(tmp_path / "int8.safetensors")
    expected = dequantize_int8_state_dict(exported)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    clone = copy.deepcopy(model)
    clone.load_state_dict(loaded)
    inputs = example_inputs("gpt2")
    with torch.no_grad():
        torch.testing.assert_close(output_of(clone, inputs), output_of(model, inputs), rtol=0, atol=1e-5)
    float_weights = load_int8_export(tmp_path / "int8.safetensors", activation_ranges=False)
    assert not [key for key in float_weights if ".act_" in key]
    # a path that cannot be written or read is named (safetensors named a temporary file, or none)
    with pytest.raises(ValueError, match=r"its folder .*missing' does not exist"):
        save_int8_export(model, tmp_path / "missing" / "int8.safetensors")
    with pytest.raises(ValueError, match=r"is a folder: name the file to write in it"):
        save_int8_export(model, tmp_path)
    # a name ending in a separator names a folder (Path() dropped the separator: a file of that name was written)
    with pytest.raises(ValueError, match=r"names a folder \(it ends in a path separator\): name the file to write"):
        save_int8_export(model, f"{tmp_path / 'newname'}/")
    assert not (tmp_path / "newname").exists()
    (tmp_path / "notes.txt").write_text("not tensors")
    with pytest.raises(ValueError, match=r"notes\.txt cannot be read as a safetensors file"):
        load_int8_export(tmp_path / "notes.txt")
    model.save_pretrained(tmp_path / "saved")  # fp32 master weights: no int8 codes
    with pytest.raises(ValueError, match=r"holds no int8 codes: not an int8 export"):
        load_int8_export(tmp_path / "saved" / "model.safetensors")


def test_int8_export_loads_into_the_float_model_without_the_activation_ranges():
    """The docstring promised a state dict for the float model too, but the 8-bit layers' range
    buffers made its strict load_state_dict fail with "Unexpected key(s)"."""
    model = train_steps(quantize_model(ARCHITECTURES["distilbert"]()))
    exported = export_int8_state_dict(model)
    float_model = dequantize_model(copy.deepcopy(model))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        float_model.load_state_dict(dequantize_int8_state_dict(exported))
    weights = dequantize_int8_state_dict(exported, activation_ranges=False)
    assert not [k for k in weights if ".act_" in k]
    plain = ARCHITECTURES["distilbert"]()
    plain.load_state_dict(weights)  # strict
    q_lin = model.distilbert.transformer.layer[0].attention.q_lin
    assert torch.allclose(plain.distilbert.transformer.layer[0].attention.q_lin.weight,
                          fake_quantize(q_lin.weight.detach(), *tensor_range(q_lin.weight.detach()), 8), atol=1e-6)
    with pytest.raises(ValueError, match="activation_ranges must be True or False, got 'no'"):
        dequantize_int8_state_dict(exported, activation_ranges="no")


def test_int8_export_of_embeddings_codes_tables_of_embedding_subclasses_and_refuses_a_model_without_one():
    """BART's scaled and positional tables (nn.Embedding subclasses) stayed float under
    embeddings=True, and a model without a table gave the same export as embeddings=False, both
    without a word."""
    from transformers import BartConfig, BartForConditionalGeneration

    bart = quantize_model(BartForConditionalGeneration(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=32)))
    exported = export_int8_state_dict(bart, embeddings=True)
    assert all(exported[key].dtype == torch.int8 for key in ("model.shared.weight", "model.encoder.embed_positions.weight",
                                                             "model.decoder.embed_positions.weight"))
    with pytest.raises(ValueError, match=r"embeddings=True codes the model's nn\.Embedding tables, and it has none"):
        export_int8_state_dict(quantize_model(ARCHITECTURES["resnet"]()), embeddings=True)


def test_int8_export_of_embeddings_codes_each_row_on_its_own_grid():
    model = train_steps(quantize_model(ARCHITECTURES["distilbert"]()))
    layers_only, exported = export_int8_state_dict(model), export_int8_state_dict(model, embeddings=True)
    tables = {f"{n}.weight": m.weight.detach() for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    assert sorted(tables) == ["distilbert.embeddings.position_embeddings.weight",
                              "distilbert.embeddings.word_embeddings.weight"]
    for key, weight in tables.items():
        assert layers_only[key].dtype == torch.float32  # tables stay full precision by default
        codes, scale, offset = exported[key], exported[key + "_scale"], exported[key + "_offset"]
        assert codes.dtype == torch.int8 and scale.shape == offset.shape == (weight.shape[0], 1)
        restored = codes.float() * scale + offset
        # nearest rounding on each row's own 256-level grid: within half a step of that row
        assert ((restored - weight).abs() <= scale / 2 + 1e-6).all()
        # each row's min and max are its grid's ends (a per-tensor grid would not reach them on every
        # row); a constant row (the zero padding row) has step 0 and comes back exactly
        wide = scale.squeeze(1) > 0
        assert (codes[wide].min(dim=1).values == -128).all() and (codes[wide].max(dim=1).values == 127).all()
        assert torch.equal(restored[~wide], weight[~wide]) and (~wide).sum() <= 1
    for key, value in layers_only.items():  # everything but the tables is exported as before
        if key not in tables:
            assert torch.equal(exported[key], value), key
    # bytes counted are bytes held: each table entry 4 -> 1 byte, plus an fp32 scale and offset per row
    saved = sum(3 * w.numel() - 8 * w.shape[0] for w in tables.values())
    assert state_dict_nbytes(layers_only) - state_dict_nbytes(exported) == saved

    clone = copy.deepcopy(model)
    clone.load_state_dict(dequantize_int8_state_dict(exported))
    for key, weight in tables.items():
        assert torch.allclose(clone.get_parameter(key), weight, atol=float(exported[key + "_scale"].max()) / 2 + 1e-6)


def test_int8_export_codes_tied_weights_once():
    model = quantize_model(ARCHITECTURES["gpt2"]())
    assert model.lm_head.weight is model.transformer.wte.weight  # a float head tied to the embedding table
    exported = export_int8_state_dict(model, embeddings=True)
    for suffix in ("", "_scale", "_offset"):
        assert exported["lm_head.weight" + suffix] is exported["transformer.wte.weight" + suffix]
    restored = dequantize_int8_state_dict(exported)
    assert torch.equal(restored["lm_head.weight"], restored["transformer.wte.weight"])
    assert export_int8_state_dict(model)["lm_head.weight"].dtype == torch.float32


def test_8bit_embeddings_train_export_exactly_and_reload(tmp_path):
    """GPT-2 with QuantConfig(embeddings=True): wte/wpe are 8-bit lookups, the float lm_head tied to
    wte reads the fp32 master table, the int8 export reproduces the tables the forward used (wte,
    which lm_head reads, in fp32), and save_pretrained / load_quantized gives the same model."""
    torch.manual_seed(0)
    model = quantize_model(ARCHITECTURES["gpt2"](), QuantConfig(embeddings=True))
    assert type(model.transformer.wte) is QuantEmbedding and type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight
    inputs = example_inputs("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    exported = export_int8_state_dict(model)  # the QuantEmbedding tables are quantized layers now
    table, key = model.transformer.wpe.weight.detach(), "transformer.wpe.weight"
    restored = exported[key].float() * exported[key + "_scale"] + exported[key + "_offset"]
    assert exported[key].dtype == torch.int8 and exported[key + "_scale"].dim() == 0
    assert torch.allclose(restored, fake_quantize(table, *tensor_range(table), 8), atol=1e-6)
    # the float head tied to wte read the fp32 master table, so the table stays fp32 under both keys
    for key in ("lm_head.weight", "transformer.wte.weight"):
        assert torch.equal(exported[key], model.lm_head.weight) and key + "_scale" not in exported

    model.save_pretrained(tmp_path)
    loaded = load_quantized(tmp_path, auto_class=AutoModelForCausalLM).eval()
    assert type(loaded.transformer.wte) is QuantEmbedding
    assert loaded.config.quantization_config.embeddings is True
    with torch.no_grad():
        assert torch.equal(output_of(loaded, inputs), output_of(model, inputs))


def test_int8_export_keeps_a_weight_tied_to_a_float_module_fp32_and_reproduces_the_model():
    """BertForMaskedLM with its MLM decoder quantized: the decoder's weight is the float word
    embeddings' table, so the export keeps it fp32 under both keys, and loading the dequantized
    export gives back the embeddings exactly and the 8-bit model's logits."""
    model = BertForMaskedLM(BertConfig(**TEXT))
    quantize_model(model, QuantConfig(skip=()))
    decoder, table = model.cls.predictions.decoder, model.bert.embeddings.word_embeddings
    assert type(decoder) is QuantLinear and type(table) is nn.Embedding and decoder.weight is table.weight
    ids = torch.randint(3, VOCAB, (4, 10))
    model(input_ids=ids)  # calibrates the activation ranges
    model.eval()
    exported = export_int8_state_dict(model)
    for key in ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"):
        assert torch.equal(exported[key], table.weight) and key + "_scale" not in exported
    assert exported["bert.encoder.layer.0.output.dense.weight"].dtype == torch.int8  # untied layers: int8
    clone = copy.deepcopy(model)
    clone.load_state_dict(dequantize_int8_state_dict(exported))
    assert torch.equal(clone.bert.embeddings.word_embeddings.weight, table.weight)
    with torch.no_grad():
        assert torch.allclose(clone(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_int8_export_refuses_a_model_converted_after_the_surgery_as_its_forward_does():
    """model.half() after quantize_model: the forward refused it, the export coded the rounded
    weights without a word."""
    model = quantize_model(ARCHITECTURES["distilbert"]()).half()
    with pytest.raises(TypeError, match=r"master weights must be float32 \(SPEC 4\), got weight of dtype torch.float16; "
                                        r"the model was converted after quantize_model"):
        export_int8_state_dict(model)


def test_int8_export_rejects_a_non_bool_embeddings_flag():
    model = quantize_model(ARCHITECTURES["distilbert"]())
    with pytest.raises(ValueError, match=r"embeddings must be True or False, got 'yes'"):
        export_int8_state_dict(model, embeddings="yes")


COMPILE_IN_A_FRESH_PROCESS = """
import copy, torch
from transformers import BertConfig, BertForSequenceClassification
from lp_decentral_nlp import QuantConfig, quantize_model
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                 intermediate_size=64, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0, num_labels=3))
quantize_model(model, QuantConfig())
eager = copy.deepcopy(model)
compiled = torch.compile(model, backend="eager")
batch = dict(input_ids=torch.randint(0, 100, (2, 8)), labels=torch.tensor([0, 2]))
for net in (compiled, eager):
    torch.manual_seed(1)  # the same stochastic rounding of the gradients
    net(**batch).loss.backward()
assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))
"""


def test_an_8bit_model_compiles_in_a_fresh_process_and_matches_eager():
    """The CPU kernels (numba) run outside torch.compile's graphs: Dynamo, tracing into numba's
    first call of a process, failed on every backend."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", COMPILE_IN_A_FRESH_PROCESS], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("arch", ["llama", "vision resnet20"])
def test_compiled_graphs_hold_none_of_the_8bit_layers_internals(arch):
    """Under torch.compile each 8-bit layer runs eagerly between the compiled pieces. Traced around
    its numba kernels, a layer call broke several times and Dynamo compiled the pieces between the
    breaks once per weight shape up to its recompile limit: a compiled 8-bit Llama trained 3x
    slower than the uncompiled one."""
    import os
    import re

    import lp_decentral_nlp
    from lp_decentral_nlp.vision import build_vision_model

    traced_files = set()

    def recording_backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            traced_files.update(re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or ""))
        return graph_module.forward

    torch.manual_seed(0)
    if arch == "llama":
        model, inputs = ARCHITECTURES["llama"](), example_inputs("llama")
        run = lambda net: net(**inputs).logits
        quantize_model(model, QuantConfig(embeddings=True))
    else:
        model, inputs = build_vision_model("resnet20", 10, "range_evonorm"), torch.randn(4, 3, 8, 8)
        run = lambda net: net(inputs)
        quantize_model(model, QuantConfig())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend)
    for _ in range(2):
        run(compiled).sum().backward()
    with torch.no_grad():
        run(compiled.eval())
    package = os.path.dirname(lp_decentral_nlp.__file__)
    ours = {os.path.relpath(f, package) for f in traced_files if f.startswith(package + os.sep)}
    assert traced_files, "the model around the 8-bit layers is compiled"
    assert ours <= {os.path.join("vision", "models.py")}, ours  # the ResNet's own forward, not its layers'


def test_quantized_model_trains_inside_hf_trainer(tmp_path):
    """A learnable toy task (label = a marker token at position 1) through plain Trainer."""
    torch.manual_seed(0)
    model = quantize_model(ARCHITECTURES["distilbert"]())
    n = 96
    labels = torch.arange(n) % 3
    ids = torch.randint(10, VOCAB, (n, 12))
    ids[:, 1] = 3 + labels
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=16, num_train_epochs=12, learning_rate=3e-3,
        logging_steps=6, save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.25 * losses[0], losses
    assert isinstance(trainer.model.distilbert.transformer.layer[0].ffn.lin1, QuantLinear)
    predictions = trainer.predict(data).predictions.argmax(-1)
    assert (predictions == labels.numpy()).mean() > 0.9

    trainer.save_model(str(tmp_path / "final"))
    loaded = load_quantized(tmp_path / "final", auto_class=AutoModelForSequenceClassification)
    with torch.no_grad():
        model.eval()
        assert torch.equal(loaded(input_ids=ids[:8]).logits, model(input_ids=ids[:8]).logits)


def test_pretrained_minilm_8bit_embeddings_match_fp32(minilm_path, ag_news_csv):
    """The packaged pretrained MiniLM on real AG News text: 8-bit sentence embeddings ~ fp32."""
    with open(ag_news_csv, newline="", encoding="utf-8") as f:
        rows = [r for _, r in zip(range(16), csv.DictReader(f))]
    texts = [f"{r['title']}. {r['description']}" for r in rows]
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    calibration, probe = (tokenizer(t, padding=True, truncation=True, max_length=64, return_tensors="pt")
                          for t in (texts[:8], texts[8:]))
    model = AutoModel.from_pretrained(minilm_path).eval()

    def embed(m):
        with torch.no_grad():
            hidden = m(**probe).last_hidden_state
        mask = probe["attention_mask"].unsqueeze(-1)
        return (hidden * mask).sum(1) / mask.sum(1)

    float_emb = embed(model)
    quantize_model(model)
    model.train()
    with torch.no_grad():
        model(**calibration)  # one training-mode batch sets the running activation ranges
    model.eval()
    # Per-tensor ranges are coarse for this checkpoint's outlier weights (e.g. the first FFN
    # output weight spans [-0.6, 7.9] with std 0.045), so the match is close but not exact.
    cos = nn.functional.cosine_similarity(embed(model), float_emb)
    assert cos.min() > 0.95, cos


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_updates_the_running_ranges_once_per_step(use_reentrant):
    """The recomputation in backward leaves the running activation ranges alone: a checkpointed run
    gives the uncheckpointed run's ranges (SPEC 4's momentum update once per training batch)."""
    batches = [torch.randint(3, VOCAB, (2, 8)) for _ in range(2)]
    buffers = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = quantize_model(BertForSequenceClassification(BertConfig(
            **TEXT, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
        if checkpointed:
            model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
        model.train()
        for ids in batches:
            model(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
        buffers.append({k: v for k, v in model.state_dict().items() if ".act_" in k})
    assert buffers[1]["bert.encoder.layer.1.attention.self.query.act_num_batches"].item() == len(batches)
    assert all(torch.equal(buffers[0][k], buffers[1][k]) for k in buffers[0])


class _ForwardingWrapper(nn.Module):
    """What PEFT's PeftModel is to this library: it holds a transformers model, forwards unknown
    attributes (``config``, ``dequantize``) to it, and returns it from ``get_base_model()``."""

    def __init__(self, model):
        super().__init__()
        self.base_model = model

    def get_base_model(self):
        return self.base_model

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)


def test_a_wrapped_model_keeps_its_quantizer_and_config_on_the_model_it_wraps():
    """With PEFT's wrapper, quantize_model set hf_quantizer on the wrapper, so the model of
    merge_and_unload() refused dequantize() ("You need to first quantize your model"); and
    dequantize_model of a wrapper around a quantized model failed deleting the quantizer from the
    wrapper after every layer was float, leaving quantization_config behind: the saved base
    reloaded 8-bit."""
    from lp_decentral_nlp.quant import QuantModule

    inner = ARCHITECTURES["bert"]()
    wrapper = quantize_model(_ForwardingWrapper(inner))
    assert "hf_quantizer" in vars(inner) and "hf_quantizer" not in vars(wrapper)
    inner.dequantize()  # the merged model's way
    assert not any(isinstance(m, QuantModule) for m in inner.modules())
    assert not hasattr(inner.config, "quantization_config")

    inner = quantize_model(ARCHITECTURES["bert"]())
    dequantize_model(_ForwardingWrapper(inner))
    assert not any(isinstance(m, QuantModule) for m in inner.modules())
    assert not hasattr(inner.config, "quantization_config") and "hf_quantizer" not in vars(inner)
