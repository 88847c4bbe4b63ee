"""End to end on the real default target (SmolLM2-135M-Instruct from its packaged GGUF). Run with -m slow."""

import pytest

from bench.prompts import read_prompts
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.prompts import encode_prompt
from runtime.proposers import NgramProposer
from runtime.target.model import load_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def targets():
    ours = load_target("smollm2-135m")
    stock = load_target("smollm2-135m", attn_implementation="sdpa", quiet=True).model
    return ours, stock


def test_default_target_shape(targets):
    target, _ = targets
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.tokenizer.chat_template


def test_speculative_output_equals_hf_greedy_on_mt_bench(targets):
    target, stock = targets
    for item in read_prompts(limit=3):
        ids = encode_prompt(target.tokenizer, item["prompt"])
        reference = stock.generate(ids[None], max_new_tokens=48, do_sample=False)[0, ids.numel():].tolist()
        for proposer in (None, NgramProposer()):
            result = SpeculativeDecoder(target, proposer, tree_size=8).generate(ids, 48)
            assert result.tokens == reference


def test_sampling_runs_and_is_reproducible(targets):
    target, _ = targets
    ids = encode_prompt(target.tokenizer, "Name three colors.")
    decoder = SpeculativeDecoder(target, NgramProposer(), tree_size=8)
    first = decoder.generate(ids, 24, temperature=0.8, top_p=0.9, seed=7).tokens
    assert first == decoder.generate(ids, 24, temperature=0.8, top_p=0.9, seed=7).tokens
    assert len(first) > 0 and all(0 <= t < target.vocab_size for t in first)


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "eagle3+ngram", "dflash", "dflash+ngram"])
def test_shipped_heads_are_the_default_and_lossless(targets, kind):
    from heads.shipped import SHIPPED_DIR
    from runtime.proposers import ProposerSpec, build_proposer

    target, stock = targets
    head_type, _, lookup = kind.partition("+")
    # no head given: the one shipped for the default target
    proposer = build_proposer(ProposerSpec(head_type, lookup_first=bool(lookup)), target)
    assert proposer.name == kind
    prompts = read_prompts(limit=2)
    accepted = []
    for item in prompts:
        ids = encode_prompt(target.tokenizer, item["prompt"])
        reference = stock.generate(ids[None], max_new_tokens=48, do_sample=False)[0, ids.numel():].tolist()
        result = SpeculativeDecoder(target, proposer, tree_size=8).generate(ids, 48)  # force drafting
        assert result.tokens == reference
        accepted.extend(result.accept_lengths)
    assert sum(accepted) / len(accepted) > 1.1, "the shipped head drafts nothing acceptable"
    head_kind = kind.split("+")[0]
    assert (SHIPPED_DIR / f"smollm2-135m-{head_kind}" / "model.safetensors").stat().st_size < 32 * 2**20
