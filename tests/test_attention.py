"""Every tree-attention backend available here gives the same result as SDPA."""

import pytest
import torch

from runtime.target.attention import (attention_with_lse, available_backends, cascade_attention, merge_attention,
                                      reference_prefix_attention, tree_attention)
from runtime.target.model import target_from_model
from runtime.engine.tree import Tree, verification_mask
from tests.conftest import tiny_model


def random_case(seed=0, batch=2, heads=6, kv_heads=2, prefix=11, nodes=7, dim=8, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, nodes, dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=generator).to(dtype)
    tree = Tree(torch.zeros(nodes, dtype=torch.long), torch.tensor([-1, 0, 0, 1, 1, 2, 5]))
    mask = verification_mask(tree.ancestor_mask(), prefix).expand(batch, 1, nodes, prefix + nodes)
    return q, k, v, mask, prefix


@pytest.mark.parametrize("backend", available_backends(torch.device("cpu")))
def test_backend_matches_sdpa_on_raw_tensors(backend):
    q, k, v, mask, prefix = random_case()
    expected = tree_attention(q, k, v, mask, 0.3, "sdpa")
    got = tree_attention(q, k, v, mask, 0.3, backend, prefix_len=prefix)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_reference_kernel_matches_sdpa_and_merge_is_exact():
    q, k, v, mask, prefix = random_case(seed=1)
    out, lse = attention_with_lse(q, k, v, mask, 0.5)
    torch.testing.assert_close(out, tree_attention(q, k, v, mask, 0.5), atol=1e-5, rtol=1e-5)
    # split the keys anywhere: merging the two halves by log-sum-exp gives the whole
    a = attention_with_lse(q, k[:, :, :5], v[:, :, :5], mask[..., :5], 0.5)
    b = attention_with_lse(q, k[:, :, 5:], v[:, :, 5:], mask[..., 5:], 0.5)
    merged, merged_lse = merge_attention(*a, *b)
    torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_attends_in_query_chunks_with_the_same_result(softcap):
    """A budget of a few scores splits the query rows into chunks (the memory bound of a long soft-capped or
    windowed prefill); every row, lse and the zero output of a row that sees nothing come out as in one piece."""
    q, k, v, mask, _ = random_case(seed=4)
    mask = mask.clone()
    mask[1, :, 3] = False  # a row that may attend to nothing
    whole = attention_with_lse(q, k, v, mask, 0.5, softcap)
    for budget in (1, 2 * 6 * 18 * 3):  # one row at a time; three rows a chunk (batch 2, 6 heads, 18 keys)
        chunked = attention_with_lse(q, k, v, mask, 0.5, softcap, max_scores=budget)
        torch.testing.assert_close(chunked[0], whole[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(chunked[1], whole[1], atol=1e-6, rtol=1e-6)
    assert torch.equal(whole[0][1, :, 3], torch.zeros_like(whole[0][1, :, 3])) and whole[1][1, :, 3].isinf().all()
    # a mask broadcast over the rows, and none
    for shared in (mask[:, :, :1], None):
        torch.testing.assert_close(attention_with_lse(q, k, v, shared, 0.5, softcap, max_scores=1),
                                   attention_with_lse(q, k, v, shared, 0.5, softcap), atol=1e-6, rtol=1e-6)


def test_cascade_with_explicit_reference_prefix_kernel():
    q, k, v, mask, prefix = random_case(seed=2)
    got = cascade_attention(q, k, v, mask, 0.25, prefix, prefix_kernel=reference_prefix_attention)
    torch.testing.assert_close(got, tree_attention(q, k, v, mask, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", available_backends(torch.device("cpu")))
def test_backend_gives_the_same_logits_through_the_model(backend, arch):
    target = target_from_model(tiny_model(arch, vocab_size=64), identity="tiny")
    prompt = torch.arange(3, 20)[None]
    tree = Tree(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([-1, 0, 0, 1, 3]))
    results = {}
    for name in ("sdpa", backend):
        cache = target.new_cache(1, 64)
        target.forward(prompt, torch.arange(prompt.shape[1])[None], cache, None)
        cache.commit(prompt.shape[1])
        mask = verification_mask(tree.ancestor_mask(), prompt.shape[1])
        results[name] = target.forward(tree.tokens[None], tree.position_ids(prompt.shape[1])[None], cache, mask,
                                       backend=name, prefix_len=prompt.shape[1]).logits
    torch.testing.assert_close(results[backend], results["sdpa"], atol=1e-5, rtol=1e-5)


def counted_decode_kernel(monkeypatch) -> list[int]:
    """The compiled decode attention kernel, each call appending to the returned list (skips where it is not)."""
    from runtime.target import attention

    kernel = attention.decode_attention()
    if kernel is None:
        pytest.skip("the decode attention kernel needs AVX2")
    calls: list[int] = []
    monkeypatch.setattr(attention, "decode_attention", lambda: lambda *args: calls.append(1) or kernel(*args))
    return calls


def test_bf16_tree_pass_through_the_decode_kernel_matches_the_fp32_pass(monkeypatch):
    """In bf16 on CPU the sdpa backend sends tree passes through the compiled decode kernel (head size 64)."""
    calls = counted_decode_kernel(monkeypatch)
    model = tiny_model("llama", vocab_size=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prompt = torch.arange(3, 30)
    tree = Tree(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([-1, 0, 0, 1, 3]))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = target_from_model(model.to(dtype), identity="tiny")
        cache = target.new_cache(1, 64)
        target.forward(prompt[None], torch.arange(len(prompt))[None], cache, None)
        cache.commit(len(prompt))
        logits[dtype] = target.forward(tree.tokens[None], tree.position_ids(len(prompt))[None], cache,
                                       verification_mask(tree.ancestor_mask(), len(prompt))).logits[0].float()
    assert len(calls) == model.config.num_hidden_layers  # the bf16 tree pass; the prefill stays on SDPA
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=0.1, rtol=0.05)
    assert torch.equal(logits[torch.bfloat16].argmax(-1), logits[torch.float32].argmax(-1))


def test_tree_pass_reproduces_per_path_logits():
    """The logits at each tree node equal a plain causal pass over that node's root path."""
    model = tiny_model("llama", vocab_size=64)
    target = target_from_model(model, identity="tiny")
    prompt = torch.arange(3, 15)
    tree = Tree(torch.tensor([7, 8, 9, 10, 11, 12]), torch.tensor([-1, 0, 0, 1, 3, 2]))
    cache = target.new_cache(1, 64)
    target.forward(prompt[None], torch.arange(12)[None], cache, None)
    cache.commit(12)
    logits = target.forward(tree.tokens[None], tree.position_ids(12)[None], cache,
                            verification_mask(tree.ancestor_mask(), 12)).logits[0]
    for path in tree.paths():
        sequence = torch.cat([prompt, tree.tokens[path]])
        fresh = target.new_cache(1, 64)
        plain = target.forward(sequence[None], torch.arange(len(sequence))[None], fresh, None).logits[0, 12:]
        torch.testing.assert_close(logits[path], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_backends_match_sdpa(dtype):
    q, k, v, mask, prefix = (t.cuda() if isinstance(t, torch.Tensor) else t
                             for t in random_case(seed=3, heads=8, kv_heads=2, prefix=300, nodes=7, dim=64,
                                                  dtype=dtype))
    expected = tree_attention(q, k, v, mask, 0.125, "sdpa")
    for backend in available_backends(q.device):
        got = tree_attention(q, k, v, mask, 0.125, backend, prefix_len=prefix)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)



def bf16_eagle3_head():
    """(a tiny llama target of head size 64, a bf16 EAGLE-3 head on it with stock SDPA attention)."""
    from heads.common import frozen_target_weights
    from heads.eagle3 import Eagle3Config, Eagle3Head

    model = tiny_model("llama", vocab_size=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(feature_layers=[0, 1, 1]), model.config)
    head.attach_target_weights(*frozen_target_weights(model))
    return model, head.eval().bfloat16()


def test_a_head_under_tree_attention_drafts_through_the_decode_kernel_as_under_sdpa(monkeypatch):
    """``use_tree_attention`` points a runtime-owned head's layers at the tree attention: in bf16 its batched
    drafting passes take the decode kernel, with SDPA's outputs; the stock head, and the target, stay on SDPA."""
    import copy

    from runtime.target import attention
    from runtime.engine.kv_cache import KVCache

    calls = counted_decode_kernel(monkeypatch)
    model, head = bf16_eagle3_head()
    tree_head = attention.use_tree_attention(copy.deepcopy(head))
    assert head.layer_config._attn_implementation == "sdpa" and model.config._attn_implementation != "headstart_tree"
    batch, context, new = 3, 20, 4
    features = torch.randn(batch, context + new, head.feature_size, dtype=torch.bfloat16)
    tokens = torch.randint(0, 64, (batch, context + new))
    positions = torch.arange(context + new).repeat(batch, 1)
    mask = torch.ones(batch, 1, new, context + new, dtype=torch.bool)
    mask[:, 0, :, context:] = torch.rand(batch, new, new) > 0.5  # tree rows: any pattern with each row's own slot
    mask[:, 0, torch.arange(new), context + torch.arange(new)] = True
    out = {}
    with torch.inference_mode():
        for name, drafter in (("sdpa", head), ("tree", tree_head)):
            cache = KVCache(1, batch, 1, 64, context + new, torch.bfloat16, "cpu")
            drafter.hidden_states(tokens[:, :context], features[:, :context], positions[:, :context], None, cache)
            cache.commit(context)
            out[name] = drafter.hidden_states(tokens[:, context:], features[:, context:], positions[:, context:],
                                              mask, cache).float()
    assert calls == [1]  # the tree head's 4-row pass; its 20-row prefill and the stock head stay on SDPA
    torch.testing.assert_close(out["tree"], out["sdpa"], atol=0.05, rtol=0.05)


def test_a_stock_head_reads_packed_rows_through_the_decode_kernel_for_that_pass_alone(monkeypatch):
    """``tree_attention_for`` switches a head the runtime did not load to the tree attention for one pass: in bf16
    its packed rows (different counts of new rows per row, ``runtime.engine.ragged``) go through the decode kernel at
    once and give each row what its own pass gives under SDPA; the head's setting comes back afterwards, and a module
    whose layers have no config to switch is refused."""
    from runtime.target import attention
    from runtime.engine.kv_cache import KVCache
    from runtime.engine.ragged import RaggedRows

    calls = counted_decode_kernel(monkeypatch)
    model, head = bf16_eagle3_head()
    done, counts = [7, 12, 3], [4, 1, 3]  # rows already cached, new rows per row
    width = max(counts)
    tokens = [torch.randint(0, 64, (d + c,)) for d, c in zip(done, counts)]
    features = [torch.randn(d + c, head.feature_size, dtype=torch.bfloat16) for d, c in zip(done, counts)]
    alone, cached = [], KVCache(1, 3, 1, 64, max(done) + width, torch.bfloat16, "cpu")
    with torch.inference_mode():
        for b, (d, c) in enumerate(zip(done, counts)):
            cache = KVCache(1, 1, 1, 64, d + c, torch.bfloat16, "cpu")
            positions = torch.arange(d + c)[None]
            hidden = head.hidden_states(tokens[b][None], features[b][None], positions, None, cache)
            alone.append(hidden[0, d:].float())
            cached.kv[:, :, b, :, :d] = cache.kv[:, :, 0, :, :d]
        cached.commit(torch.tensor(done))
        mask = torch.zeros(3, 1, width, max(done) + width, dtype=torch.bool)
        new = torch.arange(width)
        for b, d in enumerate(done):
            mask[b, 0, :, :d] = True
            mask[b, 0, :, d:d + width] = new[None, :] <= new[:, None]
        positions = torch.cat([torch.arange(d, d + c) for d, c in zip(done, counts)])
        ragged = RaggedRows.from_counts(counts, positions)
        with attention.tree_attention_for(head), cached.packed(ragged):
            packed = head.hidden_states(torch.cat([t[d:] for t, d in zip(tokens, done)])[None],
                                        torch.cat([f[d:] for f, d in zip(features, done)])[None], positions[None],
                                        mask, cached, ragged=ragged)
    assert calls == [1]  # one kernel call for the three rows' packed tokens
    assert head.layer_config._attn_implementation == "sdpa"
    torch.testing.assert_close(packed[0].float(), torch.cat(alone), atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="no layer whose config"):
        with attention.tree_attention_for(torch.nn.Linear(2, 2)):
            pass
