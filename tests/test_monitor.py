"""The rolling acceptance monitor: on hand-built pass sequences, and inside the decoders (a scrambled head warns, a
drafter that is always right does not)."""

import warnings

import pytest
import torch

from runtime.engine.batched import BatchedDecoder
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.monitor import AcceptanceMonitor, AcceptanceWarning, judged_drafter, monitor_for, trained_acceptance
from runtime.proposers import NgramProposer, NoProposer, Proposer, ProposerSpec, build_proposer
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.lookup_first import LookupFirstProposer
from runtime.target.model import target_from_model
from tests.conftest import tiny_model
from runtime.engine.sizing import BatchSizing

VOCAB = 64


def feed(monitor, hits: list[bool]) -> None:
    for hit in hits:
        monitor.observe(3, 2 if hit else 0)


def test_warns_once_when_the_rolling_rate_stays_far_below_the_trained_rate():
    monitor = AcceptanceMonitor(0.8, window=16, tolerance=0.5, min_passes=16, name="medusa")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing before min_passes drafting passes
        feed(monitor, [True, False, False, False] * 3 + [False] * 3)
        assert monitor.passes == 15 and not monitor.drifting
    with pytest.warns(AcceptanceWarning, match=r"medusa: .* 19% of the last 16 drafting passes, far below the 80%"):
        feed(monitor, [False])
    assert monitor.drifting and monitor.warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per monitor
        feed(monitor, [False] * 40)
    report = monitor.report()
    assert report == {"expected": 0.8, "rate": 0.0, "window_passes": 16, "passes": 56, "overall_rate": round(3 / 56, 4),
                      "drifting": True, "warned": True}
    monitor.reset()
    assert monitor.rate is None and monitor.passes == 0 and not monitor.warned


def test_no_warning_when_the_rate_is_close_to_the_trained_rate_or_there_is_none():
    close = AcceptanceMonitor(0.8, window=16, min_passes=16)
    unknown = AcceptanceMonitor(None, window=16, min_passes=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feed(close, [True, True, False] * 40)  # 0.67: below 0.8, but not far below
        feed(unknown, [False] * 100)
    assert not close.drifting and close.rate == pytest.approx(10 / 16)
    assert unknown.rate == 0.0 and not unknown.drifting and unknown.report()["expected"] is None


def test_the_rolling_window_forgets_old_passes_and_passes_without_drafts_do_not_count():
    monitor = AcceptanceMonitor(0.9, window=8, min_passes=16)
    feed(monitor, [False] * 8 + [True] * 8)  # a bad start, long gone from the window: no warning
    assert monitor.rate == 1.0 and monitor.overall_rate == 0.5 and not monitor.warned
    for _ in range(20):
        monitor.observe(0, 0)  # plain decoding passes (a one-node tree) say nothing about the drafts
    assert monitor.passes == 16 and monitor.rate == 1.0
    with pytest.warns(AcceptanceWarning):
        feed(monitor, [False] * 8)
    assert monitor.rate == 0.0 and monitor.overall_rate == pytest.approx(8 / 24)


def test_monitor_settings_are_checked():
    for kwargs, message in [({"window": 0}, "window"), ({"tolerance": 0}, "tolerance"),
                            ({"tolerance": 1.5}, "tolerance"), ({"min_passes": 0}, "min_passes")]:
        with pytest.raises(ValueError, match=message):
            AcceptanceMonitor(0.5, **kwargs)
    with pytest.raises(ValueError, match="expected"):
        AcceptanceMonitor(1.5)


def test_trained_acceptance_is_the_heads_only():
    class Head(Proposer):
        name, trained_acceptance, expected_acceptance = "eagle3", 0.7, 0.7

    assert trained_acceptance(Head()) == 0.7
    assert trained_acceptance(LookupFirstProposer(Head(), NgramProposer())) == 0.7  # held to its head's rate
    assert trained_acceptance(NgramProposer()) is None and trained_acceptance(NoProposer()) is None
    assert trained_acceptance(None) is None
    assert monitor_for(Head()).expected == 0.7 and monitor_for(Head()).name == "eagle3"
    assert judged_drafter(LookupFirstProposer(Head(), NgramProposer())) == "eagle3"  # the head's passes alone
    assert judged_drafter(Head()) is None and judged_drafter(NgramProposer()) is None and judged_drafter(None) is None
    assert monitor_for(LookupFirstProposer(Head(), NgramProposer())).drafter == "eagle3"


def test_a_proposer_with_several_drafters_is_judged_by_its_heads_passes():
    monitor = AcceptanceMonitor(0.8, window=16, min_passes=16, name="eagle3+ngram", drafter="eagle3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(40):  # lookup's misses (text that stopped repeating) say nothing about the head
            monitor.observe(3, 0, "ngram")
        for _ in range(20):
            monitor.observe(2, 1, "eagle3")
    assert monitor.passes == 20 and monitor.rate == 1.0 and not monitor.drifting
    with pytest.warns(AcceptanceWarning, match=r"eagle3\+ngram \(eagle3's passes\): .* 38% of the last 16"):
        for _ in range(8):
            monitor.observe(2, 0, "eagle3")
        for _ in range(8):
            monitor.observe(2, 0)  # a pass of unknown drafter counts as the judged one's
    report = monitor.report()
    assert report["drafter"] == "eagle3" and report["passes"] == 36
    assert report["by_drafter"] == {"eagle3": {"passes": 28, "overall_rate": round(20 / 28, 4)},
                                    "ngram": {"passes": 40, "overall_rate": 0.0}}
    monitor.reset()
    assert monitor.report()["by_drafter"] == {}


def scrambled_medusa(target, directory, acceptance):
    """A Medusa head saved with the acceptance it 'measured in training', its weights then replaced by noise."""
    from heads.common import target_signature
    from heads.io import save_head
    from tests.test_head_proposers import medusa_heads

    heads = medusa_heads(target, seed=3)
    with torch.no_grad():
        for name, parameter in heads.named_parameters():
            if "lm_head" not in name:
                parameter.copy_(torch.randn_like(parameter) * 3)
    save_head(heads, directory, target_signature(target.model, "tiny"), tree={"acceptance": acceptance})
    return build_proposer(ProposerSpec("medusa", head=str(directory)), target)


def test_a_scrambled_head_warns_and_an_accurate_drafter_does_not(tmp_path):
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    prompts = [list(range(10, 30)), [3, 9, 27, 17, 51, 25], [5]]
    scrambled = scrambled_medusa(target, tmp_path / "medusa", [0.8, 0.5, 0.3])
    assert scrambled.trained_acceptance == 0.8
    decoder = SpeculativeDecoder(target, scrambled, tree_size=4)
    assert decoder.monitor.expected == 0.8
    with pytest.warns(AcceptanceWarning, match="medusa: .* far below the 80% its head measured in training"):
        for prompt in prompts:
            decoder.generate(prompt, 60)
    assert decoder.monitor.report()["drifting"] and decoder.monitor.rate < 0.4

    batched = BatchedDecoder(target, scrambled, tree_size=4)
    with pytest.warns(AcceptanceWarning):
        results = batched.generate(prompts, 60, batch_size=2)
    assert batched.monitor.passes == sum(result.depth_attempts[0] for result in results)  # one monitor, all rows
    assert all(result.depth_acceptance[0] < 0.4 for result in results)  # each row's own rate

    accurate = DraftModelProposer(target, target, "chain", depth=4)  # drafts what the target decodes
    accurate.trained_acceptance = 0.9
    decoder = SpeculativeDecoder(target, accurate, tree_size=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcceptanceWarning)
        stream = decoder.stream_tokens(prompts[0], 400)
        next(stream)
        assert decoder.monitor.rate is None  # the first token comes from the prefill: nothing drafted yet
        next(stream)
        assert decoder.monitor.rate == 1.0 and decoder.monitor.passes == 1  # the rate as the stream goes
        for _ in stream:
            pass
        assert decoder.monitor.passes >= 64 and not decoder.monitor.drifting
        batched = BatchedDecoder(target, accurate, tree_size=5)
        batched.generate(prompts * 4, 120, batch_size=3)
    assert batched.monitor.passes >= 64 and batched.monitor.rate == 1.0
    assert SpeculativeDecoder(target, NgramProposer(), tree_size=4).monitor.expected is None


def test_decoders_hold_a_head_with_lookup_first_to_the_heads_passes(tmp_path):
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    head = scrambled_medusa(target, tmp_path / "medusa", [0.8, 0.5, 0.3])
    proposer = LookupFirstProposer(head, NgramProposer())
    prompts = [list(range(10, 30)) * 3, [3, 9, 27, 17, 51, 25] * 4, [5, 6, 7]]
    for decoder, run in [(SpeculativeDecoder(target, proposer, tree_size=4),
                          lambda decoder: [decoder.generate(prompt, 60) for prompt in prompts]),
                         (BatchedDecoder(target, proposer, tree_size=4, sizing=BatchSizing(per_row_sizes=False)),
                          lambda decoder: decoder.generate(prompts, 60, batch_size=2)),
                         (BatchedDecoder(target, proposer,
                                         sizing=BatchSizing(tree_size=4, per_row_sizes=True, trial_passes=0)),
                          lambda decoder: decoder.generate(prompts, 60, batch_size=2))]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AcceptanceWarning)
            results = run(decoder)
        report = decoder.monitor.report()
        drafted = sum(result.depth_attempts[0] for result in results)
        assert set(report["by_drafter"]) == {"medusa", "ngram"}, report
        assert sum(counts["passes"] for counts in report["by_drafter"].values()) == drafted
        assert report["passes"] == report["by_drafter"]["medusa"]["passes"] > 0 and report["drafter"] == "medusa"
