"""Candidate trees: tokens, parent links, and everything a verification pass derives from them.

Node 0 is the root: the last emitted token, whose keys/values are not in the cache yet. Every other node is a
drafted continuation. Nodes are stored parent-before-child (``parents[i] < i``), so a node's index is also its
slot offset in the verification pass, and sorted node lists are root-to-leaf orders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence

import torch


@dataclass
class Tree:
    """tokens [N] long; parents [N] long with parents[0] = -1 and parents[i] < i.

    ``proposal_probs`` [N, V] (optional): row i is the draft distribution node i's children were *sampled* from.
    Without it, children are deterministic picks (top-k, lookup) and acceptance treats them as point masses.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    proposal_probs: torch.Tensor | None = None
    _parent_list: list[int] = field(init=False, repr=False)
    _depth_list: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        self._parent_list = self.parents.tolist()
        if self._parent_list[0] != -1 or any(p >= i or p < 0 for i, p in enumerate(self._parent_list) if i):
            raise ValueError("tree nodes must be ordered parent-before-child with parents[0] = -1")
        depths = [0] * len(self._parent_list)
        for i in range(1, len(depths)):
            depths[i] = depths[self._parent_list[i]] + 1
        self._depth_list = depths

    @property
    def size(self) -> int:
        return len(self._parent_list)

    @property
    def depths(self) -> torch.Tensor:
        """[N] long: number of edges from the root."""
        return torch.tensor(self._depth_list, dtype=torch.long, device=self.tokens.device)

    @property
    def max_depth(self) -> int:
        return max(self._depth_list)

    def children(self) -> list[list[int]]:
        """children()[i]: node i's children in proposal order."""
        kids: list[list[int]] = [[] for _ in self._parent_list]
        for i, p in enumerate(self._parent_list[1:], start=1):
            kids[p].append(i)
        return kids

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True iff j is i or an ancestor of i (the tree-attention mask)."""
        n = self.size
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self._parent_list):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask.to(self.tokens.device)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """[N] long: prefix_len + depth."""
        return self.depths + prefix_len

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node lists, one per leaf, in node order of the leaves."""
        kids = self.children()
        result = []
        for leaf in (i for i in range(self.size) if not kids[i]):
            path = [leaf]
            while self._parent_list[path[-1]] >= 0:
                path.append(self._parent_list[path[-1]])
            result.append(path[::-1])
        return result

    @staticmethod
    def chain(root: int, tokens: Sequence[int], device=None, proposal_probs=None) -> Tree:
        """A single path root -> tokens[0] -> tokens[1] ..."""
        all_tokens = torch.tensor([root, *tokens], dtype=torch.long, device=device)
        parents = torch.arange(-1, len(tokens), dtype=torch.long, device=device)
        return Tree(all_tokens, parents, proposal_probs)

    @staticmethod
    def from_sequences(root: int, sequences: Sequence[Sequence[int]], max_nodes: int, device=None) -> Tree:
        """A trie of continuations, earlier sequences first; at most ``max_nodes`` nodes including the root.

        Shared prefixes are merged, so siblings always carry distinct tokens.
        """
        tokens, parents = [root], [-1]
        index: dict[tuple[int, int], int] = {}
        for sequence in sequences:
            node = 0
            for token in sequence:
                key = (node, int(token))
                if key not in index:
                    if len(tokens) >= max_nodes:
                        break
                    index[key] = len(tokens)
                    tokens.append(int(token))
                    parents.append(node)
                node = index[key]
        return Tree(torch.tensor(tokens, dtype=torch.long, device=device),
                    torch.tensor(parents, dtype=torch.long, device=device))

    @staticmethod
    def from_choices(root: int, choices: Sequence[Sequence[int]], candidates: torch.Tensor) -> Tree:
        """A static (Medusa-style) tree. ``choices``: paths of top-k ranks, e.g. [[0], [0, 0], [1]];
        ``candidates`` [D, K]: the ranked tokens for each depth. A node for choice c at depth len(c) carries
        ``candidates[len(c) - 1, c[-1]]``. Missing intermediate choices are added.
        """
        all_choices = {tuple(c[:i]) for c in choices for i in range(1, len(c) + 1)}
        ordered = sorted(all_choices, key=lambda c: (len(c), c))
        position = {(): 0}
        tokens, parents = [root], [-1]
        for choice in ordered:
            position[choice] = len(tokens)
            tokens.append(int(candidates[len(choice) - 1, choice[-1]]))
            parents.append(position[choice[:-1]])
        device = candidates.device
        return Tree(torch.tensor(tokens, dtype=torch.long, device=device),
                    torch.tensor(parents, dtype=torch.long, device=device))


def verification_mask(tree_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[1, 1, N, prefix_len + N] bool: every node sees the whole prefix, then its ancestors and itself."""
    n = tree_mask.shape[0]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask], dim=1)[None, None]


def select_frontier(parent_scores: torch.Tensor, child_logprobs: torch.Tensor, top_k: int):
    """One EAGLE-2 expansion step.

    parent_scores [F] cumulative log-probabilities of the frontier; child_logprobs [F, V].
    Returns (parent index [k] into the frontier, tokens [k], scores [k]) of the global top-k children, best first.
    """
    k = min(top_k, child_logprobs.shape[1])
    local_scores, local_tokens = child_logprobs.topk(k, dim=-1)  # [F, k]
    scores = (parent_scores[:, None] + local_scores).flatten()
    best_scores, best = scores.topk(min(top_k, scores.numel()))
    return best // k, local_tokens.flatten()[best], best_scores


def keep_best_nodes(scores: torch.Tensor, parents: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices (ascending) of the ``keep`` best-scoring nodes, closed under ancestors.

    scores [M], parents [M] with parents < own index and -1 for children of the root. Scores are cumulative
    log-probabilities, so a parent never scores below its child; ancestors are still added explicitly so that ties
    can never orphan a node.
    """
    if scores.numel() <= keep:
        return torch.arange(scores.numel(), device=scores.device)
    chosen = set(scores.topk(keep).indices.tolist())
    parent_list = parents.tolist()
    for node in list(chosen):
        while parent_list[node] >= 0 and parent_list[node] not in chosen:
            node = parent_list[node]
            chosen.add(node)
    return torch.tensor(sorted(chosen), dtype=torch.long, device=scores.device)
