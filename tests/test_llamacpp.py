"""llama.cpp with our exports (-m llamacpp: needs llama.cpp built once, ``python -m bench.llamacpp build``, and the real
default target): the shipped EAGLE-3 and DFlash heads exported as GGUF draft in llama.cpp as they draft in our
runtime.

llama.cpp computes in bf16 with its own kernels and summation orders, so its tokens may differ from ours where two
tokens nearly tie; a wrong export (a layer id shifted, q/k rows in the wrong rotary order, norms swapped, d2t
misread) shows as acceptance collapsing, not as a few percent. So the check is the tokens accepted per pass of a chain
of three drafts, in both engines on the same prompts, within 10%."""

from __future__ import annotations

import pytest

from bench.llamacpp import LlamaCppDecoder, LlamaCppMethod, missing_llamacpp
from bench.prompts import read_prompts
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.prompts import encode_prompt
from runtime.proposers import ProposerSpec, build_proposer
from runtime.proposers.dflash import DFlashProposer
from runtime.proposers.eagle import EagleProposer
from runtime.target.model import load_target

pytestmark = pytest.mark.llamacpp
CHAIN = 3


@pytest.fixture(scope="module")
def target():
    problem = missing_llamacpp()
    if problem:
        pytest.fail(problem)
    return load_target("smollm2-135m", dtype="bfloat16")


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_exported_heads_draft_in_llama_cpp_as_in_our_runtime(target, kind):
    prompts = [encode_prompt(target.tokenizer, p["prompt"]) for p in read_prompts()[::10]]
    head = build_proposer(ProposerSpec(kind), target).head
    chain = EagleProposer(head, target, depth=CHAIN, top_k=1) if kind == "eagle3" else DFlashProposer(
        head, target, top_k=1)
    ours = SpeculativeDecoder(target, chain, tree_size=CHAIN + 1)
    eos = sorted(target.eos_token_ids)
    ours_tokens = ours_passes = 0
    theirs_tokens = theirs_passes = 0
    llama = LlamaCppDecoder(LlamaCppMethod(f"llamacpp-{kind}", draft_max=CHAIN), target)
    try:
        for ids in prompts:
            result = ours.generate(ids, 128)
            ours_tokens += len(result.tokens) - 1  # the prefill's token is no pass's
            ours_passes += result.target_forwards - 1
            tokens, _, forwards, _ = llama.generate(ids, 128, eos)
            theirs_tokens += len(tokens) - 1
            theirs_passes += forwards - 1
    finally:
        llama.close()
    ours_tau, theirs_tau = ours_tokens / ours_passes, theirs_tokens / theirs_passes
    print(f"{kind} tokens per pass, chain of {CHAIN}: ours {ours_tau:.3f}, llama.cpp {theirs_tau:.3f}")
    assert ours_tau > 1.2  # the head drafts at all
    assert abs(theirs_tau - ours_tau) <= 0.1 * ours_tau, (ours_tau, theirs_tau)
