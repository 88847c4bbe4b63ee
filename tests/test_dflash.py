"""DFlash heads: the block mask, anchors and row weights on hand-built cases; the drafter's KV injection against a
hand-written reference over a checkpoint in the published layout written here independently; training blocks equal
decoding's single blocks; export and import round trips (the DFlash layout, llama.cpp's GGUF)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from heads.common import frozen_target_weights
from heads.dflash import ContextKV, DFlashConfig, DFlashHead, default_feature_layers, dflash_layer_ids
from heads.export import export_head
from heads.formats import detect_layout, export_files, load_any_head
from runtime.engine.sampling import SamplingParams
from runtime.proposers.base import ProposeInput
from runtime.proposers.dflash import DFlashProposer, block_tree
from tests.test_import_published import D, EPS, FFN, HEADS, KV, LAYERS, H, V, rand, rotate, target
from training.objectives.dflash import (block_mask, block_positions, blocks_hidden, dflash_matches, reply_anchors,
                                        row_weights, sample_anchors)

BLOCK = 4


def test_block_mask_keeps_blocks_apart_and_sees_the_context_before_each_anchor():
    mask = block_mask(torch.tensor([[2, 4]]), context_length=6, block_size=2)[0, 0]
    expected = torch.zeros(4, 10, dtype=torch.bool)
    expected[0:2, 0:2] = True  # block at anchor 2: context 0, 1
    expected[0:2, 6:8] = True  # and its own two rows, both ways
    expected[2:4, 0:4] = True  # block at anchor 4: context 0 .. 3
    expected[2:4, 8:10] = True
    assert torch.equal(mask, expected)
    assert block_positions(torch.tensor([[2, 4]]), 2).tolist() == [[2, 3, 4, 5]]


def test_anchors_are_drawn_among_candidates_and_rows_weigh_by_distance():
    candidates = torch.zeros(2, 12, dtype=torch.bool)
    candidates[0, [3, 5, 6, 9, 10]] = True
    candidates[1, [2, 7]] = True
    anchors, keep = sample_anchors(candidates, 3, torch.Generator().manual_seed(0))
    assert keep.tolist() == [[True] * 3, [True, True, False]]
    assert anchors[1, :2].tolist() == [2, 7]
    assert set(anchors[0].tolist()) <= {3, 5, 6, 9, 10} and anchors[0].tolist() == sorted(anchors[0].tolist())
    draws = {tuple(sample_anchors(candidates, 3, torch.Generator().manual_seed(seed))[0][0].tolist())
             for seed in range(8)}
    assert len(draws) > 1  # resampled with the step's seed
    assert row_weights(4, 7.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])
    assert row_weights(3, 0.0).tolist() == [0.0, 1.0, 1.0]
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the published Qwen3-8B drafters' ids
    assert default_feature_layers(36, 5) == [2, 10, 18, 26, 34]


# --- a checkpoint in the DFlash layout, written here independently of heads/, and what the authors' code computes

MASK_ID, LAYER_IDS = 7, [1, 4, 5]  # DFlash ids (outputs of layers 1, 4, 5): our feature layers 2, 5, 6


def write_dflash(directory, seed=0, layers=2, with_mask_file=False):
    generator = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": rand(H, len(LAYER_IDS) * H, generator=generator),
               "hidden_norm.weight": 1 + rand(H, generator=generator), "norm.weight": 1 + rand(H, generator=generator)}
    for i in range(layers):
        p = f"layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rand(HEADS * D, H, generator=generator),
                        p + "self_attn.k_proj.weight": rand(KV * D, H, generator=generator),
                        p + "self_attn.v_proj.weight": rand(KV * D, H, generator=generator),
                        p + "self_attn.o_proj.weight": rand(H, HEADS * D, generator=generator),
                        p + "self_attn.q_norm.weight": 1 + rand(D, generator=generator),
                        p + "self_attn.k_norm.weight": 1 + rand(D, generator=generator),
                        p + "input_layernorm.weight": 1 + rand(H, generator=generator),
                        p + "post_attention_layernorm.weight": 1 + rand(H, generator=generator),
                        p + "mlp.gate_proj.weight": rand(FFN, H, generator=generator),
                        p + "mlp.up_proj.weight": rand(FFN, H, generator=generator),
                        p + "mlp.down_proj.weight": rand(H, FFN, generator=generator)})
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": FFN,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D, "num_hidden_layers": layers,
              "rms_norm_eps": EPS, "rope_theta": 100000.0, "hidden_act": "silu", "vocab_size": V,
              "max_position_embeddings": 512, "tie_word_embeddings": False, "block_size": BLOCK,
              "num_target_layers": LAYERS, "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS}}
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    mask = None
    if with_mask_file:
        mask = rand(H, generator=generator)
        torch.save({"mask_token_id": MASK_ID, "embedding": mask}, directory / "mask_embedding.pt")
    return tensors, mask


def rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def reference_block(t, layers, features, root, mask_embedding, embed):
    """The DFlash drafter (the authors' dflash.py) over one block after a context: features [S, K*H] of positions
    0 .. S-1, the block [root, MASK x (B-1)] at positions S .. S+B-1 -> normed hidden [B, H]."""
    context = rms(features @ t["fc.weight"].T, t["hidden_norm.weight"])
    s = context.shape[0]
    x = torch.cat([embed[root][None], mask_embedding[None].expand(BLOCK - 1, -1)])
    context_positions, block_positions_ = torch.arange(s), torch.arange(s, s + BLOCK)
    for i in range(layers):
        p = f"layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = rms((h @ t[p + "self_attn.q_proj.weight"].T).view(BLOCK, HEADS, D), t[p + "self_attn.q_norm.weight"])
        keys = []
        for source, positions in ((context, context_positions), (h, block_positions_)):  # context first, no norm
            k = rms((source @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV, D), t[p + "self_attn.k_norm.weight"])
            keys.append(rotate(k.transpose(0, 1), positions))
        k = torch.cat(keys, 1)
        v = torch.cat([(source @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV, D).transpose(0, 1)
                       for source in (context, h)], 1)
        q = rotate(q.transpose(0, 1), block_positions_)
        k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
        attended = ((q @ k.transpose(1, 2)) / D ** 0.5).softmax(-1) @ v  # bidirectional: no mask
        x = x + attended.transpose(0, 1).reshape(BLOCK, H) @ t[p + "self_attn.o_proj.weight"].T
        m = rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[
            p + "mlp.down_proj.weight"].T
    return rms(x, t["norm.weight"])


@pytest.mark.parametrize("with_mask_file", [False, True])
def test_published_dflash_heads_inject_the_context_as_their_authors_code_does(tmp_path, with_mask_file):
    t = target()
    tensors, mask = write_dflash(tmp_path / "published", with_mask_file=with_mask_file)
    assert detect_layout(tmp_path / "published").layout == "dflash"
    head, _ = load_any_head(tmp_path / "published", t.model)
    embed, lm_head = frozen_target_weights(t.model)
    assert head.feature_layers == [i + 1 for i in LAYER_IDS] and head.block_size == BLOCK
    # without a mask file the mask rows embed as the target's row of the mask id (the authors' and SGLang's way)
    torch.testing.assert_close(head.mask_row(), mask if with_mask_file else embed[MASK_ID])
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(9, len(LAYER_IDS) * H, generator=generator)
    expected = reference_block(tensors, 2, features, 11, head.mask_row(), embed)
    # the training path: ContextKV over the context's projected keys and values
    context = head.context(features[None])
    kv = ContextKV(head.context_kv(context, torch.arange(9)[None]))
    got = head.block_hidden(head.block_embeddings(torch.tensor([[11]]), torch.float32),
                            torch.arange(9, 9 + BLOCK)[None], torch.ones(1, 1, BLOCK, 9 + BLOCK, dtype=torch.bool), kv)
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=1e-4)
    # the runtime path: the proposer's cache of the verified context, then one block pass
    proposer = DFlashProposer(head, t, top_k=1)
    state = proposer.start(torch.zeros(10, dtype=torch.long), 64)
    history = torch.cat([torch.randint(0, V, (9,), generator=generator), torch.tensor([11])])
    step = ProposeInput(history, torch.zeros(9, H), tuple(features.split(H, dim=-1)), BLOCK,
                        SamplingParams(temperature=0.0), None)
    tree = proposer.propose(state, step)
    want = (expected[1:] @ lm_head.T).argmax(-1)
    assert tree.tokens.tolist() == [11, *want.tolist()] and state.cache.max_committed == 9


def test_training_blocks_are_decodings_single_blocks(tmp_path):
    """All blocks of a batch in one pass (the block mask) give each block what drafting it alone after the context
    strictly before its anchor gives."""
    t = target()
    write_dflash(tmp_path / "published")
    head, _ = load_any_head(tmp_path / "published", t.model)
    generator = torch.Generator().manual_seed(2)
    length = 14
    ids = torch.randint(0, V, (2, length), generator=generator)
    features = torch.randn(2, length, len(LAYER_IDS) * H, generator=generator)
    anchors = torch.tensor([[3, 7, 12], [1, 5, 9]])
    hidden = blocks_hidden(head, {"input_ids": ids, "layer_hidden": features}, anchors)
    for b in range(2):
        for n, anchor in enumerate(anchors[b].tolist()):
            context = head.context(features[b: b + 1, :anchor])
            kv = ContextKV(head.context_kv(context, torch.arange(anchor)[None]))
            alone = head.block_hidden(head.block_embeddings(ids[b: b + 1, anchor: anchor + 1], torch.float32),
                                      torch.arange(anchor, anchor + BLOCK)[None],
                                      torch.ones(1, 1, BLOCK, anchor + BLOCK, dtype=torch.bool), kv)
            torch.testing.assert_close(hidden[b, n], alone[0], atol=1e-5, rtol=1e-4)


def test_matches_list_the_rows_an_eagle_chain_lists(tmp_path):
    t = target()
    write_dflash(tmp_path / "published")
    head, _ = load_any_head(tmp_path / "published", t.model)
    assistant = torch.zeros(2, 10, dtype=torch.bool)
    assistant[0, 4:] = True
    assistant[1, 2:6] = True
    anchors, keep = reply_anchors(assistant)
    assert anchors[keep].tolist() == [4, 5, 6, 7, 8, 9, 2, 3, 4, 5]
    generator = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(0, V, (2, 10), generator=generator), "assistant_mask": assistant,
             "layer_hidden": torch.randn(2, 10, len(LAYER_IDS) * H, generator=generator),
             "branches": torch.randint(0, V, (2, 10, BLOCK - 1), generator=generator)}
    matches = dflash_matches(head, batch, BLOCK - 1)
    assert matches.shape == (int(assistant[:, 1:].sum()), BLOCK - 1)


def test_block_trees_keep_the_most_probable_rank_paths():
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]]))
    chain = block_tree(9, logprobs, 4, top_k=1)
    assert chain.tokens.tolist() == [9, 0, 0, 0] and chain.parents.tolist() == [-1, 0, 1, 2]
    tree = block_tree(9, logprobs, 5, top_k=2)  # paths 0.6 (0), 0.54 (0, 0), 0.3 (1), 0.27 (0, 0, 0) before (1, 0)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()

    def path(node):
        return [] if node == 0 else path(parents[node]) + [tokens[node]]

    assert sorted(path(node) for node in range(1, tree.size)) == [[0], [0, 0], [0, 0, 0], [1]]


def small_head(t, draft_vocab=0, seed=0):
    torch.manual_seed(seed)
    head = DFlashHead(DFlashConfig(num_layers=1, block_size=BLOCK, num_features=2, draft_vocab_size=draft_vocab),
                      t.config)
    head.attach_target_weights(*frozen_target_weights(t.model))
    if draft_vocab:
        ids = torch.arange(0, V, V // draft_vocab)[:draft_vocab]
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        head.set_draft_vocab(ids - torch.arange(draft_vocab), t2d)
    head.init_mask_embedding()
    return head.eval()


def test_exported_dflash_heads_load_back_and_refuse_what_their_readers_cannot_take(tmp_path):
    t = target()
    head = small_head(t)
    with torch.no_grad():
        head.mask_embedding.weight.add_(1.0)  # a trained mask embedding, no row of the target's
    files = export_files(head, "sglang")
    config = files["config.json"]
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [i - 1 for i in head.feature_layers],
                                       "block_size": BLOCK}
    assert not any(key.startswith(("embed", "lm_head", "mask")) for key in files["model.safetensors"])
    export_head(head, tmp_path / "export", fmt="sglang")
    mask = torch.load(tmp_path / "export" / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == V - 1
    loaded, _ = load_any_head(tmp_path / "export", t.model)
    torch.testing.assert_close(loaded.mask_row(), head.mask_row())
    features = torch.randn(1, 6, 2 * H)
    for module in (head, loaded):
        kv = ContextKV(module.context_kv(module.context(features), torch.arange(6)[None]))
        module.out = module.block_hidden(module.block_embeddings(torch.tensor([[3]]), torch.float32),
                                         torch.arange(6, 6 + BLOCK)[None],
                                         torch.ones(1, 1, BLOCK, 6 + BLOCK, dtype=torch.bool), kv)
    torch.testing.assert_close(loaded.out, head.out)
    reduced = small_head(t, draft_vocab=16)
    with pytest.raises(ValueError, match="draft vocabulary of 16 .*--format gguf"):
        export_files(reduced, "sglang")
    with pytest.raises(ValueError, match="--format sglang"):
        export_files(head, "reference")


def test_dflash_gguf_is_llama_cpps_dflash_draft(tmp_path):
    import gguf

    from heads.export import export_gguf

    t = target()
    head = small_head(t, draft_vocab=16)
    with torch.no_grad():
        head.mask_embedding.weight.add_(1.0)
    fields = {"tokenizer.ggml.model": ("gpt2", [gguf.GGUFValueType.STRING])}
    path = export_gguf(head, tmp_path / "gguf", fields, "float32") / "draft.gguf"
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "dflash"
    assert reader.fields["dflash.target_layers"].contents() == head.feature_layers
    assert reader.fields["dflash.block_size"].contents() == BLOCK
    assert reader.fields["tokenizer.ggml.mask_token_id"].contents() == V - 1
    assert head.gguf_draft_max() == BLOCK - 1  # the serve command's --spec-draft-n-max: the block's drafts
    tensors = {tensor.name: torch.from_numpy(tensor.data.copy()) for tensor in reader.tensors}
    assert {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "output.weight", "token_embd.weight", "d2t",
            "blk.0.attn_q_norm.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight"} <= set(tensors)
    torch.testing.assert_close(tensors["token_embd.weight"][V - 1], head.mask_row())
    torch.testing.assert_close(tensors["token_embd.weight"][:V - 1], head.embed_weight[:V - 1])
    assert tensors["d2t"].tolist() == head.draft_to_target.tolist()  # absolute target ids
    torch.testing.assert_close(tensors["output.weight"], head.lm_head.weight)
    torch.testing.assert_close(tensors["blk.0.attn_q.weight"], head.layers[0].self_attn.q_proj.weight.detach())


def test_what_does_not_load_says_why(tmp_path):
    t = target()
    write_dflash(tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    for name, change, message in (("layers", {"num_target_layers": LAYERS + 2}, "num_target_layers"),
                                  ("mask", {"dflash_config": {"target_layer_ids": LAYER_IDS}}, "mask_token_id"),
                                  ("swa", {"use_sliding_window": True}, "sliding")):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "model.safetensors").write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes())
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_any_head(directory, t.model)
