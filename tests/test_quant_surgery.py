"""Model surgery: selection rules and their errors, dry-run report, dequantize, config validation."""
import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from lp_decentral_nlp import QuantConfig, dequantize_model, export_int8_state_dict, kernel_report, quantize_model
from lp_decentral_nlp.quant import (DEFAULT_SKIP, QUANT_LAYERS, QuantEmbedding, QuantLinear, QuantModule,
                                    dequantize_int8_state_dict, register_quant_layer)
from lp_decentral_nlp.quant.surgery import CONFIG_KEY

LINEAR_NAMES = ("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2")


def tiny_distilbert():
    config = DistilBertConfig(vocab_size=120, dim=32, hidden_dim=64, n_layers=2, n_heads=2, num_labels=4)
    return DistilBertForSequenceClassification(config)


def quantized_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, QuantModule))


def test_default_quantizes_every_linear_but_the_heads():
    model = tiny_distilbert()
    params_before = dict(model.named_parameters())
    keys_before = set(model.state_dict())
    quantize_model(model)
    names = quantized_names(model)
    assert len(names) == 2 * len(LINEAR_NAMES)
    assert all(n.rsplit(".", 1)[1] in LINEAR_NAMES for n in names)
    assert type(model.classifier) is nn.Linear and type(model.pre_classifier) is nn.Linear
    assert all(isinstance(model.get_submodule(n), nn.Linear) for n in names)
    # Same Parameter objects (an optimizer built before the surgery keeps working), same keys.
    assert all(p is params_before[n] for n, p in model.named_parameters())
    new_keys = set(model.state_dict()) - keys_before
    assert new_keys == {f"{n}.{b}" for n in names for b in ("act_running_min", "act_running_max", "act_num_batches")}
    assert getattr(model.config, CONFIG_KEY).to_quant_config() == QuantConfig()


def test_dry_run_reports_without_touching_the_model():
    model = tiny_distilbert()
    report = quantize_model(model, QuantConfig(skip=("classifier", "pre_classifier", "layer.1.ffn")), dry_run=True)
    assert quantized_names(model) == [] and not hasattr(model.config, CONFIG_KEY)
    assert len(report.quantized) == 10
    assert set(report.skipped) == {"pre_classifier", "classifier", "distilbert.transformer.layer.1.ffn.lin1",
                                   "distilbert.transformer.layer.1.ffn.lin2", "distilbert.embeddings.word_embeddings",
                                   "distilbert.embeddings.position_embeddings"}
    text = str(report)
    assert "10 layers quantized, 6 kept full precision" in text
    assert "matches skip pattern 'layer.1.ffn'" in text
    assert "Embedding: off by default (QuantConfig(embeddings=True) quantizes it)" in text
    # the norms are no layers of the surgery, but stay fp32 too: the report says so
    assert report.other_float == {"LayerNorm": 5}  # the embeddings' and two per block
    assert text.splitlines()[-1] == ("  float  also 5 LayerNorm: 1-D parameters only (scales, shifts) and no "
                                     "registered 8-bit version, so fp32")
    assert report.problems == []


def test_target_selects_by_name_suffix_or_regex():
    model = quantize_model(tiny_distilbert(), QuantConfig(target=("q_lin", r".*layer\.1\.ffn\.lin\d")))
    assert quantized_names(model) == sorted(
        ["distilbert.transformer.layer.0.attention.q_lin", "distilbert.transformer.layer.1.attention.q_lin",
         "distilbert.transformer.layer.1.ffn.lin1", "distilbert.transformer.layer.1.ffn.lin2"]
    )


def test_skip_wins_over_target_and_parent_names_select_children():
    model = quantize_model(tiny_distilbert(), QuantConfig(target=("attention",), skip=("layer.0", "classifier")))
    assert quantized_names(model) == [f"distilbert.transformer.layer.1.attention.{n}" for n in ("k_lin", "out_lin", "q_lin", "v_lin")]


@pytest.mark.parametrize(
    "config, message",
    [
        (QuantConfig(skip=("classifer",)), "skip pattern 'classifer' matches no quantizable layer"),
        # the tables are kept float anyway (embeddings=False): the pattern has no effect, and the message says why
        (QuantConfig(skip=("classifier", "embeddings")), "skip pattern 'embeddings' matches only layers kept float "
         "without it (e.g. 'distilbert.embeddings.word_embeddings': off by default, QuantConfig(embeddings=True) "
         "quantizes it): drop it"),
        (QuantConfig(target=("q_lin", "query")), "target pattern 'query' matches no quantizable layer"),
        # it read "matches no quantizable layer", not pointing to the switch
        (QuantConfig(target=("q_lin", "word_embeddings")), "target pattern 'word_embeddings' matches only layers kept "
         "float (e.g. 'distilbert.embeddings.word_embeddings': off by default (QuantConfig(embeddings=True) quantizes "
         "it))"),
    ],
)
def test_patterns_matching_nothing_are_errors(config, message):
    model = tiny_distilbert()
    with pytest.raises(ValueError, match=re.escape(message)):
        quantize_model(model, config)
    assert quantized_names(model) == []
    assert message in str(quantize_model(model, config, dry_run=True))  # the dry run reports it


@pytest.mark.parametrize("target", [("q_lin", "classifier"), ("classifier",)])
def test_a_target_pattern_meeting_only_skipped_layers_is_an_error(target):
    """It counted as matched: ('q_lin', 'classifier') quantized the q_lin layers and said nothing of the
    head, and ('classifier',) alone said "no layer to quantize", of a model full of Linear layers."""
    model = tiny_distilbert()
    with pytest.raises(ValueError, match=r"^quantize_model: target pattern 'classifier' matches only layers kept float "
                                         r"\(e.g. 'classifier': matches skip pattern 'classifier'\) \(quantize_model"
                                         r"\(model, config, dry_run=True\) gives every layer's decision\)$"):
        quantize_model(model, QuantConfig(target=target))
    assert quantized_names(model) == []
    head = quantize_model(model, QuantConfig(target=target, skip=("pre_classifier",)))  # unskipped: it is quantized
    assert isinstance(head.classifier, QuantLinear)


@pytest.mark.parametrize("make_computed", [
    lambda layer: prune.l1_unstructured(layer, "weight", amount=0.5),
    lambda layer: prune.random_unstructured(layer, "bias", amount=0.5),
    lambda layer: torch.nn.utils.weight_norm(layer),
    lambda layer: torch.nn.utils.parametrizations.weight_norm(layer),
], ids=["pruned weight", "pruned bias", "weight_norm", "parametrized"])
@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_a_layer_whose_weight_a_hook_recomputes_stays_float_with_a_warning(make_computed):
    """Pruned or weight-normed layers were swapped without their hook: the forward failed on a meta
    tensor, and the undo left a meta weight that computed NaN. One warning says so: the
    parametrization's own container (``parametrizations.weight``) was also warned about as a module
    of no registered 8-bit type holding fp32 weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    make_computed(model[0])
    x = torch.randn(4, 8)
    with torch.no_grad():
        before = model(x)
    assert "ParametrizationList" not in str(quantize_model(model, dry_run=True))
    with pytest.warns(UserWarning, match=r"^1 layer\(s\) the selection asks for stay fp32: 0 \(its (weight|bias) is "
                                         r"(recomputed from .* before each forward \(pruning, weight_norm or spectral_norm\)"
                                         r"|computed by a parametrization)"):
        quantize_model(model)
    assert not isinstance(model[0], QuantModule) and isinstance(model[2], QuantLinear)
    dequantize_model(model)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # skipped, it is asked for by no one: nothing to warn about
        quantize_model(dequantize_model(quantize_model(model, QuantConfig(skip=("0",)))), QuantConfig(target=("2",)))


def test_the_hooks_of_a_swapped_layer_follow_it_both_ways():
    """A hook registered on a layer was called before the swap and never after (nor after the undo)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    calls = []
    handles = [model[0].register_forward_pre_hook(lambda module, args: calls.append(("pre", type(module).__name__))),
               model[0].register_forward_hook(lambda module, args, out: calls.append(("fwd", type(module).__name__))),
               model[2].register_full_backward_hook(lambda module, g_in, g_out: calls.append(("bwd", type(module).__name__)))]
    quantize_model(model)
    model(torch.randn(4, 8)).sum().backward()
    assert calls == [("pre", "QuantLinear"), ("fwd", "QuantLinear"), ("bwd", "QuantLinear")]
    calls.clear()
    dequantize_model(model)
    model(torch.randn(4, 8)).sum().backward()
    assert calls == [("pre", "Linear"), ("fwd", "Linear"), ("bwd", "Linear")]
    for handle in handles:  # the handles still reach them
        handle.remove()
    calls.clear()
    quantize_model(model)(torch.randn(4, 8)).sum().backward()
    assert calls == []


def test_default_head_names_absent_from_a_model_are_not_errors():
    # DistilBERT has no `score` / `lm_head`; the explicit spelling of the defaults works too.
    cfg = QuantConfig(skip=("classifier", "pre_classifier", "score", "lm_head"))
    assert len(quantized_names(quantize_model(tiny_distilbert(), cfg))) == 12


def test_nothing_to_quantize_and_double_quantization_are_errors():
    with pytest.raises(ValueError, match="no layer to quantize"):
        quantize_model(nn.Sequential(nn.LayerNorm(4), nn.ReLU()))
    with pytest.raises(ValueError, match="no layer to quantize"):
        quantize_model(tiny_distilbert(), QuantConfig(skip=("distilbert", "classifier", "pre_classifier")))
    # a bare layer is not "no layer": the swap replaces a child of its parent, and the root has none
    with pytest.raises(ValueError, match=r"the model is itself a Linear, which cannot be swapped in place: quantize "
                                         r"a module that holds it, e.g. nn.Sequential\(layer\)"):
        quantize_model(nn.Linear(4, 4))
    model = quantize_model(tiny_distilbert())
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model)
    with pytest.raises(TypeError, match="QuantConfig"):
        quantize_model(tiny_distilbert(), {"bits": 8})
    with pytest.raises(ValueError, match="no quantized layers"):
        dequantize_model(tiny_distilbert())


def test_layers_that_are_not_float32_are_refused_before_anything_is_swapped():
    """A bf16 layer among float32 ones raised TypeError from its own swap, after the layers before
    it were already 8-bit: the half-converted model then refused model.float() + quantize_model as
    "already quantized", and the dry run had said nothing."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4).to(torch.bfloat16))
    message = (r"2 parameters of the layers to quantize are not float32 \(e.g. 2.weight of dtype torch.bfloat16\): "
               r"the 8-bit layers keep float32 master weights \(SPEC 4\); call model.float\(\) first")
    assert re.fullmatch(message, quantize_model(model, dry_run=True).problems[0])
    with pytest.raises(ValueError, match="^quantize_model: " + message):
        quantize_model(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert [type(m) for m in quantize_model(model.float())] == [QuantLinear, nn.ReLU, QuantLinear]


def test_linear_subclasses_without_a_replacement_are_left_alone_and_reported():
    # nn.MultiheadAttention never calls out_proj.forward: swapping it would silently do nothing.
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2), "proj": nn.Linear(8, 8)})
    report = quantize_model(model, dry_run=True)
    assert report.quantized == ["proj"] and report.skipped == ["attn", "attn.out_proj"]
    assert "no registered 8-bit replacement" in str(report)
    # and its own in-projection weight, which it multiplies in fp32
    assert ("float  attn           MultiheadAttention: holds in_proj_weight (24, 8), which stay fp32: no 8-bit "
            "version of MultiheadAttention is registered (register_quant_layer)") in str(report)


def test_weights_no_8bit_layer_computes_with_are_reported():
    """A fused mixture-of-experts block keeps its experts as 3-D parameters, not Linear layers:
    they (and the router's weight) stay fp32, and the report says so (transformers 5's Mixtral)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                             num_experts_per_tok=2))
    report = quantize_model(model, dry_run=True)
    reasons = {d.name: d.reason for d in report.layers if not d.quantize}
    assert reasons["model.layers.0.mlp.experts"].startswith(
        "holds gate_up_proj (4, 128, 32), down_proj (4, 32, 64), which stay fp32")
    assert reasons["model.layers.0.mlp.gate"].startswith("holds weight (4, 32), which stay fp32")
    unreported = {n for n, p in model.named_parameters() if p.dim() >= 2} - {
        f"{d.name}.{suffix}" for d in report.layers for suffix in ("weight", "gate_up_proj", "down_proj")}
    assert unreported == set()
    # and the real run says so: most of the decoder's weights are the experts' (it was silent)
    expert_elements = 4 * (128 * 32 + 32 * 64) + 4 * 32
    attention_elements = 32 * 32 + 2 * 16 * 32 + 32 * 32
    share = expert_elements / (expert_elements + attention_elements)
    with pytest.warns(UserWarning, match=rf"^{share:.0%} of the weights the selection asks for stay fp32 in modules of no "
                                         r"registered 8-bit type \(e.g. 'model.layers.0.mlp.experts', MixtralExperts: 2 "
                                         r"module\(s\)\); quantize_model\(model, config, dry_run=True\) lists them$"):
        quantize_model(model)
    with warnings.catch_warnings():  # asked only for the attention, whose weights all become 8-bit: no warning
        warnings.simplefilter("error")
        quantize_model(dequantize_model(model), QuantConfig(target=("self_attn",)))


def test_tokens_and_position_tables_are_reported_as_added_to_the_activations():
    """ViT's class token and position table were reported as weights no 8-bit layer was registered
    for, which read as if the surgery had missed a layer."""
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=64, image_size=32, patch_size=8, num_labels=3))
    reasons = {d.name: d.reason for d in quantize_model(model, dry_run=True).layers if not d.quantize}
    assert reasons["vit.embeddings"] == (
        "holds cls_token (1, 1, 32), position_embeddings (1, 17, 32), which stay fp32: a leading dim of 1 broadcasts "
        "over the batch (a token or position table added to the activations, like an embedding table, not a GEMM "
        "weight)")

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel = nn.Parameter(torch.zeros(4, 8))
            self.pos = nn.Parameter(torch.zeros(1, 5, 8))
            self.proj = nn.Linear(8, 8)

    class Tokens(nn.Module):  # a position table beside attention the surgery leaves float
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(1, 5, 8))
            self.attention = nn.MultiheadAttention(8, 2)
            self.proj = nn.Linear(8, 8)

    # the warning counted the table's module as a third module of weights left fp32
    with pytest.warns(UserWarning, match=r"stay fp32 in modules of no registered 8-bit type \(e\.g\. 'attention', "
                                         r"MultiheadAttention: 1 module\(s\)\)"):
        quantize_model(Tokens())
    reasons = {d.name: d.reason for d in quantize_model(Mixed(), dry_run=True).layers if not d.quantize}
    assert reasons[""] == ("holds kernel (4, 8), which stay fp32: no 8-bit version of Mixed is registered "
                           "(register_quant_layer); and pos (1, 5, 8), which stay fp32: a leading dim of 1 broadcasts "
                           "over the batch (a token or position table added to the activations, like an embedding "
                           "table, not a GEMM weight)")


def test_shared_module_is_replaced_under_every_name():
    shared = nn.Linear(4, 4)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    quantize_model(model)
    assert isinstance(model["a"], QuantLinear) and model["b"][0] is model["a"]


def test_embeddings_are_quantized_only_when_asked_and_the_swap_undoes():
    model = quantize_model(tiny_distilbert())
    assert type(model.distilbert.embeddings.word_embeddings) is nn.Embedding  # SPEC 4 default: full precision
    model = tiny_distilbert()
    tables = {n: m.weight for n, m in model.named_modules() if type(m) is nn.Embedding}
    quantize_model(model, QuantConfig(embeddings=True))
    assert {n for n, m in model.named_modules() if isinstance(m, QuantEmbedding)} == set(tables)
    assert all(model.get_submodule(n).weight is w for n, w in tables.items())  # same Parameter objects
    assert getattr(model.config, CONFIG_KEY).embeddings is True
    dequantize_model(model)
    assert all(type(model.get_submodule(n)) is nn.Embedding and model.get_submodule(n).weight is w
               for n, w in tables.items())
    # a skip pattern still keeps a table full precision; a pattern meeting only switched-off tables is an error
    model = quantize_model(tiny_distilbert(), QuantConfig(embeddings=True, skip=("classifier", "word_embeddings")))
    assert type(model.distilbert.embeddings.word_embeddings) is nn.Embedding
    assert type(model.distilbert.embeddings.position_embeddings) is QuantEmbedding
    with pytest.raises(ValueError, match="skip pattern 'word_embeddings' matches only layers kept float without it"):
        quantize_model(tiny_distilbert(), QuantConfig(skip=("word_embeddings",)))


class ScaledEmbedding(nn.Embedding):
    """As Gemma's and BART's token tables: a subclass whose forward does more than a lookup."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


def test_embeddings_true_warns_about_the_tables_it_cannot_quantize():
    """QuantConfig(embeddings=True) quantized no table of Gemma or BART and said so only in the dry run;
    when it quantizes no table at all it is refused, as when the model has no nn.Embedding."""
    model = nn.Sequential(ScaledEmbedding(10, 8), nn.Embedding(10, 8), nn.Linear(8, 8))
    message = (r"QuantConfig\(embeddings=True\) leaves 1 embedding table\(s\) fp32: 0 \(ScaledEmbedding\): subclasses "
               r"of nn.Embedding, whose forward may do more than a lookup \(a scale, positions\), have no registered "
               r"8-bit replacement \(register_quant_layer\)")
    assert re.search("^WARNING: " + message + "$", str(quantize_model(model, QuantConfig(embeddings=True), dry_run=True)),
                     re.MULTILINE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_model(copy.deepcopy(model))  # tables stay float by default: nothing to warn about
    with pytest.warns(UserWarning, match="^" + message + "$"):
        quantize_model(model, QuantConfig(embeddings=True))
    assert type(model[0]) is ScaledEmbedding and type(model[1]) is QuantEmbedding and type(model[2]) is QuantLinear
    only_subclasses = nn.Sequential(ScaledEmbedding(10, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"quantizes no embedding table: it leaves 1 embedding table\(s\) fp32: 0 "
                                         r"\(ScaledEmbedding\): subclasses"):
        quantize_model(only_subclasses, QuantConfig(embeddings=True))
    assert type(only_subclasses[1]) is nn.Linear


@pytest.mark.parametrize("model, config, why", [
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)), {},
     "the model has no nn.Embedding"),
    (lambda: nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 2)), {"skip": ("0",)},
     r"each stays float \(e.g. '0': matches skip pattern '0'\)"),  # it promised a reason it did not give
])
def test_embeddings_true_that_quantizes_no_table_is_refused(model, config, why):
    """As a skip or target pattern that matches nothing: the setting would have no effect."""
    with pytest.raises(ValueError, match=r"QuantConfig\(embeddings=True\) quantizes no embedding table: " + why):
        quantize_model(model(), QuantConfig(embeddings=True, **config))


def test_an_embedding_with_max_norm_stays_float_with_the_reason():
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2))
    report = quantize_model(model, QuantConfig(embeddings=True), dry_run=True)
    assert report.quantized == ["1"] and report.skipped == ["0"]
    assert "max_norm=1.0 renormalizes the table in place" in str(report)


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class QuantScale(QuantModule, Scale):
    """A toy extension: quantizes its input to 8 bits (how the vision norms plug in)."""

    @classmethod
    def from_float(cls, module, config):
        new = cls(module.weight.numel())
        new.weight, new.quant_config = module.weight, config
        return new

    def to_float(self):
        back = Scale(self.weight.numel())
        back.weight = self.weight
        return back

    def forward(self, x):
        from lp_decentral_nlp.quant.functional import fake_quantize, tensor_range

        return fake_quantize(x, *tensor_range(x), self.quant_config.bits) * self.weight


def test_a_float_state_dict_loads_into_a_model_quantized_on_meta_as_an_uncalibrated_one():
    """The usual meta-device load: build on ``meta``, quantize, ``to_empty()``, load float weights.
    The float checkpoint has no activation ranges; the layers start uncalibrated, as when the
    float model is quantized after loading, instead of evaluating with whatever memory they got."""
    def mlp():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    torch.manual_seed(0)
    float_model = mlp()
    with torch.device("meta"):
        model = mlp()
    quantize_model(model)
    model.to_empty(device="cpu")
    for layer in (model[0], model[2]):  # what to_empty may leave there
        layer.act_num_batches.fill_(123456789)
        layer.act_running_max.fill_(3.0e38)
    model.load_state_dict(float_model.state_dict())  # strict: the range buffers are not missing
    expected = quantize_model(copy.deepcopy(float_model)).eval()
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), expected(x))
    # a quantized checkpoint still restores its ranges, and a partial one is reported
    calibrated = expected.state_dict()
    calibrated["2.act_num_batches"].fill_(7)
    model.load_state_dict(calibrated)
    assert int(model[2].act_num_batches) == 7
    del calibrated["2.act_running_min"]
    with pytest.raises(RuntimeError, match='Missing key.*"2.act_running_min"'):
        model.load_state_dict(calibrated)


def test_the_layer_registry_is_extensible():
    register_quant_layer(Scale, QuantScale)
    try:
        model = nn.Sequential(nn.Linear(4, 4), Scale(4))
        quantize_model(model)
        assert isinstance(model[1], QuantScale) and isinstance(model[0], QuantLinear)
        dequantize_model(model)
        assert type(model[1]) is Scale and type(model[0]) is nn.Linear
        with pytest.raises(ValueError, match="already maps"):
            register_quant_layer(Scale, QuantScale)
    finally:
        del QUANT_LAYERS[Scale]
    with pytest.raises(TypeError, match="QuantModule"):
        register_quant_layer(Scale, nn.Linear)


@pytest.mark.parametrize("undo", [dequantize_model, lambda model: model.dequantize()],
                         ids=["dequantize_model", "model.dequantize"])
def test_dequantize_gives_back_plain_layers_with_the_trained_master_weights(undo):
    torch.manual_seed(0)
    model = tiny_distilbert()
    float_reference = copy.deepcopy(model)
    quantize_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = torch.randint(0, 120, (4, 9)), torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = {n: p for n, p in model.named_parameters()}
    q_lin = "distilbert.transformer.layer.0.attention.q_lin.weight"
    assert not torch.equal(trained[q_lin], float_reference.state_dict()[q_lin]), "training moved the weights"
    undo(model)  # transformers' model.dequantize() too: quantize_model sets the hf_quantizer it calls
    assert quantized_names(model) == [] and not hasattr(model.config, CONFIG_KEY)
    assert getattr(model, "hf_quantizer", None) is None
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(p is trained[n] for n, p in model.named_parameters())
    assert set(model.state_dict()) == set(float_reference.state_dict())
    # The dequantized model is a float model: it computes what a float copy with these weights does.
    float_reference.load_state_dict(model.state_dict())
    model.eval(), float_reference.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, float_reference(input_ids=ids).logits)


def test_undoing_the_base_model_inside_a_quantized_task_model_is_refused():
    """``dequantize_model(model.distilbert)`` removed the shared record while the quantizer and the
    8-bit head stayed: a half-8-bit model whose config said float. It is refused, naming the fix;
    undoing a plain block inside leaves the record, and the whole model undoes as usual."""
    model = tiny_distilbert()
    quantize_model(model, QuantConfig(skip=()))
    with pytest.raises(ValueError, match="part of the model quantize_model was given.*call dequantize_model on that"):
        dequantize_model(model.distilbert)
    assert isinstance(model.distilbert.transformer.layer[0].attention.q_lin, QuantLinear), "nothing was swapped"
    assert hasattr(model.config, CONFIG_KEY) and model.hf_quantizer is not None
    dequantize_model(model.distilbert.transformer.layer[0])
    assert type(model.distilbert.transformer.layer[0].attention.q_lin) is nn.Linear
    assert hasattr(model.config, CONFIG_KEY)
    dequantize_model(model)
    assert quantized_names(model) == [] and not hasattr(model.config, CONFIG_KEY)


def test_a_base_model_quantized_inside_its_task_model_saves_with_it(tmp_path):
    """``quantize_model(model.distilbert)`` recorded the quantization on a copy of the config, so
    the task model saved a float config and reloaded float (its ranges "unexpected keys")."""
    torch.manual_seed(0)
    model = tiny_distilbert()
    quantize_model(model.distilbert)
    assert model.distilbert.config is model.config and hasattr(model.config, CONFIG_KEY)
    model.save_pretrained(tmp_path)
    back = DistilBertForSequenceClassification.from_pretrained(tmp_path)
    assert quantized_names(back) == quantized_names(model) != []
    ids = torch.randint(0, 120, (2, 7))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, back.eval()(input_ids=ids).logits)


def test_models_sharing_a_config_object_stay_float(tmp_path):
    """``Cls(config)`` keeps the object it is given: recording the quantization on it made every
    model built from it (a float teacher beside an 8-bit student) reload 8-bit, and undoing the
    student's surgery removed it from the teacher."""
    config = DistilBertConfig(vocab_size=120, dim=32, hidden_dim=64, n_layers=2, n_heads=2, num_labels=4)
    student, teacher = DistilBertForSequenceClassification(config), DistilBertForSequenceClassification(config)
    quantize_model(student)
    assert not hasattr(config, CONFIG_KEY) and not hasattr(teacher.config, CONFIG_KEY)
    assert all(m.config is student.config for m in student.modules() if "config" in m.__dict__)  # one copy, shared
    assert hasattr(student.distilbert.config, CONFIG_KEY)
    teacher.save_pretrained(tmp_path)
    assert quantized_names(DistilBertForSequenceClassification.from_pretrained(tmp_path)) == []
    assert quantized_names(DistilBertForSequenceClassification(config)) == []
    dequantize_model(student)
    assert not hasattr(student.config, CONFIG_KEY)


def test_a_task_model_that_is_its_own_base_model_leaves_the_users_config_alone(tmp_path):
    """T5ForConditionalGeneration holds no attribute of its base-model prefix, so it passed for a
    base model, whose config is its task model's: the user's config object got the record and a
    float teacher built from it reloaded 8-bit, uncalibrated. A part (BertModel inside its task
    model) still records on the config the task model saves."""
    from transformers import BertConfig, BertForSequenceClassification, T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=120, d_model=32, d_kv=16, d_ff=37, num_layers=1, num_heads=2)
    student, teacher = T5ForConditionalGeneration(config), T5ForConditionalGeneration(config)
    quantize_model(student)
    assert not hasattr(config, CONFIG_KEY) and hasattr(student.config, CONFIG_KEY)
    teacher.save_pretrained(tmp_path)
    assert quantized_names(T5ForConditionalGeneration.from_pretrained(tmp_path)) == []
    task = BertForSequenceClassification(BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=37))
    quantize_model(task.bert)
    assert hasattr(task.config, CONFIG_KEY)  # saved with the task model, which reloads its part 8-bit
    from transformers import FunnelConfig, FunnelForSequenceClassification  # a base model of two classes

    funnel = FunnelForSequenceClassification(FunnelConfig(vocab_size=120, d_model=32, n_head=2, d_head=16, d_inner=37,
                                                          block_sizes=[1, 1], num_decoder_layers=1))
    quantize_model(funnel.funnel)
    assert hasattr(funnel.config, CONFIG_KEY)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(bits=9), ValueError, r"bits must be an integer in \[2, 8\]"),
        (dict(grad_bits=True), ValueError, "grad_bits must be an integer"),
        (dict(kernel="int9"), ValueError, r"kernel must be one of \('simulated'"),
        (dict(grad_granularity="row"), ValueError, "grad_granularity must be one of"),
        (dict(act_momentum=0.0), ValueError, "act_momentum"),
        (dict(skip="classifier"), TypeError, "skip must be a tuple or list"),
        (dict(target=("q_lin", "(")), ValueError, "not a valid regular expression"),
        (dict(target=()), ValueError, "target must be None"),
        (dict(stochastic_grad_rounding=1), ValueError, "stochastic_grad_rounding must be True or False"),
        (dict(embeddings="yes"), ValueError, "embeddings must be True or False"),
    ],
)
def test_config_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        QuantConfig(**kwargs)


def test_config_dict_round_trip():
    cfg = QuantConfig(bits=6, skip=["classifier"], target=["q_lin"], grad_granularity="sample")
    assert cfg.skip == ("classifier",)
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown QuantConfig keys"):
        QuantConfig.from_dict({**cfg.to_dict(), "bitz": 8})
    with pytest.raises(TypeError, match="from_dict takes the dict that to_dict\\(\\) gives, got NoneType"):
        QuantConfig.from_dict(None)


TINY_TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
SEQ2SEQ = dict(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)
HEAD_MODELS = {
    "bert-qa": lambda t: t.BertForQuestionAnswering(t.BertConfig(**TINY_TEXT)),
    "bert-mlm": lambda t: t.BertForMaskedLM(t.BertConfig(**TINY_TEXT)),
    "bert-pretraining": lambda t: t.BertForPreTraining(t.BertConfig(**TINY_TEXT)),
    "albert-mlm": lambda t: t.AlbertForMaskedLM(t.AlbertConfig(**TINY_TEXT, embedding_size=16)),
    "distilbert-mlm": lambda t: t.DistilBertForMaskedLM(t.DistilBertConfig(vocab_size=100, dim=32, hidden_dim=64,
                                                                           n_layers=1, n_heads=2)),
    "bart-classification": lambda t: t.BartForSequenceClassification(t.BartConfig(**SEQ2SEQ)),
    "electra-mlm": lambda t: t.ElectraForMaskedLM(t.ElectraConfig(**TINY_TEXT, embedding_size=16)),
    "electra-pretraining": lambda t: t.ElectraForPreTraining(t.ElectraConfig(**TINY_TEXT, embedding_size=16)),
    "xlnet-classification": lambda t: t.XLNetForSequenceClassification(t.XLNetConfig(
        vocab_size=100, d_model=32, n_layer=1, n_head=2, d_inner=64)),
    "xlm-classification": lambda t: t.XLMForSequenceClassification(t.XLMConfig(
        vocab_size=100, emb_dim=32, n_layers=1, n_heads=2)),
    "gpt2-double-heads": lambda t: t.GPT2DoubleHeadsModel(t.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2)),
    "deit-teacher": lambda t: t.DeiTForImageClassificationWithTeacher(t.DeiTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)),
    "levit-teacher": lambda t: t.LevitForImageClassificationWithTeacher(t.LevitConfig(
        image_size=32, patch_size=16, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
        key_dim=[8, 8, 8], mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2], num_labels=3)),
    "whisper": lambda t: t.WhisperForConditionalGeneration(t.WhisperConfig(
        **SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
}


@pytest.mark.parametrize("arch", sorted(HEAD_MODELS))
def test_default_keeps_every_task_head_float(arch):
    """Every supported layer of the base model is quantized, none of the task head around it (SPEC 4),
    whatever the head's names; the LM head (get_output_embeddings()) stays float with DEFAULT_SKIP
    extended, and is quantized once the defaults are left out. XLNet's, XLM's, GPT-2's multiple
    choice and DeiT's distillation heads were quantized."""
    import transformers

    model = HEAD_MODELS[arch](transformers)
    body = model.base_model_prefix + "."
    report = quantize_model(model, dry_run=True)
    gemms = [d for d in report.layers if d.type_name in ("Linear", "Conv1D", "Conv2d")]
    assert all(d.quantize == d.name.startswith(body) for d in gemms), str(report)
    assert report.quantized and not all(d.quantize for d in gemms)
    head = model.get_output_embeddings()
    if head is not None:
        name = next(n for n, m in model.named_modules() if m is head)
        assert name in quantize_model(model, QuantConfig(skip=DEFAULT_SKIP + ("nothing",)), dry_run=True).skipped
        assert name in quantize_model(model, QuantConfig(skip=()), dry_run=True).quantized


@pytest.mark.parametrize("call", [dequantize_model, kernel_report, export_int8_state_dict],
                         ids=["dequantize_model", "kernel_report", "export_int8_state_dict"])
def test_the_functions_that_walk_a_model_name_a_non_module(call):
    """They failed on .modules() ("'str' object has no attribute 'modules'"), as quantize_model did not."""
    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module, got str$"):
        call("model")
    with pytest.raises(TypeError, match=r"^state_dict must be a mapping of names to tensors"):
        dequantize_int8_state_dict([1, 2])
    with pytest.raises(TypeError, match=r"^state_dict must map names to tensors \(export_int8_state_dict's output\), "
                                        r"and 'a' holds a int$"):  # it said "must be a mapping ..., got dict"
        dequantize_int8_state_dict({"a": 1})


def test_torchs_fused_transformer_path_does_not_bypass_the_8bit_layers():
    """In eval under no_grad nn.TransformerEncoderLayer ran one fused kernel reading linear1/linear2's
    weights itself: the quantized model evaluated exactly as the float one. The 8-bit layers now
    run there too (with a padding mask as well), and dequantize_model gives torch its fused path back."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    float_copy = copy.deepcopy(encoder).eval()
    with pytest.warns(UserWarning, match="MultiheadAttention"):  # attention's projections stay float
        quantize_model(encoder, QuantConfig(kernel="simulated"))
    encoder(torch.randn(4, 5, 16))  # calibrates the input ranges
    encoder.eval()
    x, padding = torch.randn(4, 5, 16), torch.zeros(4, 5, dtype=torch.bool)
    padding[:, 3:] = True
    for mask in (None, padding):
        with torch.no_grad():
            fused_allowed = encoder(x, src_key_padding_mask=mask)
            torch.backends.mha.set_fastpath_enabled(False)
            try:
                module_path = encoder(x, src_key_padding_mask=mask)
            finally:
                torch.backends.mha.set_fastpath_enabled(True)
            float_output = float_copy(x, src_key_padding_mask=mask)
        torch.testing.assert_close(fused_allowed, module_path)  # (attention's own fused kernel rounds differently)
        assert (fused_allowed - float_output).abs().max() > 1e-3
    dequantize_model(encoder)
    assert encoder.use_nested_tensor and not any(layer._forward_pre_hooks for layer in encoder.layers)
    # one layer quantized alone: its encoder (outside the model quantized) still packs nested tensors
    with pytest.warns(UserWarning, match="MultiheadAttention"):
        quantize_model(encoder.layers[0], QuantConfig(kernel="simulated"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"^an nn.TransformerEncoderLayer holding 8-bit layers got "
                                                          r"a nested tensor, .*quantize the whole encoder, or set its "
                                                          r"use_nested_tensor = False$"):
        encoder(x, src_key_padding_mask=padding)
    dequantize_model(encoder.layers[0])
    with torch.no_grad():
        torch.testing.assert_close(encoder(x, src_key_padding_mask=padding), float_copy(x, src_key_padding_mask=padding))
