"""Prompt lookup as a tree: continuations of several earlier occurrences of the current suffix, merged in a trie."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.proposers.base import Proposer, ProposeInput
from runtime.engine.tree import Tree


def suffix_matches(history: np.ndarray, max_ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the history's suffix occurred before: (ends [M], lengths [M]), each earlier position e < L - 1 whose
    token equals the last one, and how many tokens up to e equal the suffix's last ones (at most max_ngram), most
    recent first. history [L] int.

    One comparison over the history finds the few positions holding the last token; the matches are extended
    backwards from there, so a lookup costs a pass over L rather than one per n-gram length."""
    length = len(history)
    ends = np.flatnonzero(history[: length - 1] == history[length - 1])[::-1]
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_ngram, length - 1)):
        alive &= ends >= back
        alive[alive] = history[ends[alive] - back] == history[length - 1 - back]
        lengths += alive
    return ends, lengths


def find_continuations(history: np.ndarray, max_ngram: int, min_ngram: int, max_matches: int,
                       depth: int) -> list[np.ndarray]:
    """Continuations that followed earlier occurrences of the history's last n tokens (n from max_ngram down to
    min_ngram), most recent occurrence first within each n. history [L] int; returns up to max_matches arrays,
    each of at most ``depth`` tokens, distinct.
    """
    ends, lengths = suffix_matches(history, max_ngram)
    found: list[np.ndarray] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        for end in ends[lengths >= n]:
            continuation = history[end + 1: end + 1 + depth]
            key = tuple(continuation.tolist())
            if not key or key in seen:
                continue
            seen.add(key)
            found.append(continuation)
            if len(found) >= max_matches:
                return found
    return found


@dataclass
class NgramProposer(Proposer):
    """Prompt-lookup decoding over prompt + generated text, proposing a tree from several matches."""

    max_ngram: int = 4
    min_ngram: int = 2  # single-token matches are right too rarely to pay for a multi-token pass on CPU
    max_matches: int = 4
    max_depth: int = 10
    name: str = "ngram"
    expected_acceptance: float = 0.45
    tree_size: int | None = None
    drafts_without_a_model: bool = True  # a deeper tree costs its verification alone

    def match_length(self, history: torch.Tensor) -> int:
        """The longest suffix of history [L], of min_ngram to max_ngram tokens, that occurred earlier with a token
        after it (what ``propose`` continues from); 0: none did."""
        _, lengths = suffix_matches(history.cpu().numpy(), self.max_ngram)
        longest = int(lengths.max()) if len(lengths) else 0
        return longest if longest >= self.min_ngram else 0

    def finds(self, history: torch.Tensor) -> bool:
        """Whether the history's suffix [L] occurred earlier, so that ``propose`` drafts a continuation."""
        return self.match_length(history) > 0

    def draft_level(self, state: None, history: torch.Tensor) -> int | None:
        """The next step's level (``runtime.proposers.base.draft_key``): the length of the suffix it continues, None
        where it finds none."""
        return self.match_length(history) or None

    def propose(self, state: None, step: ProposeInput) -> Tree:
        history = step.history.cpu().numpy()
        depth = min(self.max_depth, step.tree_size - 1)
        sequences = find_continuations(history, self.max_ngram, self.min_ngram, self.max_matches, depth) \
            if depth > 0 else []
        return Tree.from_sequences(int(history[-1]), sequences, step.tree_size, device=step.history.device)
