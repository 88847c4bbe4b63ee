"""Static Medusa trees: each head's top-k tokens placed on a fixed tree of rank paths ("choices")."""

from __future__ import annotations

import heapq

import torch

from runtime.proposers.base import ProposeInput
from runtime.tree import Tree, closed_choices


def calibrated_choices(head_accuracy: list[float], tree_size: int, top_k: int = 10,
                       rank_decay: float = 0.5) -> list[tuple[int, ...]]:
    """The ``tree_size - 1`` rank paths with the highest estimated acceptance probability.

    A path (r_1, ..., r_d) is accepted with probability prod_i head_accuracy[i-1] * rank_decay ** r_i (top-1
    accuracy of head i, discounted for lower ranks); best-first search keeps the set ancestor-closed.
    """
    def probability(depth: int, rank: int) -> float:
        return head_accuracy[depth] * rank_decay ** rank

    chosen: list[tuple[int, ...]] = []
    frontier = [(-probability(0, 0), (0,))]
    while frontier and len(chosen) < tree_size - 1:
        negative, path = heapq.heappop(frontier)
        chosen.append(path)
        score = -negative
        depth = len(path)
        if path[-1] + 1 < top_k:  # next sibling
            sibling = path[:-1] + (path[-1] + 1,)
            parent_score = score / probability(depth - 1, path[-1])
            heapq.heappush(frontier, (-parent_score * probability(depth - 1, path[-1] + 1), sibling))
        if depth < len(head_accuracy):  # first child
            heapq.heappush(frontier, (-score * probability(depth, 0), path + (0,)))
    return chosen


class MedusaProposer:
    """``heads``: MedusaHeads attached to the target's weights. ``choices`` fixes the tree; by default it is
    calibrated from ``head_accuracy`` (per-head top-1 acceptance, e.g. measured during training) and the tree_size.
    ``tree_size``: a measured verified-tree size (None: the cost model sizes it from ``head_accuracy[0]``); with
    ``choices``, at least the tree they make, which the decoder then keeps (``own_tree_size``)."""

    name = "medusa"
    hidden_layers: tuple[int, ...] = ()
    needs_hidden = True

    def __init__(self, heads, choices: list[tuple[int, ...]] | None = None, head_accuracy: list[float] | None = None,
                 top_k: int = 10, tree_size: int | None = None):
        self.heads = heads
        self.tree_size = tree_size
        self.top_k = top_k
        self.choices = [tuple(c) for c in choices] if choices is not None else None
        if self.choices is not None:
            # the choices fix the tree (their prefixes included): adaptive sizing would ask for fewer nodes
            self.tree_size = max(tree_size or 0, 1 + len(closed_choices(self.choices)))
            self.own_tree_size = True
        self.head_accuracy = head_accuracy or [0.6 * 0.8 ** i for i in range(heads.num_heads)]
        self.expected_acceptance = self.head_accuracy[0]

    def start(self, prompt: torch.Tensor, max_length: int) -> None:
        return None

    def propose(self, state: None, step: ProposeInput) -> Tree:
        return self._trees([step])[0]

    def propose_rows(self, states: list[None], steps: list[ProposeInput]) -> list[Tree]:
        """``propose`` for several generations, every root's hidden state through the heads in one product."""
        if len({step.tree_size for step in steps}) > 1:  # one set of choices serves one tree size
            return [self._trees([step])[0] for step in steps]
        return self._trees(steps)

    @torch.inference_mode()
    def _trees(self, steps: list[ProposeInput]) -> list[Tree]:
        """One tree per step (all of one tree size)."""
        tree_size = steps[0].tree_size
        if tree_size <= 1:  # the decoder verifies the root alone (plain decoding): nothing to draft
            return [Tree.chain(int(step.history[-1]), [], device=step.history.device) for step in steps]
        choices = self.choices or calibrated_choices(self.head_accuracy, tree_size, self.top_k)
        nodes = 1 + len(closed_choices(choices))
        if nodes > tree_size:
            raise ValueError(f"{len(choices)} Medusa choices need a tree of at least {nodes} nodes, got tree_size="
                             f"{tree_size}; pass tree_size={nodes}")
        depth = max(len(c) for c in choices)
        last_hidden = torch.stack([step.new_hidden[-1] for step in steps])  # [B, H]
        logits = self.heads.first_heads_logits(last_hidden, depth)  # [D, B, V]
        ranks = max(max(c) for c in choices) + 1  # a prefix's ranks too: (2, 1) needs depth 1's rank 2
        candidates = logits.topk(ranks, dim=-1).indices  # [D, B, ranks]
        # Siblings carry distinct ranks of one head, hence distinct tokens: no duplicate branches.
        return [Tree.from_choices(int(step.history[-1]), choices, candidates[:, b])
                for b, step in enumerate(steps)]

