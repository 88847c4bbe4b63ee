"""Prompt lookup as a tree: continuations of several earlier occurrences of the current suffix, merged in a trie."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.proposers.base import ProposeInput
from runtime.tree import Tree


def find_continuations(history: np.ndarray, max_ngram: int, min_ngram: int, max_matches: int,
                       depth: int) -> list[np.ndarray]:
    """Continuations that followed earlier occurrences of the history's last n tokens (n from max_ngram down to
    min_ngram), most recent occurrence first within each n. history [L] int; returns up to max_matches arrays,
    each of at most ``depth`` tokens, distinct.
    """
    length = len(history)
    found: list[np.ndarray] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(history[: length - 1], n)  # starts 0 .. L-1-n
        starts = np.flatnonzero((windows == suffix).all(axis=1))[::-1]
        for start in starts:
            continuation = history[start + n: start + n + depth]
            key = tuple(continuation.tolist())
            if not key or key in seen:
                continue
            seen.add(key)
            found.append(continuation)
            if len(found) >= max_matches:
                return found
    return found


@dataclass
class NgramProposer:
    """Prompt-lookup decoding over prompt + generated text, proposing a tree from several matches."""

    max_ngram: int = 4
    min_ngram: int = 2  # single-token matches are right too rarely to pay for a multi-token pass on CPU
    max_matches: int = 4
    max_depth: int = 10
    name: str = "ngram"
    hidden_layers: tuple[int, ...] = ()
    needs_hidden: bool = False
    expected_acceptance: float = 0.45
    tree_size: int | None = None
    # drafting runs no model: a deeper tree costs its verification alone (``runtime.batched``'s per-row sizes)
    drafts_without_a_model: bool = True

    def start(self, prompt: torch.Tensor, max_length: int) -> None:
        return None

    def finds(self, history: torch.Tensor) -> bool:
        """Whether the history's suffix [L] occurred earlier, so that ``propose`` drafts a continuation."""
        return bool(find_continuations(history.cpu().numpy(), self.max_ngram, self.min_ngram, 1, 1))

    def propose(self, state: None, step: ProposeInput) -> Tree:
        history = step.history.cpu().numpy()
        depth = min(self.max_depth, step.tree_size - 1)
        sequences = find_continuations(history, self.max_ngram, self.min_ngram, self.max_matches, depth) \
            if depth > 0 else []
        return Tree.from_sequences(int(history[-1]), sequences, step.tree_size, device=step.history.device)
