"""The proposer interface: build a candidate tree from the current state; learn what was accepted.

A proposer object holds configuration. Everything that belongs to one generation (a draft cache, the position up
to which features were consumed) lives in the state object returned by ``start`` and passed back in. The one
exception is memory meant to outlive a generation (lookahead's carried successors): a proposer that keeps it sets
``carries_memory`` and takes ``sampling`` in ``start`` (``start_generation``), so that only greedy generations use
it; a sampled generation then draws what its prompt and seed give, whatever the proposer decoded before.

A proposal is a ``Tree``, or a ``Draft``: a tree plus extra rows the verification pass computes after the tree's
nodes, whose logits come back in the next ``ProposeInput`` (lookahead decoding's Jacobi window rides in the pass
this way). A proposer that asks for extra rows says how many it may ask for at most (``extra_rows``), so that
buffers are sized for them; other proposers need not define it.

A proposer that learns from the target's outputs at the tree's own nodes (lookahead's recycled successors) defines
``observe(state, history, tree, logits)``; the decoder calls it after every verification pass, before the next
proposal. Other proposers need not define it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.sampling import SamplingParams
from runtime.tree import Draft, Tree


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


class Proposer(Protocol):
    name: str
    hidden_layers: tuple[int, ...]  # target layers whose inputs the proposer needs (EAGLE-3); () for none
    needs_hidden: bool  # whether the decoder should hand over target hidden states
    expected_acceptance: float  # prior per-token acceptance rate, used to size trees from the cost curve
    tree_size: int | None  # a measured verified-tree size (scripts/tune_tree.py); None: the cost model decides

    def start(self, prompt: torch.Tensor, max_length: int) -> Any:
        """Per-generation state for a prompt [P] and a total length bound."""

    def propose(self, state: Any, step: ProposeInput) -> Tree | Draft:
        """A tree rooted at step.history[-1], at most step.tree_size nodes (with at most ``extra_rows`` extra rows,
        a Draft)."""


def propose_rows(proposer, states: list[Any], steps: list[ProposeInput]) -> list[Tree | Draft]:
    """``proposer``'s proposals for several generations at one step: its ``propose_rows`` where it has one (a head
    that drafts for all of them in one pass; the trees may differ from ``propose``'s by rounding, so only callers
    whose output does not depend on the tree use it), else ``propose`` for each."""
    together = getattr(proposer, "propose_rows", None)
    if together is not None:
        return together(states, steps)
    return [proposer.propose(state, step) for state, step in zip(states, steps)]


def unread_rows(proposer, state: Any, history: torch.Tensor) -> int | None:
    """How many verified rows of history [L] ``proposer``'s model has yet to read before it drafts (its
    ``unread_rows``; None for a proposer that does not say). A head that skipped passes reads their rows in its next
    call, so that call costs more than a call in a run of drafting passes."""
    count = getattr(proposer, "unread_rows", None)
    return None if count is None else count(state, history)


def start_generation(proposer, prompt: torch.Tensor, max_length: int, sampling: SamplingParams | None) -> Any:
    """``proposer.start(prompt, max_length)``, with ``sampling`` (None: greedy) for a proposer that
    ``carries_memory`` across generations."""
    if getattr(proposer, "carries_memory", False):
        return proposer.start(prompt, max_length, sampling=sampling)
    return proposer.start(prompt, max_length)


def extra_rows(proposer) -> int:
    """The most extra rows ``proposer`` asks a verification pass for (its ``extra_rows``; 0 when it has none)."""
    return int(getattr(proposer, "extra_rows", 0))


def observe(proposer, state: Any, history: torch.Tensor, tree: Tree, logits: torch.Tensor) -> None:
    """Hand ``proposer`` (its ``observe``, where it has one) the target's logits [N, V] at the nodes of ``tree``,
    just verified; history [L] is the history the tree was drafted from (its root is history[-1])."""
    learn = getattr(proposer, "observe", None)
    if learn is not None:
        learn(state, history, tree, logits)


def drafters(proposer) -> dict[str, Any]:
    """The drafters whose trees are sized apart, by name. A proposer that drafts each step with one of several
    (prompt lookup where it finds a match, a head elsewhere) lists them in ``drafters`` and names the next step's
    in ``draft_source(state, history)``; any other proposer is its own one drafter."""
    return dict(getattr(proposer, "drafters", None) or {proposer.name: proposer})


def draft_source(proposer, state: Any, history: torch.Tensor) -> str:
    """The name of the drafter (a key of ``drafters(proposer)``) that will draft the next step, history [L] being
    the prompt and emitted tokens."""
    choose = getattr(proposer, "draft_source", None)
    return proposer.name if choose is None else choose(state, history)


def draft_key(proposer, state: Any, history: torch.Tensor) -> tuple[str, int] | None:
    """(the drafter that drafts the next step: ``draft_source``, its level), or None where that drafter will find
    nothing to draft. A proposer's ``draft_level(state, history)`` gives the level, whose drafts are learnt apart from
    other levels': prompt lookup's is the length of the suffix it matched, since a longer match is right more often;
    a drafter without levels is at 0."""
    source = draft_source(proposer, state, history)
    level = getattr(proposer, "draft_level", None)
    found = 0 if level is None else level(state, history)
    return None if found is None else (source, found)


def drafts_with_a_model(drafter) -> bool:
    """Whether ``drafter``'s drafting costs a model's call (a head, a draft model); a drafter that looks its drafts
    up (``drafts_without_a_model``: prompt lookup) costs next to nothing, and nothing where it finds nothing."""
    return not getattr(drafter, "drafts_without_a_model", False)


def sizes_own_tree(proposer) -> bool:
    """Whether ``proposer`` verifies trees of its own ``tree_size`` at every step (``own_tree_size``). Adaptive
    sizing models a tree of n nodes as a chain n - 1 deep; a proposer whose gain comes from width (lookahead's
    candidates side by side) would be shrunk to a single chain by it."""
    return bool(getattr(proposer, "own_tree_size", False)) and proposer.tree_size is not None


class NoProposer:
    """Plain autoregressive decoding through the same verification path (a tree of just the root)."""

    name = "none"
    hidden_layers: tuple[int, ...] = ()
    needs_hidden = False
    expected_acceptance = 0.0
    tree_size = 1

    def start(self, prompt: torch.Tensor, max_length: int) -> None:
        return None

    def propose(self, state: None, step: ProposeInput) -> Tree:
        return Tree.chain(int(step.history[-1]), [], device=step.history.device)
