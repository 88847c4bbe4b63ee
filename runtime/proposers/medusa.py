"""Static Medusa trees: each head's top-k tokens placed on a fixed tree of rank paths ("choices")."""

from __future__ import annotations

import heapq

import torch

from runtime.proposers.base import Proposer, ProposeInput
from runtime.engine.tree import Tree, closed_choices


# Ranks of each head a static tree draws from: the most a tree, estimated or measured, may hold.
TOP_K = 10


def best_rank_paths(probability, depths: int, top_k: int, count: int) -> list[tuple[int, ...]]:
    """The ``count`` rank paths (r_1, ..., r_d), d <= ``depths``, every r_i < ``top_k``, with the highest products
    of ``probability(i, r_i)`` (depth i from 0, non-increasing in the rank), found best-first so that the set is
    ancestor-closed: a tree of independently drafted positions (Medusa's heads, a DFlash block)."""
    chosen: list[tuple[int, ...]] = []
    frontier = [(-probability(0, 0), (0,))]
    while frontier and len(chosen) < count:
        negative, path = heapq.heappop(frontier)
        chosen.append(path)
        score = -negative
        depth = len(path)
        if path[-1] + 1 < top_k:  # next sibling
            sibling = path[:-1] + (path[-1] + 1,)
            parent_score = score / max(probability(depth - 1, path[-1]), 1e-30)
            heapq.heappush(frontier, (-parent_score * probability(depth - 1, path[-1] + 1), sibling))
        if depth < depths:  # first child
            heapq.heappush(frontier, (-score * probability(depth, 0), path + (0,)))
    return chosen


def calibrated_choices(head_accuracy: list[float], tree_size: int, top_k: int = TOP_K,
                       rank_decay: float = 0.5) -> list[tuple[int, ...]]:
    """The ``tree_size - 1`` rank paths with the highest estimated acceptance probability.

    A path (r_1, ..., r_d) is accepted with probability prod_i head_accuracy[i-1] * rank_decay ** r_i (top-1
    accuracy of head i, discounted for lower ranks); best-first search keeps the set ancestor-closed.
    """
    return best_rank_paths(lambda depth, rank: head_accuracy[depth] * rank_decay ** rank, len(head_accuracy), top_k,
                           tree_size - 1)


def measured_rank_paths(ranks: torch.Tensor, top_k: int = TOP_K,
                        max_paths: int | None = 255) -> tuple[list[tuple[int, ...]], list[float]]:
    """The static Medusa tree measured on text: ranks [N, D] long, ranks[n, d] the rank of the target's own token
    under head d at position n (0 = the head's top token) -> (paths, frequencies), at most ``max_paths`` of each.

    A path (r_1, ..., r_k) is a rank prefix seen at some position with every r_i < ``top_k``; its frequency is the
    fraction of the N positions whose ranks start with it. Paths come most frequent first, each after its own
    prefixes (a prefix is at least as frequent; ties go to the shorter path, then the smaller ranks). A tree of the
    first T - 1 paths is ancestor-closed and, at a position, gets exactly as many drafts accepted as it holds
    prefixes of that position's ranks, so it accepts sum(frequencies[:T - 1]) drafts per pass on the measured text:
    the most any tree of T nodes accepts there (calibrated_choices estimates the same from per-head rates).
    ``max_paths=None`` keeps every path seen (what ``tree_tau`` needs to score any tree).
    """
    if ranks.dim() != 2:
        raise ValueError(f"ranks must be [positions, heads], got shape {tuple(ranks.shape)}")
    positions, depth = ranks.shape
    counts: dict[tuple[int, ...], int] = {}
    inside = torch.ones(positions, dtype=torch.bool, device=ranks.device)
    for length in range(1, depth + 1):
        inside &= ranks[:, length - 1] < top_k  # a prefix with a rank past top_k is not in any tree
        if not inside.any():
            break
        prefixes, seen = ranks[inside, :length].unique(dim=0, return_counts=True)
        counts.update(zip(map(tuple, prefixes.tolist()), seen.tolist()))
    paths = sorted(counts, key=lambda path: (-counts[path], len(path), path))[:max_paths]
    return paths, [counts[path] / max(positions, 1) for path in paths]


def tree_tau(choices: list[tuple[int, ...]], frequency: dict[tuple[int, ...], float]) -> float:
    """Tokens per pass a static tree of ``choices`` (prefixes added) gets on text whose rank-path frequencies are
    ``frequency`` (every path ``measured_rank_paths`` saw there): 1 + the frequencies of the tree's paths."""
    return 1.0 + sum(frequency.get(path, 0.0) for path in closed_choices(choices))


def tree_accepted(choices: list[tuple[int, ...]], ranks: torch.Tensor) -> torch.Tensor:
    """Drafts a static tree of ``choices`` (prefixes added) gets accepted at each position: ranks [N, D] as
    ``measured_rank_paths`` takes them -> [N] long, how many of the tree's nodes are prefixes of the position's
    ranks. Its mean plus one is ``tree_tau``; ``training.metrics.decoding_tau`` of it is what decoding gets."""
    nodes = closed_choices(choices)
    accepted = torch.zeros(ranks.shape[0], dtype=torch.long)
    inside = torch.ones(ranks.shape[0], dtype=torch.bool)
    for length in range(1, ranks.shape[1] + 1):
        inside &= torch.tensor([tuple(prefix) in nodes for prefix in ranks[:, :length].tolist()], dtype=torch.bool)
        accepted += inside
    return accepted


def check_rank_paths(paths: list[tuple[int, ...]], num_heads: int, top_k: int) -> None:
    """A ValueError unless ``paths`` is a measured tree for ``num_heads`` heads: each path of 1..num_heads ranks
    below ``top_k``, after its own prefix, none twice (any first T - 1 of them then make a tree)."""
    seen: set[tuple[int, ...]] = set()
    for number, path in enumerate(paths):
        problem = ("is empty or longer than the heads" if not 1 <= len(path) <= num_heads
                   else f"has a rank outside 0..{top_k - 1}" if not all(0 <= rank < top_k for rank in path)
                   else "repeats an earlier path" if path in seen
                   else f"comes before its prefix {path[:-1]}" if len(path) > 1 and path[:-1] not in seen else None)
        if problem:
            raise ValueError(f"Medusa rank path {number} {list(path)} {problem}; rank paths come from "
                             f"measured_rank_paths for a head of {num_heads} heads (remeasure them with "
                             f"scripts/eval_head.py)")
        seen.add(path)


class MedusaProposer(Proposer):
    """``heads``: MedusaHeads attached to the target's weights. ``choices`` fixes the tree; by default a tree of T
    nodes is the first T - 1 of ``rank_paths`` (``measured_rank_paths``, most frequent first) where given, else
    calibrated from ``head_accuracy`` (per-head top-1 acceptance, e.g. measured during training).
    ``tree_size``: a measured verified-tree size (None: the cost model sizes it from ``head_accuracy[0]``); with
    ``choices``, at least the tree they make, which the decoder then keeps (``own_tree_size``)."""

    name = "medusa"
    needs_hidden = True

    def __init__(self, heads, choices: list[tuple[int, ...]] | None = None, head_accuracy: list[float] | None = None,
                 top_k: int = TOP_K, tree_size: int | None = None, rank_paths: list[tuple[int, ...]] | None = None):
        self.heads = heads
        self.rank_paths = [tuple(path) for path in rank_paths] if rank_paths else None
        if self.rank_paths:
            check_rank_paths(self.rank_paths, heads.num_heads, top_k)
        self.tree_size = tree_size
        self.top_k = top_k
        self.choices = [tuple(c) for c in choices] if choices is not None else None
        if self.choices is not None:
            # the choices fix the tree (their prefixes included): adaptive sizing would ask for fewer nodes
            self.tree_size = max(tree_size or 0, 1 + len(closed_choices(self.choices)))
            self.own_tree_size = True
        self.head_accuracy = head_accuracy or [0.6 * 0.8 ** i for i in range(heads.num_heads)]
        self.expected_acceptance = self.head_accuracy[0]

    @classmethod
    def from_head(cls, heads, target, tree: dict, tree_size: int | None) -> MedusaProposer:
        """The proposer for loaded ``heads`` with its config's tree defaults ``tree`` (measured acceptance per head,
        rank paths) and a measured verified-tree size (``runtime.proposers.measured_tree_size``)."""
        accuracy = tree.get("acceptance")
        return cls(heads, head_accuracy=accuracy[: heads.num_heads] if accuracy else None, tree_size=tree_size,
                   rank_paths=tree.get("rank_paths"))

    def propose(self, state: None, step: ProposeInput) -> Tree:
        return self._trees([step])[0]

    def propose_rows(self, states: list[None], steps: list[ProposeInput]) -> list[Tree]:
        """``propose`` for several generations, every root's hidden state through the heads in one product."""
        if len({step.tree_size for step in steps}) > 1:  # one set of choices serves one tree size
            return [self._trees([step])[0] for step in steps]
        return self._trees(steps)

    def tree_choices(self, tree_size: int) -> list[tuple[int, ...]]:
        """The tree of ``tree_size`` nodes: the measured paths (all of them where they make fewer nodes), else the
        calibrated estimate."""
        if self.rank_paths:
            return self.rank_paths[: tree_size - 1]
        return calibrated_choices(self.head_accuracy, tree_size, self.top_k)

    @torch.inference_mode()
    def _trees(self, steps: list[ProposeInput]) -> list[Tree]:
        """One tree per step (all of one tree size)."""
        tree_size = steps[0].tree_size
        if tree_size <= 1:  # the decoder verifies the root alone (plain decoding): nothing to draft
            return [Tree.chain(int(step.history[-1]), [], device=step.history.device) for step in steps]
        choices = self.choices or self.tree_choices(tree_size)
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

