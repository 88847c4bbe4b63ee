"""Lookahead decoding: the window's layout, mask and Jacobi update, the n-gram pool and the candidate trie on hand-built
cases; the settings chosen from a cost curve; and the window never changing what the verified tree computes."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import runtime.proposers.lookahead as lookahead_module
import runtime.proposers.successor_prior as successor_prior_module
from runtime.engine.decoder import SpeculativeDecoder
from runtime.proposers.base import ProposeInput
from runtime.proposers import ProposerSpec, build_proposer
from runtime.proposers.lookahead import (SUCCESSORS, LookaheadProposer, NgramPool, SuccessorPrior, chunked_topk,
                                         SuccessorTable, blend_successors, choose_settings, expected_tokens,
                                         jacobi_update, pass_rows, record_successors, top_probabilities, window_mask,
                                         window_ngrams, window_offsets, window_tokens)
from runtime.proposers.lookup_first import LookupFirstProposer
from runtime.proposers.ngram import NgramProposer
from runtime.proposers.spec import LookaheadSettings
from runtime.engine.sampling import SamplingParams
from runtime.proposers.successor_prior import measure_successor_prior, prior_prefix, successor_prior
from runtime.target.model import target_from_model
from runtime.engine.tree import Draft, Tree, draft_row_mask, verification_mask
from tests.conftest import tiny_model
from tests.script_runs import REPO, run_script

VOCAB = 64


def test_window_layout_on_a_hand_built_window():
    # W = 3, N = 4: level 0 holds the root (column 0) and two guesses, levels 1 and 2 three each; rows in order
    # (0,1) (0,2) (1,0) (1,1) (1,2) (2,0) (2,1) (2,2); level l, column j stands j + l after the root
    assert window_offsets(3, 4).tolist() == [1, 2, 1, 2, 3, 2, 3, 4]
    expected = torch.tensor([
        # (0,1) (0,2) (1,0) (1,1) (1,2) (2,0) (2,1) (2,2)
        [1, 0, 0, 0, 0, 0, 0, 0],  # (0,1): root, itself
        [1, 1, 0, 0, 0, 0, 0, 0],  # (0,2): root, (0,1), itself
        [0, 0, 1, 0, 0, 0, 0, 0],  # (1,0): root, itself
        [1, 0, 0, 1, 0, 0, 0, 0],  # (1,1): root, (0,1), itself
        [1, 1, 0, 0, 1, 0, 0, 0],  # (1,2): root, (0,1), (0,2), itself
        [0, 0, 1, 0, 0, 1, 0, 0],  # (2,0): root, (1,0), itself
        [1, 0, 0, 1, 0, 0, 1, 0],  # (2,1): root, (0,1), (1,1), itself
        [1, 1, 0, 0, 1, 0, 0, 1],  # (2,2): root, (0,1), (0,2), (1,2), itself
    ], dtype=torch.bool)
    assert torch.equal(window_mask(3, 4), expected)
    # what each row sees is a run of consecutive positions after the root, ending at its own
    offsets = window_offsets(3, 4)
    for row in range(8):
        assert sorted(offsets[expected[row]].tolist()) == list(range(1, int(offsets[row]) + 1))
    settings = LookaheadSettings(3, 4, 2)
    assert settings.window_rows == 8 and settings.tree_size == 7


def test_window_of_one_column():
    assert window_offsets(1, 3).tolist() == [1]
    assert window_mask(1, 3).tolist() == [[True]]
    assert window_offsets(1, 4).tolist() == [1, 2]
    assert window_mask(1, 4).tolist() == [[True, False], [True, True]]


def test_jacobi_update_and_ngrams_on_a_hand_built_window():
    levels = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])  # [N - 1 = 3, W = 3]
    new = torch.tensor([90, 91, 92])
    assert window_tokens(levels).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert jacobi_update(levels, new).tolist() == [[3, 4, 5], [6, 7, 8], [90, 91, 92]]
    # column 0 starts with the root of the pass that produced ``new``
    assert window_ngrams(levels, 77, new).tolist() == [[77, 3, 6, 90], [1, 4, 7, 91], [2, 5, 8, 92]]
    assert levels[0, 0] == 0  # not written through


def test_pool_keeps_the_most_recent_continuations_per_first_token():
    pool = NgramPool(capacity=2)
    pool.add(torch.tensor([[5, 1, 2], [6, 1, 1], [5, 3, 4]]))
    assert pool.candidates(5) == [(3, 4), (1, 2)]
    assert pool.candidates(6) == [(1, 1)] and pool.candidates(7) == []
    pool.add(torch.tensor([[5, 1, 2]]))  # seen again: most recent now
    assert pool.candidates(5) == [(1, 2), (3, 4)]
    pool.add(torch.tensor([[5, 8, 9]]))  # full: the least recently seen goes
    assert pool.candidates(5) == [(8, 9), (1, 2)]
    assert len(pool) == 3
    with pytest.raises(ValueError, match="capacity"):
        NgramPool(0)


def test_successor_table_prefers_the_pair_and_keeps_the_latest():
    table = SuccessorTable(recent_weight=1.0)
    table.record([1, 5], [5, 6], [[6, 7], [8, 9]], [[0.6, 0.3], [0.5, 0.2]])  # after 1 then 5: 6 or 7; 5 6: 8 or 9
    assert table.successors(1, 5) == (6, 7)
    assert table.successors(2, 5) == (6, 7)  # no entry for (2, 5): what followed 5 alone
    assert table.successors(0, 4) == ()
    # 5 again, after 3: the latest wins for 5 alone, the pair (1, 5) stays
    table.record([3], [5], [[4, 2]], [[0.9, 0.1]])
    assert table.successors(2, 5) == (4, 2) and table.successors(1, 5) == (6, 7) and table.successors(3, 5) == (4, 2)
    assert len(table) == 2


def test_successor_table_blends_each_recording_into_the_entry():
    assert blend_successors((), ((4, 0.8), (2, 0.1)), 0.5) == ((4, 0.4), (2, 0.05))  # a first recording: half
    # (1 - w) old + w new over both sides' tokens, a token missing from one side at 0 there, likeliest first
    mixed = blend_successors(((1, 0.6), (2, 0.3)), ((2, 0.5), (3, 0.4)), 0.5, keep=3)
    assert [token for token, _ in mixed] == [2, 1, 3]
    assert [chance for _, chance in mixed] == pytest.approx([0.4, 0.3, 0.2])
    assert blend_successors(((1, 0.6),), ((2, 0.6),), 0.5) == ((1, 0.3), (2, 0.3))  # a tie: old's token first
    assert blend_successors(((1, 0.6),), ((2, 0.6),), 1.0) == ((2, 0.6),)  # the latest alone
    assert len(blend_successors(tuple((t, 0.1) for t in range(8)), tuple((t, 0.1) for t in range(8, 16)), 0.5)) \
        == SUCCESSORS

    table = SuccessorTable(recent_weight=0.5)
    table.record([1], [5], [[6, 7]], [[0.6, 0.3]])
    table.record([1, 3], [5, 5], [[7, 8], [9, 6]], [[0.9, 0.1], [0.5, 0.4]])  # (1, 5) again, then 5 after 3
    # the pair's two recordings: (6 .3, 7 .15), then (7 .525, 6 .15, 8 .05)
    assert table.successors(1, 5) == (7, 6, 8)
    assert [chance for _, chance in table.entry(1, 5)] == pytest.approx([0.525, 0.15, 0.05])
    # 5 alone blends all three, in order, the last giving 6 .275, 7 .2625, 9 .25, 8 .025
    assert table.successors(4, 5) == (6, 7, 9, 8) and table.successors(3, 5) == (9, 6)
    with pytest.raises(ValueError, match="recent_weight"):
        SuccessorTable(recent_weight=0.0)


def test_recycled_paths_go_best_first_with_prefixes_first():
    table = SuccessorTable(recent_weight=1.0)
    table.record([0, 1, 2, 3], [1, 2, 3, 4], [[2, 9], [3, 8], [4, 7], [5, 6]],
                 [[0.5, 0.3], [0.9, 0.05], [0.4, 0.35], [0.5, 0.1]])  # a chain 1 2 3 4 5 of first picks
    # path scores are products of probabilities: 2 (0.5), 2 3 (0.45), 9 (0.3), 2 3 4 (0.18), 2 3 7 (0.1575),
    # 2 3 4 5 (0.09); a confident second step (3 after 2) goes deeper before an unlikely first (9) is tried
    assert table.scored_paths(0, 1, 3) == [((2,), 0.5), ((2, 3), 0.45), ((9,), 0.3)]
    assert table.paths(0, 1, 6) == [(2,), (2, 3), (9,), (2, 3, 4), (2, 3, 7), (2, 3, 4, 5)]
    assert table.paths(0, 1, 0) == [] and table.paths(0, 42, 5) == []
    tree = Tree.from_sequences(1, table.paths(0, 1, 6), max_nodes=7)
    assert tree.tokens.tolist() == [1, 2, 3, 9, 4, 7, 5] and tree.parents.tolist() == [-1, 0, 1, 0, 2, 2, 4]


def test_successors_are_recorded_at_every_node_after_its_parent():
    tree = Tree(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1]))
    logits = torch.full((4, VOCAB), -1.0)
    for node, (best, second) in enumerate([(20, 21), (22, 23), (24, 25), (26, 27)]):
        logits[node, best], logits[node, second] = 2.0, 1.0
    table = SuccessorTable()
    record_successors(table, torch.tensor([3, 4, 10]), tree, logits)  # the root 10 came after 4
    assert table.successors(4, 10)[:2] == (20, 21) and table.successors(10, 11)[:2] == (22, 23)
    assert table.successors(10, 12)[:2] == (24, 25) and table.successors(11, 13)[:2] == (26, 27)


def test_recycled_nodes_fill_what_the_pool_leaves_and_stay_exact():
    """With R > 0 the tree holds recycled successors where the pool has nothing, drafts get accepted on
    repetitive text, and the output is the target's, alone and behind lookup; with R = 0 no table is kept."""
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    prompt = [9, 4, 9, 4, 9, 4, 9, 4, 9, 4, 9, 4]
    reference = hf_greedy(prompt, 48)
    proposer = LookaheadProposer(LookaheadSettings(1, 3, 1, 4))
    assert proposer.tree_size == 7 and proposer.max_depth is None
    state = proposer.start(torch.tensor(prompt), 80)
    tree = Tree(torch.tensor([4, 9]), torch.tensor([-1, 0]))
    logits = torch.zeros(2, VOCAB)
    logits[0, 9], logits[1, 4] = 10.0, 10.0  # confident: the chain 9 4 outscores every second choice
    proposer.observe(state, torch.tensor(prompt), tree, logits)
    step = ProposeInput(torch.tensor(prompt), None, (), proposer.tree_size, SamplingParams(), None)
    drafted = proposer.propose(state, step).tree
    assert drafted.tokens[:3].tolist() == [4, 9, 4] and drafted.size == 7  # the pool is empty: all recycled
    result = SpeculativeDecoder(target, proposer).generate(prompt, 48)
    assert result.tokens == reference and result.tau > 1.0
    both = LookupFirstProposer(LookaheadProposer(LookaheadSettings(1, 3, 1, 4)), NgramProposer())
    assert SpeculativeDecoder(target, both).generate(prompt, 48).tokens == reference
    plain = LookaheadProposer(LookaheadSettings(1, 3, 1))
    state = plain.start(torch.tensor(prompt), 80)
    plain.observe(state, torch.tensor(prompt), tree, logits)
    assert len(state.successors) == 0


def test_recycled_successors_carry_from_one_generation_to_the_next():
    """By default a proposer's generations share one successor table: a second prompt's first draft already holds
    what the first generation's passes computed, and both outputs stay the target's. With carry off each generation
    starts empty; a table given to two proposers is shared."""
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    first, second = [9, 4, 9, 4, 9, 4, 9, 4, 9, 4], [7, 9, 46]  # the first reply holds 46
    proposer = LookaheadProposer(LookaheadSettings(1, 3, 1, 4))
    decoder = SpeculativeDecoder(target, proposer)
    reply = decoder.generate(first, 24).tokens
    assert reply == hf_greedy(first, 24) and 46 in reply
    recorded = len(proposer.successors)
    assert recorded > 0
    state = proposer.start(torch.tensor(second), 40)
    assert state.successors is proposer.successors
    step = ProposeInput(torch.tensor(second), None, (), proposer.tree_size, SamplingParams(), None)
    assert proposer.propose(state, step).tree.size > 1  # drafted from the first generation's passes
    assert decoder.generate(second, 24).tokens == hf_greedy(second, 24)
    assert len(proposer.successors) >= recorded
    # a sampled generation keeps its own table, alone and behind lookup, so its seed alone decides what it draws
    for sampled in (proposer, LookupFirstProposer(proposer, NgramProposer())):
        state = sampled.start(torch.tensor(second), 40, SamplingParams(temperature=1.0))
        own = getattr(state, "head", state).successors
        assert own is not proposer.successors and len(own) == 0
        greedy = sampled.start(torch.tensor(second), 40, SamplingParams())
        assert getattr(greedy, "head", greedy).successors is proposer.successors

    fresh = LookaheadProposer(LookaheadSettings(1, 3, 1, 4, carry=False))
    assert fresh.successors is None and "successors per generation" in str(fresh.settings)
    SpeculativeDecoder(target, fresh).generate(first, 24)
    state = fresh.start(torch.tensor(second), 40)
    assert len(state.successors) == 0
    assert fresh.propose(state, step).tree.size == 1  # nothing recorded in this generation yet

    table = SuccessorTable()
    a, b = (LookaheadProposer(LookaheadSettings(1, 3, 1, 4), successors=table) for _ in range(2))
    assert a.successors is table and b.successors is table  # an empty table given is used, not replaced
    with pytest.raises(ValueError, match="carry"):
        LookaheadProposer(LookaheadSettings(1, 3, 1, 4, carry=False), successors=table)
    with pytest.raises(ValueError, match="carry must be True or False"):
        LookaheadSettings(1, 3, 1, 4, carry=1)


def test_successor_table_drops_the_least_recently_recorded_pairs():
    table = SuccessorTable(pair_capacity=2, recent_weight=1.0)
    top, probs = [[1, 2]], [[0.6, 0.3]]
    table.record([5], [6], top, probs)
    table.record([6], [7], top, probs)
    table.record([5], [6], [[3, 4]], probs)  # recorded again: now the newest
    table.record([7], [8], top, probs)  # over capacity: (6, 7) goes
    assert list(table.after_pair) == [(5, 6), (7, 8)]
    assert table.successors(5, 6) == (3, 4)
    assert table.successors(6, 7) == (1, 2)  # the pair is gone; the token's own entry remains
    assert len(table) == 3
    with pytest.raises(ValueError, match="pair_capacity"):
        SuccessorTable(pair_capacity=0)


def test_candidate_trie_shares_prefixes_and_keeps_the_size():
    tree = Tree.from_sequences(7, [(1, 2), (1, 3), (4, 5)], max_nodes=10)
    assert tree.tokens.tolist() == [7, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0, 4]
    assert Tree.from_sequences(7, [(1, 2), (4, 5)], max_nodes=4).tokens.tolist() == [7, 1, 2, 4]
    assert Tree.from_sequences(7, [], max_nodes=4).size == 1


def test_draft_row_mask_keeps_the_tree_blind_to_extra_rows():
    tree = Tree(torch.tensor([10, 11, 12]), torch.tensor([-1, 0, 0]))
    draft = Draft(tree, torch.tensor([20, 21]), torch.tensor([1, 2]), torch.tensor([[True, False], [True, True]]))
    mask = draft.row_mask()
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, False, False, True, False],  # an extra row sees the root, no other node
        [True, False, False, True, True],
    ]
    assert torch.equal(draft_row_mask(tree.ancestor_mask(), draft.extra_mask), mask)
    assert draft.tokens().tolist() == [10, 11, 12, 20, 21]
    assert draft.position_ids(5).tolist() == [5, 6, 6, 6, 7]
    assert draft.rows == 5 and Draft.of(tree).extra_count == 0 and Draft.of(draft) is draft
    with pytest.raises(ValueError, match="together"):
        Draft(tree, torch.tensor([20]))
    with pytest.raises(ValueError, match="extra_mask"):
        Draft(tree, torch.tensor([20]), torch.tensor([1]), torch.ones(2, 2, dtype=torch.bool))


@torch.inference_mode()
def test_extra_rows_do_not_change_the_tree_rows_logits():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    prompt = torch.arange(3, 20)
    tree = Tree(torch.tensor([20, 21, 22, 23]), torch.tensor([-1, 0, 0, 1]))
    s = LookaheadSettings(3, 4, 2)
    draft = Draft(tree, torch.randint(0, VOCAB, (s.window_rows,)), window_offsets(3, 4), window_mask(3, 4))
    logits = []
    for rows in (Draft(tree), draft):
        cache = target.new_cache(1, 64)
        target.forward(prompt[None], torch.arange(17)[None], cache, None, logits_from=16)
        cache.commit(17)
        mask = verification_mask(rows.row_mask(), 17)
        logits.append(target.forward(rows.tokens()[None], rows.position_ids(17)[None], cache, mask).logits[0, :4])
    torch.testing.assert_close(logits[0], logits[1])


@torch.inference_mode()
def test_window_rows_compute_what_the_sequences_they_stand_for_would():
    """A window row's logits equal those of the last token of the sequence it stands for, run plainly."""
    model = tiny_model("llama", seed=0, vocab_size=VOCAB)
    target = target_from_model(model, identity="tiny")
    prompt = torch.arange(3, 20)
    window, ngram = 3, 4
    levels = torch.randint(0, VOCAB, (ngram - 1, window), generator=torch.Generator().manual_seed(1))
    root = int(prompt[-1])
    draft = Draft(Tree.chain(root, []), window_tokens(levels), window_offsets(window, ngram),
                  window_mask(window, ngram))
    cache = target.new_cache(1, 64)
    target.forward(prompt[:-1][None], torch.arange(16)[None], cache, None, logits_from=15)
    cache.commit(16)
    out = target.forward(draft.tokens()[None], draft.position_ids(16)[None], cache,
                         verification_mask(draft.row_mask(), 16), logits_from=0).logits[0, 1:]
    # the row at level 2, column 2 (the last) stands for: prompt, levels[0, 1], levels[0, 2], levels[1, 2],
    # levels[2, 2]
    sequence = torch.cat([prompt, levels[0, 1:3], levels[1:, 2]])
    plain = model(sequence[None]).logits[0, -1]
    torch.testing.assert_close(out[-1], plain, atol=1e-4, rtol=1e-4)
    # level 1, column 0: prompt, levels[1, 0]
    plain = model(torch.cat([prompt, levels[1:2, 0]])[None]).logits[0, -1]
    torch.testing.assert_close(out[window - 1], plain, atol=1e-4, rtol=1e-4)


def test_settings_from_cost_curves():
    flat = {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.03, 16: 1.05, 32: 1.1, 64: 1.2}
    settings, why = choose_settings(flat)
    assert pass_rows(settings) > 16 and "rows a pass" in why  # nearly free rows: a wide window
    steep = {1: 1.0, 2: 1.9, 4: 3.8, 8: 7.5, 16: 15.0}
    small, _ = choose_settings(steep)
    assert pass_rows(small) <= 16 and pass_rows(small) < pass_rows(settings)
    assert settings.candidates == settings.window  # G = W, as the reference does
    assert settings.recycled > 0  # nearly free rows: recycled nodes too
    # recycled nodes add tokens where no n-gram's first token is right, less the more often one is
    assert expected_tokens(LookaheadSettings(2, 3, 2, 7)) > expected_tokens(LookaheadSettings(2, 3, 2))


def test_sizes_no_pass_can_pay_for_are_refused_with_the_largest_window_that_would():
    """An unbounded window (lookahead:5000,3,2) would allocate or compute for minutes before anything is said: sizes
    whose pass costs more, on the machine's cost curve, than the most tokens its tree can return, or that do not fit
    the context, are refused at once with the largest window that would do."""
    from runtime.proposers.lookahead import check_settings_pay

    curve = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4, 32: 1.9, 64: 3.0}
    check_settings_pay(LookaheadSettings(8, 3, 8, 7), curve, 8192)  # a pass of 39 rows returns up to 24 tokens
    with pytest.raises(ValueError, match="10004 rows, more than the target's context of 8192 .*at most 51"):
        check_settings_pay(LookaheadSettings(5000, 3, 2), curve, 8192)
    with pytest.raises(ValueError, match=r"about \d+ one-row passes .*more than the 5 tokens .*at most 51"):
        check_settings_pay(LookaheadSettings(400, 3, 2), curve, 8192)
    target = target_from_model(tiny_model("llama", vocab_size=VOCAB), identity="tiny")
    with pytest.raises(ValueError, match="lookahead W=5000"):
        LookaheadProposer.for_target(target, LookaheadSettings(5000, 3, 2))


def test_settings_are_checked():
    with pytest.raises(ValueError, match="ngram must be >= 3"):
        LookaheadSettings(4, 2, 4)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        LookaheadSettings(0, 3, 4)
    with pytest.raises(ValueError, match="lookahead's sizes"):
        ProposerSpec("ngram", lookahead=LookaheadSettings(4, 3, 4))
    spec = ProposerSpec("lookahead", lookup_first=True, lookahead=(4, 3, 5))
    assert spec.lookahead == LookaheadSettings(4, 3, 5) and spec.label == "lookahead+ngram"
    assert ProposerSpec(**asdict(spec)) == spec  # as the benchmark reads a spec back from its results
    fresh = ProposerSpec("lookahead", lookahead=(1, 3, 1, 5, False))
    assert fresh.lookahead == LookaheadSettings(1, 3, 1, 5, carry=False) and ProposerSpec(**asdict(fresh)) == fresh


def test_build_proposer_spells_lookahead_and_lookahead_with_lookup():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    proposer = build_proposer(ProposerSpec("lookahead", lookahead=(4, 3, 5)), target)
    assert isinstance(proposer, LookaheadProposer) and proposer.name == "lookahead"
    assert proposer.extra_rows == 7 and proposer.tree_size == 11
    assert "own size" in SpeculativeDecoder(target, proposer).tree_size_reason
    both = build_proposer(ProposerSpec("lookahead", lookup_first=True, lookahead=(4, 3, 5)), target)
    assert both.name == "lookahead+ngram" and isinstance(both.lookup, NgramProposer)
    assert isinstance(both.head, LookaheadProposer) and both.head.settings == LookaheadSettings(4, 3, 5)
    assert both.extra_rows == 7 and both.tree_size is None  # lookup's trees are sized adaptively
    decoder = SpeculativeDecoder(target, both)
    assert "adaptive" in decoder.tree_size_reason and decoder.extra_rows == 7


def hf_greedy(prompt, new_tokens):
    model = tiny_model("llama", seed=0, vocab_size=VOCAB)
    return model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):].tolist()


def test_the_pool_fills_and_gets_drafts_accepted():
    """On repetitive text the window's n-grams are right: lookahead alone (no prompt lookup) gets drafts accepted,
    and the output stays the target's."""
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    prompt = [9, 4, 9, 4, 9, 4, 9, 4, 9, 4, 9, 4]
    reference = hf_greedy(prompt, 48)
    result = SpeculativeDecoder(target, LookaheadProposer(LookaheadSettings(4, 3, 4))).generate(prompt, 48)
    assert result.tokens == reference
    assert result.tau > 1.0 and max(result.tree_sizes) > 1


def test_behind_lookup_the_window_rides_only_where_lookup_finds_nothing():
    """lookahead+ngram: a step where prompt lookup finds a continuation verifies lookup's own tree (here deeper than
    lookahead's 3-node trie) and no window rows; the other steps carry the window. Adaptive sizing learns only from
    the lookup steps (the window's steps keep lookahead's own size), and the output stays the target's."""
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    prompt = [9, 4, 9, 4, 9, 4, 9, 4, 9, 4, 9, 4]
    drafts = []

    class Recording(LookupFirstProposer):
        def propose(self, state, step):
            drafts.append(Draft.of(super().propose(state, step)))
            return drafts[-1]

    proposer = Recording(LookaheadProposer(LookaheadSettings(1, 3, 1)), NgramProposer())
    for tree_size in (8, None):
        drafts.clear()
        decoder = SpeculativeDecoder(target, proposer, tree_size=tree_size)
        assert decoder.generate(prompt, 48).tokens == hf_greedy(prompt, 48)
        lookup = [d for d in drafts if not d.extra_count]
        assert lookup and len(lookup) < len(drafts)  # both kinds of step happened
        assert all(d.extra_count == proposer.extra_rows and d.tree.size <= 3 for d in drafts if d.extra_count)
        if tree_size == 8:
            assert max(d.tree.size for d in lookup) > 3
        else:
            observed = sum(d.tree.max_depth >= 1 for d in lookup)
            assert list(decoder.sizers) == ["ngram"] and decoder.own_sizes == {"lookahead": 3}
            assert decoder.sizers["ngram"].acceptance.attempts[0] == observed


def test_a_proposer_asking_for_more_extra_rows_than_it_declares_is_refused():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    proposer = LookaheadProposer(LookaheadSettings(3, 3, 2))
    proposer.extra_rows = 2  # declares fewer than the window's 5
    with pytest.raises(ValueError, match="extra rows"):
        SpeculativeDecoder(target, proposer).generate([1, 2, 3], 4)


# The command-line spellings, parsed in the interpreter the scripts run in (cli/args.py).
PARSE = r"""
import dataclasses, json, sys
from cli.args import parse_methods, parse_proposer

out = []
for kind, text in json.loads(sys.argv[1]):
    try:
        if kind == "methods":
            out.append({name: dataclasses.asdict(method.proposer) | {"tree_size": method.tree_size}
                        for name, method in parse_methods(text).items() if hasattr(method, "proposer")})
        else:
            out.append(dataclasses.asdict(parse_proposer(text)))
    except SystemExit as error:
        out.append({"error": str(error)})
print(json.dumps(out))
"""


def test_command_line_spellings():
    def spec(name="lookahead", **kwargs):
        return json.loads(json.dumps(asdict(ProposerSpec(name, **kwargs))))  # settings as JSON gives them back

    cases = [
        ("proposer", "lookahead", spec()),
        ("proposer", "lookahead+ngram", spec(lookup_first=True)),
        ("proposer", "lookahead+ngram:8,3,6", spec(lookup_first=True, lookahead=(8, 3, 6))),
        ("proposer", "lookahead:8,3", "give lookahead's sizes as lookahead:W,N,G"),
        ("proposer", "lookahead:2,3,2,6", spec(lookahead=(2, 3, 2, 6))),
        ("proposer", "lookahead:2,3,2,6,0", spec(lookahead=(2, 3, 2, 6, False))),
        ("proposer", "lookahead:2,3,2,6,1", spec(lookahead=(2, 3, 2, 6))),
        ("proposer", "lookahead:2,3,2,6,2", "lookahead:W,N,G,R,C"),
        ("proposer", "lookahead:2,3,2,6,1,0", spec(lookahead=(2, 3, 2, 6, True, False))),
        ("proposer", "lookahead:2,3,2,6,1,2", "lookahead:W,N,G,R,C,P"),
        ("proposer", "lookahead:2,3,2,6,1,1,1", "lookahead:W,N,G,R,C,P"),
        ("proposer", "lookahead:8,2,8", "ngram must be >= 3"),
        ("methods", "hf-greedy,lookahead:4,3,4@9,lookahead+ngram,ngram",
         {"lookahead:4,3,4@9": {**spec(lookahead=(4, 3, 4)), "tree_size": 9},
          "lookahead+ngram": {**spec(lookup_first=True), "tree_size": None},
          "ngram": {**spec("ngram"), "tree_size": None}}),
    ]
    result = run_script("-c", PARSE, json.dumps([case[:2] for case in cases]), cwd=REPO / "scripts")
    for (_, text, expected), got in zip(cases, json.loads(result.stdout), strict=True):
        if isinstance(expected, str):
            assert expected in got.get("error", ""), (text, got)
        else:
            assert got == expected, (text, got)


def test_a_prior_serves_tokens_never_recorded_and_mixes_into_a_tokens_entry():
    """The table's rule on hand-built entries: a pair's own entry first; else the token's, mixed with the prior's
    at ``prior_weight``; else the prior's alone."""
    prior = SuccessorPrior(torch.tensor([[1, 2], [0, 2], [1, 0]]), torch.tensor([[0.5, 0.25], [0.5, 0.5], [1.0, 0.0]]))
    assert prior.entry(0) == ((1, 0.5), (2, 0.25)) and prior.entry(3) == () and prior.entry(-1) == ()
    table = SuccessorTable(recent_weight=1.0, prior=prior)
    assert table.entry(5, 0) == ((1, 0.5), (2, 0.25))  # nothing recorded for 0: the prior's
    table.record([5], [0], [[2]], [[1.0]])
    assert table.entry(5, 0) == ((2, 1.0),)  # the pair's own
    assert table.entry(7, 0) == ((2, 0.625), (1, 0.25))  # 0's own (2: 1.0) half and half with the prior's
    assert table.successors(7, 1) == (0, 2)
    alone = SuccessorTable(recent_weight=1.0, prior=prior, prior_weight=0.0)
    alone.record([5], [0], [[2]], [[1.0]])
    assert alone.entry(7, 0) == ((2, 1.0),) and alone.entry(7, 1) == ((0, 0.5), (2, 0.5))
    with pytest.raises(ValueError, match="prior_weight"):
        SuccessorTable(prior=prior, prior_weight=1.0)
    with pytest.raises(ValueError, match="one shape"):
        SuccessorPrior(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1))


def test_a_priors_entries_read_as_tuples_are_kept_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(successor_prior_module, "PRIOR_MEMO_CAPACITY", 2)
    prior = SuccessorPrior(torch.tensor([[1], [2], [0]]), torch.tensor([[0.5], [0.25], [1.0]]))
    assert [prior.entry(token) for token in (0, 1, 0)] == [((1, 0.5),), ((2, 0.25),), ((1, 0.5),)]
    assert len(prior._entries) == 2
    assert prior.entry(2) == ((0, 1.0),) and len(prior._entries) == 1  # full: dropped, then the new one kept


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_measured_prior_is_each_tokens_next_tokens_after_the_prefix(arch):
    """Many tokens share one pass over the prefix's cache, each row seeing the prefix and itself: the same top-k as
    a forward pass of prefix + token, token by token, whatever the rows a pass."""
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    target = target_from_model(model, identity="tiny")
    prefix = torch.tensor([3, 17, 5, 40, 12, 9, 33, 21, 8, 50])  # longer than the tiny gemma2's sliding window
    ids = torch.cat([prefix.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
    with torch.no_grad():
        reference = model(ids).logits[:, -1].float().softmax(-1).topk(4, dim=-1)
    for rows in (7, VOCAB):
        prior = measure_successor_prior(target, prefix, rows=rows, keep=4, progress=False)
        assert torch.equal(prior.tokens, reference.indices), f"{arch}: rows {rows}"
        torch.testing.assert_close(prior.probs, reference.values)
        assert prior.vocab_size == VOCAB


def test_successor_prior_is_measured_once_and_read_back(tmp_path, monkeypatch):
    """The prior is cached (safetensors) per target and prefix and read back without measuring; lookahead built for
    a target takes it where it recycles successors and its settings ask for it."""
    import runtime.proposers.successor_prior as module

    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    tokenizer = SimpleNamespace(chat_template=None, bos_token_id=None, eos_token_id=2)
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), tokenizer, identity="tiny")
    assert prior_prefix(tokenizer).tolist() == [2]  # no template, no BOS: the end-of-sequence token

    class Templated:  # the template's ids, dated where the template prints a date
        chat_template = "..."

        def apply_chat_template(self, messages, **kwargs):
            assert kwargs["add_generation_prompt"] and kwargs["date_string"]
            return [5, 6, len(messages[0]["content"])]

    assert prior_prefix(Templated()).tolist() == [5, 6, len("Write an answer.")]
    first = successor_prior(target)
    assert len(list((tmp_path / "successor_priors").glob("*.safetensors"))) == 1
    assert not list((tmp_path / "successor_priors").glob("*.partial"))

    def measure(*args, **kwargs):
        raise AssertionError("measured again")

    real_measure = module.measure_successor_prior
    monkeypatch.setattr(module, "measure_successor_prior", measure)
    again = successor_prior(target)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.probs, first.probs)
    assert LookaheadProposer.for_target(target, LookaheadSettings(1, 3, 1, 4)).successors.prior is not None
    assert LookaheadProposer.for_target(target, LookaheadSettings(1, 3, 1, 4, prior=False)).prior is None
    assert LookaheadProposer.for_target(target, LookaheadSettings(1, 3, 1)).prior is None  # nothing recycled
    assert "no prior" in str(LookaheadSettings(1, 3, 1, 4, prior=False))
    # a file that does not fit this target's vocabulary (another model under the same identity) is measured again
    path = next((tmp_path / "successor_priors").glob("*.safetensors"))
    save_file({"tokens": torch.full((VOCAB, SUCCESSORS), VOCAB, dtype=torch.int32),
               "probs": torch.zeros(VOCAB, SUCCESSORS)}, str(path))
    monkeypatch.setattr(module, "measure_successor_prior", real_measure)
    assert torch.equal(successor_prior(target).tokens, first.tokens)
    path.write_bytes(b"not safetensors")
    assert torch.equal(successor_prior(target).tokens, first.tokens)
    with pytest.raises(ValueError, match="prior=True"):
        LookaheadProposer(LookaheadSettings(1, 3, 1, 4, prior=False), prior=first)
    shared = SuccessorTable(prior=first)
    assert LookaheadProposer(LookaheadSettings(1, 3, 1, 4), successors=shared).prior is first  # sampled tables too
    # a prior that would take too long on this device is not measured: lookahead goes without it, and later calls
    # on this machine skip the probing pass; a larger budget measures it
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "other"))
    assert successor_prior(target, budget_seconds=0.0) is None
    assert not list((tmp_path / "other" / "successor_priors").glob("*.safetensors"))
    assert len(list((tmp_path / "other" / "successor_priors").glob("*.too_slow.json"))) == 1
    monkeypatch.setattr(module, "measure_successor_prior", measure)
    assert successor_prior(target, budget_seconds=0.0) is None  # the verdict, without measuring
    monkeypatch.setattr(module, "measure_successor_prior", real_measure)
    assert torch.equal(successor_prior(target, budget_seconds=1e9).tokens, first.tokens)
    monkeypatch.setattr(lookahead_module, "successor_prior", lambda target: None)  # the name lookahead calls
    assert LookaheadProposer.for_target(target, LookaheadSettings(1, 3, 1, 4)).successors.prior is None
    with pytest.raises(ValueError, match="prior must be True or False"):
        LookaheadSettings(1, 3, 1, 4, prior=1)
    with pytest.raises(ValueError, match="prior=False"):
        prior_prefix(SimpleNamespace(chat_template=None, bos_token_id=None, eos_token_id=None))
    # without a tokenizer, the model's own special tokens
    assert prior_prefix(None, SimpleNamespace(bos_token_id=None, eos_token_id=[7, 8])).tolist() == [7]
    with pytest.raises(ValueError, match="prior=False"):
        prior_prefix(None, SimpleNamespace())


def test_top_probabilities_are_the_softmaxs_largest_without_changing_the_logits():
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(5, 3000, generator=generator) * 4).to(dtype)
        kept = logits.clone()
        probs, tokens = top_probabilities(logits, 8)
        softmax = logits.float().softmax(-1)
        assert torch.equal(logits, kept)  # fp32 logits are not normalized in place
        # the k largest probabilities (among equal logits another index may be picked), each at its own token
        torch.testing.assert_close(probs, softmax.topk(8, dim=-1).values, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(probs, softmax.gather(-1, tokens), rtol=1e-5, atol=1e-7)
    probs, tokens = top_probabilities(torch.tensor([[0.0, -1.0, float("-inf"), 2.0]]), 2)  # by hand
    total = 1 + math.exp(-1) + math.exp(2)
    assert tokens.tolist() == [[3, 0]]
    torch.testing.assert_close(probs, torch.tensor([[math.exp(2) / total, 1 / total]]))


def test_chunked_topk_gives_topks_values_and_indices_that_hold_them():
    """By hand: the two largest of a row lie in different chunks of 2, one of them past a width no multiple of the
    chunk; then random rows (bf16 values, so with ties) of widths around the chunk against torch.topk."""
    values, indices = chunked_topk(torch.tensor([[0.0, 5.0, 1.0, 2.0, 9.0]]), 2, chunk=2)
    assert values.tolist() == [[9.0, 5.0]] and indices.tolist() == [[4, 1]]
    generator = torch.Generator().manual_seed(0)
    for width, k, chunk in [(49152, 8, 128), (1000, 8, 128), (300, 8, 128), (64, 8, 128), (37, 3, 4)]:
        rows = torch.randn(5, width, generator=generator).bfloat16().float()
        got, where = chunked_topk(rows, k, chunk)
        expected = rows.topk(k, dim=-1).values
        assert torch.equal(got, expected)
        assert torch.equal(rows.gather(1, where), got)  # each index holds its value
        assert all(len(set(row)) == k for row in where.tolist())  # k distinct positions
