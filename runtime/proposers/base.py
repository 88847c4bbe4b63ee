"""The proposer interface: build a candidate tree from the current state; learn what was accepted.

``Proposer`` is the base class every proposer derives from: it declares ``start`` and ``propose``, which each
proposer defines, and documented hooks whose defaults do nothing, which a proposer overrides where it does more.

A proposer object holds configuration. Everything that belongs to one generation (a draft cache, the position up
to which features were consumed) lives in the state object returned by ``start`` and passed back in. The one
exception is memory meant to outlive a generation (lookahead's carried successors): ``start`` gets the generation's
``sampling`` (None: greedy), so that only greedy generations use it; a sampled generation then draws what its prompt
and seed give, whatever the proposer decoded before.

A proposal is a ``Tree``, or a ``Draft``: a tree plus extra rows the verification pass computes after the tree's
nodes, whose logits come back in the next ``ProposeInput`` (lookahead decoding's Jacobi window rides in the pass
this way). A proposer that asks for extra rows says how many it may ask for at most (``extra_rows``), so that
buffers are sized for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.engine.sampling import SamplingParams
from runtime.engine.tree import Draft, Tree


@dataclass
class ProposeInput:
    """What the decoder knows before a proposal.

    history [L] long: prompt + emitted tokens; history[-1] is the root of the next tree (not yet verified).
    new_hidden [A, H] or None: target hidden states (after the final norm) of the positions verified since the
    previous proposal, i.e. of history[L - 1 - A : L - 1]; new_layer_hidden: the same for requested layers.
    tree_size: the largest tree (nodes, root included) the verifier wants.
    extra_logits [E, V] or None: the target's logits at the extra rows of the previous proposal's ``Draft``, in its
    order (None when it asked for none, and before the first verification).
    """

    history: torch.Tensor
    new_hidden: torch.Tensor | None
    new_layer_hidden: tuple[torch.Tensor, ...]
    tree_size: int
    sampling: SamplingParams
    generator: torch.Generator | None
    extra_logits: torch.Tensor | None = None


class Proposer:
    """What the decoders ask of a proposer. Subclasses set ``name`` and define ``start`` and ``propose``; the
    attributes below are the defaults of a proposer that drafts alone, from the history only, with a model."""

    name: str = "proposer"
    hidden_layers: tuple[int, ...] = ()  # target layers whose inputs the proposer needs (EAGLE-3); () for none
    needs_hidden: bool = False  # whether the decoder should hand over target hidden states
    expected_acceptance: float = 0.0  # prior per-token acceptance rate, used to size trees from the cost curve
    tree_size: int | None = None  # a measured verified-tree size (scripts/tune_tree.py); None: the cost model decides
    # acc@1 measured in training, what ``runtime.engine.monitor`` holds the rolling acceptance to (None: unknown)
    trained_acceptance: float | None = None
    tree_size_reason: str | None = None  # how the proposer chose its own tree size, where it did
    extra_rows: int = 0  # the most extra rows (``Draft``) it asks a verification pass for
    max_depth: int | None = None  # the deepest node it drafts; None where it does not say
    # Drafting runs no model (prompt lookup): a deeper tree costs its verification alone, and nothing where it finds
    # nothing (``runtime.engine.batched``'s per-row sizes).
    drafts_without_a_model: bool = False
    # It verifies trees of its own ``tree_size`` at every step (``sizes_own_tree``).
    own_tree_size: bool = False
    # It learns from the verified nodes' logits (``observe``); otherwise a greedy pass may compute only their argmax.
    observes_logits: bool = False

    def start(self, prompt: torch.Tensor, max_length: int, sampling: SamplingParams | None = None) -> Any:
        """Per-generation state for a prompt [P] and a total length bound; ``sampling`` is the generation's (None:
        greedy), for a proposer whose memory outlives a generation and serves greedy ones only."""
        return None

    def propose(self, state: Any, step: ProposeInput) -> Tree | Draft:
        """A tree rooted at step.history[-1], at most step.tree_size nodes (with at most ``extra_rows`` extra rows,
        a Draft)."""
        raise NotImplementedError

    def propose_rows(self, states: list[Any], steps: list[ProposeInput]) -> list[Tree | Draft]:
        """Proposals for several generations at one step: ``propose`` for each, unless a proposer drafts for all of
        them in one pass (a head). Its trees may then differ from ``propose``'s by rounding, so only callers whose
        output does not depend on the tree use it."""
        return [self.propose(state, step) for state, step in zip(states, steps)]

    def unread_rows(self, state: Any, history: torch.Tensor) -> int | None:
        """How many verified rows of history [L] the proposer's model has yet to read before it drafts (None: it does
        not say). A head that skipped passes reads their rows in its next call, so that call costs more than a call
        in a run of drafting passes."""
        return None

    def observe(self, state: Any, history: torch.Tensor, tree: Tree, logits: torch.Tensor | None) -> None:
        """The target's logits [N, V] at the nodes of ``tree``, just verified, for a proposer that learns from them
        (lookahead's recycled successors; None for a proposer that does not, ``observes_logits``, where the pass
        computed only their argmax); history [L] is the history the tree was drafted from (its root is history[-1]).
        The decoders call it after every verification pass, before the next proposal."""

    @property
    def drafters(self) -> dict[str, Proposer]:
        """The drafters whose trees are sized apart, by name. A proposer that drafts each step with one of several
        (prompt lookup where it finds a match, a head elsewhere) lists them and names the next step's in
        ``draft_source``; any other proposer is its own one drafter."""
        return {self.name: self}

    def draft_source(self, state: Any, history: torch.Tensor) -> str:
        """The name of the drafter (a key of ``drafters``) that will draft the next step, history [L] being the prompt
        and emitted tokens."""
        return self.name

    def draft_level(self, state: Any, history: torch.Tensor) -> int | None:
        """The next step's level, whose drafts are learnt apart from other levels' (prompt lookup's is the length of
        the suffix it matched, since a longer match is right more often); None where the drafter will find nothing
        to draft. A drafter without levels is at 0."""
        return 0

    def draft_key(self, state: Any, history: torch.Tensor) -> tuple[str, int] | None:
        """(the drafter that drafts the next step, its level), or None where that drafter will find nothing to
        draft."""
        source = self.draft_source(state, history)
        level = self.draft_level(state, history)
        return None if level is None else (source, level)

    @property
    def drafts_with_a_model(self) -> bool:
        """Whether drafting costs a model's call (a head, a draft model)."""
        return not self.drafts_without_a_model

    @property
    def sizes_own_tree(self) -> bool:
        """Whether the proposer verifies trees of its own ``tree_size`` at every step. Adaptive sizing models a tree
        of n nodes as a chain n - 1 deep; a proposer whose gain comes from width (lookahead's candidates side by
        side) would be shrunk to a single chain by it."""
        return self.own_tree_size and self.tree_size is not None


class NoProposer(Proposer):
    """Plain autoregressive decoding through the same verification path (a tree of just the root)."""

    name = "none"
    tree_size = 1

    def propose(self, state: None, step: ProposeInput) -> Tree:
        return Tree.chain(int(step.history[-1]), [], device=step.history.device)
