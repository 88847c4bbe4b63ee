"""GGUF files for llama.cpp (heads.gguf, heads.export.export_gguf, scripts/export.py --format gguf): what they hold,
read back with the gguf package as llama.cpp reads them. The marked test (-m llamacpp) runs llama.cpp itself."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from heads.common import frozen_target_weights
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.export import DRAFT_GGUF, TARGET_GGUF, export_gguf
from heads.gguf import rope_permute, tokenizer_fields, write_gguf, target_layout
from heads.medusa import MedusaConfig, MedusaHeads
from tests.conftest import tiny_model
from tests.script_runs import default_tokenizer

V = 64


def eagle3_head(model) -> Eagle3Head:
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config(feature_layers=[0, 1, 1], draft_vocab_size=16), model.config)
    ids = torch.arange(0, V, 4)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(16), t2d)
    for parameter in head.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    head.attach_target_weights(*frozen_target_weights(model))
    return head


def read(path):
    reader = gguf.GGUFReader(str(path))
    values = {key: field.contents() for key, field in reader.fields.items()}
    return values, {tensor.name: tensor for tensor in reader.tensors}


def as_torch(tensor) -> torch.Tensor:
    """A GGUF tensor's data as torch holds it (ggml's order reversed back), bf16 from its raw bits."""
    data = np.array(tensor.data)
    shape = [int(n) for n in reversed(tensor.shape)]
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(data.copy()).reshape(shape)


TOKENIZER = {"tokenizer.ggml.model": ("gpt2", [gguf.GGUFValueType.STRING]),
             "tokenizer.ggml.tokens": ([f"t{i}" for i in range(V)], [gguf.GGUFValueType.ARRAY,
                                                                     gguf.GGUFValueType.STRING])}


def test_an_eagle3_draft_is_what_llamas_converter_writes(tmp_path):
    """arch eagle3: target_layers as our feature layers (both tap layer inputs), target_hidden_size, one block whose
    q and k rows are in ggml's rotary order, the hidden norm as attn_norm_2, norms in float32, the draft LM head, and
    d2t as absolute int64 target ids; the target's tokenizer fields travel with it."""
    model = tiny_model("llama", vocab_size=V, num_hidden_layers=2)
    head = eagle3_head(model)
    out = export_gguf(head, tmp_path / "exp", TOKENIZER, "bfloat16")
    values, tensors = read(out / DRAFT_GGUF)
    assert values["general.architecture"] == "eagle3"
    assert list(values["eagle3.target_layers"]) == [0, 1, 1]
    assert values["eagle3.target_hidden_size"] == model.config.hidden_size
    assert values["eagle3.block_count"] == 1 and values["eagle3.vocab_size"] == V
    assert values["tokenizer.ggml.model"] == "gpt2" and len(values["tokenizer.ggml.tokens"]) == V
    state = head.state_dict()
    heads = model.config.num_attention_heads
    q = as_torch(tensors["blk.0.attn_q.weight"])
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert torch.equal(q, rope_permute(state["midlayer.self_attn.q_proj.weight"], heads).to(torch.bfloat16))
    assert not torch.equal(q, state["midlayer.self_attn.q_proj.weight"].to(torch.bfloat16))
    assert list(tensors["fc.weight"].shape) == [3 * model.config.hidden_size, model.config.hidden_size]  # ggml order
    norm = tensors["blk.0.attn_norm_2.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(as_torch(norm), state["midlayer.hidden_norm.weight"])
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert as_torch(tensors["d2t"]).tolist() == list(range(0, V, 4))
    assert as_torch(tensors["output.weight"]).shape == (16, model.config.hidden_size)


def test_the_target_and_permutation_round_trip():
    """The llama target's tensors under ggml's names (a tied LM head written once, as the embedding), and the rotary
    permutation undone by its inverse: the file holds the very weights."""
    model = tiny_model("llama", vocab_size=V, num_hidden_layers=2, tie_word_embeddings=True)
    layout = target_layout(model)
    assert layout.arch == "llama" and "output.weight" not in layout.tensors
    assert len([name for name in layout.tensors if name.startswith("blk.")]) == 2 * 9
    k = model.model.layers[1].self_attn.k_proj.weight
    kv_heads = model.config.num_key_value_heads
    permuted = layout.tensors["blk.1.attn_k.weight"]
    rows, dim = permuted.shape[0], permuted.shape[0] // kv_heads // 2
    undone = permuted.reshape(kv_heads, dim, 2, -1).swapaxes(1, 2).reshape(rows, -1)
    assert torch.equal(undone, k)


def test_llama_cpp_drafts_only_with_heads_it_runs(tmp_path):
    model = tiny_model("llama", vocab_size=V)
    heads = MedusaHeads(MedusaConfig(num_heads=2), model.config)
    heads.attach_target_weights(*frozen_target_weights(model))
    with pytest.raises(ValueError, match="llama.cpp drafts with EAGLE-3 heads"):
        export_gguf(heads, tmp_path / "exp", TOKENIZER)
    assert not (tmp_path / "exp").exists()


def test_an_hf_tokenizer_is_written_as_llamas_converter_writes_it(tmp_path):
    """The default target's HF tokenizer as GGUF fields: byte-level BPE with SmolLM's pre-tokenizer, tokens in id
    order, special tokens as control tokens, its merges, special ids and chat template."""
    tokenizer = default_tokenizer()
    fields = tokenizer_fields(tokenizer)
    assert fields["tokenizer.ggml.pre"][0] == "smollm" and fields["tokenizer.ggml.model"][0] == "gpt2"
    tokens = fields["tokenizer.ggml.tokens"][0]
    assert len(tokens) == len(tokenizer) and tokens[tokenizer.eos_token_id] == tokenizer.eos_token
    assert fields["tokenizer.ggml.token_type"][0][tokenizer.eos_token_id] == gguf.TokenType.CONTROL
    assert fields["tokenizer.ggml.eos_token_id"][0] == tokenizer.eos_token_id
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=1, hidden_size=16,
                       intermediate_size=32)
    path = write_gguf(target_layout(model), fields, tmp_path / TARGET_GGUF, "float32")
    values, tensors = read(path)
    assert values["tokenizer.ggml.pre"] == "smollm" and len(values["tokenizer.ggml.merges"]) > 1000
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F32
