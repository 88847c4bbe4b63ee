"""Heads published by others load as they are (heads.formats.load_any_head, --head DIR): checkpoints written here
in each published layout, by code independent of ours, load, compute what their authors' code computes, and decode
token-identically to the target's greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from heads.formats import detect_layout, load_any_head
from runtime.engine.decoder import SpeculativeDecoder
from runtime.proposers import ProposerSpec, build_proposer
from runtime.target.model import target_from_model
from tests.conftest import tiny_model

H, V, HEADS, KV, FFN, LAYERS, THETA, EPS = 32, 64, 4, 2, 64, 8, 100000.0, 1e-6
D = H // HEADS


def target():
    return target_from_model(tiny_model("llama", num_hidden_layers=LAYERS, rope_parameters={
        "rope_type": "default", "rope_theta": THETA}), identity="tiny-published")


def rand(*shape, generator):
    return torch.randn(*shape, generator=generator) * 0.2


def llama_config(**extra):
    """A config.json as the EAGLE authors' and SpecForge's code write it (a Llama config of the draft layer)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": FFN,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1, "rms_norm_eps": EPS,
            "rope_theta": THETA, "hidden_act": "silu", "vocab_size": V, "max_position_embeddings": 512,
            "tie_word_embeddings": False, "torch_dtype": "float32", **extra}


def layer_tensors(prefix, in_width, generator, input_norm=True):
    tensors = {f"{prefix}self_attn.q_proj.weight": rand(HEADS * D, in_width, generator=generator),
               f"{prefix}self_attn.k_proj.weight": rand(KV * D, in_width, generator=generator),
               f"{prefix}self_attn.v_proj.weight": rand(KV * D, in_width, generator=generator),
               f"{prefix}self_attn.o_proj.weight": rand(H, HEADS * D, generator=generator),
               f"{prefix}mlp.gate_proj.weight": rand(FFN, H, generator=generator),
               f"{prefix}mlp.up_proj.weight": rand(FFN, H, generator=generator),
               f"{prefix}mlp.down_proj.weight": rand(H, FFN, generator=generator),
               f"{prefix}post_attention_layernorm.weight": 1 + rand(H, generator=generator)}
    if input_norm:
        tensors[f"{prefix}input_layernorm.weight"] = 1 + rand(H, generator=generator)
    return tensors


DRAFT_IDS = torch.arange(0, V, 4)  # a draft vocabulary of 16 target tokens


def write_eagle3(directory, layout, seed=0, **config_extra):
    """``authors``: the EAGLE authors' EAGLE-3 (pytorch_model.bin, an embedding copy, no layer ids); ``specforge``:
    SpecForge's output (model.safetensors, layer ids in eagle_config, SGLang's convention)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": rand(H, 3 * H, generator=generator), "norm.weight": 1 + rand(H, generator=generator),
               "lm_head.weight": rand(len(DRAFT_IDS), H, generator=generator),
               "d2t": DRAFT_IDS - torch.arange(len(DRAFT_IDS)), "t2d": torch.isin(torch.arange(V), DRAFT_IDS),
               "midlayer.hidden_norm.weight": 1 + rand(H, generator=generator),
               **layer_tensors("midlayer.", 2 * H, generator)}
    config = llama_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(DRAFT_IDS), **config_extra)
    directory.mkdir(parents=True)
    if layout == "authors":
        tensors["embed_tokens.weight"] = rand(V, H, generator=generator)
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}
        save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def write_eagle1(directory, seed=0):
    """The EAGLE authors' EAGLE-1: fc with bias, layer 0 without an input norm, the embedding in the state."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"embed_tokens.weight": rand(V, H, generator=generator), "fc.weight": rand(H, 2 * H, generator=generator),
               "fc.bias": rand(H, generator=generator), **layer_tensors("layers.0.", H, generator, input_norm=False)}
    directory.mkdir(parents=True)
    torch.save(tensors, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps(llama_config(bias=True)))
    return tensors


def write_medusa(directory, seed=0, heads=2, layers=1, stated_heads=None):
    """FasterDecoding Medusa: medusa_lm_head.pt, ModuleList of Sequential(ResBlock..., Linear(H, V))."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for h in range(heads):
        for layer in range(layers):
            tensors[f"{h}.{layer}.linear.weight"] = rand(H, H, generator=generator)
            tensors[f"{h}.{layer}.linear.bias"] = rand(H, generator=generator)
        tensors[f"{h}.{layers}.weight"] = rand(V, H, generator=generator)
    directory.mkdir(parents=True)
    torch.save(tensors, directory / "medusa_lm_head.pt")
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": stated_heads or heads,
                                                       "medusa_num_layers": layers,
                                                       "base_model_name_or_path": "tiny"}))
    return tensors


# --- what the authors' code computes, written out here independently of heads/ ---

def rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotate(x, positions, theta=THETA):
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    angles = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + half * sin


def reference_eagle3_logits(t, ids, features, embed):
    """One causal pass of the EAGLE-3 draft layer (SafeAILab cnets.py) over rows (token, fused features)."""
    g = features @ t["fc.weight"].T
    x = torch.cat([rms(embed[ids], t["midlayer.input_layernorm.weight"]), rms(g, t["midlayer.hidden_norm.weight"])], -1)
    n = ids.shape[0]
    positions = torch.arange(n)
    q = rotate((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, D).transpose(0, 1), positions)
    k = rotate((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV, D).transpose(0, 1), positions)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV, D).transpose(0, 1)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = (q @ k.transpose(1, 2)) / D ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, H) @ t["midlayer.self_attn.o_proj.weight"].T
    h = g + attended
    m = rms(h, t["midlayer.post_attention_layernorm.weight"])
    h = h + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t[
        "midlayer.mlp.down_proj.weight"].T
    return rms(h, t["norm.weight"]) @ t["lm_head.weight"].T


@pytest.mark.parametrize("layout, layers", [("authors", [2, 4, 5]), ("specforge", [1, 3, 6])])
def test_published_eagle3_heads_load_and_compute_what_their_authors_code_computes(layout, layers, tmp_path):
    tiny = target()
    tensors = write_eagle3(tmp_path / layout, layout)
    detected = detect_layout(tmp_path / layout)
    assert (detected.layout, detected.head_type) == ("eagle3", "eagle3")
    head, config = load_any_head(tmp_path / layout, tiny.model)
    assert config["layout"] == "eagle3" and head.feature_layers == layers  # SpecForge's ids are SGLang's: + 1
    assert torch.equal(head.draft_to_target, DRAFT_IDS)
    generator = torch.Generator().manual_seed(3)
    ids, features = torch.randint(0, V, (6,), generator=generator), torch.randn(6, 3 * H, generator=generator)
    with torch.no_grad():
        ours = head(ids[None], features[None], torch.arange(6)[None])[1][0]
    expected = reference_eagle3_logits(tensors, ids, features, tiny.model.get_input_embeddings().weight.detach())
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_published_eagle1_and_medusa_heads_load_with_their_weights_in_place(tmp_path):
    tiny = target()
    tensors = write_eagle1(tmp_path / "eagle1")
    detected = detect_layout(tmp_path / "eagle1")
    assert (detected.layout, detected.head_type) == ("eagle", "eagle")
    head, _ = load_any_head(tmp_path / "eagle1", tiny.model)
    state = head.state_dict()
    assert head.config.fc_bias and set(state) == set(tensors) - {"embed_tokens.weight"}
    assert all(torch.equal(state[name], tensors[name]) for name in state)

    tensors = write_medusa(tmp_path / "medusa", heads=3, layers=1, stated_heads=2)
    with pytest.warns(UserWarning, match="states 2 heads with 1 blocks, the weights hold 3"):
        heads, _ = load_any_head(tmp_path / "medusa", tiny.model)
    hidden = torch.randn(5, H)
    with torch.no_grad():
        ours = heads(hidden)
    for h in range(3):
        x = hidden + F.silu(hidden @ tensors[f"{h}.0.linear.weight"].T + tensors[f"{h}.0.linear.bias"])
        torch.testing.assert_close(ours[h], x @ tensors[f"{h}.1.weight"].T, rtol=1e-5, atol=1e-6)


def test_medusa_heads_with_the_targets_lm_head_load_as_shared(tmp_path):
    tiny = target()
    tensors = write_medusa(tmp_path / "medusa")
    lm_head = tiny.model.get_output_embeddings().weight.detach()
    for h in range(2):
        tensors[f"{h}.1.weight"] = lm_head.clone()
    torch.save(tensors, tmp_path / "medusa" / "medusa_lm_head.pt")
    heads, _ = load_any_head(tmp_path / "medusa", tiny.model)
    assert heads.config.shared_lm_head


def hf_greedy(model, prompt, new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_imported_heads_decode_token_identically_to_greedy(tmp_path):
    tiny = target()
    write_eagle3(tmp_path / "eagle3", "specforge")
    write_eagle1(tmp_path / "eagle")
    write_medusa(tmp_path / "medusa")
    prompts = [[5, 6, 7], list(range(10, 30))]
    expected = [hf_greedy(tiny.model, prompt, 24) for prompt in prompts]
    for kind in ("eagle3", "eagle", "medusa"):
        proposer = build_proposer(ProposerSpec(kind, head=str(tmp_path / kind)), tiny)
        for lookup_first in (False, True):
            if lookup_first:
                proposer = build_proposer(ProposerSpec(kind, head=str(tmp_path / kind), lookup_first=True), tiny)
            decoder = SpeculativeDecoder(tiny, proposer, tree_size=6)
            for prompt, want in zip(prompts, expected):
                assert decoder.generate(torch.tensor(prompt), 24).tokens == want, (kind, lookup_first, prompt)


def test_what_does_not_load_says_why(tmp_path):
    tiny = target()
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no head layout known here \(found: notes.txt\). Looked for: headstart"):
        load_any_head(tmp_path / "nothing", tiny.model)
    with pytest.raises(ValueError, match="holds a medusa head, not eagle3"):
        write_medusa(tmp_path / "m")
        build_proposer(ProposerSpec("eagle3", head=str(tmp_path / "m")), tiny)
    write_eagle3(tmp_path / "wide", "authors", hidden_size=48)
    with pytest.raises(ValueError, match=r"does not fit this target: hidden_size 48 \(this target: 32\)"):
        load_any_head(tmp_path / "wide", tiny.model)
    write_eagle3(tmp_path / "theta", "authors")
    config = json.loads((tmp_path / "theta" / "config.json").read_text())
    del config["rope_theta"]  # the authors' code then uses 10000
    (tmp_path / "theta" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_theta 10000.0 \(this target: 100000.0\)"):
        load_any_head(tmp_path / "theta", tiny.model)
    write_eagle3(tmp_path / "qwen", "authors")
    state = torch.load(tmp_path / "qwen" / "pytorch_model.bin", weights_only=True)
    state["midlayer.self_attn.q_proj.bias"] = torch.zeros(H)
    torch.save(state, tmp_path / "qwen" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="weights of a non-Llama layer"):
        load_any_head(tmp_path / "qwen", tiny.model)
    write_medusa(tmp_path / "pickle")
    torch.save({"0.0.linear.weight": torch.zeros(H, H), "code": print}, tmp_path / "pickle" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="weights_only=True"):
        load_any_head(tmp_path / "pickle", tiny.model)
