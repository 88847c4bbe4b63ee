"""Tree sizing: the cost curve's best size by hand, and the adaptive sizer on hand-built costs and acceptance."""

from __future__ import annotations

import pytest

from runtime.engine.tree_sizing import best_tree_size, expected_tokens
from runtime.target.cost_model import pass_overhead_tokens, prefill_groups
from runtime.engine.tree_sizing import DepthAcceptance, TreeSizer


def test_expected_tokens_by_hand():
    assert expected_tokens(1, 0.5) == 1
    assert expected_tokens(3, 0.5) == pytest.approx(1.75)


def test_best_tree_size_by_hand():
    curve = {1: 1.0, 2: 1.25, 4: 1.3, 8: 1.9}
    # per unit cost at acceptance 0.5: 1.0, 1.2, 1.44, 1.05
    assert best_tree_size(curve, 0.5) == 4
    # at 0.1 nothing beats plain decoding: 1.0, 0.88, 0.85, 0.58
    assert best_tree_size(curve, 0.1) == 1


def test_depth_acceptance_is_conditional_on_the_depth_above():
    acceptance = DepthAcceptance(prior=0.5, prior_weight=2)
    acceptance.observe(drafted_depth=3, accepted_depth=1)  # depth 1 taken, depth 2 tried and missed, depth 3 unseen
    acceptance.observe(drafted_depth=3, accepted_depth=3)
    assert acceptance.attempts == [2, 2, 1] and acceptance.accepts == [2, 1, 1]
    assert acceptance.rate(1) == pytest.approx((2 + 1) / (2 + 2))
    assert acceptance.rate(3) == pytest.approx((1 + 1) / (1 + 2))
    assert acceptance.rate(4) == 0.5  # never tried: the prior
    assert acceptance.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75 * 0.5)


def run(sizer: TreeSizer, steps: int, accepted, seconds) -> list[int]:
    """Drive the sizer: ``accepted(size)`` drafts accepted, ``seconds(size)`` per step."""
    chosen = []
    for _ in range(steps):
        size = sizer.choose()
        chosen.append(size)
        sizer.observe(size, size - 1, min(accepted(size), size - 1), seconds(size))
    return chosen


def test_a_pessimistic_curve_is_corrected_by_probing_and_timings():
    """A curve that says two tokens cost 1.9x one switches speculation off at first; probes measure the real cost
    (1.05x) and the acceptance, and the sizer settles on speculating."""
    sizer = TreeSizer({1: 1.0, 2: 1.9, 4: 2.6, 8: 4.0}, prior_acceptance=0.45, probe_every=8)
    assert sizer.best() == 1
    # two drafts accepted whenever drafted: a tree of 4 (three deep) is the best value
    chosen = run(sizer, 200, accepted=lambda size: 2, seconds=lambda size: 0.010 * (1 + 0.05 * size))
    assert chosen[0] == 1 and chosen[7] == 2  # the first probe goes upwards from plain decoding
    assert set(chosen[-40:]) - {4} <= {2, 8}  # settled on 4, its neighbours probed now and then
    assert sizer.report()["sizes"][4] > 100


def test_speculation_that_never_pays_goes_off_and_is_still_probed():
    sizer = TreeSizer({1: 1.0, 2: 1.05, 4: 1.2}, prior_acceptance=0.6, probe_every=10)
    chosen = run(sizer, 100, accepted=lambda size: 0, seconds=lambda size: 0.01 * (1 + 0.1 * size))
    assert chosen[-20:].count(1) >= 18  # plain decoding wins once nothing is ever accepted
    assert 2 in chosen[-20:]  # and a bigger tree is still tried now and then


def test_a_measured_start_size_is_kept_until_the_first_probe():
    sizer = TreeSizer({1: 1.0, 2: 1.9, 4: 2.6}, prior_acceptance=0.3, start=4, probe_every=16)
    assert sizer.started and sizer.current == 4
    chosen = run(sizer, 4, accepted=lambda size: size - 1, seconds=lambda size: None)
    assert chosen == [4, 4, 4, 2]  # the first probe, at step 4, tries the size below (4 is the largest)


def test_timings_are_ignored_when_costs_must_not_move():
    sizer = TreeSizer({1: 1.0, 2: 1.9}, prior_acceptance=0.5, probe_every=4, learn_costs=False)
    run(sizer, 40, accepted=lambda size: size - 1, seconds=lambda size: 0.01)
    assert sizer.seconds == {} and sizer.cost(2) == 1.9


def test_the_quick_start_speculates_even_from_a_pessimistic_cached_curve(monkeypatch):
    """The reported failure: a cached curve saying two tokens cost 1.92x one made ngram draft nothing for good.
    With adaptive sizing the decoder starts at plain decoding, probes, learns and speculates (tau > 1), and the
    output stays the target's greedy output."""
    import runtime.engine.sizing
    from runtime.engine.decoder import SpeculativeDecoder
    from runtime.proposers import NgramProposer
    from runtime.target.model import target_from_model
    from tests.conftest import tiny_model
    from tests.test_greedy_equality import hf_greedy

    import runtime.engine.decoder

    monkeypatch.setattr(runtime.engine.sizing, "cost_curve",
                        lambda target, batch_size=1: {1: 1.0, 2: 1.92, 4: 2.6, 8: 4.0})
    # A tiny model's step timings are mostly Python and vary with the machine: every step reports the same seconds
    # (a pass costs the same at every size, as the probes would find on a real target's flat end), so what is
    # tested is the probing and learning of acceptance, not this machine's timer.
    monkeypatch.setattr(runtime.engine.decoder, "synchronized_seconds", lambda device, started: 0.01)
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=64), identity="tiny")
    decoder = SpeculativeDecoder(target, NgramProposer())
    assert decoder.tree_size_reason.startswith("adaptive, starting at 1") and decoder.tree_size == 8
    prompt = [1, 2, 3, 1, 2, 3, 1]
    result = decoder.generate(prompt, 200)
    assert result.tokens == hf_greedy("llama", prompt, 200)
    assert result.tree_sizes[0] == 1 and max(result.tree_sizes) > 1
    assert result.tau > 1.2
    assert sum(decoder.tree_size_report()["sizes"].values()) == len(result.tree_sizes)


def test_timings_wait_for_the_device(monkeypatch):
    """CUDA runs kernels asynchronously: a timing must synchronise first (checked here without a GPU)."""
    import time

    import torch

    from runtime.target.machine import synchronized_seconds

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    started = time.perf_counter()
    assert synchronized_seconds(torch.device("cuda", 0), started) >= 0 and waited == [torch.device("cuda", 0)]
    synchronized_seconds(torch.device("cpu"), started)
    assert len(waited) == 1


def test_the_batched_tree_size_follows_the_cost_curve_at_the_batch_size():
    """Many rows make extra tree nodes dearer: the size shrinks with the batch, to plain decoding where drafting no
    longer pays (measured curves, here hand-built); sampled rows keep the one-row size so that their draws do not
    depend on how many rows share the batch. Allocated per row and pass, greedy rows draft fewer nodes as the batch
    grows."""
    from runtime.engine.batched import BatchedDecoder
    from runtime.engine.sizing import BatchSizing
    from runtime.proposers import NgramProposer
    from runtime.target.model import target_from_model
    from tests.conftest import tiny_model
    from tests.proposers_for_tests import BadProposer

    curves = {1: {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3}, 2: {1: 1.0, 2: 1.1, 4: 1.45, 8: 2.0},
              4: {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5}}

    def sized(per_row_sizes):
        return BatchSizing(per_row_sizes=per_row_sizes, curve=lambda target, batch_size=1: curves[batch_size])

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=64), identity="tiny")
    decoder = BatchedDecoder(target, NgramProposer(), sizing=sized(False))  # prior acceptance 0.45
    default = BatchedDecoder(target, NgramProposer(), sizing=sized(None))  # per row: lookup at any batch size
    modelled = BatchedDecoder(target, BadProposer(), sizing=sized(None))  # per row where one size would draft
    prompts = [[1, 2, 3, 1, 2, 3]] * 4
    chosen = {}
    for rows in (1, 2, 4):
        decoder.generate(prompts, 4, batch_size=rows)
        chosen[rows] = decoder.tree_size
        default.generate(prompts, 4, batch_size=rows)
        modelled.generate(prompts, 4, batch_size=rows)
        # None: a lookup's sizes per row at every batch size of several rows (a lookup that finds nothing costs
        # nothing, and its long matches pay where its average does not); another drafter's per row where several
        # rows' one size would draft, plain decoding where it would not; a lone row's one size
        assert (default.allocation is not None) == (rows > 1)
        assert (modelled.allocation is not None) == (rows > 1 and modelled.tree_size > 1)
    assert chosen == {1: 4, 2: 2, 4: 1} and "drafting does not pay" in decoder.tree_size_reason
    assert default.tree_size > 1 and "allocated per row and pass" in default.tree_size_reason
    assert default.tree_size_report()["curve_scale"] > 0
    assert modelled.tree_size == 1 and "drafting does not pay" in modelled.tree_size_reason
    decoder.generate(prompts, 4, batch_size=4, temperature=1.0, seeds=[0, 1, 2, 3])
    assert decoder.tree_size == 4

    per_row = BatchedDecoder(target, NgramProposer(), sizing=sized(True))
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [9, 9, 9, 9, 9], [3, 1, 3, 1]]
    mean_size = {}
    for rows in (1, 4):
        results = per_row.generate(prompts, 12, batch_size=rows)
        sizes = [size for result in results for size in result.tree_sizes]
        mean_size[rows] = sum(sizes) / len(sizes)
        assert "allocated per row and pass" in per_row.tree_size_reason
        assert any(name.startswith("ngram@") for name in per_row.tree_size_report()["acceptance_by_depth"])
    assert mean_size[4] < mean_size[1]
    per_row.generate(prompts, 4, batch_size=4, temperature=1.0, seeds=[0, 1, 2, 3])
    assert per_row.tree_size == 4 and per_row.allocation is None


def test_the_curves_price_above_one_node_is_learnt_from_the_passes_by_hand():
    """``CurveScale``: passes whose cost above one node is 1.5 times what the curve says move the scale to 1.5 (a
    cached curve measured on a busy machine understates it); passes that all sit at one size cannot tell a slope and
    leave it; the scale stays within its limits."""
    from runtime.engine.tree_sizing import CurveScale

    curve = {1: 1.0, 2: 1.4, 4: 2.2}
    scale = CurveScale()
    for extra in [0.0, 0.1, 0.4, 0.2, 0.0, 0.3] * 4:  # seconds = 0.02 * (1 + 1.5 * extra)
        scale.observe(extra, 0.02 * (1 + 1.5 * extra))
    assert scale.scale == pytest.approx(1.5)
    assert scale.curve(curve) == pytest.approx({1: 1.0, 2: 1.6, 4: 2.8})
    flat = CurveScale()
    for seconds in (0.02, 0.03, 0.025) * 6:
        flat.observe(0.4, seconds)
    assert flat.scale == 1.0
    steep = CurveScale()
    for extra in [0.0, 0.1, 0.2] * 6:
        steep.observe(extra, 0.02 * (1 + 10 * extra))
    assert steep.scale == pytest.approx(steep.limit)
    few = CurveScale()
    few.observe(0.0, 0.02)
    few.observe(0.5, 0.04)
    assert few.scale == 1.0  # two passes are not enough to go by


def test_a_run_prices_its_curve_from_its_full_width_passes_by_hand():
    """``Allocation.observe_step``: passes at the run's full width correct the curve the sizes come from; passes
    of a draining batch (fewer rows) do not, since a pass of fewer rows is cheaper at every size."""
    from runtime.engine.sizing import Allocation

    allocation = Allocation({1: 1.0, 2: 1.4, 4: 2.2}, {"ngram": 4}, {"ngram": 0.45}, set(), width=4)
    for nodes in [1.0, 1.25, 2.0, 1.5] * 4:  # the curve says 1.0 / 1.1 / 1.4 / 1.2, the passes cost twice above 1
        extra = 0.4 * (nodes - 1)
        allocation.observe_step(nodes, 0.02 * (1 + 2 * extra), 0.0, 0.03, rows=4)
        allocation.observe_step(1.0, 0.001, 0.0, 0.002, rows=2)  # a drained pass: cheap, and not a full width
    assert allocation.scale.scale == pytest.approx(2.0)
    assert allocation.priced == pytest.approx({1: 1.0, 2: 1.8, 4: 3.4})
    # sized on the priced curve: a first node accepted 0.5 of the time paid at 0.4 of a pass and no longer does
    assert allocate_nodes_on(allocation, [[0.5]] * 4) == [1, 1, 1, 1]
    assert allocate_nodes_on(Allocation({1: 1.0, 2: 1.4, 4: 2.2}, {"ngram": 4}, {"ngram": 0.45}, set()),
                             [[0.5]] * 4) == [2, 2, 2, 2]


def allocate_nodes_on(allocation, gains):
    return allocation.sizes(gains, [("ngram", 4)] * len(gains))


def test_nodes_go_where_they_pay_by_hand():
    from runtime.engine.tree_sizing import allocate_nodes

    # 16 rows; one more node per row costs 0.6 of a pass of one each, so a node pays while what it adds exceeds
    # 16 * 0.6 / 16 = 0.6 tokens (a little more as the pass's tokens grow)
    curve = {1: 1.0, 2: 1.6, 4: 2.8, 8: 5.2}
    gains = [[0.9, 0.8, 0.7], [0.3, 0.1], [0.7, 0.5]] + [[0.2]] * 13
    assert allocate_nodes(gains, curve) == [4, 1, 2] + [1] * 13
    # two rows where extra nodes are nearly free: every node drafted goes in, up to each row's drafts
    assert allocate_nodes([[0.9, 0.8, 0.7], [0.3, 0.1]], {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3}) == [4, 3]
    assert allocate_nodes([[], [0.2]], {1: 1.0, 2: 1.0}) == [1, 2]  # a row without drafts stays at its root


def test_a_rows_acceptance_leans_on_its_runs_until_it_has_its_own():
    from runtime.engine.tree_sizing import DepthAcceptance

    run = DepthAcceptance(0.5)
    for _ in range(40):
        run.observe(2, 2)  # the run's rows get both depths accepted
    row = DepthAcceptance(0.5, parent=run)
    assert row.rate(1) == pytest.approx(run.rate(1))
    for _ in range(40):
        row.observe(2, 0)  # this row gets nothing accepted
    assert row.rate(1) < 0.3 < 0.9 < run.rate(1)
    assert row.reach(2) == pytest.approx([row.rate(1), row.rate(1) * row.rate(2)])


def test_pass_overhead_from_the_curves_largest_sizes():
    assert pass_overhead_tokens({1: 1.0, 8: 1.1, 32: 1.5, 64: 2.0}) == pytest.approx(64.0)  # 1.0 + T / 64
    assert pass_overhead_tokens({1: 1.0, 2: 2.0, 4: 4.0}) == 0.0  # cost in proportion to the tokens
    assert pass_overhead_tokens({1: 1.0, 2: 1.5, 4: 4.5}) == 0.0  # a line below 0 at T = 0: no fixed cost
    assert pass_overhead_tokens({1: 1.0, 8: 1.0, 16: 1.0}) == float("inf")  # extra tokens cost nothing


def test_prefill_groups_by_hand():
    # one pass of all four costs 25 + 4 * 300; the three short ones together and the long one alone 25 + 3 * 60 +
    # 25 + 300; each alone 4 * 25 + 465
    assert prefill_groups([50, 300, 55, 60], overhead=25) == [[0, 2, 3], [1]]
    assert prefill_groups([50, 300, 55, 60], overhead=0) == [[0], [2], [3], [1]]
    assert prefill_groups([50, 300, 55, 60], overhead=1000) == [[0, 2, 3, 1]]
    assert prefill_groups([50, 300, 55, 60], overhead=float("inf")) == [[0, 2, 3, 1]]
    assert prefill_groups([7], overhead=3) == [[0]] and prefill_groups([], overhead=3) == []


def test_break_even_acceptance_by_hand():
    from runtime.target.cost_model import break_even_acceptance

    # 16 rows: 27 ms with one token per row, 45 ms with two: a node costs 18/27 of a plain token
    assert break_even_acceptance({1: 0.027, 2: 0.045}) == pytest.approx(18 / 27)
    assert break_even_acceptance({1: 0.015, 2: 0.016}) == pytest.approx(1 / 15)  # one row: nodes are nearly free
    assert break_even_acceptance({1: 0.015, 2: 0.014}) == 0.0


def test_pooled_depth_acceptance_by_hand():
    from runtime.target.cost_model import pooled_depth_acceptance
    from runtime.engine.decoder import GenerationResult

    # row a: 4 passes, 3 drafted a depth-1 node (2 accepted), 1 of them a depth-2 node (accepted)
    a = GenerationResult([], [], 5, 0.0, "length", depth_attempts=[3, 1], depth_accepts=[2, 1])
    # row b: 2 passes, 1 drafted (rejected)
    b = GenerationResult([], [], 3, 0.0, "length", depth_attempts=[1], depth_accepts=[0])
    drafting, acceptance = pooled_depth_acceptance([a, b])
    assert drafting == pytest.approx(4 / 6)
    assert acceptance == pytest.approx([2 / 4, 1.0])
    assert pooled_depth_acceptance([GenerationResult([], [], 1, 0.0, "length")]) == (0.0, [])


def test_lookup_first_sizes_each_drafters_trees_apart(monkeypatch):
    """Lookup first, a head otherwise: each drafter gets its own sizer, which learns only from the steps that drafter
    drafted. Here lookup's continuations are right (the text loops) and the head's guesses never are, so lookup's
    trees stay large while the head's shrink to plain decoding; the output stays the target's greedy output."""
    import runtime.engine.sizing
    from runtime.engine.decoder import SpeculativeDecoder
    from runtime.proposers import NgramProposer
    from runtime.proposers.lookup_first import LookupFirstProposer
    from runtime.target.model import target_from_model
    from tests.conftest import tiny_model
    from tests.proposers_for_tests import BadProposer
    from tests.test_greedy_equality import hf_greedy

    monkeypatch.setattr(runtime.engine.sizing, "cost_curve",
                        lambda target, batch_size=1: {1: 1.0, 2: 1.3, 4: 1.6, 8: 2.0})
    steps = []

    class Recording(LookupFirstProposer):
        def propose(self, state, step):
            tree = super().propose(state, step)
            steps.append((self.draft_source(state, step.history), step.tree_size, tree.size))
            return tree

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=64), identity="tiny")
    proposer = Recording(BadProposer(), NgramProposer())
    decoder = SpeculativeDecoder(target, proposer)
    assert set(decoder.sizers) == {"ngram", "bad"} and "adaptive for each drafter" in decoder.tree_size_reason
    for sizer in decoder.sizers.values():
        sizer.learn_costs = False  # the hand-built curve's costs, not this machine's timings of a tiny model
    prompt = [1, 2, 3, 1, 2, 3, 1]
    assert decoder.generate(prompt, 200).tokens == hf_greedy("llama", prompt, 200)
    lookup = [(asked, size) for source, asked, size in steps if source == "ngram"]
    head = [(asked, size) for source, asked, size in steps if source == "bad"]
    assert lookup and head  # both drafters drafted
    sizers = decoder.sizers
    assert sizers["ngram"].acceptance.attempts[0] == sum(size > 1 for _, size in lookup)
    assert sizers["bad"].acceptance.attempts[0] == sum(size > 1 for _, size in head)
    assert sizers["ngram"].acceptance.rate(1) > 0.8 and sizers["bad"].acceptance.accepts[0] == 0
    assert sizers["ngram"].best() >= 4 and sizers["bad"].best() == 1  # each drafter at its own best size
    assert sum(asked >= 4 for asked, _ in lookup[-10:]) >= 8 and sum(asked == 1 for asked, _ in head) >= 4
    report = decoder.tree_size_report()
    assert set(report["drafters"]) == {"ngram", "bad"} and sum(report["sizes"].values()) == len(steps)


def test_lookup_first_searches_the_history_once_where_nothing_matches():
    """draft_source's search found no match: that step's proposal goes to the head without searching again; a later
    step (a longer history) searches again."""
    import torch

    from runtime.proposers import NgramProposer
    from runtime.proposers.base import ProposeInput
    from runtime.proposers.lookup_first import LookupFirstProposer
    from runtime.engine.sampling import SamplingParams
    from tests.proposers_for_tests import BadProposer

    searches = []

    class Counting(NgramProposer):
        def propose(self, state, step):
            searches.append(step.history.numel())
            return super().propose(state, step)

    proposer = LookupFirstProposer(BadProposer(), Counting())
    state = proposer.start(torch.tensor([1, 2, 3]), 64)

    def step(history):
        return ProposeInput(torch.tensor(history), None, (), 4, SamplingParams(), None)

    history = [1, 2, 3, 4]  # no earlier occurrence of any suffix
    assert proposer.draft_source(state, torch.tensor(history)) == "bad"
    proposer.propose(state, step(history))
    assert searches == []
    history = [1, 2, 3, 4, 1, 2]  # "1 2" occurred before
    assert proposer.draft_source(state, torch.tensor(history)) == "ngram"
    assert proposer.propose(state, step(history)).size > 1 and searches == [6]
    proposer.propose(state, step([1, 2, 3, 4, 1, 2, 9]))  # no draft_source call for this length: lookup searches
    assert searches == [6, 7]


def test_drafting_trial_by_hand():
    """A greedy batched run alternates blocks of drafting passes and plain ones and chooses whichever emitted more
    tokens per second, compared between adjacent blocks only; the first pass of a block after a switch (a head's
    catching up) is left out. Afterwards the last block of every period goes to the other choice, which takes over
    where it now measures faster than its neighbours, even when the whole run has slowed down (rows finishing)."""
    from runtime.engine.tree_sizing import DraftingTrial

    trial = DraftingTrial(3, passes=4, warmup=1, block=2, every=6, decay=1.0)
    sizes = []
    # drafting: 8 tokens in 0.2 s after a slow first pass of each block; plain: 4 tokens in 0.05 s
    for tokens, seconds in [(1, 9.0), (8, 0.2), (4, 0.0), (4, 0.05)] * 2:
        sizes.append(trial.size())
        assert trial.decided is None
        trial.observe(sizes[-1], tokens, seconds)
    assert sizes == [3, 3, 1, 1] * 2
    assert trial.pairs == 3 and trial.advantage() == pytest.approx(0.5)  # 40 tokens/s against 80, three times
    assert trial.decided == 1 and trial.size() == 1 and "plain decoding measured faster" in trial.report()
    # the run slows to a quarter (rows finish), then a block drafting again emits 1.25x its neighbour's rate
    sizes = []
    for tokens, seconds in [(4, 0.05), (4, 0.05), (1, 0.2), (1, 0.2), (1, 9.0), (5, 0.8)]:
        sizes.append(trial.size())
        trial.observe(sizes[-1], tokens, seconds)
    assert sizes == [1, 1, 1, 1, 3, 3]
    assert trial.pairs == 4 and trial.advantage() == pytest.approx((0.5 ** 3 * 1.25) ** 0.25)
    assert trial.decided == 1 and trial.switches == 0  # not yet enough to outweigh three pairs against it
    sizes = []
    for tokens, seconds in [(1, 0.2), (1, 0.2)]:
        sizes.append(trial.size())
        trial.observe(sizes[-1], tokens, seconds)
    # the plain block after the recheck pairs with it: the ratio moves, the choice waits for the next recheck
    assert trial.pairs == 5 and trial.decided == 1
    chosen_on = (0.5 ** 3 * 1.25) ** 0.25
    assert trial.chosen_on == pytest.approx(chosen_on)
    assert f"{chosen_on:.2f}x plain decoding's tokens per second in adjacent blocks at the last choice, " \
           f"{trial.advantage():.2f}x since" in trial.report()
    for tokens, seconds in [(1, 0.2), (1, 0.2), (1, 9.0), (25, 0.8)]:
        sizes.append(trial.size())
        trial.observe(sizes[-1], tokens, seconds)
    assert sizes == [1, 1, 1, 1, 3, 3]
    assert trial.pairs == 6  # each drafting block pairs with the plain blocks on both sides of it
    assert trial.advantage() == pytest.approx((0.5 ** 3 * 1.25 * 1.25 * 6.25) ** (1 / 6))
    assert trial.decided == 3 and trial.size() == 3 and "1 switches" in trial.report()

    drafting_wins = DraftingTrial(2, passes=2, warmup=0, block=1)
    for tokens, seconds in [(9, 0.1), (4, 0.1), (9, 0.1), (4, 0.1)]:
        drafting_wins.observe(drafting_wins.size(), tokens, seconds)
    assert drafting_wins.decided == 2 and "drafting measured faster" in drafting_wins.report()
    assert "2.25x plain" in drafting_wins.report()
    with pytest.raises(ValueError, match="drafting size"):
        DraftingTrial(1)


def test_lookup_levels_are_the_matched_suffix_by_hand():
    """Prompt lookup's level (``draft_key``) is the longest suffix of 2-4 tokens that occurred earlier with a token
    after it; where none did it drafts nothing, and the key is None."""
    import torch

    from runtime.proposers import NgramProposer

    lookup = NgramProposer()
    cases = {(1, 2, 3, 4, 9, 2, 3, 4): 3, (1, 2, 3, 4, 5, 1, 2, 3, 4): 4, (7, 8, 9, 5, 8, 9): 2, (1, 2, 3, 4): 0,
             (5, 6, 5, 6): 2, (4, 4, 4): 2}
    for history, found in cases.items():
        history = torch.tensor(history)
        assert lookup.match_length(history) == found, history
        assert lookup.finds(history) == (found > 0)
        assert lookup.draft_key(None, history) == (("ngram", found) if found else None)


def test_suffix_matches_and_continuations_by_hand():
    """Earlier positions holding the last token, most recent first, with how far back each matches the suffix; the
    continuations of the longest matches come first, the most recent first among equals."""
    import numpy as np

    from runtime.proposers.ngram import find_continuations, suffix_matches

    history = np.array([7, 2, 3, 9, 4, 2, 3, 5, 4, 2, 3])
    ends, lengths = suffix_matches(history, 4)
    assert ends.tolist() == [6, 2] and lengths.tolist() == [3, 2]
    assert suffix_matches(history, 2)[1].tolist() == [2, 2]
    assert [c.tolist() for c in find_continuations(history, 4, 2, 4, 3)] == [[5, 4, 2], [9, 4, 2]]
    assert [c.tolist() for c in find_continuations(history, 4, 3, 4, 3)] == [[5, 4, 2]]  # a 2-token match is short
    assert suffix_matches(np.array([5]), 4)[0].tolist() == []
    assert suffix_matches(np.array([5, 5, 5, 5]), 4)[1].tolist() == [3, 2, 1]  # a match stops at the start


def test_rows_are_sized_without_a_models_call_when_that_pays_more_by_hand():
    """``Allocation.sizes``: a model drafter's call costs about as much for one row as for all, so rows are sized
    without it and with it, and the step with more tokens per unit of cost is taken."""
    from runtime.engine.sizing import Allocation

    curve = {1: 1.0, 2: 1.4, 4: 2.2}
    allocation = Allocation(curve, {"ngram": 4, "eagle3": 2}, {"ngram": 0.45, "eagle3": 0.5}, {"eagle3"})
    keys = [("ngram", 4)] + [("eagle3", 0)] * 3
    gains = [[0.9, 0.8, 0.7]] + [[0.8]] * 3
    allocation.pass_seconds, allocation.model_call = 0.1, 0.1  # a call costs a whole pass: the head is left out
    assert allocation.sizes(gains, keys) == [4, 1, 1, 1]
    allocation.model_call = 0.001  # nearly free: its rows draft too
    assert allocation.sizes(gains, keys) == [4, 2, 2, 2]
    allocation.overhead = 0.0
    assert allocation.sizes([[]] + [[0.1]] * 3, [None] + keys[1:]) == [1, 1, 1, 1]  # nothing pays
    # a step's measured seconds beside its pass (bookkeeping) count in the pass's unit
    allocation.observe_step(nodes_per_row=1.0, forward=0.1, model=0.0, step=0.15)
    assert allocation.overhead == pytest.approx(0.1 * 0.5)
