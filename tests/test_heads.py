"""Head modules and checkpoints: round trip, refusing a mismatched target, serving export layouts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from heads.common import target_signature
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.export import export_head
from heads.io import load_head, save_head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.registry import HEAD_TYPES, build_head
from tests.tiny_training import char_tokenizer


def tiny_target(hidden=32, vocab=64, layers=4, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        pad_token_id=None, bos_token_id=None, eos_token_id=None)).eval()


def make_head(kind, model):
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if kind == "eagle":
        head = EagleHead(EagleConfig(), model.config)
    elif kind == "eagle3":
        head = Eagle3Head(Eagle3Config(feature_layers=[1, 2, 3], draft_vocab_size=16), model.config)
        t2d = torch.zeros(64, dtype=torch.bool)
        t2d[torch.arange(0, 64, 4)] = True
        head.set_draft_vocab(torch.arange(0, 64, 4) - torch.arange(16), t2d)
    else:
        head = MedusaHeads(MedusaConfig(num_heads=3, num_layers=2, shared_lm_head=kind == "medusa"), model.config)
        head.attach_target_weights(embed, lm_head, init_heads=True)
        return head
    head.attach_target_weights(embed, lm_head)
    return head


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


def test_truncated_or_mismatched_head_weights_get_a_sentence_naming_the_file(tmp_path):
    """A cut-short weights file, weights of another shape and a draft vocabulary the weights do not have are named
    (file, tensor, shapes) as such, not left to a safetensors or load_state_dict traceback."""
    model = tiny_target()
    head_dir = save_head(make_head("eagle3", model), tmp_path / "head", target_signature(model, "tiny"))
    weights = head_dir / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors cannot be read .*truncated or damaged"):
        load_head(head_dir, model)
    weights.write_bytes(whole)
    config = json.loads((head_dir / "config.json").read_text())
    config["head_config"]["draft_vocab_size"] = 32  # the weights hold 16 rows
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not match its config.json .*draft_vocab_size.*lm_head.weight "
                                         r"\(16, 32\) \(expected \(32, 32\)\)"):
        load_head(head_dir, model)


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


def test_registry_builds_every_head_type_from_its_saved_config():
    model = tiny_target()
    for head_type, cls in HEAD_TYPES.items():
        assert cls.head_type == head_type
        head = build_head(head_type, {}, model.config)
        assert type(head) is cls and head.head_type == head_type
    with pytest.raises(ValueError, match="unknown head type 'hydra'; choose one of eagle, eagle3, medusa"):
        build_head("hydra", {}, model.config)
    with pytest.raises(ValueError, match=r"unknown medusa head config keys \['depth'\]"):
        build_head("medusa", {"depth": 3}, model.config)


def test_every_head_type_has_a_training_config_and_no_other():
    from pathlib import Path

    conf = Path(__file__).resolve().parents[1] / "conf" / "head"
    assert {path.stem for path in conf.glob("*.yaml")} == set(HEAD_TYPES)


def test_heads_saved_with_the_shared_eagle_config_still_load():
    """Heads written when EAGLE-1 and EAGLE-3 shared one config carry its keys (kind, fc_bias, ...)."""
    model = tiny_target()
    eagle3 = build_head("eagle3", {"kind": "eagle3", "num_layers": 1, "fc_bias": False, "feature_layers": [1, 2, 3],
                                   "draft_vocab_size": 16}, model.config)
    assert eagle3.feature_layers == [1, 2, 3] and eagle3.draft_vocab_size == 16
    eagle = build_head("eagle", {"kind": "eagle", "num_layers": 1, "fc_bias": True, "feature_layers": [],
                                 "draft_vocab_size": 0}, model.config)
    assert eagle.config == EagleConfig()
    with pytest.raises(ValueError, match="kind='eagle3', not 'eagle'"):
        build_head("eagle", {"kind": "eagle3"}, model.config)


def test_eagle3_defaults_and_checks_its_feature_layers():
    model = tiny_target(layers=8)
    assert Eagle3Head(Eagle3Config(), model.config).feature_layers == [2, 4, 5]
    with pytest.raises(ValueError, match=r"feature layers \[8\] are outside the target's layers 0..7"):
        Eagle3Head(Eagle3Config(feature_layers=[0, 1, 8]), model.config)
