"""Loading a target refuses what would decode garbage: a file that is not the GGUF it claims to be, a cached copy of
another file, weights that do not match the config."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.target.model import _float_cache_for_gguf, load_target
from tests.conftest import tiny_model


def test_a_file_that_is_not_gguf_is_refused_before_loading(tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"\x00" * 4096)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_target(str(fake))


def test_a_truncated_gguf_is_refused_with_a_sentence_before_dequantizing(tmp_path, monkeypatch):
    """A GGUF file cut short (an interrupted copy) is named as such, not reported as a numpy reshape error."""
    import gguf

    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "whole.gguf"), "llama")
    writer.add_tensor("token_embd.weight", torch.ones(64, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = (tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="is not a complete GGUF file .*cut short"):
        load_target(str(tmp_path / "cut.gguf"))


def test_the_dequantized_cache_is_keyed_on_content_not_name_and_size(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, filler in ((first, b"\x01"), (second, b"\x02")):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + filler * 1000)  # same name, same size, other bytes
    assert _float_cache_for_gguf(first) != _float_cache_for_gguf(second)
    assert _float_cache_for_gguf(first) == _float_cache_for_gguf(first)


@pytest.mark.parametrize("change", [1, -1])
def test_weights_that_do_not_match_the_config_are_refused_in_either_direction(tmp_path, change):
    """A config edited to more layers than the weights hold would make up weights; to fewer, it would drop some and
    load silently: both are refused, naming the mismatch."""
    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] += change
    (tmp_path / "config.json").write_text(json.dumps(config))
    wrong = r"lack \d+ tensors .*num_hidden_layers" if change > 0 else r"hold \d+ tensors the config has no place"
    with pytest.raises(ValueError, match=wrong):
        load_target(str(tmp_path))


def test_attention_the_tree_attention_would_not_apply_is_refused():
    """Sinks (GPT-OSS's learnt per-head logits) and windows that only transformers' own masks apply (Qwen2-MoE,
    Llama-4's chunks) would be lost under the runtime's tree mask: such targets are refused when made, and a sink
    that reaches the attention call anyway is refused there."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from runtime.target.attention import transformers_attention_forward
    from runtime.target.model import target_from_model

    model = tiny_model("llama")
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="has sinks"):
        target_from_model(model, identity="sinks")
    config = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
                            vocab_size=64, use_sliding_window=True, sliding_window=6, max_position_embeddings=512)
    with pytest.raises(ValueError, match="sliding window of 6 tokens that qwen2_moe applies only"):
        target_from_model(AutoModelForCausalLM.from_config(config).eval(), identity="moe")
    config.use_sliding_window = False  # no window: nothing lost
    target_from_model(AutoModelForCausalLM.from_config(config).eval(), identity="moe")
    chunked = tiny_model("llama")
    chunked.config.attention_chunk_size = 8
    with pytest.raises(ValueError, match="chunks of 8 tokens"):
        target_from_model(chunked, identity="chunked")
    query = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="sinks"):
        transformers_attention_forward(None, query, query, query, None, s_aux=torch.zeros(4))


def test_a_rotary_embedding_that_rescales_per_pass_limits_the_context():
    """LongRoPE (and dynamic NTK) pick their frequencies from the longest position of a pass: past the original
    context, a verification pass's drafts would change what its accepted tokens saw. The decoder stops there, and
    says why."""
    from runtime.engine.decoder import SpeculativeDecoder
    from runtime.target.model import target_from_model

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}
    target = target_from_model(tiny_model("llama", max_position_embeddings=64, rope_parameters=rope), identity="long")
    assert target.max_positions == 16
    decoder = SpeculativeDecoder(target, None, tree_size=1)
    assert len(decoder.generate(list(range(1, 9)), 8).tokens) == 8
    with pytest.raises(ValueError, match="context of 16 positions .its rotary embedding rescales past 16"):
        decoder.generate(list(range(1, 9)), 9)
    assert target_from_model(tiny_model("llama"), identity="plain").max_positions == 512


def test_a_composite_models_attention_settings_come_back_after_a_pass(monkeypatch):
    """The runtime sets its tree attention for a pass and restores each config's own setting, sub-configs included
    (the transformers setter would write the top-level value down into every sub-config)."""
    import torch
    from transformers import LlamaConfig

    from runtime.target.model import target_from_model

    model = tiny_model("llama")
    config = model.config
    # as a composite model's config lists its parts
    monkeypatch.setattr(LlamaConfig, "sub_configs", {"text_config": LlamaConfig})
    config.text_config = LlamaConfig()
    config._attn_implementation_internal = "sdpa"
    config.text_config._attn_implementation_internal = "eager"
    target = target_from_model(model, identity="composite")
    cache = target.new_cache(1, 8)
    target.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, None)
    assert (config._attn_implementation, config.text_config._attn_implementation) == ("sdpa", "eager")


def test_an_hf_id_neither_cached_nor_reachable_is_named_at_once(monkeypatch):
    """Not in the cache and no hub within reach: a sentence naming the id and what to pass instead, before
    transformers' retries (most of a minute) and their traceback."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="someorg/missing-model is not in the local Hugging Face cache and "
                                                "HF_HUB_OFFLINE is set; pass a local model directory"):
        load_target("someorg/missing-model")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unreachable(self, name, timeout=None):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(FileNotFoundError, match="the hub cannot be reached .*Name or service not known"):
        load_target("someorg/missing-model")
