"""The lean decode pass (runtime.target.lean) computes what the stock layers with the decode kernels compute: the same
hidden states, layer inputs and cache entries, on trees, batched rows and packed ragged rows; and decoding through it
is the stock pass's decoding, token for token."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.batched import BatchedDecoder
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.ragged import RaggedRows
from runtime.engine.tree import Tree, verification_mask
from runtime.proposers.ngram import NgramProposer
from runtime.target.decode_layers import PackedWeights
from runtime.target.kernels import LEAN_FORMS, lean_product
from runtime.target.lean import LeanLlama
from runtime.target.linear_plan import LinearPlan
from runtime.target.model import target_from_model
from tests.conftest import tiny_model

# every form whose products run here: the AVX2 kernel's wherever AVX2 does (the path of CPUs without AVX512-BF16,
# tested on the others too), the AVX512-BF16 and AMX kernels' where the CPU has their instructions
FORMS_HERE = [form for form in LEAN_FORMS if lean_product(form) is not None]
pytestmark = pytest.mark.skipif(not FORMS_HERE, reason="the lean pass's bf16 kernels do not run on this CPU")


@pytest.fixture(params=FORMS_HERE or [None])
def form(request) -> str:
    """Each lean form that runs here, in turn."""
    return request.param


def lean_target(form: str, seed: int = 0, compiled_layers: bool = True):
    """A tiny Llama in bf16 whose heads the decode attention kernel takes (head size 64), with and without the lean
    pass (its plan: ``form``'s kernel for every product; ``compiled_layers``: its layer stack in one compiled call
    where every row has the same length, else its Python loop)."""
    model = tiny_model("llama", seed=seed, vocab_size=96, hidden_size=128, intermediate_size=256,
                       num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                       max_position_embeddings=256).to(torch.bfloat16)
    target = target_from_model(model, identity="tiny-lean")
    packed = PackedWeights(LinearPlan(form, {}, ((256, True),)))
    assert LeanLlama.supports(model, packed)
    lean = LeanLlama(model, packed, compiled_layers)
    assert (lean.stack is not None) == compiled_layers  # the compiled stack builds wherever the block kernels run
    return target, lean


def run(target, lean, *args, **kwargs):
    target._lean = lean
    try:
        return target.forward(*args, **kwargs)
    finally:
        target._lean = None


def prefilled(target, prompts: torch.Tensor, extra: int):
    cache = target.new_cache(prompts.shape[0], prompts.shape[1] + extra)
    target.forward(prompts, torch.arange(prompts.shape[1]).expand(prompts.shape[0], -1), cache, None)
    cache.commit(prompts.shape[1])
    return cache


@pytest.mark.parametrize("compiled_layers", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_a_verification_pass_equals_the_stock_layers(form, rows, compiled_layers):
    """Hidden states, requested layer inputs and the cache's new entries: equal, through the compiled layer stack and
    through the Python loop; logits within bf16 rounding of the LM head's product (the packed kernel beside the stock
    rules) and with the same argmax."""
    target, lean = lean_target(form, compiled_layers=compiled_layers)
    calls, stack = [], lean.stack
    if stack is not None:
        lean.stack = lambda *args: calls.append(1) or stack(*args)
    torch.manual_seed(1)
    prompts = torch.randint(0, 96, (2, 9))
    tree = Tree(torch.randint(0, 96, (rows,)), torch.tensor([-1] + [max(0, i - 2) for i in range(1, rows)]))
    ids, positions = tree.tokens.expand(2, -1), tree.position_ids(9).expand(2, -1)
    mask = verification_mask(tree.ancestor_mask(), 9).expand(2, -1, -1, -1)
    outputs, caches = [], []
    for pass_lean in (None, lean):
        cache = prefilled(target, prompts, rows)
        outputs.append(run(target, pass_lean, ids, positions, cache, mask, hidden_layers=(0, 1)))
        caches.append(cache.kv.clone())
    stock, ours = outputs
    assert lean.layers is not None and len(calls) == compiled_layers  # the pass was the lean one, as asked
    assert torch.equal(stock.hidden, ours.hidden) and torch.equal(caches[0], caches[1])
    assert all(torch.equal(a, b) for a, b in zip(stock.layer_hidden, ours.layer_hidden))
    torch.testing.assert_close(ours.logits.float(), stock.logits.float(), atol=0.05, rtol=0.02)
    assert torch.equal(stock.logits.argmax(-1), ours.logits.argmax(-1))


def test_packed_ragged_rows_equal_the_stock_layers(form):
    """Rows of different committed lengths and tree sizes, packed: the lean pass writes each row's entries at its
    own length and attends over its own keys, as the stock pass does."""
    target, lean = lean_target(form)
    torch.manual_seed(2)
    prompts = torch.randint(0, 96, (2, 8))
    counts = [3, 1]
    outputs, caches = [], []
    for pass_lean in (None, lean):
        cache = prefilled(target, prompts, 4)
        cache.lengths[1] -= 2  # row 1 committed fewer positions
        cache.commit(0)
        positions = torch.tensor([[8, 9, 10, 6]])
        ragged = RaggedRows.from_counts(counts, positions[0])
        mask = torch.zeros(2, 1, 3, 11, dtype=torch.bool)
        mask[0, 0, :, :8] = True
        mask[0, 0, :, 8:11] = torch.ones(3, 3, dtype=torch.bool).tril()
        mask[1, 0, :, :6] = True
        mask[1, 0, 0, 6] = True
        mask[1, 0, 1, 7] = mask[1, 0, 2, 8] = True  # padding rows see themselves
        outputs.append(run(target, pass_lean, torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(3)),
                           positions, cache, mask, ragged=ragged, key_positions=torch.arange(11).repeat(2, 1)))
        caches.append(cache.kv.clone())
    assert torch.equal(outputs[0].hidden, outputs[1].hidden) and torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("compiled_layers", [True, False])
@pytest.mark.parametrize("batched", [False, True])
def test_decoding_through_the_lean_pass_is_the_stock_passes_decoding(form, batched, compiled_layers):
    """Greedy decoding with prompt lookup, alone and in a batch of rows: token for token what the stock layers
    decode (both in bf16)."""
    target, lean = lean_target(form, seed=3, compiled_layers=compiled_layers)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 9], [1, 2, 3, 4, 1, 2, 3]]
    outputs = []
    for pass_lean in (None, lean):
        target._lean = pass_lean
        try:
            if batched:
                results = BatchedDecoder(target, NgramProposer(), tree_size=4).generate(prompts, 24, batch_size=3)
            else:
                results = [SpeculativeDecoder(target, NgramProposer(), tree_size=4).generate(p, 24) for p in prompts]
        finally:
            target._lean = None
        outputs.append([result.tokens for result in results])
    assert outputs[0] == outputs[1]
