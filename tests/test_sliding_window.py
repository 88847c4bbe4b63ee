"""Sliding-window attention: once the context is longer than the window, every proposer's tree passes must still
reproduce HF greedy decoding, on each way families express windows (Mistral: every layer; Qwen2: some layers;
Gemma-2: alternating layers, with attention logit soft-capping)."""

from __future__ import annotations

import pytest
import torch

from runtime.target.attention import sliding_window_mask
from runtime.engine.decoder import SpeculativeDecoder
from runtime.target.model import target_from_model
from tests.conftest import SLIDING_WINDOW, tiny_model
from tests.test_greedy_equality import proposers
from tests.test_head_proposers import head_proposers

VOCAB = 64
NEW_TOKENS = 24
# longer than the window, with repeats so lookup and the heads draft
PROMPTS = [list(range(10, 30)), [1, 2, 3, 4] * 5]


def test_sliding_window_mask_by_hand():
    # 3 cached positions, then a pass of 2 rows at positions 3 and 4 (row 1 sees row 0: a chain)
    mask = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])[None, None]
    windowed = sliding_window_mask(mask, torch.tensor([[3, 4]]), 5, window=2)
    assert windowed[0, 0].tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
    causal = sliding_window_mask(None, torch.arange(4)[None], 4, window=2)  # a prefill
    assert causal[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                     [False, True, True, False], [False, False, True, True]]


def hf_greedy(arch: str, prompt: list[int]) -> list[int]:
    model = tiny_model(arch, seed=0, vocab_size=VOCAB)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["mistral", "qwen2-sliding", "gemma2"])
def test_every_proposer_matches_hf_greedy_past_the_window(arch):
    assert all(len(prompt) > SLIDING_WINDOW for prompt in PROMPTS)
    target = target_from_model(tiny_model(arch, seed=0, vocab_size=VOCAB), identity="tiny")
    references = [hf_greedy(arch, prompt) for prompt in PROMPTS]
    candidates = {**proposers(target, arch), **head_proposers(target)}
    for name, proposer in candidates.items():
        for attention in ("sdpa", "cascade"):
            decoder = SpeculativeDecoder(target, proposer, tree_size=8, attention=attention)
            for prompt, reference in zip(PROMPTS, references):
                result = decoder.generate(prompt, NEW_TOKENS)
                assert result.tokens == reference, f"{arch}/{name}/{attention}: output differs"
