"""Fixed-shape verification passes (runtime.target.static_pass), which a GPU captures as CUDA graphs: on a CPU the same
passes run eagerly, the CPU twin checked here against the ordinary pass and the target's greedy decoding; the
captured side runs in the GPU-marked test (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.batched import BatchedDecoder
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.ragged import RaggedRows
from runtime.engine.tree import Tree, verification_mask
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.ngram import NgramProposer
from runtime.target.static_pass import BUCKETS, bucket_for, fixed_inputs, write_index
from runtime.target.model import target_from_model
from tests.conftest import tiny_model

VOCAB = 64
PROMPTS = [[5], [1, 2, 3, 1, 2, 3, 1], list(range(10, 40))]
NEW_TOKENS = 24


def test_a_pass_takes_the_smallest_bucket_that_holds_its_rows():
    assert [bucket_for(rows) for rows in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert bucket_for(65) is None
    assert bucket_for(3, (4, 16)) == 4


def test_fixed_inputs_pad_rows_that_see_only_their_own_slot():
    """Two rows of committed lengths 3 and 5 verify a root and its child (3 rows in all with the pad) over a
    buffer of 10 slots: the ordinary mask's columns are slots, each row writes after its own length."""
    ids = torch.tensor([[7, 8], [9, 10]])
    positions = torch.tensor([[3, 4], [5, 6]])
    lengths = torch.tensor([3, 5])
    mask = verification_mask(Tree(torch.tensor([7, 8]), torch.tensor([-1, 0])).ancestor_mask(), 5)  # [1, 1, 2, 7]
    mask = mask.expand(2, -1, -1, -1).clone()
    mask[0, 0, :, 3:5] = False  # row 0 has 3 committed slots: its tree sits at slots 3 and 4
    mask[0, 0, 0, 3] = mask[0, 0, 1, 3] = mask[0, 0, 1, 4] = True
    mask[0, 0, :, 5:] = False
    fixed = fixed_inputs(ids, positions, mask, lengths, committed=5, bucket=4, buffer=10)
    assert fixed.input_ids.tolist() == [[7, 8, 8, 8], [9, 10, 10, 10]]
    assert fixed.position_ids.tolist() == [[3, 4, 4, 4], [5, 6, 6, 6]]
    assert fixed.slots.tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]
    assert fixed.mask.shape == (2, 1, 4, 10)
    assert torch.equal(fixed.mask[:, :, :2, :7], mask) and not fixed.mask[:, :, :2, 7:].any()
    assert fixed.mask[0, 0, 2].nonzero().flatten().tolist() == [5]  # a pad row: its own slot alone
    assert fixed.mask[1, 0, 3].nonzero().flatten().tolist() == [8]
    # slot j holds position j, except the pass's own slots, which hold the rows' positions
    assert fixed.key_positions[0].tolist() == [0, 1, 2, 3, 4, 4, 4, 7, 8, 9]
    assert fixed.key_positions[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 6, 9]


def test_one_row_without_a_mask_sees_every_slot_an_ordinary_pass_returns():
    fixed = fixed_inputs(torch.tensor([[4]]), torch.tensor([[6]]), None, torch.tensor([6]), committed=6, bucket=1,
                         buffer=9)
    assert fixed.mask[0, 0, 0].tolist() == [True] * 7 + [False] * 2


def test_the_write_index_orders_slots_as_key_states_flatten():
    slots = torch.tensor([[3, 4], [5, 6]])
    kv = torch.zeros(2, 3, 10, 1)  # [B, Hkv, S, D]
    keys = torch.arange(1, 13, dtype=torch.float).view(2, 3, 2, 1)  # [B, Hkv, N, D]
    kv.view(-1, 1).index_copy_(0, write_index(slots, 3, 10), keys.reshape(-1, 1))
    for b in range(2):
        assert torch.equal(kv[b, :, slots[b], 0], keys[b, :, :, 0])


def targets(arch: str, **overrides):
    """The same tiny model wrapped twice: the ordinary passes and the fixed-shape ones."""
    model = tiny_model(arch, seed=0, vocab_size=VOCAB, **overrides)
    return target_from_model(model, identity="tiny"), target_from_model(model, identity="tiny", fixed_shapes=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "mistral", "gemma2"])
def test_a_fixed_shape_pass_computes_what_the_ordinary_pass_does(arch):
    """A tree of 5 nodes (bucket 8) over two rows of different committed lengths: logits, hidden states, layer inputs
    and the keys and values written after each row's length agree (sliding windows and soft-capping included)."""
    ordinary, fixed = targets(arch)
    torch.manual_seed(3)
    lengths = [9, 13]
    tree = Tree(torch.randint(0, VOCAB, (5,)), torch.tensor([-1, 0, 0, 1, 3]))
    outputs, caches = [], []
    for target in (ordinary, fixed):
        cache = target.new_cache(2, 40)
        for row, length in enumerate(lengths):
            prompt = torch.arange(length)[None] % VOCAB
            target.forward(prompt, torch.arange(length)[None], cache.rows(row, row + 1), None)
            cache.set_row_length(row, length)
        masks = [verification_mask(tree.ancestor_mask(), length) for length in lengths]
        mask = torch.zeros(2, 1, 5, 13 + 5, dtype=torch.bool)
        for row, length in enumerate(lengths):
            mask[row, :, :, :length] = True
            mask[row, :, :, length:length + 5] = masks[row][0, :, :, length:]
        positions = torch.stack([tree.position_ids(length) for length in lengths])
        outputs.append(target.forward(tree.tokens.expand(2, -1), positions, cache, mask, hidden_layers=(0, 1)))
        caches.append(cache)
    assert fixed._static.passes, "the fixed-shape pass was not taken"
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outputs[1].hidden, outputs[0].hidden, rtol=1e-4, atol=1e-5)
    for got, want in zip(outputs[1].layer_hidden, outputs[0].layer_hidden):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for row, length in enumerate(lengths):
        torch.testing.assert_close(caches[1].kv[:, :, row, :, :length + 5], caches[0].kv[:, :, row, :, :length + 5],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_packed_rows_run_padded_and_come_back_packed(arch):
    """Rows of 5, 2 and 3 tree nodes packed into one pass (``runtime.engine.ragged``), as the batched decoder sends
    rows of different sizes: the fixed-shape pass pads them and returns what the ordinary packed pass does."""
    ordinary, fixed = targets(arch)
    lengths, counts = [9, 13, 4], [5, 2, 3]
    trees = [Tree(torch.arange(1, 1 + count) * (row + 2) % VOCAB, torch.tensor([-1, 0, 0, 1, 3][:count]))
             for row, count in enumerate(counts)]
    width, keys = max(counts), max(lengths) + max(counts)
    mask = torch.zeros(3, 1, width, keys, dtype=torch.bool)
    positions = torch.zeros(3, width, dtype=torch.long)
    key_positions = torch.arange(keys).repeat(3, 1)
    for row, (tree, length, count) in enumerate(zip(trees, lengths, counts)):
        mask[row, 0, :, :length] = True
        mask[row, 0, :count, length:length + count] = tree.ancestor_mask()
        padding = torch.arange(count, width)
        mask[row, 0, padding, length + padding] = True
        positions[row, :count] = tree.position_ids(length)
        positions[row, count:] = length
        key_positions[row, length:length + width] = positions[row]
    real = torch.arange(width)[None] < torch.tensor(counts)[:, None]
    tokens = torch.cat([tree.tokens for tree in trees])[None]
    outputs = []
    for target in (ordinary, fixed):
        cache = target.new_cache(3, 40)
        for row, length in enumerate(lengths):
            target.forward(torch.arange(length)[None] % VOCAB, torch.arange(length)[None], cache.rows(row, row + 1),
                           None)
            cache.set_row_length(row, length)
        ragged = RaggedRows.from_counts(counts, positions[real])
        outputs.append((target.forward(tokens, positions[real][None], cache, mask, hidden_layers=(1,),
                                       key_positions=key_positions, ragged=ragged), cache))
    assert fixed._static.passes, "the fixed-shape pass was not taken"
    (want, want_cache), (got, got_cache) = outputs
    assert got.logits.shape == want.logits.shape == (1, sum(counts), VOCAB)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.layer_hidden[0], want.layer_hidden[0], rtol=1e-4, atol=1e-5)
    for row, (length, count) in enumerate(zip(lengths, counts)):
        torch.testing.assert_close(got_cache.kv[:, :, row, :, :length + count],
                                   want_cache.kv[:, :, row, :, :length + count], rtol=1e-4, atol=1e-5)


def hf_greedy(arch: str, prompt: list[int]) -> list[int]:
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "mistral"])
def test_decoding_through_fixed_shape_passes_is_the_targets_greedy_decoding(arch):
    """Plain decoding, lookup and a draft model's trees at batch 1 and batched: token for token HF greedy, with
    every verification pass of the single-row decoder at a fixed shape, and no more shapes than buckets."""
    _, target = targets(arch)
    draft = target_from_model(tiny_model(arch, seed=1, vocab_size=VOCAB), identity="draft")
    references = [hf_greedy(arch, prompt) for prompt in PROMPTS]
    calls = []
    run = target._static.run
    target._static.run = lambda *args: calls.append(args[0].input_ids.shape) or run(*args)
    for proposer in (None, NgramProposer(), DraftModelProposer(draft, target, "tree", depth=4, top_k=3)):
        decoder = SpeculativeDecoder(target, proposer, tree_size=6, attention="sdpa")
        for prompt, reference in zip(PROMPTS, references):
            calls.clear()
            result = decoder.generate(prompt, NEW_TOKENS)
            assert result.tokens == reference, f"{arch}/{proposer}: output differs"
            assert len(calls) >= result.target_forwards - 1  # every pass but a prefill of several rows
            assert {shape[1] for shape in calls} <= set(BUCKETS)
        calls.clear()
        results = BatchedDecoder(target, proposer, tree_size=6, attention="sdpa").generate(PROMPTS, NEW_TOKENS,
                                                                                          batch_size=3)
        assert [result.tokens for result in results] == references, f"{arch}/{proposer}: a batched row differs"
        assert any(shape[0] == 3 for shape in calls), "the batched passes did not take fixed shapes"
    assert {key[3] for key in target._static.passes} <= set(BUCKETS)


@torch.inference_mode()  # as inside Target.forward: a pass with gradients never takes a fixed shape
def test_a_pass_larger_than_every_bucket_or_past_the_cache_takes_the_ordinary_pass():
    _, fixed = targets("llama")
    cache = fixed.new_cache(1, 70)
    fixed.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, None)
    cache.commit(3)
    static = fixed._static
    tree = Tree.chain(1, list(range(2, 66)))  # 65 rows: no bucket
    mask = verification_mask(tree.ancestor_mask(), 3)
    assert not static.applies(tree.tokens[None], mask, cache, "sdpa", None, 0)
    small = Tree.chain(1, [2, 3])  # bucket 4 fits 3 + 4 <= 70
    assert static.applies(small.tokens[None], verification_mask(small.ancestor_mask(), 3), cache, "sdpa", None, 0)
    assert not static.applies(small.tokens[None], verification_mask(small.ancestor_mask(), 3), cache, "flex", None,
                              0)
    cache.commit(64)  # 67 committed: a bucket of 4 would write past slot 69
    assert not static.applies(small.tokens[None], verification_mask(small.ancestor_mask(), 67), cache, "sdpa", None,
                              0)


def test_a_target_whose_rotary_rescales_with_each_pass_is_refused_fixed_shapes():
    model = tiny_model("llama", seed=0, vocab_size=VOCAB, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                     "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rescales"):
        target_from_model(model, fixed_shapes=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_decode_the_targets_greedy_output(dtype):
    """On a GPU every fixed-shape pass is a captured CUDA graph, replayed: the output is the eager passes'."""
    model = tiny_model("llama", seed=0, vocab_size=VOCAB).to("cuda", dtype)
    eager = target_from_model(model, identity="tiny")
    graphed = target_from_model(model, identity="tiny", fixed_shapes=True)
    draft = target_from_model(tiny_model("llama", seed=1, vocab_size=VOCAB).to("cuda", dtype), identity="draft")
    for proposer in (None, NgramProposer(), DraftModelProposer(draft, graphed, "tree", depth=4, top_k=3)):
        for prompt in PROMPTS:
            want = SpeculativeDecoder(eager, proposer, tree_size=6, attention="sdpa").generate(prompt, NEW_TOKENS)
            got = SpeculativeDecoder(graphed, proposer, tree_size=6, attention="sdpa").generate(prompt, NEW_TOKENS)
            assert got.tokens == want.tokens
    assert graphed._static.passes and all(found.graph is not None for found in graphed._static.passes.values())
