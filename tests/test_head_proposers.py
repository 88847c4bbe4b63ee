"""EAGLE, EAGLE-3, Medusa and DFlash proposers: lossless at temperature 0 and when sampling, trained or not."""

import pytest
import torch

from heads.common import frozen_target_weights
from heads.dflash import DFlashConfig, DFlashHead
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads
from runtime.target.attention import ATTN_IMPLEMENTATION
from runtime.engine.decoder import SpeculativeDecoder
from runtime.proposers.dflash import DFlashProposer
from runtime.proposers.eagle import EagleProposer
from runtime.proposers.lookup_first import LookupFirstProposer
from runtime.proposers.medusa import MedusaProposer, calibrated_choices, measured_rank_paths, tree_accepted, tree_tau
from runtime.proposers.ngram import NgramProposer
from runtime.engine.sampling import SamplingParams
from runtime.target.model import target_from_model
from tests.conftest import tiny_model
from tests.test_greedy_equality import PROMPTS, hf_greedy

VOCAB = 64


def eagle_head(target, head_type, seed=0, draft_vocab=0, layers=1):
    torch.manual_seed(seed)
    if head_type == "eagle3":
        head = Eagle3Head(Eagle3Config(draft_vocab_size=draft_vocab), target.config)
    else:
        head = EagleHead(EagleConfig(num_layers=layers), target.config)
    head.attach_target_weights(*frozen_target_weights(target.model))
    if head_type == "eagle3" and draft_vocab:
        # a reduced vocabulary: every other target id
        draft_ids = torch.arange(0, VOCAB, VOCAB // draft_vocab)[:draft_vocab]
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[draft_ids] = True
        head.set_draft_vocab(draft_ids - torch.arange(draft_vocab), t2d)
    return head.eval()


def dflash_head(target, seed=0, draft_vocab=0, layers=1, block_size=5):
    torch.manual_seed(seed)
    head = DFlashHead(DFlashConfig(num_layers=layers, block_size=block_size, num_features=2,
                                   draft_vocab_size=draft_vocab), target.config)
    head.attach_target_weights(*frozen_target_weights(target.model))
    if draft_vocab:
        draft_ids = torch.arange(0, VOCAB, VOCAB // draft_vocab)[:draft_vocab]
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[draft_ids] = True
        head.set_draft_vocab(draft_ids - torch.arange(draft_vocab), t2d)
    head.init_mask_embedding()
    return head.eval()


def medusa_heads(target, seed=0, layers=1, trained=True, num_heads=3):
    torch.manual_seed(seed)
    _, lm_head = frozen_target_weights(target.model)
    heads = MedusaHeads(MedusaConfig(num_heads=num_heads, num_layers=layers, shared_lm_head=True), target.config)
    heads.attach_target_weights(None, lm_head)
    with torch.no_grad():  # "trained": move the residual blocks off their identity initialisation
        for parameter in heads.parameters() if trained else ():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return heads.eval()


def head_proposers(target):
    return {
        "eagle": EagleProposer(eagle_head(target, "eagle"), target, depth=4, top_k=3),
        "eagle3": EagleProposer(eagle_head(target, "eagle3"), target, depth=4, top_k=3),
        "eagle3-draft-vocab": EagleProposer(eagle_head(target, "eagle3", draft_vocab=32), target, depth=3, top_k=4),
        "medusa": MedusaProposer(medusa_heads(target)),
        "medusa-identity": MedusaProposer(medusa_heads(target, layers=1, trained=False, num_heads=2)),
        "eagle3+ngram": LookupFirstProposer(EagleProposer(eagle_head(target, "eagle3"), target, depth=4, top_k=3)),
        "medusa+ngram": LookupFirstProposer(MedusaProposer(medusa_heads(target))),
        "dflash": DFlashProposer(dflash_head(target, layers=2), target, top_k=3),
        "dflash-chain-draft-vocab": DFlashProposer(dflash_head(target, draft_vocab=32), target, top_k=1),
        "dflash+ngram": LookupFirstProposer(DFlashProposer(dflash_head(target), target, top_k=2)),
    }


def test_head_proposers_match_hf_greedy(arch):
    target = target_from_model(tiny_model(arch, seed=0, vocab_size=VOCAB), identity="tiny")
    references = [hf_greedy(arch, prompt, 40) for prompt in PROMPTS]
    for name, proposer in head_proposers(target).items():
        for attention in ("sdpa", "cascade"):
            decoder = SpeculativeDecoder(target, proposer, tree_size=10, attention=attention)
            for prompt, reference in zip(PROMPTS, references):
                result = decoder.generate(prompt, 40)
                assert result.tokens == reference, f"{arch}/{name}/{attention}"
            assert max(result.tree_sizes) > 1, f"{name} never drafted"


def test_medusa_with_fixed_choices_keeps_their_tree_under_adaptive_sizing():
    """Explicit choices fix the tree (a missing prefix included): the decoder verifies that tree at every step rather
    than asking for fewer nodes than the choices make, alone and in a batch."""
    from runtime.engine.batched import BatchedDecoder

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    proposer = MedusaProposer(medusa_heads(target), choices=[(0,), (0, 0), (1,), (0, 0, 0), (2, 1)])
    assert proposer.tree_size == 7  # (2,) joins as the prefix of (2, 1)
    decoder = SpeculativeDecoder(target, proposer)
    assert "own size" in decoder.tree_size_reason
    result = decoder.generate(PROMPTS[1], 20)
    assert result.tokens == hf_greedy("llama", PROMPTS[1], 20) and set(result.tree_sizes) == {7}
    batched = BatchedDecoder(target, proposer).generate(PROMPTS, 20, batch_size=3)
    assert [row.tokens for row in batched] == [hf_greedy("llama", prompt, 20) for prompt in PROMPTS]
    with pytest.raises(ValueError, match="need a tree of at least 7 nodes"):
        SpeculativeDecoder(target, proposer, tree_size=4).generate(PROMPTS[1], 4)


def test_calibrated_choices_are_ancestor_closed_and_prefer_likely_paths():
    choices = calibrated_choices([0.8, 0.5, 0.3], tree_size=8, top_k=4)
    assert len(choices) == 7 and choices[0] == (0,)
    assert all(c[:-1] in choices or len(c) == 1 for c in choices)
    assert (0, 0) in choices and (0, 0, 0) in choices
    assert calibrated_choices([0.9], tree_size=4, top_k=10) == [(0,), (1,), (2,)]


def test_measured_rank_paths_are_the_best_tree_of_every_size():
    """Hand-built ranks of 8 positions under 3 heads: paths come most frequent first, each after its prefix (ties:
    shorter, then smaller ranks), ranks past top_k end a path; the first T - 1 paths accept what brute force finds."""
    ranks = torch.tensor([[0, 0, 0], [0, 0, 4], [0, 1, 0], [1, 0, 0], [1, 0, 9], [2, 3, 0], [9, 0, 0], [0, 9, 0]])
    paths, frequencies = measured_rank_paths(ranks, top_k=5)
    assert paths[:4] == [(0,), (1,), (0, 0), (1, 0)]  # 4, then three of 2: the shorter first, then smaller ranks
    assert frequencies[:4] == [4 / 8, 2 / 8, 2 / 8, 2 / 8]
    assert (9,) not in paths and (1, 0, 9) not in paths and (0, 9) not in paths
    assert all(len(path) == 1 or path[:-1] in paths[:number] for number, path in enumerate(paths))
    assert len(paths) == len(set(paths)) == 12 and sum(frequencies) == pytest.approx(18 / 8)
    for size in range(1, len(paths) + 2):
        tree = set(paths[: size - 1])
        accepted = sum(max((d for d in range(1, 4) if tuple(row[:d]) in tree), default=0) for row in ranks.tolist())
        assert accepted / 8 == pytest.approx(sum(frequencies[: size - 1]))
    assert measured_rank_paths(ranks, top_k=5, max_paths=2)[0] == [(0,), (1,)]
    frequency = dict(zip(paths, frequencies))
    for choices in ([(0, 0, 0)], [(2, 3), (1,)], [(0, 1, 0), (4,)]):  # any tree (ranks < top_k), prefixes implied
        tree = {tuple(c[:i]) for c in choices for i in range(1, len(c) + 1)}
        accepted = sum(max((d for d in range(1, 4) if tuple(row[:d]) in tree), default=0) for row in ranks.tolist())
        assert tree_tau(choices, frequency) == pytest.approx(1 + accepted / 8)
        assert tree_accepted(choices, ranks).sum().item() == accepted
    assert tree_accepted([(0, 0), (1,)], ranks).tolist() == [2, 2, 1, 1, 1, 0, 0, 1]


def test_medusa_drafts_the_measured_tree_and_refuses_paths_that_are_not_one():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    paths = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (2,), (1, 0)]
    proposer = MedusaProposer(medusa_heads(target), rank_paths=paths)
    assert proposer.tree_choices(4) == paths[:3] and proposer.tree_choices(20) == paths  # too few paths: all of them
    for size in (4, 8):
        result = SpeculativeDecoder(target, proposer, tree_size=size).generate(PROMPTS[1], 24)
        assert result.tokens == hf_greedy("llama", PROMPTS[1], 24) and max(result.tree_sizes) == size
    for bad, problem in (([(0, 0), (0,)], "before its prefix"), ([(0,), (0,)], "repeats"),
                         ([(0,), (0, 0, 0, 0)], "longer than the heads"), ([(0,), (10,)], "outside 0..9")):
        with pytest.raises(ValueError, match=problem):
            MedusaProposer(medusa_heads(target), rank_paths=bad)


@pytest.mark.parametrize("name", ["eagle", "eagle3-draft-vocab", "medusa", "medusa-measured-tree", "eagle+ngram",
                                  "dflash", "dflash-draft-vocab+ngram"])
def test_head_proposers_preserve_the_sampling_distribution(name):
    from tests import test_sampling_distribution as sampling

    def build(target):
        return head_proposers_small(target)[name]

    assert sampling.empirical_p_value(build, SamplingParams(temperature=1.0), tree_size=5) > 1e-3


def head_proposers_small(target):
    """The same proposers over the 5-token vocabulary of the sampling test."""
    embed, lm_head = frozen_target_weights(target.model)
    torch.manual_seed(0)
    eagle = EagleHead(EagleConfig(), target.config)
    eagle.attach_target_weights(embed, lm_head)
    eagle.eval()
    eagle3 = Eagle3Head(Eagle3Config(feature_layers=[0, 0, 0], draft_vocab_size=3), target.config)
    eagle3.attach_target_weights(embed, lm_head)
    t2d = torch.zeros(5, dtype=torch.bool)
    t2d[[0, 2, 4]] = True
    eagle3.set_draft_vocab(torch.tensor([0, 1, 2]), t2d)
    dflash = DFlashHead(DFlashConfig(block_size=3, feature_layers=[0, 0], draft_vocab_size=3), target.config)
    dflash.attach_target_weights(embed, lm_head)
    dflash.set_draft_vocab(torch.tensor([0, 1, 2]), t2d)
    dflash.init_mask_embedding()
    medusa = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1), target.config)
    medusa.attach_target_weights(embed, lm_head)
    medusa.eval()
    return {"eagle": EagleProposer(eagle, target, depth=3, top_k=2),
            "eagle3-draft-vocab": EagleProposer(eagle3.eval(), target, depth=3, top_k=2),
            "medusa": MedusaProposer(medusa, top_k=3),
            "medusa-measured-tree": MedusaProposer(medusa, top_k=3, rank_paths=[(1,), (0,), (1, 2), (2,), (0, 0)]),
            "eagle+ngram": LookupFirstProposer(EagleProposer(eagle, target, depth=3, top_k=2),
                                               NgramProposer(max_ngram=2, min_ngram=1)),
            "dflash": DFlashProposer(dflash.eval(), target, top_k=2),
            "dflash-draft-vocab+ngram": LookupFirstProposer(DFlashProposer(dflash.eval(), target, top_k=2),
                                                            NgramProposer(max_ngram=2, min_ngram=1))}


def test_saved_heads_load_into_proposers_by_spec(tmp_path):
    from heads.common import target_signature
    from heads.io import save_head
    from runtime.proposers import NoShippedHead, ProposerSpec, build_proposer

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    eagle_dir, medusa_dir = tmp_path / "eagle", tmp_path / "medusa"
    signature = target_signature(target.model, "tiny")
    save_head(eagle_head(target, "eagle"), eagle_dir, signature, tree={"depth": 3})
    save_head(medusa_heads(target), medusa_dir, signature, tree={"acceptance": [0.7, 0.4, 0.2], "size": 3})
    eagle = build_proposer(ProposerSpec("eagle", head=eagle_dir), target)
    medusa = build_proposer(ProposerSpec("medusa", head=str(medusa_dir)), target)
    assert eagle.depth == 3 and medusa.head_accuracy == [0.7, 0.4, 0.2]
    combined = build_proposer(ProposerSpec("medusa", head=str(medusa_dir), lookup_first=True), target)
    assert combined.name == "medusa+ngram" and combined.tree_size == 3 and combined.head.head_accuracy[0] == 0.7
    assert eagle.tree_size is None and medusa.tree_size == 3  # a measured size in the config is the default
    adaptive = SpeculativeDecoder(target, medusa)  # the measured size is where adaptive sizing starts
    assert adaptive.sizers["medusa"].current == 3 and "measured size" in adaptive.tree_size_reason
    bf16 = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB).to(torch.bfloat16), identity="tiny")
    assert build_proposer(ProposerSpec("medusa", head=str(medusa_dir)), bf16).tree_size is None  # float32 only
    bf16_combined = build_proposer(ProposerSpec("medusa", head=str(medusa_dir), lookup_first=True), bf16)
    assert bf16_combined.tree_size is None  # so the cost model sizes it, for lookup's acceptance where that is higher
    assert bf16_combined.expected_acceptance == max(NgramProposer().expected_acceptance,
                                                    bf16_combined.head.expected_acceptance)
    reference = hf_greedy("llama", PROMPTS[1], 30)
    for proposer in (eagle, medusa):
        assert SpeculativeDecoder(target, proposer, tree_size=8).generate(PROMPTS[1], 30).tokens == reference
    with pytest.raises(ValueError, match="holds a medusa head"):
        build_proposer(ProposerSpec("eagle", head=str(medusa_dir)), target)
    with pytest.raises(NoShippedHead, match="no eagle3 head ships for target 'tiny' .* pass ProposerSpec.head"):
        build_proposer(ProposerSpec("eagle3"), target)
    with pytest.raises(TypeError, match="takes a ProposerSpec"):
        build_proposer(f"eagle:{eagle_dir}", target)  # the kind:DIR spelling is the scripts' (cli/args.py)


@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_head_proposers_with_a_one_node_tree_decode_plainly(name):
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    proposer = head_proposers(target)[name]
    result = SpeculativeDecoder(target, proposer, tree_size=1).generate(PROMPTS[0], 12)
    assert result.tokens == hf_greedy("llama", PROMPTS[0], 12) and result.tau == 1.0


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_target_and_heads_pass_the_cache_under_the_installed_transformers_name(name):
    # transformers 5.24 renamed past_key_values to cache (the old name warns, then goes in 5.40): decoding must use
    # whichever name the installed release declares, so no deprecation warning may come up
    import warnings

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    decoder = SpeculativeDecoder(target, head_proposers(target)[name], tree_size=6)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        result = decoder.generate(PROMPTS[0], 12)
    assert result.tokens == hf_greedy("llama", PROMPTS[0], 12)


def test_lookup_first_drafts_by_lookup_where_the_text_repeats_and_by_the_head_elsewhere():
    from runtime.proposers.base import ProposeInput

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    head = EagleProposer(eagle_head(target, "eagle"), target, depth=3, top_k=2)
    combined = LookupFirstProposer(head)
    sampling = SamplingParams(temperature=0.0)

    def features(history):
        return target.forward(torch.tensor([history[:-1]]), torch.arange(len(history) - 1)[None],
                              target.new_cache(1, 64), None, logits_from=0).hidden[0]

    def step(history, hidden):
        return ProposeInput(torch.tensor(history), hidden, (), 6, sampling, None)

    repeating = [7, 8, 9, 7, 8]  # "7 8" occurred before, followed by 9 7 8
    state = combined.start(torch.tensor(repeating), 64)
    hidden = features(repeating)
    tree = combined.propose(state, step(repeating, hidden))
    assert tree.tokens.tolist() == [8, 9, 7, 8]
    assert state.head.cache.max_committed == 0  # the verified rows wait until the head drafts
    # the next step finds no match ("8 5" did not occur before): the head reads the waiting rows and this step's
    # together, and drafts what it drafts alone over the same history
    longer = repeating + [5]
    hidden = features(longer)
    tree = combined.propose(state, step(longer, hidden[len(repeating) - 1:]))
    assert state.head.cache.max_committed == len(longer) - 1
    alone = head.propose(head.start(torch.tensor(longer), 64), step(longer, hidden))
    assert torch.equal(tree.tokens, alone.tokens) and torch.equal(tree.parents, alone.parents)
    assert tree.size > 1


@pytest.mark.parametrize("name", ["eagle", "eagle-2-layers", "eagle3", "eagle3-draft-vocab", "eagle3+ngram", "medusa",
                                  "medusa+ngram", "dflash", "dflash-chain-draft-vocab", "dflash+ngram"])
def test_heads_draft_for_several_rows_together_as_each_alone(name):
    """propose_rows reads every row's new verified rows in one head pass (ragged: different histories, different
    rows already in the head's cache, different counts of new rows) and drafts the trees and head caches each row
    gets from propose alone."""
    from runtime.proposers.base import ProposeInput

    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    proposer = (EagleProposer(eagle_head(target, "eagle", layers=2), target, depth=4, top_k=3)
                if name == "eagle-2-layers" else head_proposers(target)[name])
    sampling = SamplingParams(temperature=0.0)
    generator = torch.Generator().manual_seed(3)
    histories = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in (9, 14, 6)]
    histories[2] = [5, 6, 7, 5, 6, 7]  # lookup finds a continuation here: that row waits for the head
    read_first = [4, 12, 2]  # history rows the head has read before the step compared

    def step(history, start):
        out = target.forward(torch.tensor([history[:-1]]), torch.arange(len(history) - 1)[None],
                             target.new_cache(1, 64), None, logits_from=0, hidden_layers=proposer.hidden_layers)
        return ProposeInput(torch.tensor(history), out.hidden[0, start:],
                            tuple(h[0, start:] for h in out.layer_hidden), 6, sampling, None)

    def prepared():
        states = []
        for history, first in zip(histories, read_first):
            state = proposer.start(torch.tensor(history), 64)
            proposer.propose(state, step(history[:first + 1], 0))
            states.append(state)
        return states

    alone_states = prepared()
    alone = [proposer.propose(state, step(history, first))
             for state, history, first in zip(alone_states, histories, read_first)]
    states = prepared()
    eagle = proposer if isinstance(proposer, EagleProposer) else getattr(proposer, "head", None)
    passes = []
    if isinstance(eagle, EagleProposer):  # count the head's passes: one reads the rows, then one per tree level
        hidden_states = eagle.head.hidden_states

        def counted(tokens, *args, **kwargs):  # (rows, tokens) of each pass; packed rows say how many they are
            ragged = kwargs.get("ragged")
            passes.append((tokens.shape[0] if ragged is None else ragged.batch, tokens.numel()))
            if ragged is not None:  # only the tree attention takes packed rows, switched on for the pass alone
                assert eagle.head.layer_config._attn_implementation == ATTN_IMPLEMENTATION
            return hidden_states(tokens, *args, **kwargs)

        eagle.head.hidden_states = counted
        stock = eagle.head.layer_config._attn_implementation
    together = proposer.propose_rows(states, [step(history, first) for history, first in zip(histories, read_first)])
    for one, both in zip(alone, together):
        assert torch.equal(one.tokens, both.tokens) and torch.equal(one.parents, both.parents)
    assert any(tree.size > 1 for tree in together)
    for one, both in zip(alone_states, states):  # each head cache holds what the row's own reads wrote
        one, both = getattr(one, "head", one), getattr(both, "head", both)
        if hasattr(one, "cache"):
            length = one.cache.max_committed
            assert both.cache.max_committed == length
            torch.testing.assert_close(both.cache.kv[..., :length, :], one.cache.kv[..., :length, :])
    if isinstance(eagle, EagleProposer):
        del eagle.head.hidden_states
        assert eagle.head.layer_config._attn_implementation == stock  # the packed pass does not change the head
        # the row lookup drafts for does not go to the head; the others' new rows go packed, without padding
        heads_rows = [0, 1] if name.endswith("+ngram") else [0, 1, 2]
        new_rows = sum(len(histories[b]) - 1 - read_first[b] for b in heads_rows)
        assert passes[0] == (len(heads_rows), new_rows)
        # then depth - 1 levels, every row at once
        assert [rows for rows, _ in passes[1:]] == [len(heads_rows)] * (min(eagle.depth, 5) - 1)
