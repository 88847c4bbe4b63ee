"""Head modules and checkpoints: round trip, refusing a mismatched target, serving export layouts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from heads.common import target_signature
from heads.eagle import EagleConfig, EagleHead
from heads.io import export_head, load_head, save_head
from heads.medusa import MedusaConfig, MedusaHeads
from tests.tiny_training import char_tokenizer


def tiny_target(hidden=32, vocab=64, layers=4, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        pad_token_id=None, bos_token_id=None, eos_token_id=None)).eval()


def make_head(kind, model):
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if kind == "eagle":
        return EagleHead(EagleConfig(), model.config, embed, lm_head)
    if kind == "eagle3":
        head = EagleHead(EagleConfig(kind="eagle3", fc_bias=False, feature_layers=[1, 2, 3], draft_vocab_size=16),
                         model.config, embed, None)
        t2d = torch.zeros(64, dtype=torch.bool)
        t2d[torch.arange(0, 64, 4)] = True
        head.set_draft_vocab(torch.arange(0, 64, 4) - torch.arange(16), t2d)
        return head
    return MedusaHeads(MedusaConfig(num_heads=3, num_layers=2, shared_lm_head=kind == "medusa"), model.config,
                       lm_head)


def perturb(head):
    """Zero-initialised Medusa blocks are the identity: give them weights so the round trip can fail."""
    if isinstance(head, MedusaHeads):
        with torch.no_grad():
            for block in head.blocks:
                for layer in block.layers:
                    layer.weight.normal_(0, 0.1)
    return head


def outputs(head, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if isinstance(head, MedusaHeads):
            return head(torch.randn(2, 5, 32, generator=generator))
        ids = torch.randint(0, 64, (2, 5), generator=generator)
        features = torch.randn(2, 5, head.feature_size, generator=generator)
        return head(ids, features, torch.arange(5)[None].expand(2, -1))[1]


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "medusa-own-heads"])
def test_checkpoint_round_trip_gives_identical_outputs(tmp_path, kind):
    model = tiny_target()
    head = perturb(make_head(kind, model))
    before = outputs(head)
    save_head(head, tmp_path / "head", target_signature(model, "tiny", char_tokenizer()))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["head_type"] == kind.split("-")[0] and config["target"]["hidden_size"] == 32
    loaded = load_head(tmp_path / "head", model, identity="tiny", tokenizer=char_tokenizer())
    after = outputs(loaded)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    weights = set(loaded.state_dict())
    assert not any("embed" in k or "target_lm_head" in k for k in weights), "frozen target weights were saved"
    if kind == "eagle3":
        assert torch.equal(loaded.draft_to_target, torch.arange(0, 64, 4))


def test_head_refuses_mismatched_target(tmp_path):
    model = tiny_target()
    save_head(make_head("eagle", model), tmp_path / "head", target_signature(model, "tiny-a", char_tokenizer()))
    with pytest.raises(ValueError, match="hidden size 32, this target has 48"):
        load_head(tmp_path / "head", tiny_target(hidden=48))
    with pytest.raises(ValueError, match="vocabulary size 64, this target has 80"):
        load_head(tmp_path / "head", tiny_target(vocab=80))
    with pytest.raises(ValueError, match="number of layers 4, this target has 2"):
        load_head(tmp_path / "head", tiny_target(layers=2))
    other_tokenizer = char_tokenizer()
    other_tokenizer.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="tokenizer fingerprint"):
        load_head(tmp_path / "head", model, tokenizer=other_tokenizer)
    with pytest.raises(FileNotFoundError, match="not a head directory"):
        load_head(tmp_path, model)
    with pytest.warns(UserWarning, match="trained for 'tiny-a'"):
        load_head(tmp_path / "head", model, identity="tiny-b")


def test_head_without_target_weights_says_how_to_fix():
    model = tiny_target()
    head = EagleHead(EagleConfig(), model.config)
    with pytest.raises(RuntimeError, match="load_head"):
        head(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 32), torch.arange(2)[None])


def test_serving_export_layouts(tmp_path):
    from safetensors.torch import load_file

    model = tiny_target()
    export_head(make_head("eagle3", model), tmp_path / "e3")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    keys = set(load_file(str(tmp_path / "e3" / "model.safetensors")))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 16
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight"} <= keys
    assert not any("embed" in k for k in keys)
    export_head(make_head("eagle", model), tmp_path / "e1")
    keys = set(load_file(str(tmp_path / "e1" / "model.safetensors")))
    assert json.loads((tmp_path / "e1" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= keys
    assert "layers.0.input_layernorm.weight" not in keys
    export_head(make_head("medusa", model), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    keys = set(load_file(str(tmp_path / "m" / "model.safetensors")))
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 2
    assert {"blocks.0.layers.1.weight", "blocks.2.layers.0.bias", "lm_heads.2.weight"} <= keys


@pytest.mark.parametrize("kind", ["medusa", "medusa-own-heads"])
def test_batched_medusa_logits_equal_per_head_logits(kind):
    heads = perturb(make_head(kind, tiny_target()))
    hidden = torch.randn(32)
    with torch.no_grad():
        batched = heads.first_heads_logits(hidden, 2)
        separate = torch.stack([heads.head_logits(i, hidden) for i in range(2)])
    assert batched.shape == (2, 64)
    torch.testing.assert_close(batched, separate)


@pytest.mark.parametrize("shape", [(32,), (1, 32), (3, 32), (2, 3, 32), (1, 9, 32)])
def test_vocab_logits_equals_linear(shape):
    from heads.common import vocab_logits

    weight = torch.randn(64, 32)
    hidden = torch.randn(*shape)
    with torch.inference_mode():
        fast = vocab_logits(hidden, weight)
    torch.testing.assert_close(fast, torch.nn.functional.linear(hidden, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(32,), (1, 32), (2, 3, 32), (1, 16, 32), (1, 17, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_linear_equals_linear(shape, with_bias):
    from heads.common import decode_linear

    weight, bias = torch.randn(48, 32), (torch.randn(48) if with_bias else None)
    hidden = torch.randn(*shape[:-1], 64)[..., ::2]  # a strided view, as attention outputs can be
    with torch.inference_mode():
        fast = decode_linear(hidden, weight, bias)
    torch.testing.assert_close(fast, torch.nn.functional.linear(hidden, weight, bias), rtol=1e-5, atol=1e-5)
    # A strided result would push the attention that follows off SDPA's fused CPU kernel.
    assert fast.is_contiguous()


def test_decode_linears_switch_plain_linears_only_and_keep_outputs():
    from heads.common import DecodeLinear, use_decode_linears

    class Adapter(torch.nn.Linear):
        pass

    model = tiny_target()
    model.extra = Adapter(4, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.inference_mode():
        before = model(ids).logits
        use_decode_linears(model)
        after = model(ids).logits
    layer = model.get_decoder().layers[0]
    assert type(layer.self_attn.q_proj) is DecodeLinear and type(layer.mlp.down_proj) is DecodeLinear
    assert type(model.extra) is Adapter
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, switched", [("llama", True), ("qwen2", True), ("gemma", False)])
def test_decode_norms_switch_llama_formula_norms_only_and_keep_outputs(arch, switched):
    from heads.common import use_decode_norms
    from tests.conftest import tiny_model

    model = tiny_model(arch).bfloat16()
    norm_class = type(model.get_decoder().norm)
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.inference_mode():
        before = model(ids).logits.float()
        use_decode_norms(model)
        after = model(ids).logits.float()
    now = type(model.get_decoder().norm)
    assert (now is not norm_class and issubclass(now, norm_class)) == switched
    torch.testing.assert_close(after, before, rtol=0.02, atol=0.02)  # bf16: the sum of squares in another order


def test_eagle3_output_starts_as_the_targets_lm_head():
    model = tiny_target()
    head = make_head("eagle3", model)
    final_norm = model.get_decoder().norm
    with torch.no_grad():
        final_norm.weight.uniform_(0.5, 1.5)
        head.init_output_from_target(model.get_output_embeddings().weight, final_norm.weight)
        hidden = torch.randn(3, 32)
        expected = model.get_output_embeddings()(final_norm(hidden))[:, head.draft_to_target]
        torch.testing.assert_close(head.logits(hidden), expected)


def test_softcap_logits_caps_and_passes_through():
    from heads.common import softcap_logits

    logits = torch.tensor([-100.0, 0.5, 100.0])
    assert torch.equal(softcap_logits(logits, None), logits)
    capped = softcap_logits(logits, 30.0)
    torch.testing.assert_close(capped, 30.0 * torch.tanh(logits / 30.0))
    assert capped.abs().max() < 30.0
