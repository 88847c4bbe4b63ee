"""Every head type in every export format: what each reader reads is in the files, and the export loads back as the
same head (heads.formats, heads.io.export_head / export_all, scripts/export.py --format)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from heads.common import frozen_target_weights, target_signature
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.formats import detect_layout, export_refusal, load_any_head
from heads.export import EXPORT_MARKER, export_all, export_head
from heads.io import load_head, save_head
from heads.medusa import MedusaConfig, MedusaHeads
from tests.conftest import tiny_model
from tests.script_runs import check_arguments
from tests.test_heads import outputs as draft_logits

LAYERS = 8  # default EAGLE-3 layers (2, 4, 5): distinct, as published heads' are
THETA = 100000.0  # SmolLM2's rope base: not the 10000 legacy readers assume


def target_model(arch="llama"):
    return tiny_model(arch, num_hidden_layers=LAYERS, rope_parameters={"rope_type": "default", "rope_theta": THETA})


def randomized(head, seed=1):
    """Trained-looking weights everywhere (zero-initialised Medusa blocks would hide a lost bias)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return head


def make_head(kind, model):
    if kind.startswith("eagle3"):
        layers = [1, 3, 6] if kind == "eagle3-layers" else []
        head = Eagle3Head(Eagle3Config(layers, draft_vocab_size=16), model.config)
        ids = torch.arange(0, 64, 4)
        t2d = torch.zeros(64, dtype=torch.bool)
        t2d[ids] = True
        head.set_draft_vocab(ids - torch.arange(16), t2d)
        d2t, t2d = head.d2t.clone(), head.t2d.clone()
        randomized(head)
        head.set_draft_vocab(d2t, t2d)
    elif kind.startswith("eagle"):
        head = randomized(EagleHead(EagleConfig(fc_bias=kind != "eagle-nobias"), model.config))
    else:
        head = randomized(MedusaHeads(MedusaConfig(num_heads=3, num_layers=1 if kind == "medusa-one-layer" else 2,
                                                   shared_lm_head=kind != "medusa-own-heads"), model.config))
    head.attach_target_weights(*frozen_target_weights(model))
    return head.eval()


KINDS = ["eagle3", "eagle3-layers", "eagle", "eagle-nobias", "medusa", "medusa-own-heads", "medusa-one-layer"]
FORMATS = ["sglang", "vllm", "reference"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_export_loads_back_as_the_same_head(kind, tmp_path):
    model = target_model()
    head = make_head(kind, model)
    expected = draft_logits(head)
    exported = 0
    for fmt in FORMATS:
        if export_refusal(head.head_type, head.config.__dict__, LAYERS, fmt):
            with pytest.raises(ValueError, match="--format"):
                export_head(head, tmp_path / fmt, fmt=fmt)
            continue
        out = export_head(head, tmp_path / fmt, fmt=fmt)
        assert json.loads((out / EXPORT_MARKER).read_text())["layout"] == fmt
        assert detect_layout(out).head_type == head.head_type
        loaded, config = load_any_head(out, model)
        assert config["format"] == "imported" and config["head_type"] == head.head_type
        torch.testing.assert_close(draft_logits(loaded), expected, rtol=0, atol=0)
        exported += 1
    assert exported >= (1 if kind in ("medusa", "medusa-own-heads") else 2)  # two Medusa layers: vLLM only


def test_the_refused_combinations_say_which_format_to_use():
    assert "SGLang has no Medusa" in export_refusal("medusa", {}, LAYERS, "sglang")
    assert "no bias on fc" in export_refusal("eagle", {"fc_bias": True}, LAYERS, "vllm")
    assert export_refusal("eagle", {"fc_bias": False}, LAYERS, "vllm") is None
    assert "always fuses the inputs of target layers [2, 4, 5]" in export_refusal(
        "eagle3", {"feature_layers": [1, 3, 6]}, LAYERS, "reference")
    assert export_refusal("eagle3", {"feature_layers": [2, 4, 5]}, LAYERS, "reference") is None
    assert "repeats one residual block" in export_refusal("medusa", {"num_layers": 2}, LAYERS, "reference")
    assert export_refusal("medusa", {"num_layers": 1}, LAYERS, "reference") is None
    for fmt in ("sglang", "vllm"):  # the engines fuse in ascending layer order, each layer once
        assert "ascending order" in export_refusal("eagle3", {"feature_layers": [6, 3, 1]}, LAYERS, fmt)
        assert "ascending order" in export_refusal("eagle3", {"feature_layers": [1, 3, 3]}, LAYERS, fmt)
        assert export_refusal("eagle3", {"feature_layers": [1, 3, 6]}, LAYERS, fmt) is None


def config_of(directory):
    return json.loads((directory / "config.json").read_text())


def test_eagle3_configs_carry_rope_theta_and_each_engines_layer_ids(tmp_path):
    model = target_model()
    for kind, layers in (("eagle3", [2, 4, 5]), ("eagle3-layers", [1, 3, 6])):
        head = make_head(kind, model)
        sglang = config_of(export_head(head, tmp_path / kind / "sglang", fmt="sglang"))
        vllm = config_of(export_head(head, tmp_path / kind / "vllm", fmt="vllm"))
        for config in (sglang, vllm):
            assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 16
            assert config["rope_theta"] == THETA and config["rope_parameters"]["rope_theta"] == THETA
            assert config["eagle_aux_hidden_state_layer_ids"] == layers  # vLLM: hidden_states[i]
            assert not config["attention_bias"] and config["hidden_act"] == "silu" and config["vocab_size"] == 64
        nested = sglang["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        # SGLang adds 1; its default is ours, and the default is left to it (economize reads nested ids as vLLM's)
        assert nested == (None if kind == "eagle3" else [0, 2, 5])
        assert "eagle_aux_hidden_state_layer_ids" not in vllm["eagle_config"]
    reference = export_head(make_head("eagle3", model), tmp_path / "reference", fmt="reference")
    config = config_of(reference)
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
    state = torch.load(reference / "pytorch_model.bin", weights_only=True)
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(state)


def test_eagle1_and_medusa_files_are_what_each_engine_loads(tmp_path):
    model = target_model()
    sglang = export_head(make_head("eagle-nobias", model), tmp_path / "e1-sglang", fmt="sglang")
    assert config_of(sglang)["architectures"] == ["LlamaForCausalLMEagle"]
    weights = load_file(str(sglang / "model.safetensors"))
    assert not weights["fc.bias"].any()  # SGLang's fc always has a bias: a zero one keeps the head exact
    vllm = export_head(make_head("eagle-nobias", model), tmp_path / "e1-vllm", fmt="vllm")
    assert config_of(vllm)["architectures"] == ["LlamaForCausalLM"]  # vLLM makes it EagleLlamaForCausalLM
    assert "fc.bias" not in load_file(str(vllm / "model.safetensors"))
    reference = export_head(make_head("eagle", model), tmp_path / "e1-reference", fmt="reference")
    state = torch.load(reference / "pytorch_model.bin", weights_only=True)
    assert config_of(reference)["bias"] is True and "embed_tokens.weight" in state and "fc.bias" in state
    assert "layers.0.input_layernorm.weight" not in state

    medusa = make_head("medusa", model)
    vllm = config_of(export_head(medusa, tmp_path / "m-vllm", fmt="vllm"))
    assert vllm["medusa_fc_bias"] is True and vllm["num_heads"] == 3 and vllm["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="repeats one residual block"):  # two different blocks per head
        export_head(medusa, tmp_path / "m-reference", fmt="reference", base_model="tiny")
    reference = export_head(make_head("medusa-one-layer", model), tmp_path / "m-reference", fmt="reference",
                            base_model="tiny")
    config = config_of(reference)
    assert (config["medusa_num_heads"], config["medusa_num_layers"], config["base_model_name_or_path"]) == (
        3, 1, "tiny")
    state = torch.load(reference / "medusa_lm_head.pt", weights_only=True)
    assert set(state) == {f"{h}.0.linear.{leaf}" for h in range(3) for leaf in ("weight", "bias")} | {
        f"{h}.1.weight" for h in range(3)}
    torch.testing.assert_close(state["1.1.weight"], model.get_output_embeddings().weight)


def test_export_all_writes_one_directory_per_format_that_carries_the_head(tmp_path):
    model = target_model()
    done = export_all(make_head("medusa-one-layer", model), tmp_path / "all")
    assert done["sglang"].startswith("skipped: SGLang has no Medusa")
    assert sorted(path.name for path in (tmp_path / "all").iterdir()) == [EXPORT_MARKER, "reference", "vllm"]
    for fmt in ("vllm", "reference"):
        assert load_any_head(tmp_path / "all" / fmt, model)[0].num_heads == 3
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not an earlier export"):
        export_all(make_head("eagle3", model), tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_heads_for_non_llama_targets_draft_with_a_llama_style_layer(arch, tmp_path):
    if arch == "qwen3":
        from transformers import AutoModelForCausalLM, Qwen3Config

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)).eval()
    else:
        model = target_model(arch)
    for kind in ("eagle3", "eagle"):
        head = make_head(kind, model)
        names = set(head.state_dict())
        assert not any(name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) or "q_norm" in name
                       for name in names)
        assert type(next(m for n, m in head.named_modules() if n in ("midlayer", "layers.0"))).__name__ == (
            "LlamaDecoderLayer")
        out = export_head(head, tmp_path / arch / kind, fmt="sglang")
        torch.testing.assert_close(draft_logits(load_any_head(out, model)[0]), draft_logits(head), rtol=0, atol=0)


def test_a_head_saved_with_the_targets_own_qwen_layer_gets_a_clear_error(tmp_path):
    model = target_model("qwen2")
    head = make_head("eagle3", model)
    directory = save_head(head, tmp_path / "head", target_signature(model))
    config = json.loads((directory / "config.json").read_text())
    assert config["draft_layer"] == "llama"
    assert load_head(directory, model) is not None
    del config["draft_layer"]  # as earlier versions saved it
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="saved by an earlier version with draft layers of the target's own qwen2"):
        load_head(directory, model)


def test_export_script_refuses_a_format_that_cannot_carry_the_head_before_loading(tmp_path):
    model = target_model()
    signature = target_signature(model, "tiny")
    medusa = save_head(make_head("medusa", model), tmp_path / "medusa", signature)
    eagle = save_head(make_head("eagle", model), tmp_path / "eagle", signature)
    eagle3 = save_head(make_head("eagle3-layers", model), tmp_path / "eagle3", signature)
    cases = [([medusa, tmp_path / "o", "--format", "sglang"], "--format: SGLang has no Medusa"),
             ([eagle, tmp_path / "o", "--format", "vllm"], "--format: vLLM's EAGLE-1 drafter has no bias on fc"),
             ([eagle3, tmp_path / "o", "--format", "reference"], "--format: the EAGLE authors' code always fuses"),
             ([medusa, tmp_path / "o", "--format", "gguf"],
              "--format: llama.cpp drafts with EAGLE-3 heads (and DFlash), not medusa heads"),
             ([medusa, tmp_path / "o", "--format", "vllm"], None),
             ([eagle3, tmp_path / "o", "--format", "all"], None),
             ([medusa, tmp_path / "o"], None)]
    for (argv, expected), got in zip(cases, check_arguments([("export", argv) for argv, _ in cases]), strict=True):
        if expected is None:
            assert got["outcome"] == "loads", (argv, got)
        else:
            assert got["outcome"] == "error" and expected in got["message"], (argv, expected, got)
