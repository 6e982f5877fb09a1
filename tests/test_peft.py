"""What the README says of PEFT (LoRA) models: the 8-bit surgery reaches the base and the adapters
(``skip`` keeps the adapters float), decentralized training leaves the frozen base as it is on
every node, and ``merge_and_unload()`` gives the trained 8-bit model whole, which reloads."""
import pytest
import torch
from helpers import agnews_sample, tiny_distilbert

from lp_decentral_nlp import QuantConfig, load_quantized, quantize_model
from lp_decentral_nlp.quant import DEFAULT_SKIP, QuantLinear
from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments

peft = pytest.importorskip("peft")
QUERY = "base_model.model.distilbert.transformer.layer.0.attention.q_lin"


def lora_model(seed=0):
    """A tiny DistilBERT classifier with rank-4 LoRA adapters on the attention's query and value."""
    config = peft.LoraConfig(r=4, target_modules=["q_lin", "v_lin"], task_type="SEQ_CLS")
    return peft.get_peft_model(tiny_distilbert(seed), config)


def test_the_surgery_makes_base_and_adapters_8bit_and_skip_keeps_the_adapters_float():
    modules = dict(quantize_model(lora_model()).named_modules())
    assert all(isinstance(modules[f"{QUERY}.{part}"], QuantLinear)
               for part in ("base_layer", "lora_A.default", "lora_B.default"))
    assert not isinstance(modules["base_model.model.classifier.modules_to_save.default"], QuantLinear)  # the head
    modules = dict(quantize_model(lora_model(), QuantConfig(skip=DEFAULT_SKIP + ("lora_A", "lora_B"))).named_modules())
    assert isinstance(modules[f"{QUERY}.base_layer"], QuantLinear)
    assert type(modules[f"{QUERY}.lora_A.default"]) is torch.nn.Linear
    assert type(modules[f"{QUERY}.lora_B.default"]) is torch.nn.Linear


def test_decentralized_training_moves_the_adapters_and_leaves_the_frozen_base(tmp_path, tokenizer):
    data = agnews_sample(tokenizer, max_length=16, max_train_samples=128, max_eval_samples=16)
    model = lora_model()
    base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    args = DecentralizedTrainingArguments(output_dir=str(tmp_path), num_nodes=4, per_device_train_batch_size=8,
                                          learning_rate=1e-2, max_steps=3, save_strategy="no", use_cpu=True,
                                          disable_tqdm=True, report_to=[], compression=90.0, compressor="randomk")
    trainer = DecentralizedTrainer(model=model, args=args, train_dataset=data["train"], processing_class=tokenizer)
    trainer.train()
    for net in (trainer.model, *trainer.nodes):
        params = dict(net.named_parameters())
        assert all(torch.equal(params[name], value) for name, value in base.items())
        assert any(not torch.equal(params[name], value) for name, value in adapters.items())
    assert isinstance(dict(trainer.model.named_modules())[f"{QUERY}.lora_A.default"], QuantLinear)


def test_merge_and_unload_keeps_the_8bit_model_whole_and_it_reloads(tmp_path):
    model = quantize_model(lora_model())
    tokens = torch.randint(0, 30522, (2, 8))
    model.train()
    model(input_ids=tokens)  # one training forward: the 8-bit layers' running input ranges
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter (LoRA starts with B = 0)
    merged = model.merge_and_unload().eval()
    assert isinstance(merged.distilbert.transformer.layer[0].attention.q_lin, QuantLinear)
    logits = merged(input_ids=tokens).logits
    merged.save_pretrained(tmp_path)
    reloaded = load_quantized(tmp_path).eval()
    assert isinstance(reloaded.distilbert.transformer.layer[0].attention.q_lin, QuantLinear)
    torch.testing.assert_close(reloaded(input_ids=tokens).logits, logits, rtol=0, atol=0)
