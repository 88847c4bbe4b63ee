"""Prompt lookup first, a draft head otherwise.

Where the text repeats an earlier stretch (code, lists, quoted prompt text), a continuation found by n-gram lookup is
right more often than a small head's guess (scripts/benchmark.py reports both methods' depth-1 acceptance) and costs
almost nothing to find. Elsewhere lookup finds nothing and the head drafts.

The head must read every verified row before it drafts (an EAGLE head keeps its own cache over the context), but
not at once: rows verified in lookup steps wait, and the head reads them together with the rows of the step in which
it next drafts. One head pass over the rows of several steps costs about as much as a pass over one step's rows
(a decode-sized pass is bound by reading the weights and by per-call overhead), so lookup steps cost the head
nothing.

A head that asks for extra rows (lookahead's Jacobi window) gets them only in the steps it drafts: a lookup step's
pass carries none, so the next draft's ``extra_logits`` are None and the head skips that update.

The two drafters' trees are sized apart (``drafters``, ``draft_source``), each by what its own steps get accepted:
lookup's chains tend to be right deep or not at all, a head's guesses fade with depth, and one acceptance learnt
from both describes neither.

Either tree is verified by the same exact acceptance, so the output stays the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.proposers.base import Proposer, ProposeInput
from runtime.proposers.ngram import NgramProposer
from runtime.engine.sampling import SamplingParams
from runtime.engine.tree import Draft, Tree


@dataclass
class LookupFirstState:
    """The head's own state, and the target features of rows verified since the head last drafted."""

    head: Any
    # the history length at which draft_source found no match (the length grows every step, so an old one never
    # matches): the step's proposal then skips lookup's second search
    nothing_found_at: int = -1
    match: tuple[int, int] = (-1, 0)  # (history length, the suffix lookup matched there) from draft_source
    hidden: list[torch.Tensor] = field(default_factory=list)  # each [A, H]
    layer_hidden: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # each a tuple of [A, H]


def _with_pending(state: LookupFirstState, step: ProposeInput) -> ProposeInput:
    """``step`` with the waiting rows' features in front of its own (rows in history order)."""
    if not state.hidden and not state.layer_hidden:
        return step
    hidden = None if step.new_hidden is None else torch.cat([*state.hidden, step.new_hidden])
    layer_hidden = tuple(torch.cat(parts) for parts in zip(*state.layer_hidden, step.new_layer_hidden))
    state.hidden, state.layer_hidden = [], []
    return ProposeInput(step.history, hidden, layer_hidden, step.tree_size, step.sampling, step.generator,
                        step.extra_logits)


class LookupFirstProposer(Proposer):
    """``head`` drafts the steps where ``lookup`` finds no earlier occurrence of the current suffix."""

    def __init__(self, head: Proposer, lookup: NgramProposer | None = None):
        self.head = head
        self.lookup = lookup if lookup is not None else NgramProposer()
        self.name = f"{head.name}+{self.lookup.name}"
        self.hidden_layers = head.hidden_layers
        self.needs_hidden = head.needs_hidden
        # Without a measured tree size the cost model sizes the tree; it has to hold lookup's chains as well as the
        # head's guesses, so it is sized for the better of the two drafters.
        self.expected_acceptance = max(head.expected_acceptance, self.lookup.expected_acceptance)
        # a head sizing its own trees (lookahead's width) has no measured size for lookup's chains to start from
        self.tree_size = None if head.sizes_own_tree else head.tree_size
        self.extra_rows = head.extra_rows
        self.observes_logits = head.observes_logits

    @property
    def trained_acceptance(self) -> float | None:
        """The head's: its passes are held to it (``runtime.engine.monitor.judged_drafter``)."""
        return self.head.trained_acceptance

    @property
    def drafters(self) -> dict[str, Proposer]:
        return {self.lookup.name: self.lookup, self.head.name: self.head}

    def draft_source(self, state: LookupFirstState, history: torch.Tensor) -> str:
        """Which drafter drafts the next step: lookup where the suffix of history [L] occurred before, else the
        head."""
        found = self.lookup.match_length(history)
        state.match = (history.numel(), found)
        if found:
            return self.lookup.name
        state.nothing_found_at = history.numel()
        return self.head.name

    def draft_level(self, state: LookupFirstState, history: torch.Tensor) -> int:
        """The next step's level (``runtime.proposers.base.draft_key``): the suffix lookup matched where it drafts,
        0 (one level) for the head."""
        length, found = state.match
        return found if length == history.numel() else self.lookup.match_length(history)

    def start(self, prompt: torch.Tensor, max_length: int, sampling: SamplingParams | None = None) -> LookupFirstState:
        return LookupFirstState(self.head.start(prompt, max_length, sampling))

    def propose(self, state: LookupFirstState, step: ProposeInput) -> Tree | Draft:
        found = self._lookup(state, step)
        return found if found is not None else self.head.propose(state.head, _with_pending(state, step))

    def propose_rows(self, states: list[LookupFirstState], steps: list[ProposeInput]) -> list[Tree | Draft]:
        """``propose`` for several generations: lookup for each, then the head for those lookup found nothing for,
        together."""
        trees = [self._lookup(state, step) for state, step in zip(states, steps)]
        waiting = [i for i, tree in enumerate(trees) if tree is None]
        if waiting:
            drafted = self.head.propose_rows([states[i].head for i in waiting],
                                             [_with_pending(states[i], steps[i]) for i in waiting])
            for i, tree in zip(waiting, drafted):
                trees[i] = tree
        return trees

    def unread_rows(self, state: LookupFirstState, history: torch.Tensor) -> int | None:
        """The rows the head has yet to read, lookup steps' included."""
        return self.head.unread_rows(state.head, history)

    def observe(self, state: LookupFirstState, history: torch.Tensor, tree: Tree, logits: torch.Tensor) -> None:
        """The head learns from every pass, lookup's too."""
        self.head.observe(state.head, history, tree, logits)

    def _lookup(self, state: LookupFirstState, step: ProposeInput) -> Tree | None:
        """Lookup's tree when it finds a continuation (the step's features then wait for the head), else None."""
        if state.nothing_found_at == step.history.numel():
            return None
        found = self.lookup.propose(None, step)
        if found.size <= 1:
            return None
        if step.new_hidden is not None:
            state.hidden.append(step.new_hidden)
        if step.new_layer_hidden:
            state.layer_hidden.append(step.new_layer_hidden)
        return found
