"""GGUF files for llama.cpp, written with the ``gguf`` package (llama.cpp's own writer): a head as a draft model
(``-md DRAFT.gguf``) and, for llama-family targets loaded from HF weights, the target itself in the dtype asked for.

A GGUF carries its tokenizer; llama.cpp loads a draft's vocabulary and checks it against the target's. Both files get
the target's tokenizer fields: copied from the target's own GGUF where it came from one (the default target does),
else built from an HF byte-level BPE tokenizer (``tokenizer_fields``).

Tensor layouts follow llama.cpp's converter (``convert_hf_to_gguf.py``) for the same models: names ``blk.N.attn_q``
..., shapes as torch holds them (the writer reverses them into ggml's order), q and k rows permuted from HF's rotary
layout into ggml's (``rope_permute``), norms in float32, the other matrices in the dtype asked for. A head type that
llama.cpp runs describes its own file (``DraftHead.gguf_layout``): EAGLE-3 as arch ``eagle3``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from heads.common import draft_rope_parameters
from heads.layouts import new_mode

GGUF_DTYPES = ("float32", "float16", "bfloat16")
# llama.cpp's name of the pre-tokenizer (how text is split before BPE) of the tokenizer families recognised here, by
# a token only that family's vocabulary has (llama.cpp's converter tells them apart by hashing the tokenizer's output;
# another family: convert with it).
BPE_PRE_TOKENIZERS = {"<|begin_of_text|>": "llama-bpe", "<|endoftext|><|im_start|>": "smollm",
                      "<|im_start|><|vision_start|>": "qwen2"}


@dataclass
class GGUFLayout:
    """What a GGUF file holds: its architecture, key/values ({key: (value, kind)}; kind one of "u32", "f32", "bool",
    "str", "i32s" (an array of int32)) and tensors ({name: tensor as torch holds it}). One-dimensional tensors (norms)
    stay float32 whatever the dtype, as llama.cpp's converter keeps them: its kernels multiply by float32 norms."""

    arch: str
    values: dict[str, tuple[object, str]]
    tensors: dict[str, torch.Tensor]


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k projection rows [heads * head_dim, ...] from HF's rotary layout (halves) into ggml's (interleaved
    pairs), as llama.cpp's converter permutes them for its NORM rope."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tokenizer_fields_from_gguf(path: str | os.PathLike) -> dict[str, tuple[object, object]]:
    """Every ``tokenizer.*`` field of a GGUF file: {key: (value, GGUF value type(s))}, to write into another."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {key: (item.contents(), item.types) for key, item in reader.fields.items() if key.startswith("tokenizer.")}


def bpe_pre_tokenizer(vocab: dict[str, int]) -> str | None:
    """llama.cpp's pre-tokenizer name for a vocabulary of a family ``BPE_PRE_TOKENIZERS`` recognises, else None."""
    for marks, name in BPE_PRE_TOKENIZERS.items():
        tokens = ["<|" + mark for mark in marks.split("<|") if mark]
        if all(token in vocab for token in tokens) and not (name == "smollm" and "<|vision_start|>" in vocab):
            return name
    return None


def tokenizer_fields(tokenizer) -> dict[str, tuple[object, object]]:
    """The ``tokenizer.*`` fields of an HF byte-level BPE tokenizer (what llama.cpp's converter writes for it): the
    tokens in id order, their types (special tokens as control), the merges, the special ids and the chat template.
    Other tokenizers are refused, naming llama.cpp's converter."""
    import json

    import gguf

    vocab = tokenizer.get_vocab()
    pre = bpe_pre_tokenizer(vocab)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str())["model"] if backend is not None else {}
    if pre is None or model.get("type") != "BPE":
        raise ValueError(f"writing this target's tokenizer ({type(tokenizer).__name__}) into a GGUF is done here for "
                         f"the byte-level BPE tokenizers of Llama 3, Qwen 2/3 and SmolLM only; convert the target with "
                         f"llama.cpp's convert_hf_to_gguf.py and pass that file as the tokenizer's source "
                         f"(--tokenizer-gguf)")
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for token, index in vocab.items():
        tokens[index] = token
    special = set(tokenizer.all_special_ids) | {index for token, index in vocab.items()
                                                 if token in getattr(tokenizer, "added_tokens_encoder", {})}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(size)]
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model.get("merges", [])]
    kind = gguf.GGUFValueType
    S, A, U, B, I32 = kind.STRING, kind.ARRAY, kind.UINT32, kind.BOOL, kind.INT32
    fields = {"tokenizer.ggml.model": ("gpt2", [S]), "tokenizer.ggml.pre": (pre, [S]),
              "tokenizer.ggml.tokens": (tokens, [A, S]), "tokenizer.ggml.token_type": (types, [A, I32]),
              "tokenizer.ggml.merges": (merges, [A, S]), "tokenizer.ggml.add_bos_token": (False, [B])}
    for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("unk_token_id", "unknown"),
                      ("pad_token_id", "padding")):
        value = getattr(tokenizer, name, None)
        if value is not None:
            fields[f"tokenizer.ggml.{key}_token_id"] = (int(value), [U])
    if getattr(tokenizer, "chat_template", None):
        fields["tokenizer.chat_template"] = (tokenizer.chat_template, [S])
    return fields


def write_gguf(layout: GGUFLayout, tokenizer: dict, path: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """Write ``layout`` with the ``tokenizer`` fields to ``path`` (whole or not at all: a temporary sibling is
    renamed into place), matrices in ``dtype``."""
    import gguf

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r}: choose one of {', '.join(GGUF_DTYPES)}")
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), layout.arch)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    writer.add_file_type(file_type)
    add = {"u32": writer.add_uint32, "f32": writer.add_float32, "bool": writer.add_bool, "str": writer.add_string,
           "i32s": lambda key, value: writer.add_array(key, [int(v) for v in value])}
    for key, (value, kind) in layout.values.items():
        add[kind](key, value)
    for key, (value, types) in tokenizer.items():
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, list(value), types[0], sub_type=types[1])
        else:
            writer.add_key_value(key, value, types[0])
    for name, tensor in layout.tensors.items():
        data, raw = _tensor_data(tensor, dtype if tensor.dim() > 1 else "float32")
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.chmod(partial, new_mode())
    os.replace(partial, path)
    return path


def _tensor_data(tensor: torch.Tensor, dtype: str):
    """(numpy data, raw GGML type or None) of a tensor in ``dtype``: bf16 as its raw 16 bits, integers as int64."""
    import gguf

    tensor = tensor.detach().cpu().contiguous()
    if not tensor.is_floating_point():
        return tensor.to(torch.int64).numpy(), gguf.GGMLQuantizationType.I64
    if dtype == "bfloat16":
        return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    if dtype == "float16":
        return tensor.to(torch.float16).numpy(), None
    return tensor.to(torch.float32).numpy(), None


def llama_values(arch: str, config, layers: int, hidden: int, context: int) -> dict[str, tuple[object, str]]:
    """The hyperparameters of a llama-style block stack of ``layers`` layers under ``arch.``, from a transformers
    config (heads, key/value heads, MLP width, norm epsilon, rotary base and width)."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    rope = draft_rope_parameters(config)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"a rotary embedding with scaling ({rope}) is not written into GGUF here; convert the target "
                         f"with llama.cpp's convert_hf_to_gguf.py")
    theta = float(rope["rope_theta"])
    return {f"{arch}.block_count": (layers, "u32"), f"{arch}.context_length": (context, "u32"),
            f"{arch}.embedding_length": (hidden, "u32"),
            f"{arch}.feed_forward_length": (int(config.intermediate_size), "u32"),
            f"{arch}.attention.head_count": (heads, "u32"),
            f"{arch}.attention.head_count_kv": (int(getattr(config, "num_key_value_heads", None) or heads), "u32"),
            f"{arch}.attention.key_length": (head_dim, "u32"), f"{arch}.attention.value_length": (head_dim, "u32"),
            f"{arch}.rope.freq_base": (theta, "f32"), f"{arch}.rope.dimension_count": (head_dim, "u32"),
            f"{arch}.attention.layer_norm_rms_epsilon": (float(config.rms_norm_eps), "f32"),
            f"{arch}.vocab_size": (int(config.vocab_size), "u32")}


def llama_layer_tensors(prefix: str, layer: dict[str, torch.Tensor], config, index: int) -> dict[str, torch.Tensor]:
    """One llama-style decoder layer's tensors ({HF name without ``prefix``: tensor}) under ggml's names, q and k
    rows permuted for its rotary layout."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    names = {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
             "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
             "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}
    tensors = {}
    for name, ggml in names.items():
        tensor = layer[prefix + name]
        if ggml == "attn_q":
            tensor = rope_permute(tensor, heads)
        elif ggml == "attn_k":
            tensor = rope_permute(tensor, kv_heads)
        tensors[f"blk.{index}.{ggml}.weight"] = tensor
    return tensors


LLAMA_FAMILIES = ("llama",)


def target_layout(model) -> GGUFLayout:
    """A llama-family transformers causal LM as llama.cpp's ``llama`` architecture (embedding, blocks, final norm, and
    the LM head unless tied to the embedding). Other families are refused, naming llama.cpp's converter."""
    config = model.config
    if config.model_type not in LLAMA_FAMILIES:
        raise ValueError(f"writing a {config.model_type} target as GGUF is done here for {', '.join(LLAMA_FAMILIES)} "
                         f"models; convert it with llama.cpp's convert_hf_to_gguf.py")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("a llama target with attention or MLP biases is not written as GGUF here; convert it with "
                         "llama.cpp's convert_hf_to_gguf.py")
    state = model.state_dict()
    layers = int(config.num_hidden_layers)
    values = llama_values("llama", config, layers, int(config.hidden_size),
                          int(getattr(config, "max_position_embeddings", 2048)))
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"]}
    for index in range(layers):
        tensors.update(llama_layer_tensors(f"model.layers.{index}.", state, config, index))
    tensors["output_norm.weight"] = state["model.norm.weight"]
    if not getattr(config, "tie_word_embeddings", False):
        tensors["output.weight"] = state["lm_head.weight"]
    return GGUFLayout("llama", values, tensors)
