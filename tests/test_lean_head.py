"""Drafting through the lean pass's kernels (runtime.proposers.lean_head) computes what the heads' own modules compute
with the same products: for EAGLE-3 hidden states, logits and the head's cache, for a verified run of rows and for a
tree's frontier (through the compiled layer stack); for DFlash the context's keys and values and a block's hidden
states, cache entries and logits; and decoding with either is the target's greedy decoding."""

from __future__ import annotations

import pytest
import torch

from heads.common import frozen_target_weights
from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from runtime.engine.batched import BatchedDecoder
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.kv_cache import KVCache
from runtime.proposers.dflash import DFlashProposer
from runtime.proposers.eagle import EagleProposer, causal_rows_mask
from runtime.proposers.lean_head import LeanDFlash, LeanEagle3
from runtime.target.attention import use_tree_attention
from runtime.target.decode_layers import PackedWeights, decode_layer_classes
from runtime.target.linear_plan import LinearPlan
from tests.test_lean import FORMS_HERE, lean_target

pytestmark = pytest.mark.skipif(not FORMS_HERE, reason="the lean pass's bf16 kernels do not run on this CPU")


@pytest.fixture(params=FORMS_HERE or [None])
def form(request) -> str:
    """Each lean form that runs here, in turn (the drafters compute with the target's lean products)."""
    return request.param


def bf16_head(target, form: str, seed: int = 0) -> Eagle3Head:
    """A random EAGLE-3 head for the tiny lean target, in bf16, its modules switched to the decode layers with every
    product ``form``'s kernel (what the lean layer computes with), tree attention as the runtime runs it."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config(feature_layers=[0, 1, 1], draft_vocab_size=48), target.config)
    with torch.no_grad():
        for parameter in head.parameters():  # norms off their ones, so that every weight matters
            parameter.add_(torch.randn_like(parameter) * 0.05)
    head.attach_target_weights(*frozen_target_weights(target.model))
    head.set_draft_vocab(torch.arange(48) * 2 - torch.arange(48), torch.arange(96) % 2 == 0)
    return decode_switched(head.to(torch.bfloat16).eval(), form)


def decode_switched(head, form: str):
    """``head`` with its modules switched to the decode layers, every product ``form``'s kernel (what the lean drafters
    compute with), and tree attention as the runtime runs it."""
    decode_class = decode_layer_classes(PackedWeights(LinearPlan(form, {}, ((256, True),))))
    for module in head.modules():
        fast = decode_class(type(module))
        if fast is not None:
            module.__class__ = fast
    return use_tree_attention(head)


def head_cache(head, length: int) -> KVCache:
    config = head.layer_config
    return KVCache(1, 1, config.num_key_value_heads, config.head_dim, length, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("rows", [1, 5])
def test_the_lean_layer_equals_the_heads_modules(form, rows):
    """A run of verified rows (fused features, causal over the cached rows), then a frontier of tree nodes (the head's
    own hidden, a tree mask): equal hidden states, logits and cache entries either way."""
    target, lean = lean_target(form)
    head = bf16_head(target, form)
    assert LeanEagle3.supports(head, lean)
    drafter = LeanEagle3(head, lean)
    calls, stack = [], lean.stack
    lean.stack = lambda *args: calls.append(1) or stack(*args)
    torch.manual_seed(2)
    done = 6
    tokens = torch.randint(0, 96, (1, done + rows))
    features = torch.randn(1, done + rows, 3 * head.hidden_size).bfloat16()
    frontier = torch.randint(0, 96, (1, 3))
    parents = torch.randn(1, 3, head.hidden_size).bfloat16()
    tree_mask = torch.ones(1, 1, 3, done + rows + 3, dtype=torch.bool)
    tree_mask[..., done + rows:] = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    results = []
    for way in (head, drafter):
        with torch.inference_mode():
            cache = head_cache(head, done + rows + 3)
            # the rows before: through the head's modules both times (a prompt's rows take them in the runtime too)
            head.hidden_states(tokens[:, :done], features[:, :done], torch.arange(done)[None],
                               causal_rows_mask(0, done, "cpu"), cache)
            cache.commit(done)
            read = way.hidden_states(tokens[:, done:], features[:, done:], torch.arange(done, done + rows)[None],
                                     causal_rows_mask(done, rows, "cpu"), cache)
            cache.commit(rows)
            hidden, logits = way(frontier, parents, torch.tensor([[done + rows] * 3]), tree_mask, cache)
            results.append((read, way.logits(read), hidden, logits, cache.kv.clone()))
    assert len(calls) == 2  # the run of rows and the frontier, each through the compiled stack
    for stock, ours in zip(*results):
        assert torch.equal(stock, ours)


def test_decoding_with_the_lean_head_is_the_targets_greedy_decoding(form):
    target, lean = lean_target(form)
    target._lean = lean
    proposer = EagleProposer(bf16_head(target, form, seed=3), target, depth=3, top_k=3)
    assert proposer.lean is not None  # the lean head drafts here
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target).generate(prompt, 24)
    drafted = SpeculativeDecoder(target, proposer, tree_size=6).generate(prompt, 24)
    assert drafted.tokens == plain.tokens and drafted.target_forwards < plain.target_forwards + 1


def bf16_dflash(target, form: str, seed: int = 0) -> DFlashHead:
    """A random two-layer DFlash head for the tiny lean target, in bf16, switched to the decode layers as
    ``bf16_head``."""
    torch.manual_seed(seed)
    head = DFlashHead(DFlashConfig(num_layers=2, block_size=4, feature_layers=[0, 1], draft_vocab_size=48),
                      target.config)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    head.attach_target_weights(*frozen_target_weights(target.model))
    head.set_draft_vocab(torch.arange(48) * 2 - torch.arange(48), torch.arange(96) % 2 == 0)
    return decode_switched(head.to(torch.bfloat16).eval(), form)


@pytest.mark.parametrize("context_rows", [1, 6])
def test_lean_dflash_equals_the_heads_modules(form, context_rows):
    """The context's keys and values, a block's hidden states, its cache entries and logits: equal either way."""
    target, lean = lean_target(form)
    head = bf16_dflash(target, form)
    assert LeanDFlash.supports(head, lean)
    drafter = LeanDFlash(head, lean)
    torch.manual_seed(5)
    features = torch.randn(1, context_rows, 2 * head.hidden_size).bfloat16()
    positions = torch.arange(context_rows)[None]
    size = head.block_size
    results = []
    for way in (head, drafter):
        with torch.inference_mode():
            context_kv = way.context_kv(way.context(features), positions)
            cache = KVCache(2, 1, 1, 64, context_rows + size, torch.bfloat16, torch.device("cpu"))
            for layer, (keys, values) in enumerate(context_kv):
                cache.kv[layer, 0, 0, :, :context_rows] = keys[0]
                cache.kv[layer, 1, 0, :, :context_rows] = values[0]
            cache.commit(context_rows)
            embeddings = head.block_embeddings(torch.tensor([[7]]), torch.bfloat16)
            mask = torch.ones(1, 1, size, context_rows + size, dtype=torch.bool)
            hidden = way.block_hidden(embeddings, context_rows - 1 + torch.arange(size)[None], mask, cache)
            results.append([t for pair in context_kv for t in pair] + [hidden, way.logits(hidden), cache.kv.clone()])
    for stock, ours in zip(*results):
        assert torch.equal(stock, ours)


def test_decoding_with_lean_dflash_is_the_targets_greedy_decoding(form):
    target, lean = lean_target(form)
    target._lean = lean
    proposer = DFlashProposer(bf16_dflash(target, form, seed=6), target, top_k=2)
    assert proposer.lean is not None
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(7))
    plain = SpeculativeDecoder(target).generate(prompt, 24)
    drafted = SpeculativeDecoder(target, proposer, tree_size=4).generate(prompt, 24)
    assert drafted.tokens == plain.tokens


@pytest.mark.parametrize("head_type", ["eagle3", "dflash"])
def test_batched_drafting_through_the_lean_drafters_drafts_as_the_heads_modules(form, head_type):
    """Rows of different lengths draft together (their caches then write row by row): the same trees through the lean
    drafters as through the heads' modules, hence the same outputs and passes. (A bf16 batch's output may differ from
    each prompt's own decoding at near-ties: its prefill and ragged passes round differently.)"""
    target, lean = lean_target(form)
    target._lean = lean
    if head_type == "eagle3":
        proposer = EagleProposer(bf16_head(target, form, seed=8), target, depth=3, top_k=3)
    else:
        proposer = DFlashProposer(bf16_dflash(target, form, seed=8), target, top_k=2)
    drafter = proposer.lean
    assert drafter is not None
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 96, (length,), generator=generator) for length in (5, 11, 8)]
    runs = []
    for way in (drafter, None):
        proposer.lean = way
        results = BatchedDecoder(target, proposer, tree_size=4).generate(prompts, 20, batch_size=3)
        runs.append([(result.tokens, result.target_forwards, result.tree_sizes, result.depth_accepts)
                     for result in results])
    assert runs[0] == runs[1]
    assert any(size > 1 for _, _, sizes, _ in runs[0] for size in sizes)  # trees were drafted and verified


def test_rows_of_different_lengths_through_the_lean_layer_equal_the_heads_modules(form):
    """Two rows whose caches hold 4 and 7 entries (the cache then writes row by row, not through shared views), two new
    rows each: equal hidden states and cache entries either way."""
    target, lean = lean_target(form)
    head = bf16_head(target, form, seed=10)
    drafter = LeanEagle3(head, lean)
    torch.manual_seed(11)
    tokens = torch.randint(0, 96, (2, 2))
    features = torch.randn(2, 2, head.hidden_size).bfloat16()
    lengths = torch.tensor([4, 7])
    positions = lengths[:, None] + torch.arange(2)[None]
    mask = torch.zeros(2, 1, 2, 9, dtype=torch.bool)
    for row, length in enumerate(lengths.tolist()):
        mask[row, 0, :, :length] = True
        mask[row, 0, :, length:length + 2] = torch.ones(2, 2, dtype=torch.bool).tril()
    results = []
    for way in (head, drafter):
        with torch.inference_mode():
            config = head.layer_config
            cache = KVCache(1, 2, config.num_key_value_heads, config.head_dim, 9, torch.bfloat16,
                            torch.device("cpu"))
            cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(12)).bfloat16())
            cache.commit(lengths)
            results.append((way.hidden_states(tokens, features, positions, mask, cache), cache.kv.clone()))
    for stock, ours in zip(*results):
        assert torch.equal(stock, ours)
