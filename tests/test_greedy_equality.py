"""Every proposer must reproduce the target's own greedy decoding token for token."""

import pytest
import torch

from runtime.engine.decoder import SpeculativeDecoder
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.lookahead import LookaheadProposer
from runtime.proposers.lookup_first import LookupFirstProposer
from runtime.proposers.ngram import NgramProposer
from runtime.proposers.spec import LookaheadSettings
from runtime.proposers.successor_prior import measure_successor_prior
from runtime.target.model import target_from_model
from tests.conftest import tiny_model
from tests.proposers_for_tests import BadProposer, RandomProposer

VOCAB = 64
PROMPTS = [[5], [1, 2, 3, 1, 2, 3, 1], list(range(10, 40))]
NEW_TOKENS = 40


def hf_greedy(arch, prompt, new_tokens, **kwargs):
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def proposers(target, arch):
    draft = target_from_model(tiny_model(arch, seed=1, vocab_size=VOCAB), identity="draft")
    return {
        "none": None,
        "ngram": NgramProposer(),
        "draft-tree": DraftModelProposer(draft, target, "tree", depth=4, top_k=3),
        "draft-chain": DraftModelProposer(draft, target, "chain", depth=4),
        "self-draft": DraftModelProposer(target, target, "chain", depth=6),
        "bad": BadProposer(),
        "random": RandomProposer(VOCAB),
    }


def test_every_proposer_matches_hf_greedy(arch):
    target = target_from_model(tiny_model(arch, seed=0, vocab_size=VOCAB), identity="tiny")
    references = [hf_greedy(arch, prompt, NEW_TOKENS) for prompt in PROMPTS]
    for name, proposer in proposers(target, arch).items():
        # cascade: the flash-attn decode path, here with its reference prefix kernel (flash-attn needs CUDA)
        for tree_size, attention in ((1, "sdpa"), (8, "sdpa"), (1, "cascade"), (8, "cascade")):
            decoder = SpeculativeDecoder(target, proposer, tree_size=tree_size, attention=attention)
            for prompt, reference in zip(PROMPTS, references):
                result = decoder.generate(prompt, NEW_TOKENS)
                assert result.tokens == reference, f"{arch}/{name}/T={tree_size}/{attention}: output differs"
                assert sum(result.accept_lengths) + 1 == NEW_TOKENS or result.stop_reason == "stop"
                assert result.target_forwards == len(result.accept_lengths) + 1


def lookahead_proposers(target=None):
    """Lookahead, alone and with prompt lookup; windows of one column and of several, n-grams of 3 and 4 tokens,
    without recycled successors and with them; with ``target``, also behind lookup drafting from the target's
    successor prior."""
    found = {
        "lookahead": LookaheadProposer(LookaheadSettings(4, 3, 4)),
        "lookahead-narrow-recycled": LookaheadProposer(LookaheadSettings(1, 4, 2, 3)),
        "lookahead+ngram": LookupFirstProposer(LookaheadProposer(LookaheadSettings(3, 4, 3, 2)), NgramProposer()),
    }
    if target is not None:
        prior = measure_successor_prior(target, torch.tensor([1]), progress=False)
        found["lookahead+ngram-prior"] = LookupFirstProposer(
            LookaheadProposer(LookaheadSettings(1, 3, 1, 5), prior=prior), NgramProposer())
    return found


def test_lookahead_matches_hf_greedy(arch):
    """The window's rows ride in every pass and never change the output: as plain greedy decoding, with the
    proposer's own tree size and with fixed ones (1: the window alone beside the root)."""
    target = target_from_model(tiny_model(arch, seed=0, vocab_size=VOCAB), identity="tiny")
    references = [hf_greedy(arch, prompt, NEW_TOKENS) for prompt in PROMPTS]
    candidates = lookahead_proposers(target)
    for name, proposer in candidates.items():
        for tree_size, attention in ((None, "sdpa"), (1, "sdpa"), (8, "cascade")):
            decoder = SpeculativeDecoder(target, proposer, tree_size=tree_size, attention=attention)
            for prompt, reference in zip(PROMPTS, references):
                result = decoder.generate(prompt, NEW_TOKENS)
                assert result.tokens == reference, f"{arch}/{name}/T={tree_size}/{attention}: output differs"
                assert result.target_forwards == len(result.accept_lengths) + 1
    assert candidates["lookahead+ngram-prior"].head.prior._entries  # the prior was drafted from


@pytest.mark.parametrize("arch", ["mistral", "qwen2-sliding", "gemma2"])
def test_lookahead_with_sliding_windows_matches_hf_greedy(arch):
    """The window's rows stand at their own positions, which the sliding-window mask must follow."""
    target = target_from_model(tiny_model(arch, seed=0, vocab_size=VOCAB), identity="tiny")
    for prompt in PROMPTS:
        reference = hf_greedy(arch, prompt, NEW_TOKENS)
        for proposer in lookahead_proposers(target).values():
            assert SpeculativeDecoder(target, proposer).generate(prompt, NEW_TOKENS).tokens == reference


def test_self_draft_accepts_whole_chains():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    result = SpeculativeDecoder(target, DraftModelProposer(target, target, "chain", depth=5),
                                tree_size=6).generate(PROMPTS[1], 34)
    assert result.accept_lengths == [6] * 5 + [3]  # every draft accepted; the last pass is cut by the length limit
    assert result.depth_acceptance[:5] == [1.0] * 5


@pytest.mark.parametrize("proposer_name", ["none", "self-draft", "ngram"])
def test_stop_token_inside_an_accepted_path_ends_generation_there(proposer_name):
    reference = hf_greedy("llama", PROMPTS[2], NEW_TOKENS)
    stop = reference[9]
    expected = reference[: reference.index(stop) + 1]
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    proposer = proposers(target, "llama")[proposer_name]
    streamed = []
    result = SpeculativeDecoder(target, proposer, tree_size=8).generate(
        PROMPTS[2], NEW_TOKENS, stop_token_ids=[stop], stream=streamed.extend)
    assert result.tokens == expected and result.stop_reason == "stop"
    assert streamed == expected
    assert hf_greedy("llama", PROMPTS[2], NEW_TOKENS, eos_token_id=stop) == expected


def test_max_new_tokens_is_respected_exactly():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    decoder = SpeculativeDecoder(target, DraftModelProposer(target, target, "chain", depth=7), tree_size=8)
    for limit in (1, 2, 5, 13):
        assert len(decoder.generate(PROMPTS[1], limit).tokens) == limit


def test_prompt_beyond_the_context_is_a_clear_error():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    decoder = SpeculativeDecoder(target, None, tree_size=1)
    with pytest.raises(ValueError, match="exceeds the target's context of 512"):
        decoder.generate(list(range(500)) * 1, 20)
    with pytest.raises(ValueError, match="prompt is empty"):
        decoder.generate([], 5)


@pytest.mark.parametrize("prompt, new_tokens, message", [
    (torch.tensor([[1, 2, 3], [4, 5, 6]]), 5, r"shape \[2, 3\]: give one prompt's token ids"),
    ([1, 2, VOCAB], 5, f"token id {VOCAB}, outside the target's vocabulary of {VOCAB}"),
    ([1, -2, 3], 5, "token id -2"),
    (torch.tensor([1.0, 2.0]), 5, "float32 values: give integer token ids"),
    ([1, 2, 3], 0, "max_new_tokens must be a whole number >= 1, got 0"),
    ([1, 2, 3], 2.5, "max_new_tokens must be a whole number >= 1, got 2.5"),
])
def test_bad_prompts_and_lengths_are_clear_errors_before_any_pass(prompt, new_tokens, message):
    """A [B, P] batch is not flattened into one prompt, ids outside the vocabulary and a length that is not a whole
    number >= 1 are named, before the target runs."""
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    with pytest.raises(ValueError, match=message):
        SpeculativeDecoder(target, NgramProposer()).generate(prompt, new_tokens)


def test_one_stop_token_id_and_an_unseeded_draw_leave_the_callers_random_state_alone():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    free = SpeculativeDecoder(target, None, tree_size=1).generate(PROMPTS[1], 12)
    stop = free.tokens[5]
    first = free.tokens.index(stop)
    assert SpeculativeDecoder(target, None, tree_size=1).generate(
        PROMPTS[1], 12, stop_token_ids=stop).tokens == free.tokens[: first + 1]
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    SpeculativeDecoder(target, NgramProposer(), tree_size=4).generate(PROMPTS[1], 8, temperature=1.0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "cascade"])
def test_gpu_greedy_equality(dtype, backend):
    stock = tiny_model("llama", seed=0, vocab_size=VOCAB).to("cuda", dtype)
    reference = stock.generate(torch.tensor([PROMPTS[2]], device="cuda"), max_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, len(PROMPTS[2]):].tolist()
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB).to("cuda", dtype), identity="tiny")
    for proposer in (None, NgramProposer(), DraftModelProposer(target, target, "tree", depth=4, top_k=3)):
        result = SpeculativeDecoder(target, proposer, tree_size=8, attention=backend).generate(PROMPTS[2],
                                                                                                 NEW_TOKENS)
        assert result.tokens == reference


def test_typical_acceptance_at_temperature_zero_is_greedy():
    """With a one-hot target, typical acceptance only takes the argmax: the lossy rule is exact at T = 0."""
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    reference = hf_greedy("llama", PROMPTS[1], NEW_TOKENS)
    proposer = DraftModelProposer(target, target, "tree", depth=4, top_k=3)
    result = SpeculativeDecoder(target, proposer, tree_size=8, acceptance="typical").generate(PROMPTS[1],
                                                                                                  NEW_TOKENS)
    assert result.tokens == reference
    with pytest.raises(ValueError, match="typical"):
        SpeculativeDecoder(target, proposer, tree_size=8, acceptance="lossy")


def test_stop_strings_end_generation_at_the_token_that_completes_them():
    from tests.tiny_training import char_tokenizer

    tokenizer = char_tokenizer()
    model = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    target = target_from_model(model, tokenizer, identity="tiny")
    prompt = tokenizer("abc abc abc")["input_ids"]
    free = SpeculativeDecoder(target, NgramProposer(), tree_size=6).generate(prompt, NEW_TOKENS, stop_token_ids=[])
    text = tokenizer.decode(free.tokens)
    stop = text[7:10]  # a string the free-running output contains; it ends inside the output
    end = next(n for n in range(1, len(free.tokens) + 1) if stop in tokenizer.decode(free.tokens[:n]))
    for tree_size in (1, 6):
        result = SpeculativeDecoder(target, NgramProposer(), tree_size=tree_size).generate(
            prompt, NEW_TOKENS, stop_token_ids=[], stop_strings=["never there", stop])
        assert result.tokens == free.tokens[:end] and result.stop_reason == "stop"
    alone = SpeculativeDecoder(target, NgramProposer(), tree_size=6).generate(  # one string is one stop string
        prompt, NEW_TOKENS, stop_token_ids=[], stop_strings=stop)
    assert alone.tokens == free.tokens[:end]
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        SpeculativeDecoder(target_from_model(model, None), None, tree_size=1).generate(prompt, 4, stop_strings=["a"])


def test_streaming_iterator_yields_what_generate_returns():
    target = target_from_model(tiny_model("llama", seed=0, vocab_size=VOCAB), identity="tiny")
    decoder = SpeculativeDecoder(target, NgramProposer(), tree_size=8)
    expected = decoder.generate(PROMPTS[1], NEW_TOKENS)
    chunks = decoder.stream_tokens(PROMPTS[1], NEW_TOKENS)
    received = []
    while True:
        try:
            received.append(next(chunks))
        except StopIteration as finished:
            result = finished.value
            break
    assert [t for chunk in received for t in chunk] == expected.tokens == result.tokens
    assert [len(chunk) for chunk in received[1:]] == result.accept_lengths  # the first chunk is the prefill's token


def test_auto_attention_takes_flash_attn_only_where_it_runs(monkeypatch):
    """The CUDA-only choice, decided on CPU: flash-attn takes fp16/bf16 on a CUDA GPU of compute capability 8.0
    (Ampere) or more, nothing else."""
    import importlib.util

    from runtime.target import attention

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert attention.default_backend(cuda, torch.bfloat16) == "cascade"
    assert attention.default_backend(cuda, torch.float16) == "cascade"
    assert attention.default_backend(cuda, torch.float32) == "sdpa"  # flash-attn has no fp32 kernel
    assert attention.default_backend(torch.device("cpu"), torch.bfloat16) == "sdpa"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4: flash-attn 2 fails
    assert attention.default_backend(cuda, torch.float16) == "sdpa"
