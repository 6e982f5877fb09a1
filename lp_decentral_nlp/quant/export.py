"""Inference export: int8 weights + scale and offset (SPEC section 4, last point).

For each quantized layer ``L`` the export holds ``L.weight`` as int8 codes ``c`` with
``L.weight_scale`` and ``L.weight_offset`` (fp32, 0-d) such that the weight the layer used in its
forward pass, ``q * scale + min`` with ``q = c + 2**(bits-1)``, is ``c * scale + offset`` up to
fp32 rounding (the two sums round differently: at most about one ulp of the weight apart), unless
a float module reads the same tensor (a tied weight: it then stays fp32 under every key).
Optionally every plain ``nn.Embedding`` table is stored the same way with one scale and offset per
row (post-training, weight-only). Everything else (biases,
norms, heads kept full precision, activation-range buffers) is copied as is.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..checks import check_flag, path_text
from .functional import quantize_codes, tensor_range
from .hf_quantizer import ACTIVATION_RANGE_KEYS
from .layers import QuantEmbedding, QuantGemmLayer, QuantModule, check_module

SCALE_SUFFIX, OFFSET_SUFFIX = "_scale", "_offset"
EMBEDDING_BITS = 8


@torch.no_grad()
def export_int8_state_dict(model: nn.Module, embeddings: bool = False) -> dict[str, torch.Tensor]:
    """State dict of `model` with every quantized layer's weight stored as int8 codes.

    Codes are the affine codes of SPEC 4 shifted to signed range, ``c = q - 2**(bits-1)``, so
    ``offset = min + 2**(bits-1) * scale``. A quantized layer's codes reproduce the weight its
    forward used (per tensor). A weight tied to a float module (BERT's MLM ``decoder`` quantized
    and the ``word_embeddings`` it shares its weight with, GPT-2's float ``lm_head`` when ``wte``
    is a ``QuantEmbedding``) stays fp32 under every key: the float module read the fp32 tensor and
    the quantized layer quantizes it per tensor at each forward, so ``load_state_dict`` of
    :func:`dequantize_int8_state_dict`'s output (which writes every key into the one shared
    parameter) gives back the exported model's weight codes, whatever the key order; a weight
    moves by about one ulp at most (the module docstring), which can flip an 8-bit activation code
    downstream where a value sits on a rounding boundary, so the outputs agree closely but not to
    fp32 rounding (an 8-bit ResNet-20's logits within about 1e-2). A transformer's layers compound
    the flips: a MiniLM encoder calibrated on three batches of eight texts and reloaded from its
    export gave last hidden states from 1e-7 apart (relative norm; no code flipped) to 13%,
    under either kernel; 13% is as far as scaling the embeddings' output by ``1 + 1e-6`` moves
    it, the order of its distance from fp32 (21%).

    Args:
        model: a model after :func:`quantize_model`.
        embeddings: also store every float ``nn.Embedding`` table (its subclasses too) (``(num_embeddings, dim)``, and
            the entries tied to it) as 8-bit codes with a scale and offset of shape
            ``(num_embeddings, 1)``, one per row, coded once (a quantized layer's weight tied to
            such a table too, as the table). Unlike the quantized layers' export,
            this is post-training weight-only quantization of weights the model used in fp32: each
            entry moves by at most half its row's step ``(row max - row min) / 255``. With it the
            whole export of a DistilBERT-base classifier is ~3.9x smaller than the fp32 state dict
            instead of ~1.9x. (Tables quantized in training, ``QuantConfig(embeddings=True)``, are
            quantized layers and exported with their own codes either way.)
    """
    check_module(model)
    embeddings = check_flag("embeddings", embeddings)
    exact = {f"{n}.weight": (m.quant_config.bits, tensor_range) for n, m in model.named_modules()
             if isinstance(m, (QuantGemmLayer, QuantEmbedding))}
    if not exact:
        raise ValueError("export_int8_state_dict: model has no quantized layers (call quantize_model first)")
    for module in model.modules():  # a model converted after the surgery: refused as its forward refuses it
        if isinstance(module, QuantModule):
            module.check_master_weights()
    state = model.state_dict()
    # every float table, of nn.Embedding's subclasses too (BART's scaled and positional ones): only its weight is stored
    tables = {_tensor_key(m.weight) for m in model.modules()
              if embeddings and isinstance(m, nn.Embedding) and not isinstance(m, QuantModule)}
    if embeddings and not any(isinstance(m, nn.Embedding) for m in model.modules()):  # quantized ones count
        raise ValueError("export_int8_state_dict: embeddings=True codes the model's nn.Embedding tables, and it has "
                         "none: leave embeddings=False")
    float_read = {_tensor_key(p) for m in model.modules() if not isinstance(m, QuantModule)
                  for p in m.parameters(recurse=False)}
    out, coded = {}, {}
    for key, value in state.items():
        tensor = _tensor_key(value)
        if tensor in tables:
            spec = (EMBEDDING_BITS, _row_range)
        else:
            spec = exact.get(key) if tensor not in float_read else None
        if spec is None:
            out[key] = value
            continue
        cache_key = (tensor, spec)
        if cache_key not in coded:
            bits, value_range = spec
            lo, hi = value_range(value)
            # the codes every kernel's forward multiplies (signed: the unsigned codes shifted exactly)
            codes, scale = quantize_codes(value, lo, hi, bits, signed=True)
            half = 2 ** (bits - 1)
            coded[cache_key] = (codes.to(torch.int8), scale.float(), (lo + half * scale).float())
        out[key], out[key + SCALE_SUFFIX], out[key + OFFSET_SUFFIX] = coded[cache_key]
    return out


#: the safetensors metadata entry of :func:`save_int8_export`: the tied keys, each with the key it shares
TIED_KEYS = "lp_decentral_nlp.tied"


def save_int8_export(model: nn.Module, path: str | os.PathLike, embeddings: bool = False) -> None:
    """Write :func:`export_int8_state_dict` of `model` (after :func:`quantize_model`) to the
    safetensors file `path`. Entries that hold one tensor (tied weights: BART's shared embedding
    under three keys) are written once, the other keys named in the file's metadata
    (:data:`TIED_KEYS`), as ``save_pretrained`` writes a tied weight once; :func:`load_int8_export`
    reads it back."""
    from safetensors.torch import save_file

    text = path_text(path)
    if text.endswith(("/", os.sep)):  # Path() would drop the separator and write a file of the folder's name
        raise ValueError(f"path {text!r} names a folder (it ends in a path separator): name the file to write, e.g. "
                         f"{os.path.join(text, 'int8.safetensors')!r}")
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"path {str(path)!r}: " + ("is a folder: name the file to write in it, e.g. "
                                                    f"{str(path / 'int8.safetensors')!r}" if path.is_dir() else
                                                    f"its folder {str(path.parent)!r} does not exist"))
    state = export_int8_state_dict(model, embeddings)
    written, tied, first = {}, {}, {}
    for key, tensor in state.items():
        source = first.setdefault(_tensor_key(tensor), key)
        if source == key:
            written[key] = tensor.contiguous()
        else:
            tied[key] = source
    # one metadata entry: safetensors writes several in an order that differs from process to process,
    # so two identical runs wrote files of other bytes (no "format": it marks save_pretrained's files)
    save_file(written, str(path), metadata={TIED_KEYS: json.dumps(tied)})


def load_int8_export(path: str | os.PathLike, activation_ranges: bool = True) -> dict[str, torch.Tensor]:
    """The float state dict of a file :func:`save_int8_export` wrote (its tied keys restored;
    :func:`dequantize_int8_state_dict`, whose `activation_ranges` this passes on): ready for
    ``model.load_state_dict`` of the quantized model (or, with ``activation_ranges=False``, of the
    float one)."""
    from safetensors import SafetensorError, safe_open

    path = path_text(path)
    if not Path(path).is_file():
        raise ValueError(f"path {os.fspath(path)!r} is not a file" + ("" if Path(path).exists() else " (it does not exist)"))
    try:
        with safe_open(os.fspath(path), framework="pt") as file:
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 -- safe_open is no dict
            tied = json.loads((file.metadata() or {}).get(TIED_KEYS, "{}"))
    except (SafetensorError, OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{os.fspath(path)} cannot be read as a safetensors file ({err})") from None
    if not any(tensor.dtype == torch.int8 for tensor in tensors.values()):
        raise ValueError(f"{os.fspath(path)} holds no int8 codes: not an int8 export (save_int8_export writes one)")
    tensors.update({key: tensors[source] for key, source in tied.items()})
    return dequantize_int8_state_dict(tensors, activation_ranges)


def _tensor_key(t: torch.Tensor) -> tuple:
    """Identifies the tensor a state-dict entry holds (tied entries hold the same one)."""
    return t.data_ptr(), t.shape, t.stride()


def _row_range(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of each row of a 2-D table, each of shape ``(rows, 1)``."""
    return table.aminmax(dim=1, keepdim=True)


def dequantize_int8_state_dict(state_dict: dict[str, torch.Tensor],
                               activation_ranges: bool = True) -> dict[str, torch.Tensor]:
    """Float state dict from ``export_int8_state_dict``'s output (weights ``c * scale + offset``).

    Args:
        state_dict: what :func:`export_int8_state_dict` returned.
        activation_ranges: keep the 8-bit layers' activation-range buffers
            (``act_running_min``/``act_running_max``/``act_num_batches``): the state dict loads
            into the quantized model (``load_state_dict``) and gives its outputs back up to fp32
            rounding. False drops
            them: it loads into the float model (``dequantize_model``'s, or the architecture built
            without ``lp_decentral_nlp``), which computes in fp32 with the 8-bit grid's weights.
    """
    activation_ranges = check_flag("activation_ranges", activation_ranges)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors (export_int8_state_dict's output), got "
                        f"{type(state_dict).__name__}")
    other = next(((k, v) for k, v in state_dict.items() if not torch.is_tensor(v)), None)
    if other is not None:
        raise TypeError(f"state_dict must map names to tensors (export_int8_state_dict's output), and "
                        f"{other[0]!r} holds a {type(other[1]).__name__}")
    coded = {k for k, v in state_dict.items() if v.dtype == torch.int8 and k + SCALE_SUFFIX in state_dict}
    extras = {k + s for k in coded for s in (SCALE_SUFFIX, OFFSET_SUFFIX)}
    if not activation_ranges:
        extras |= {k for k in state_dict if re.search(ACTIVATION_RANGE_KEYS, k)}
    return {
        key: value.float() * state_dict[key + SCALE_SUFFIX] + state_dict[key + OFFSET_SUFFIX] if key in coded else value
        for key, value in state_dict.items()
        if key not in extras
    }


def state_dict_nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes held by the tensors of `state_dict` (each distinct storage counted once)."""
    seen, total = set(), 0
    for t in state_dict.values():
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
