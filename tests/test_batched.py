"""Batched speculation must be exact: every row token-identical to its prompt decoded alone (HF greedy at
temperature 0, the same seeded draws when sampling), whatever the other rows accept, stop at or join."""

from __future__ import annotations

import pytest
import torch

from runtime.target.attention import sliding_window_mask
from runtime.engine.batched import BatchedDecoder
from runtime.engine.decoder import SpeculativeDecoder
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.eagle import EagleProposer
from runtime.proposers.ngram import NgramProposer
from runtime.engine.sampling import SamplingParams
from runtime.target.model import target_from_model
from runtime.proposers.base import Proposer, ProposeInput
from runtime.target.cost_model import cost_curve, pass_overhead_tokens, prefill_groups
from runtime.engine.tree import Tree, verification_mask
from tests import test_sampling_distribution as sampling
from tests.conftest import tiny_model
from tests.proposers_for_tests import BadProposer
from tests.test_greedy_equality import lookahead_proposers, proposers
from tests.test_head_proposers import eagle_head, head_proposers
from runtime.engine.sizing import Allocation, BatchSizing

VOCAB = 64
NEW_TOKENS = 16
# very different lengths (1 to 40 tokens), some with repeats so that lookup and the heads draft
PROMPTS = [[5], list(range(10, 50)), [1, 2, 3, 1, 2, 3, 1], [7, 8], list(range(3, 20)) + [3, 4, 5],
           [9, 4, 9, 4, 9, 4, 9, 4, 9, 4, 9, 4], [30, 31, 32], [2, 6, 2, 6, 2]]
BATCH_SIZES = (1, 2, 3, 8)


def hf_greedy(arch: str, prompt: list[int], new_tokens: int = NEW_TOKENS, **kwargs) -> list[int]:
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def target_for(arch: str):
    return target_from_model(tiny_model(arch, seed=0, vocab_size=VOCAB), identity="tiny")


def check_rows(decoder, references, batch_size, label, prompts=PROMPTS, **kwargs):
    results = decoder.generate(prompts, NEW_TOKENS, batch_size=batch_size, **kwargs)
    for index, (result, reference) in enumerate(zip(results, references)):
        assert result.tokens == reference, f"{label}/batch {batch_size}: row {index} differs"
        assert result.target_forwards == len(result.accept_lengths) + 1
        assert len(result.tree_sizes) == len(result.accept_lengths)
    stats = decoder.stats
    assert stats.row_passes == sum(len(result.accept_lengths) for result in results)
    assert stats.tokens == sum(sum(result.accept_lengths) for result in results)
    return results


def test_every_proposer_matches_hf_greedy_at_every_batch_size(arch):
    """Each proposer at two of the batch sizes (1 and 3, or 2 and 8; rotated by architecture, so every proposer
    meets all four over the three architectures): below 8 rows, later prompts join as earlier ones finish."""
    target = target_for(arch)
    references = [hf_greedy(arch, prompt) for prompt in PROMPTS]
    candidates = {**proposers(target, arch), **head_proposers(target), **lookahead_proposers(target)}
    shift = ["llama", "qwen2", "gemma"].index(arch)
    for number, (name, proposer) in enumerate(candidates.items()):
        decoder = BatchedDecoder(target, proposer, tree_size=8, attention="sdpa")
        first = (number + shift) % 4
        for batch_size in (BATCH_SIZES[first], BATCH_SIZES[(first + 2) % 4]):
            check_rows(decoder, references, batch_size, f"{arch}/{name}")
        if name in ("self-draft", "ngram", "lookahead+ngram"):
            assert decoder.stats.tau > 1.0, f"{name} never got a draft accepted"


@pytest.mark.parametrize("name", ["ngram", "draft-tree", "eagle3", "eagle3+ngram"])
def test_sizes_allocated_per_row_and_pass_match_hf_greedy(name, monkeypatch):
    """Per-row sizes (``per_row_sizes``): rows of one pass draft different numbers of nodes, packed; every row is
    still what HF greedy gives it alone. A flat cost curve makes nodes cheap, so rows do draft; lookup's rows go
    deeper than one size for the run would take them, a model's rows no deeper (it drafts level by level)."""
    import runtime.engine.sizing

    monkeypatch.setattr(runtime.engine.sizing, "cost_curve",
                        lambda target, batch_size=1: {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 2.0})
    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    from runtime.proposers.lookup_first import LookupFirstProposer

    candidates = {**proposers(target, "llama"), **head_proposers(target)}
    candidates["eagle3+ngram"] = LookupFirstProposer(candidates["eagle3"])
    decoder = BatchedDecoder(target, candidates[name], sizing=BatchSizing(per_row_sizes=True))
    run_size = BatchedDecoder(target, candidates[name], sizing=BatchSizing(per_row_sizes=False))
    for batch_size in (3, 8):
        results = check_rows(decoder, references, batch_size, f"{name}/per row")
        assert "allocated per row" in decoder.tree_size_reason
        run_size.generate(PROMPTS[:batch_size], 2, batch_size=batch_size)
        sizes = {size for result in results for size in result.tree_sizes}
        if name in ("ngram", "eagle3+ngram"):
            assert len(sizes) > 1 and max(sizes) > run_size.tree_size  # the rows' sizes differ, lookup's go deep
        else:
            assert max(sizes) <= run_size.tree_size


class Wrapping:
    """A proposer that is ``inner`` but for the methods a subclass defines."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_rows_given_no_node_skip_their_proposer_and_catch_up(monkeypatch):
    """Allocated per pass, a row given no draft node skips its proposer (a head would otherwise read its rows every
    pass); the features of the passes it skipped wait in the row, and when it next drafts the head reads them all:
    its cache then holds every position before the root. Every row stays HF greedy's."""

    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    head = head_proposers(target)["eagle3"]
    calls = []

    class Counting(Wrapping):
        def propose_rows(self, states, steps):
            trees = self.inner.propose_rows(states, steps)
            calls.append(len(steps))
            for state, step in zip(states, steps):
                assert int(state.cache.lengths.max()) == step.history.numel() - 1, "the head missed rows"
            return trees

    class OneRowDrafts(Allocation):
        def sizes(self, gains, keys):  # each pass, only the first row with something to draft gets a node
            sizes = [1] * len(gains)
            first = next((b for b, key in enumerate(keys) if key is not None), None)
            if first is not None:
                sizes[first] = 2
            return sizes

    sizing = BatchSizing(per_row_sizes=True, trial_passes=0, probe=lambda step: False, allocation=OneRowDrafts)
    decoder = BatchedDecoder(target, Counting(head), sizing=sizing)
    results = check_rows(decoder, references, 3, "eagle3/one row drafts")
    assert calls and set(calls) == {1}  # one row per call: the others skipped the head
    assert any(size == 1 for result in results for size in result.tree_sizes)


def test_a_heads_call_after_skipped_passes_is_not_taken_as_its_price(monkeypatch):
    """A head reads every row verified since it last drafted, so its call after passes it skipped (and its first,
    after the prompt) costs more than drafting once more. Only calls whose rows drafted in the pass before are
    measured as the price of a model's call (``Allocation.model_call``)."""

    target = target_for("llama")
    head = head_proposers(target)["eagle3"]
    calls, measured = [], []
    last_drafted: dict[int, int] = {}  # id(state) -> the pass it last drafted in

    class Counting(Wrapping):
        def propose_rows(self, states, steps):
            now = decoder.stats.passes
            calls.append(all(last_drafted.get(id(state)) == now - 1 for state in states))
            for state in states:
                last_drafted[id(state)] = now
            return self.inner.propose_rows(states, steps)

    class Recording(Allocation):
        def sizes(self, gains, keys):  # the first row with something to draft gets a node, every 3rd pass two
            sizes = [1] * len(gains)
            drafting = [b for b, key in enumerate(keys) if key is not None][: 1 + (decoder.stats.passes % 3 == 0)]
            for b in drafting:
                sizes[b] = 2
            return sizes

        def observe_step(self, nodes_per_row, forward, model, step, model_call=None, rows=None):
            if model:
                measured.append(model_call is not None)
                assert model_call is None or model_call == model
            super().observe_step(nodes_per_row, forward, model, step, model_call, rows)

    sizing = BatchSizing(per_row_sizes=True, trial_passes=0, probe=lambda step: False, allocation=Recording)
    decoder = BatchedDecoder(target, Counting(head), sizing=sizing)
    decoder.generate(PROMPTS[:3], 24, batch_size=3)
    assert measured == calls
    assert not calls[0] and True in calls and False in calls[1:]


def test_drafting_trials_go_by_live_rows_and_carry_into_the_next_run(monkeypatch):
    """Each power-of-two bucket of live rows has its own trial (a run's rows finish one by one, and drafting pays
    more where few rows share a pass); a decoder's next run carries on from them, and no pair of blocks spans two
    runs or two buckets."""
    import runtime.engine.sizing
    from runtime.engine.sizing import row_bucket

    assert [row_bucket(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31)] == [1, 2, 2, 4, 4, 8, 8, 16, 16]
    monkeypatch.setattr(runtime.engine.sizing, "cost_curve", lambda target, batch_size=1: {1: 1.0, 2: 1.05, 4: 1.1})
    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    decoder = BatchedDecoder(target, NgramProposer(), sizing=BatchSizing(trial_passes=2))
    check_rows(decoder, references, 3, "first run")
    first = dict(decoder.trials)
    assert set(first) <= {1, 2} and 2 in first and first[2].decided is not None
    assert "2+ rows: " in decoder.tree_size_reason and "measured faster" in decoder.tree_size_reason
    counts = {bucket: (trial.count, trial.pairs) for bucket, trial in first.items()}
    check_rows(decoder, references, 3, "second run")
    for bucket, trial in first.items():
        assert decoder.trials[bucket] is trial
        passes, pairs = counts[bucket]
        assert trial.count > passes and trial.pairs <= pairs + (trial.count - passes) // trial.block
    check_rows(decoder, references, 8, "eight rows")
    assert 8 in decoder.trials and 8 not in first  # a bucket of its own, measured afresh


@pytest.mark.parametrize("outcome", ["plain", "drafting"])
def test_a_drafting_trial_keeps_every_row_equal_to_hf_greedy(outcome, monkeypatch):
    """A greedy run of several rows alternates drafting and plain passes, then chooses one of the two (here forced).
    Through the plain passes the rows keep collecting the hidden states a head reads, so that where drafting resumes
    it reads every position it missed. Every row stays HF greedy's."""
    import runtime.engine.sizing
    from runtime.proposers.lookup_first import LookupFirstProposer
    from runtime.engine.tree_sizing import DraftingTrial

    class Forced(DraftingTrial):
        def observe(self, size, tokens, seconds):
            super().observe(size, tokens, seconds)
            if self.decided is not None:
                self.decided = 1 if outcome == "plain" else self.drafting_size

    monkeypatch.setattr(runtime.engine.sizing, "cost_curve", lambda target, batch_size=1: {1: 1.0, 2: 1.05, 4: 1.1})
    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    heads = head_proposers(target)
    candidates = {"eagle3+ngram": LookupFirstProposer(heads["eagle3"]), "eagle": heads["eagle"],
                  "medusa": heads["medusa"], **proposers(target, "llama")}
    candidates.pop("none")  # nothing to try
    for name, proposer in candidates.items():
        decoder = BatchedDecoder(target, proposer, sizing=BatchSizing(trial_passes=2, trial=Forced))
        results = check_rows(decoder, references, 3, f"{name}/trial {outcome}")
        assert "measured faster" in decoder.tree_size_reason, name
        sizes = [size for result in results for size in result.tree_sizes]
        if outcome == "plain":
            assert sizes[-1] == 1 and "plain decoding measured faster" in decoder.tree_size_reason
        else:
            assert decoder.tree_size > 1 and max(sizes) > 1


def test_lookahead_rows_match_hf_greedy_with_their_own_tree_size():
    """Each row's window rides beside its tree (a different number of nodes per row, padded to the longest); the
    proposer's own tree size holds at every batch size (behind lookup, the size chosen for the batch caps both
    lookup's trees and lookahead's trie)."""
    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    for name, proposer in lookahead_proposers().items():
        decoder = BatchedDecoder(target, proposer)
        for batch_size in (3, 8):
            check_rows(decoder, references, batch_size, f"{name}/own size")
            own = "own size" in decoder.tree_size_reason
            assert own == (name != "lookahead+ngram")
            assert decoder.tree_size == proposer.tree_size or not own
    # sampling: each row draws what it draws decoded alone with its seed
    proposer = lookahead_proposers()["lookahead+ngram"]
    seeds = list(range(len(PROMPTS)))
    alone = [SpeculativeDecoder(target, proposer).generate(prompt, NEW_TOKENS, temperature=1.0, seed=seed).tokens
             for prompt, seed in zip(PROMPTS, seeds)]
    results = BatchedDecoder(target, proposer).generate(PROMPTS, NEW_TOKENS, temperature=1.0, seeds=seeds,
                                                         batch_size=3)
    assert [result.tokens for result in results] == alone


@pytest.mark.parametrize("name", ["none", "draft-tree", "eagle3"])
def test_cascade_backend_matches_hf_greedy(name):
    """The cascade's maskless prefix is the shortest row's committed length, which every row sees whole."""
    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    proposer = {**proposers(target, "llama"), **head_proposers(target)}[name]
    check_rows(BatchedDecoder(target, proposer, tree_size=8, attention="cascade"), references, 3, f"cascade/{name}")


@pytest.mark.parametrize("arch", ["mistral", "qwen2-sliding", "gemma2"])
def test_sliding_window_rows_match_hf_greedy(arch):
    """Rows of different lengths put their new entries at different slots: the window must follow each row's key
    positions, not the pass's last slots."""
    target = target_for(arch)
    references = [hf_greedy(arch, prompt) for prompt in PROMPTS]
    candidates = {**proposers(target, arch), **head_proposers(target)}
    candidates["lookahead+ngram"] = lookahead_proposers()["lookahead+ngram"]
    names = list(candidates) if arch == "mistral" else ["none", "ngram", "self-draft", "eagle3", "lookahead+ngram"]
    for name in names:
        check_rows(BatchedDecoder(target, candidates[name], tree_size=8), references, 3, f"{arch}/{name}")
    for name in ("none", "self-draft", "eagle3"):
        decoder = BatchedDecoder(target, candidates[name], tree_size=8, attention="cascade")
        check_rows(decoder, references, 8, f"{arch}/{name}/cascade")


def test_sliding_window_mask_with_explicit_key_positions():
    # two rows, one node each: row 0 has 2 committed slots (its node sits at slot 2, position 2), row 1 has 4
    # (its node at slot 4, position 4); slot 3 of row 0 holds nothing of it
    position_ids = torch.tensor([[2], [4]])
    key_positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    key_positions[0, 2] = 2
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])[:, None, None]
    windowed = sliding_window_mask(mask, position_ids, 5, window=2, key_positions=key_positions)
    assert windowed[:, 0, 0].tolist() == [[False, True, True, False, False], [False, False, False, True, True]]
    with pytest.raises(ValueError, match="key_positions covers 4 key slots"):
        sliding_window_mask(mask, position_ids, 5, window=2, key_positions=key_positions[:, :4])


@pytest.mark.parametrize("name", ["none", "self-draft", "ngram", "eagle"])
def test_rows_that_stop_early_and_rows_that_join_late(name):
    """Stop tokens end rows at different steps; with fewer slots than prompts the next prompts take their rows."""
    target = target_for("llama")
    free = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    stops = {free[0][3], free[1][10], free[4][6]}
    references = [hf_greedy("llama", prompt, eos_token_id=sorted(stops)) for prompt in PROMPTS]
    assert sum(len(reference) < NEW_TOKENS for reference in references) >= 3
    proposer = {**proposers(target, "llama"), **head_proposers(target)}[name]
    decoder = BatchedDecoder(target, proposer, tree_size=6)
    for batch_size in (2, 3):
        results = check_rows(decoder, references, batch_size, f"stops/{name}", stop_token_ids=stops)
        for result, reference in zip(results, references):
            assert result.stop_reason == ("stop" if len(reference) < NEW_TOKENS else "length")
        # the first prompts in passes of similar length, each late prompt alone
        first = prefill_groups([len(prompt) for prompt in PROMPTS[:batch_size]],
                               pass_overhead_tokens(cost_curve(target)))
        assert decoder.stats.prefill_passes == len(first) + len(PROMPTS) - batch_size


def test_results_come_as_rows_finish_and_generate_keeps_input_order():
    target = target_for("llama")
    prompts = [list(range(1, 30)), [4], [6, 7, 8]]
    stops = {18, 20}  # the tiny model's outputs reach them at once (row 1), soon (row 2) and never (row 0)
    references = [hf_greedy("llama", prompt, 20, eos_token_id=sorted(stops)) for prompt in prompts]
    assert [len(reference) for reference in references] == [20, 1, 3]
    decoder = BatchedDecoder(target, NgramProposer(), tree_size=6)
    finished = list(decoder.results(prompts, 20, stop_token_ids=stops, batch_size=3))
    assert [index for index, _ in finished] == [1, 2, 0]
    assert [result.tokens for _, result in sorted(finished, key=lambda item: item[0])] == references
    generated = decoder.generate(prompts, 20, stop_token_ids=stops, batch_size=3)
    assert [result.tokens for result in generated] == references
    assert [result.stop_reason for result in generated] == ["length", "stop", "stop"]


def test_one_new_token_and_prompts_that_finish_at_prefill():
    target = target_for("qwen2")
    references = [hf_greedy("qwen2", prompt, 1) for prompt in PROMPTS]
    decoder = BatchedDecoder(target, NgramProposer(), tree_size=4)
    for batch_size in (1, 3):
        results = decoder.generate(PROMPTS, 1, batch_size=batch_size)
        assert [result.tokens for result in results] == references
        assert all(result.accept_lengths == [] and result.target_forwards == 1 for result in results)
        assert decoder.stats.passes == 0
    assert decoder.generate([], 5) == []


def test_stop_strings_and_typical_acceptance_as_decoded_alone():
    from tests.tiny_training import char_tokenizer

    tokenizer = char_tokenizer()
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=len(tokenizer)), tokenizer, identity="tiny")
    prompts = [tokenizer(text)["input_ids"] for text in ("abc abc abc", "a", "hello hello", "xyz")]
    single = SpeculativeDecoder(target, NgramProposer(), tree_size=6)
    free = [single.generate(prompt, NEW_TOKENS, stop_token_ids=[]).tokens for prompt in prompts]
    stops = [tokenizer.decode(free[0])[5:8], tokenizer.decode(free[2])[2:4]]
    settings = dict(stop_token_ids=[], stop_strings=stops)
    expected = [single.generate(prompt, NEW_TOKENS, **settings) for prompt in prompts]
    assert any(result.stop_reason == "stop" for result in expected)
    for acceptance in ("exact", "typical"):  # typical acceptance at temperature 0 takes only the argmax: exact too
        decoder = BatchedDecoder(target, NgramProposer(), tree_size=6, acceptance=acceptance)
        results = decoder.generate(prompts, NEW_TOKENS, batch_size=2, **settings)
        assert [(r.tokens, r.stop_reason) for r in results] == [(r.tokens, r.stop_reason) for r in expected]


class SplitProposer(Proposer):
    """Per row, a perfect chain (the target drafting for itself) or a wrong one, chosen by the prompt's first token:
    rows of one batch then accept very different lengths at every pass."""

    name = "split"
    expected_acceptance = 0.5

    def __init__(self, target):
        self.good, self.bad = DraftModelProposer(target, target, "chain", depth=4), BadProposer()

    def start(self, prompt, max_length, sampling=None):
        good = int(prompt[0]) % 2 == 0
        return good, self.good.start(prompt, max_length) if good else None

    def propose(self, state, step):
        good, inner = state
        return self.good.propose(inner, step) if good else self.bad.propose(None, step)


def test_rows_with_different_accepted_lengths_compact_to_their_own_paths():
    target = target_for("llama")
    prompts = [[2, 9, 4, 1], [3] + list(range(20, 33)), [4, 7], [5, 5, 6, 1, 8, 30, 31]]
    references = [hf_greedy("llama", prompt) for prompt in prompts]
    decoder = BatchedDecoder(target, SplitProposer(target), tree_size=5)
    results = check_rows(decoder, references, 4, "split", prompts=prompts)
    for good in (0, 2):  # every draft accepted, the last pass cut by the length limit
        assert results[good].accept_lengths == [5] * 3
    for bad in (1, 3):
        assert len(results[bad].accept_lengths) > 2 * len(results[0].accept_lengths)

    # the cache itself: after passes with different accepted lengths, each row holds exactly the K/V of its own
    # committed tokens, as a fresh prefill of that row alone gives them
    cache = target.new_cache(len(prompts), 64)
    greedy = SamplingParams()
    with torch.inference_mode():
        rows = decoder._prefill(cache, list(range(len(prompts))), [torch.tensor(p) for p in prompts], 30, greedy,
                                None)
        for _ in range(3):
            for row in rows:
                row.history[row.length:row.length + len(row.pending)] = torch.tensor(row.pending)
                row.length += len(row.pending)
            decoder._step(rows, cache, greedy, decoder.tree_size)
        for row in rows:  # the last pass's tokens: all but the bonus token are in the cache
            row.history[row.length:row.length + len(row.pending)] = torch.tensor(row.pending)
            row.length += len(row.pending)
        assert cache.lengths.tolist() == [row.length - 1 for row in rows]
        assert len({row.length for row in rows}) > 1
        for b, row in enumerate(rows):
            alone = target.new_cache(1, 64)
            committed = row.length - 1
            target.forward(row.history[None, :committed], torch.arange(committed)[None], alone, None)
            torch.testing.assert_close(cache.kv[:, :, b, :, :committed], alone.kv[:, :, 0, :, :committed],
                                       atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_clear_errors():
    target = target_for("llama")
    decoder = BatchedDecoder(target, None, tree_size=1)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder.generate([[1], []], 4)
    with pytest.raises(ValueError, match="seeds has 1 entries for 2 prompts"):
        decoder.generate([[1], [2]], 4, temperature=1.0, seeds=[3])
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        decoder.generate([[1]], 4, batch_size=0)
    with pytest.raises(ValueError, match="prompt 0 of 500 tokens"):
        decoder.generate([list(range(500))], 20)
    with pytest.raises(ValueError, match="tree_size"):
        BatchedDecoder(target, None, tree_size=0)
    with pytest.raises(ValueError, match="prompt 1 holds token id 64, outside the target's vocabulary"):
        decoder.generate([[1], [2, 64]], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number >= 1, got -3"):
        decoder.generate([[1]], -3)
    rows = decoder.generate(torch.tensor([PROMPTS[1][:3], PROMPTS[2][:3]]), 4)  # a [B, P] tensor is B prompts
    assert [row.tokens for row in rows] == [hf_greedy("llama", prompt[:3], 4) for prompt in PROMPTS[1:3]]


@pytest.mark.parametrize("overhead", [0.0, 4.0, float("inf")])
def test_the_first_prompts_prefill_in_groups_and_match_hf_greedy(monkeypatch, overhead):
    """Whatever the split of the first prompts into prefill passes (each alone, groups, one padded pass), every row
    writes its own rows of the cache and decodes as alone; the proposer reads each row's prompt features."""


    class Grouping(BatchSizing):
        def prefill_overhead(self, target):
            return overhead

    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    groups = prefill_groups([len(prompt) for prompt in PROMPTS], overhead)
    assert len(groups) == {0.0: 8, 4.0: 5, float("inf"): 1}[overhead]
    candidates = {**proposers(target, "llama"), **head_proposers(target)}
    for name in ("none", "eagle3"):
        decoder = BatchedDecoder(target, candidates[name], sizing=Grouping(tree_size=6))
        check_rows(decoder, references, len(PROMPTS), f"prefill groups {overhead}/{name}")
        assert decoder.stats.prefill_passes == len(groups)


def test_prefill_inputs_by_hand():
    from runtime.engine.batched import prefill_inputs

    tokens, positions, mask = prefill_inputs([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0]] and positions.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]  # causal
    # the short row's padding queries see its one real key and themselves; no query sees another padding key
    assert mask[1, 0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    tokens, _, mask = prefill_inputs([torch.tensor([4, 2])])
    assert tokens.tolist() == [[4, 2]] and mask is None  # a lone prompt: causal, no mask


def test_cache_row_views_and_dropping_rows():
    from runtime.engine.kv_cache import KVCache

    cache = KVCache(2, 3, 1, 2, 16, torch.float32, "cpu")
    cache.commit(torch.tensor([4, 9, 6]))
    view = cache.rows(1, 2)  # the next prompt takes over row 1: an empty batch-1 cache over its slots
    assert view.lengths.tolist() == [0] and view.max_committed == 0
    keys, _ = view.update(torch.full((1, 1, 3, 2), 7.0), torch.full((1, 1, 3, 2), -7.0), 1)
    assert keys.shape == (1, 1, 3, 2)
    view.commit(3)
    cache.set_row_length(1, 3)
    assert cache.lengths.tolist() == [4, 3, 6] and cache.max_committed == 6
    assert cache.kv[1, 0, 1, 0, :3].eq(7).all() and cache.kv[1, 1, 1, 0, :3].eq(-7).all()
    assert cache.kv[:, :, [0, 2]].eq(0).all() and cache.kv[0].eq(0).all()  # other rows and layers untouched
    cache.kv[:, :, 2, :, :6] = 5.0
    assert cache.keep_rows([2, 1]) == [2, 1]  # row 1 stays; row 2 moves into row 0's slots
    assert cache.kv.shape[2] == 2 and cache.lengths.tolist() == [6, 3] and cache.max_committed == 6
    assert cache.kv[1, 0, 1, 0, :3].eq(7).all() and cache.kv[:, :, 0, :, :6].eq(5).all()
    for layer in range(2):  # a pass writes through each layer's keys viewed flat: they stay contiguous
        assert cache.kv[layer, 0].is_contiguous()
    cache.update(torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2), 0)
    cache.commit(1)
    assert cache.kv[0, 0, 0, 0, 6].eq(1).all() and cache.kv[0, 0, 1, 0, 3].eq(1).all()
    assert cache.keep_rows([1]) == [1] and cache.lengths.tolist() == [4] and cache.kv[1, 0, 0, 0, :3].eq(7).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["sdpa", "flex", "cascade"])
def test_gpu_batched_greedy_equality(backend):
    """On CUDA in fp32 each row equals that prompt decoded alone (tests/test_greedy_equality.py checks the
    single-prompt decoder against HF generate there), an EAGLE-3 head's first read of prompts of different lengths
    packed included."""
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB).to("cuda"), identity="tiny")
    head = EagleProposer(eagle_head(target, "eagle3").to("cuda"), target, depth=4, top_k=3)
    for proposer in (None, NgramProposer(), DraftModelProposer(target, target, "tree", depth=4, top_k=3), head):
        single = SpeculativeDecoder(target, proposer, tree_size=8, attention=backend)
        references = [single.generate(prompt, NEW_TOKENS).tokens for prompt in PROMPTS]
        results = BatchedDecoder(target, proposer, tree_size=8, attention=backend).generate(PROMPTS, NEW_TOKENS,
                                                                                            batch_size=3)
        assert [result.tokens for result in results] == references


# -- sampling -------------------------------------------------------------------------------------------------------

def batched_p_value(proposer, params: SamplingParams, tree_size: int = 4, batch_size: int = 64) -> float:
    """The chi-square test of tests/test_sampling_distribution.py with every sample a row of one batched call: the
    same prompt in every row, each row seeded with its own number."""
    target = target_from_model(sampling.model(0), identity="tiny")
    decoder = BatchedDecoder(target, proposer(target) if proposer else None, tree_size=tree_size)
    results = decoder.generate([sampling.PROMPT] * sampling.SAMPLES, 3, params.temperature, params.top_k,
                               params.top_p, seeds=list(range(sampling.SAMPLES)), batch_size=batch_size)
    return sampling.joint_p_value([result.tokens for result in results], params)


@pytest.mark.parametrize("name,params,batch_size", [
    ("none", SamplingParams(temperature=1.0), 64),
    ("draft-chain-sampled", SamplingParams(temperature=1.0), 64),
    ("random", SamplingParams(1.3, top_k=3), 16),
    ("lookahead+ngram", SamplingParams(temperature=1.0), 16)],
    ids=["none-T1", "draft-chain-T1", "random-T1.3-top_k3", "lookahead+ngram-T1"])
def test_batched_sampling_matches_the_target_distribution(name, params, batch_size):
    assert batched_p_value(sampling.PROPOSERS[name], params, batch_size=batch_size) > 1e-3


def test_a_rows_sample_does_not_depend_on_its_neighbours():
    """A row draws from its own seeded stream only: alone, next to other prompts or seeds, at any batch size, and
    in the single-prompt decoder, a prompt and seed give the same tokens."""
    target = target_for("llama")
    draft = target_from_model(tiny_model("llama", seed=1, vocab_size=VOCAB), identity="draft")
    proposer = DraftModelProposer(draft, target, "chain", depth=3)  # draws its drafts from the row's stream
    decoder = BatchedDecoder(target, proposer, tree_size=4)
    prompt, seed = PROMPTS[2], 11
    alone = SpeculativeDecoder(target, proposer, tree_size=4).generate(prompt, NEW_TOKENS, temperature=1.0,
                                                                        seed=seed).tokens
    layouts = [([prompt], [seed], 1),
               ([PROMPTS[1], prompt, PROMPTS[0]], [1, seed, 2], 3),
               ([PROMPTS[3], PROMPTS[4], PROMPTS[0], prompt, PROMPTS[1]], [5, 6, 7, seed, 8], 2),
               ([prompt, prompt, prompt], [3, seed, 4], 8)]
    for prompts, seeds, batch_size in layouts:
        results = decoder.generate(prompts, NEW_TOKENS, temperature=1.0, seeds=seeds, batch_size=batch_size)
        assert results[seeds.index(seed)].tokens == alone, f"{len(prompts)} prompts, batch {batch_size}"
    # and the neighbours do differ from it, so the check means something
    others = decoder.generate([prompt] * 3, NEW_TOKENS, temperature=1.0, seeds=[1, 2, 3])
    assert any(result.tokens != alone for result in others)


def test_a_seed_repeats_its_draws_with_adaptive_tree_sizes(monkeypatch):
    """With the tree size left to the decoder, greedy runs teach its sizers; a sampled generation keeps the one-row
    starting size, so a seed gives the same tokens on a fresh decoder, on one that has decoded before, and in a
    batch."""
    import runtime.engine.sizing

    monkeypatch.setattr(runtime.engine.sizing, "cost_curve", lambda target, batch_size=1: {1: 1.0, 2: 1.05, 4: 1.1,
                                                                                         8: 1.3})
    target = target_for("llama")
    draft = target_from_model(tiny_model("llama", seed=1, vocab_size=VOCAB), identity="draft")
    proposer = DraftModelProposer(draft, target, "chain", depth=6)
    prompt, seed = PROMPTS[2], 11
    fresh = SpeculativeDecoder(target, proposer).generate(prompt, NEW_TOKENS, temperature=1.0, seed=seed).tokens
    used = SpeculativeDecoder(target, proposer)
    for other in PROMPTS:  # greedy decoding moves the sizer's sizes and probes
        used.generate(other, NEW_TOKENS)
    assert used.generate(prompt, NEW_TOKENS, temperature=1.0, seed=seed).tokens == fresh
    assert used.generate(prompt, NEW_TOKENS, temperature=1.0, seed=seed).tokens == fresh
    batched = BatchedDecoder(target, proposer).generate([PROMPTS[0], prompt], NEW_TOKENS, temperature=1.0,
                                                        seeds=[3, seed], batch_size=2)
    assert batched[1].tokens == fresh


class FixedTrees(Proposer):
    """Row r (in the order rows start) always gets the tree of shape ``shapes[r]``: (parents of the nodes after the
    root, their tokens)."""

    name = "fixed"

    def __init__(self, shapes):
        self.shapes, self.started = shapes, 0

    def start(self, prompt, max_length, sampling=None):
        self.started += 1
        return self.started - 1

    def propose(self, state, step):
        parents, tokens = self.shapes[state]
        return Tree(torch.tensor([int(step.history[-1]), *tokens]), torch.tensor([-1, *parents]))


def verified_alone(target, history: torch.Tensor, tree: Tree) -> torch.Tensor:
    """Logits of ``tree`` verified after ``history`` as the single-prompt decoder verifies it."""
    cache = target.new_cache(1, 128)
    committed = history.numel()
    target.forward(history[None], torch.arange(committed)[None], cache, None)
    cache.commit(committed)
    mask = verification_mask(tree.ancestor_mask(), committed)
    return target.forward(tree.tokens[None], tree.position_ids(committed)[None], cache, mask,
                          prefix_len=committed).logits[0]


@pytest.mark.parametrize("arch,attention,dtype", [("llama", "sdpa", "float32"), ("mistral", "sdpa", "float32"),
                                                  ("mistral", "cascade", "float32"), ("gemma2", "sdpa", "float32"),
                                                  ("llama", "sdpa", "bfloat16"), ("mistral", "sdpa", "bfloat16")])
def test_one_pass_gives_every_row_its_own_logits(arch, attention, dtype, monkeypatch):
    """Rows of different committed lengths and trees of different sizes and shapes (packed: no padding token is
    computed) in one pass: every real node gets the logits it gets verified alone, past a sliding window too (a
    chain deeper than the window in a row a few slots shorter than the longest), and every output of the pass is
    finite. In bf16 with 64-wide heads the CPU decode kernel reads the packed query rows itself."""
    import runtime.target.attention

    if dtype == "float32":
        target = target_for(arch)
    else:  # a head size the decode kernel takes
        model = tiny_model(arch, seed=0, vocab_size=VOCAB, hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1)
        target = target_from_model(model.to(torch.bfloat16), identity="tiny-bf16")
    kernel, packed_calls = runtime.target.attention.decode_attention(), []
    if kernel is not None:
        monkeypatch.setattr(runtime.target.attention, "decode_attention", lambda: lambda *args: packed_calls.append(
            len(args) > 5 and args[5] is not None) or kernel(*args))
    generator = torch.Generator().manual_seed(0)

    def tokens(count):
        return torch.randint(0, VOCAB, (count,), generator=generator).tolist()

    chain = list(range(7))  # parents of a 7-node chain below the root: depth 7, past the window of 6
    shapes = [([], []), ([0, 0, 0, 0, 0, 5, 6], tokens(7)), (chain, tokens(7)), (chain, tokens(7)),
              ([0, 1, 2], tokens(3))]
    prompts = [torch.tensor(tokens(length)) for length in (3, 9, 12, 15, 15)]
    decoder = BatchedDecoder(target, FixedTrees(shapes), tree_size=8, attention=attention)
    outputs = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *args, **kwargs: outputs.append(forward(*args, **kwargs))
                        or outputs[-1])
    cache = target.new_cache(len(prompts), 64)
    with torch.inference_mode():
        rows = decoder._prefill(cache, list(range(len(prompts))), prompts, 20, SamplingParams(), None)
        for row in rows:
            row.history[row.length] = row.pending[0]
            row.length += 1
        histories = [row.history[:row.length].clone() for row in rows]
        decoder._step(rows, cache, SamplingParams(), decoder.tree_size)
    verify = outputs[-1]
    sizes = [len(parents) + 1 for parents, _ in shapes]
    assert verify.hidden.shape[:2] == (1, sum(sizes)) and torch.isfinite(verify.hidden).all()
    for b, history in enumerate(histories):
        tree = FixedTrees(shapes).propose(b, ProposeInput(history, None, (), 8, SamplingParams(), None))
        with torch.inference_mode():
            alone = verified_alone(target, history[:-1], tree)
        start = sum(sizes[:b])
        # bf16: the pass's linears may take another product for 26 rows than for one tree's (decode_linear), which
        # rounds differently (measured: at most one bf16 step of these logits)
        tolerance = 1e-5 if dtype == "float32" else 1e-2
        torch.testing.assert_close(verify.logits[0, start:start + tree.size], alone, atol=tolerance,
                                   rtol=tolerance, msg=lambda text, row=b: f"row {row}: {text}")
        assert int(cache.lengths[b]) == history.numel() - 1 + len(rows[b].pending)
    if dtype == "bfloat16" and kernel is not None:
        assert any(packed_calls), "the packed pass did not reach the decode kernel"


# -- scripts/generate.py --batch-size ---------------------------------------------------------------------------------

RUN_GENERATE = r"""
import sys
import generate

for argv in sys.argv[1:]:
    generate.main(argv.split("|"))
"""


def test_generate_script_batch_size_writes_what_one_at_a_time_writes(tmp_path):
    import json

    from tests.script_runs import REPO, run_script, save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("hello there", "a", "tell me more")))
    common = ["--target", model_dir, "--proposer", "ngram", "--prompts", prompts, "--max-new-tokens", "10",
              "--tree-size", "5", "--temperature", "1", "--seed", "3", "--samples", "2"]
    outputs = {size: tmp_path / f"batch{size}.jsonl" for size in (1, 4)}
    runs = ["|".join(str(part) for part in [*common, "--batch-size", size, "--output", out])
            for size, out in outputs.items()]
    finished = run_script("-c", RUN_GENERATE, *runs, cwd=REPO / "scripts")
    assert "batches of 4" in finished.stderr
    one, batched = ([json.loads(line) for line in out.read_text().splitlines()] for out in outputs.values())
    assert [(line["id"], line["sample"]) for line in batched] == [(i, s) for i in range(3) for s in range(2)]
    for alone, together in zip(one, batched):
        assert set(together) == set(alone)
        assert together["output_ids"] == alone["output_ids"] and together["text"] == alone["text"]
        assert together["accept_lengths"] == alone["accept_lengths"]


def test_a_run_without_drafting_never_calls_the_proposer():
    """When the batch's tree size is 1 (drafting does not pay at that batch size), rows decode plainly and the
    proposer (an EAGLE head would read every verified row) is not run at all."""
    from tests.proposers_for_tests import BadProposer

    class Refusing(BadProposer):
        def propose(self, state, step):
            raise AssertionError("the proposer ran in a run that drafts nothing")

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    prompts = [[1, 2, 3], list(range(10, 30))]
    results = BatchedDecoder(target, Refusing(), tree_size=1).generate(prompts, 12, batch_size=2)
    assert [r.tokens for r in results] == [hf_greedy("llama", p, 12) for p in prompts]


def test_a_run_without_drafting_asks_the_passes_for_no_head_features(monkeypatch):
    """A 1-node run of an EAGLE-3 head costs what plain decoding does: no pass returns the head's layer inputs,
    while a run that drafts asks every pass for them; both match HF greedy."""
    target = target_for("llama")
    proposer = head_proposers(target)["eagle3"]
    asked = []
    forward = type(target).forward

    def spying(self, *args, hidden_layers=(), **kwargs):
        asked.append(tuple(hidden_layers))
        return forward(self, *args, hidden_layers=hidden_layers, **kwargs)

    monkeypatch.setattr(type(target), "forward", spying)
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    check_rows(BatchedDecoder(target, proposer, tree_size=1), references, 3, "eagle3/1 node")
    assert asked and all(layers == () for layers in asked)
    asked.clear()
    check_rows(BatchedDecoder(target, proposer, tree_size=4), references, 3, "eagle3/4 nodes")
    assert asked and all(layers == tuple(proposer.hidden_layers) for layers in asked)


@pytest.mark.parametrize("name", ["eagle3+ngram", "medusa"])
def test_greedy_rows_drafting_alone_or_together_decode_the_same(name, monkeypatch):
    """draft_together=False drafts row by row (propose_rows is never called); both modes match HF greedy."""
    target = target_for("llama")
    references = [hf_greedy("llama", prompt) for prompt in PROMPTS]
    proposer = head_proposers(target)[name]
    check_rows(BatchedDecoder(target, proposer, tree_size=6), references, 3, f"{name}/together")
    monkeypatch.setattr(type(proposer), "propose_rows", lambda *args: pytest.fail("drafted together"))
    check_rows(BatchedDecoder(target, proposer, tree_size=6, draft_together=False), references, 3, f"{name}/alone")


@pytest.mark.parametrize("name", ["none", "ngram", "eagle3"])
def test_recorded_features_are_the_targets_hidden_states(name):
    """The features a batched run records (from its prefill and verification passes, rows joining late and
    stopping early) equal one causal forward over each prompt + output: the last hidden state and the inputs of
    the recorded layers, at every position whose pass ran (all but the last output token, unless a stop cut a pass
    short after a drafted token)."""
    target = target_for("llama")
    proposer = {"none": None, "ngram": NgramProposer(),
                "eagle3": head_proposers(target)["eagle3"]}[name]
    layers = (1, 0)
    decoder = BatchedDecoder(target, proposer, tree_size=6, attention="sdpa", record_layers=layers)
    results = decoder.generate(PROMPTS, NEW_TOKENS, batch_size=3)
    plain = BatchedDecoder(target, proposer, tree_size=6, attention="sdpa").generate(PROMPTS, NEW_TOKENS,
                                                                                      batch_size=3)
    assert [r.tokens for r in results] == [r.tokens for r in plain]  # recording changes no output
    assert all(r.features is None for r in plain)
    for prompt, result in zip(PROMPTS, results):
        sequence = torch.tensor([prompt + result.tokens])
        with torch.no_grad():
            outputs = target.model.model(input_ids=sequence, output_hidden_states=True)
        features = result.features
        count = features["hidden"].shape[0]
        assert count in (len(prompt) + len(result.tokens) - 1, len(prompt) + len(result.tokens))
        torch.testing.assert_close(features["hidden"], outputs.last_hidden_state[0, :count], atol=1e-4, rtol=1e-4)
        expected = torch.cat([outputs.hidden_states[i][0, :count] for i in layers], dim=-1)
        torch.testing.assert_close(features["layer_hidden"], expected, atol=1e-4, rtol=1e-4)
    if name != "none":
        assert decoder.stats.tau > 1.0, "nothing was accepted: the test would not see tree nodes recorded"
