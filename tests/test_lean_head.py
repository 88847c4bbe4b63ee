"""EAGLE-3 drafting through the lean layer (runtime.proposers.lean_head) computes what the head's own modules compute
with the same products: hidden states, logits and the head's cache, for a verified run of rows and for a tree's
frontier; and decoding with it is the target's greedy decoding."""

from __future__ import annotations

import pytest
import torch

from heads.common import frozen_target_weights
from heads.eagle3 import Eagle3Config, Eagle3Head
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.kv_cache import KVCache
from runtime.proposers.eagle import EagleProposer, causal_rows_mask
from runtime.proposers.lean_head import LeanEagle3
from runtime.target.attention import use_tree_attention
from runtime.target.decode_layers import PackedWeights, decode_layer_classes
from runtime.target.linear_plan import LinearPlan
from tests.test_lean import FORM, lean_target

pytestmark = pytest.mark.skipif(FORM is None, reason="the block-packed bf16 kernels do not run on this CPU")


def bf16_head(target, seed: int = 0) -> Eagle3Head:
    """A random EAGLE-3 head for the tiny lean target, in bf16, its modules switched to the decode layers with every
    product the block-packed kernel's (what the lean layer computes with), tree attention as the runtime runs it."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config(feature_layers=[0, 1, 1], draft_vocab_size=48), target.config)
    with torch.no_grad():
        for parameter in head.parameters():  # norms off their ones, so that every weight matters
            parameter.add_(torch.randn_like(parameter) * 0.05)
    head.attach_target_weights(*frozen_target_weights(target.model))
    head.set_draft_vocab(torch.arange(48) * 2 - torch.arange(48), torch.arange(96) % 2 == 0)
    head = head.to(torch.bfloat16).eval()
    decode_class = decode_layer_classes(PackedWeights(LinearPlan(FORM, {}, ((256, True),))))
    for module in head.modules():
        fast = decode_class(type(module))
        if fast is not None:
            module.__class__ = fast
    return use_tree_attention(head)


def head_cache(head, length: int) -> KVCache:
    config = head.layer_config
    return KVCache(1, 1, config.num_key_value_heads, config.head_dim, length, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("rows", [1, 5])
def test_the_lean_layer_equals_the_heads_modules(rows):
    """A run of verified rows (fused features, causal over the cached rows), then a frontier of tree nodes (the head's
    own hidden, a tree mask): equal hidden states, logits and cache entries either way."""
    target, lean = lean_target()
    head = bf16_head(target)
    assert LeanEagle3.supports(head, lean)
    drafter = LeanEagle3(head, lean)
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
    for stock, ours in zip(*results):
        assert torch.equal(stock, ours)


def test_decoding_with_the_lean_head_is_the_targets_greedy_decoding():
    target, lean = lean_target()
    target._lean = lean
    proposer = EagleProposer(bf16_head(target, seed=3), target, depth=3, top_k=3)
    assert proposer.lean is not None  # the lean head drafts here
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target).generate(prompt, 24)
    drafted = SpeculativeDecoder(target, proposer, tree_size=6).generate(prompt, 24)
    assert drafted.tokens == plain.tokens and drafted.target_forwards < plain.target_forwards + 1
