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
        ordered = sorted(closed_choices(choices), key=lambda c: (len(c), c))
        position = {(): 0}
        tokens, parents = [root], [-1]
        for choice in ordered:
            position[choice] = len(tokens)
            tokens.append(int(candidates[len(choice) - 1, choice[-1]]))
            parents.append(position[choice[:-1]])
        device = candidates.device
        return Tree(torch.tensor(tokens, dtype=torch.long, device=device),
                    torch.tensor(parents, dtype=torch.long, device=device))


@dataclass
class Draft:
    """What a proposer asks one verification pass to compute: a tree, and optionally extra rows after it.

    Extra rows are tokens the proposer wants the target's logits for (lookahead decoding's Jacobi window); they are
    never candidates. extra_tokens [E] long; extra_offsets [E] long: each row's position minus the root's (>= 1);
    extra_mask [E, E] bool: which extra rows each extra row sees (itself always). Every extra row also sees the
    committed context and the root (the last emitted token, committed but written to the cache in this pass), no
    other tree node, and no tree node sees an extra row. So extra rows never change what a tree node computes:
    acceptance and cache compaction read only the tree's nodes (the first ``tree.size`` rows of the pass), the extra
    rows' cache entries are dropped with the rejected nodes', and the output is the same with or without them. Their
    logits come back in the next ``ProposeInput.extra_logits``.
    """

    tree: Tree
    extra_tokens: torch.Tensor | None = None
    extra_offsets: torch.Tensor | None = None
    extra_mask: torch.Tensor | None = None

    def __post_init__(self):
        given = [x is not None for x in (self.extra_tokens, self.extra_offsets, self.extra_mask)]
        if any(given) and not all(given):
            raise ValueError("a Draft's extra rows need extra_tokens, extra_offsets and extra_mask together")
        if all(given):
            rows = self.extra_tokens.shape[0]
            if self.extra_offsets.shape != (rows,) or self.extra_mask.shape != (rows, rows):
                raise ValueError(f"a Draft with {rows} extra tokens needs extra_offsets [{rows}] and extra_mask "
                                 f"[{rows}, {rows}], got {list(self.extra_offsets.shape)} and "
                                 f"{list(self.extra_mask.shape)}")

    @property
    def extra_count(self) -> int:
        return 0 if self.extra_tokens is None else self.extra_tokens.shape[0]

    @property
    def rows(self) -> int:
        """Rows of the verification pass: the tree's nodes, then the extra rows."""
        return self.tree.size + self.extra_count

    @staticmethod
    def of(proposal: Tree | Draft) -> Draft:
        """A proposer's answer as a Draft (a plain Tree asks for no extra rows)."""
        return proposal if isinstance(proposal, Draft) else Draft(proposal)

    def tokens(self) -> torch.Tensor:
        """[N + E] long: the pass's input tokens."""
        if not self.extra_count:
            return self.tree.tokens
        return torch.cat([self.tree.tokens, self.extra_tokens.to(self.tree.tokens.device)])

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """[N + E] long: the tree's positions (prefix_len + depth), then the extra rows' (prefix_len + offset)."""
        positions = self.tree.position_ids(prefix_len)
        if not self.extra_count:
            return positions
        return torch.cat([positions, self.extra_offsets.to(positions.device) + prefix_len])

    def row_mask(self, ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """[N + E, N + E] bool: the pass's mask among its own rows (``ancestors``: the tree's ancestor mask, when
        already computed)."""
        ancestors = self.tree.ancestor_mask() if ancestors is None else ancestors
        if not self.extra_count:
            return ancestors
        return draft_row_mask(ancestors, self.extra_mask.to(ancestors.device))


def draft_row_mask(ancestors: torch.Tensor, extra_mask: torch.Tensor) -> torch.Tensor:
    """[N + E, N + E] bool over a pass's own rows: the tree's ancestor mask [N, N] for the nodes, which see no extra
    row; ``extra_mask`` [E, E] for the extra rows, which also see the root (row 0) and no other node."""
    n, e = ancestors.shape[0], extra_mask.shape[0]
    mask = torch.zeros(n + e, n + e, dtype=torch.bool, device=ancestors.device)
    mask[:n, :n] = ancestors
    mask[n:, 0] = True
    mask[n:, n:] = extra_mask
    return mask


def verification_mask(tree_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[1, 1, N, prefix_len + N] bool: every row sees the whole prefix, then what ``tree_mask`` [N, N] lets it see
    among the pass's rows (a tree's ancestor mask: its ancestors and itself; ``Draft.row_mask`` with extra rows)."""
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


def closed_choices(choices: Sequence[Sequence[int]]) -> set[tuple[int, ...]]:
    """Static-tree choices with every prefix added: the tree's non-root nodes (``Tree.from_choices``)."""
    return {tuple(c[:i]) for c in choices for i in range(1, len(c) + 1)}


def keep_best_nodes(scores: torch.Tensor, parents: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices (ascending) of the ``keep`` best-scoring nodes, closed under ancestors.

    scores [M], parents [M] with parents < own index and -1 for children of the root. Scores are cumulative
    log-probabilities, so a parent never scores below its child, but a near-certain child scores exactly as its
    parent (its log-probability rounds to 0): the stable sort then ranks the parent, the lower index, first, where
    topk may pick the child and leave the parent to be added past ``keep``. Ancestors are still added explicitly so
    that no node is ever orphaned.
    """
    if scores.numel() <= keep:
        return torch.arange(scores.numel(), device=scores.device)
    chosen = set(scores.sort(descending=True, stable=True).indices[:keep].tolist())
    parent_list = parents.tolist()
    for node in list(chosen):
        while parent_list[node] >= 0 and parent_list[node] not in chosen:
            node = parent_list[node]
            chosen.add(node)
    return torch.tensor(sorted(chosen), dtype=torch.long, device=scores.device)
