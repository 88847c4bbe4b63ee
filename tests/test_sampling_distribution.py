"""Sampling must be lossless: the first three generated tokens follow the target's exact distribution.

Chi-square goodness of fit on the joint distribution of (x1, x2, x3) over a 5-token vocabulary; and the same test
must reject a deliberately broken acceptance rule, so it can catch a real bug.
"""

import pytest
import torch
from scipy.stats import chisquare

import runtime.engine.decoder
from runtime.engine.acceptance import rejection_accept
from runtime.engine.decoder import SpeculativeDecoder
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.lookahead import LookaheadProposer
from runtime.proposers.lookup_first import LookupFirstProposer
from runtime.proposers.ngram import NgramProposer
from runtime.proposers.spec import LookaheadSettings
from runtime.engine.sampling import SamplingParams, processed_probs
from runtime.proposers.successor_prior import measure_successor_prior
from runtime.target.model import target_from_model
from tests.conftest import tiny_model
from tests.proposers_for_tests import RandomProposer

VOCAB = 5
PROMPT = [1, 2, 1, 2, 1, 3, 1, 2]
SAMPLES = 1500


def model(seed):
    return tiny_model("llama", seed=seed, vocab_size=VOCAB, scale=8.0, num_hidden_layers=1)


@torch.inference_mode()
def exact_joint(params: SamplingParams) -> torch.Tensor:
    """[V, V, V] probabilities of (x1, x2, x3) under the target, computed by enumeration."""
    stock = model(0)
    prompt = torch.tensor(PROMPT)
    p1 = processed_probs(stock(prompt[None]).logits[0, -1], params)
    ones = torch.arange(VOCAB)[:, None]
    p2 = processed_probs(stock(torch.cat([prompt.expand(VOCAB, -1), ones], 1)).logits[:, -1], params)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    p3 = processed_probs(stock(torch.cat([prompt.expand(len(pairs), -1), pairs], 1)).logits[:, -1], params)
    return p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)


def empirical_p_value(proposer, params: SamplingParams, tree_size: int = 4, device: str = "cpu",
                      fixed_shapes: bool = False) -> float:
    target = target_from_model(model(0).to(device), identity="tiny", fixed_shapes=fixed_shapes)
    decoder = SpeculativeDecoder(target, proposer(target) if proposer else None, tree_size=tree_size)
    samples = [decoder.generate(PROMPT, 3, params.temperature, params.top_k, params.top_p, seed=seed).tokens
               for seed in range(SAMPLES)]
    return joint_p_value(samples, params)


def joint_p_value(samples: list[list[int]], params: SamplingParams) -> float:
    """Chi-square p-value of sampled (x1, x2, x3) triples against the target's exact joint distribution."""
    counts = torch.zeros(VOCAB ** 3)
    for x1, x2, x3 in samples:
        counts[x1 * VOCAB * VOCAB + x2 * VOCAB + x3] += 1
    expected = exact_joint(params).flatten() * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a sequence the target gives zero probability"
    # merge rare outcomes so every bin expects at least 5 samples
    rare = expected < 5
    observed = torch.cat([counts[~rare], counts[rare].sum()[None]])
    wanted = torch.cat([expected[~rare], expected[rare].sum()[None]])
    keep = wanted > 0
    scale = observed.sum().item() / wanted[keep].sum().item()
    return float(chisquare(observed[keep].numpy(), wanted[keep].numpy() * scale).pvalue)


def draft(target, mode):
    return DraftModelProposer(target_from_model(model(1).to(target.device), identity="draft"), target, mode, depth=3,
                              top_k=2)


PROPOSERS = {
    "none": None,
    "ngram": lambda target: NgramProposer(max_ngram=2),
    "draft-tree": lambda target: draft(target, "tree"),
    "draft-chain-sampled": lambda target: draft(target, "chain"),
    "random": lambda target: RandomProposer(VOCAB, seed=3),
    # the window's guesses are the target's argmax even when sampling, the recycled successors its top-k: deterministic
    # functions of the history and the earlier passes' logits; the trie goes through the exact acceptance
    "lookahead": lambda target: LookaheadProposer(LookaheadSettings(3, 3, 3)),
    "lookahead+ngram": lambda target: LookupFirstProposer(LookaheadProposer(LookaheadSettings(2, 3, 2, 3)),
                                                     NgramProposer(max_ngram=2)),
    # the successor prior is a function of the target alone
    "lookahead+ngram-prior": lambda target: LookupFirstProposer(
        LookaheadProposer(LookaheadSettings(1, 3, 1, 5),
                          prior=measure_successor_prior(target, torch.tensor([1]), progress=False)),
        NgramProposer(max_ngram=2)),
}


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_distribution_matches_target(name):
    assert empirical_p_value(PROPOSERS[name], SamplingParams(temperature=1.0)) > 1e-3


@pytest.mark.parametrize("name", ["draft-tree", "random"])
def test_distribution_matches_target_through_fixed_shape_passes(name):
    """The CPU twin of the CUDA-graph passes (runtime.target.static_pass) samples the target's distribution too."""
    assert empirical_p_value(PROPOSERS[name], SamplingParams(temperature=1.0), fixed_shapes=True) > 1e-3


@pytest.mark.parametrize("name,params", [("draft-chain-sampled", SamplingParams(0.7, top_p=0.8)),
                                         ("random", SamplingParams(1.3, top_k=3)),
                                         ("lookahead", SamplingParams(0.7, top_k=3))],
                         ids=["draft-chain-T0.7-top_p0.8", "random-T1.3-top_k3", "lookahead-T0.7-top_k3"])
def test_distribution_with_truncation(name, params):
    assert empirical_p_value(PROPOSERS[name], params) > 1e-3


def test_a_broken_acceptance_rule_is_detected(monkeypatch):
    def accept_without_residual(tokens, children, target_probs, proposal_probs, generator):
        # Bug: ignores the draft distribution (accepts sampled children with p(x) instead of p(x)/q(x)) and
        # does not remove rejected mass, so rejected tokens come back too often.
        path = [0]
        node = 0
        while children[node]:
            child = children[node][0]
            if float(torch.rand((), generator=generator)) < float(target_probs[node][tokens[child]]) * 1.5:
                path.append(child)
                node = child
            else:
                break
        return path, int(torch.multinomial(target_probs[node], 1, generator=generator))

    monkeypatch.setattr(runtime.engine.decoder, "rejection_accept", accept_without_residual)
    assert empirical_p_value(PROPOSERS["draft-chain-sampled"], SamplingParams(temperature=1.0)) < 1e-6
    monkeypatch.setattr(runtime.engine.decoder, "rejection_accept", rejection_accept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["draft-tree", "draft-chain-sampled", "random"])
def test_distribution_matches_target_on_cuda(name):
    """The same draws (a CPU generator) and acceptance code with the models on the GPU."""
    assert empirical_p_value(PROPOSERS[name], SamplingParams(temperature=1.0), device="cuda") > 1e-3


def test_random_draws_use_a_cpu_generator_whatever_the_device():
    """The CPU twin of the CUDA path: the decoder's generator is a CPU one, so draws do not depend on the device
    and go through the same code (a CUDA generator cannot drive the CPU draws of the acceptance test)."""
    from runtime.engine.sampling import new_generator, sample

    generator = new_generator(7)
    assert generator.device.type == "cpu"
    probs = torch.tensor([0.1, 0.2, 0.7])
    first = [sample(probs, generator) for _ in range(20)]
    again = new_generator(7)
    assert [sample(probs, again) for _ in range(20)] == first
