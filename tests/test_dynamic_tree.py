"""EAGLE-2 dynamic tree expansion against an exhaustive search over a drafter with fixed random log-probabilities."""

import itertools

import pytest
import torch

from runtime.proposers.dynamic import build_dynamic_tree, build_dynamic_trees, expand_dynamic_tree

VOCAB = 6


def path_logprobs(path: tuple[int, ...], seed: int) -> torch.Tensor:
    """The drafter's log-probabilities [VOCAB] after the token path ``path``: fixed per path, random across paths."""
    generator = torch.Generator().manual_seed(hash((seed, path)) % (1 << 31))
    return torch.log_softmax(torch.randn(VOCAB, generator=generator) * 2, dim=-1)


def exhaustive_best(depth: int, tree_size: int, seed: int) -> set[tuple[int, ...]]:
    """The ``tree_size - 1`` best paths of up to ``depth`` tokens by cumulative log-probability, over every path."""
    scored = []
    for length in range(1, depth + 1):
        for path in itertools.product(range(VOCAB), repeat=length):
            score = sum(float(path_logprobs(path[:i], seed)[path[i]]) for i in range(length))
            scored.append((score, path))
    scored.sort(reverse=True)
    return {path for _, path in scored[: tree_size - 1]}


def tree_paths(tree) -> set[tuple[int, ...]]:
    """Every non-root node as its token path from the root (root excluded)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = set()
    for node in range(1, len(tokens)):
        path, at = [], node
        while at > 0:
            path.append(tokens[at])
            at = parents[at]
        paths.add(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("depth,top_k,tree_size", [(2, 4, 4), (3, 4, 5), (3, 5, 6), (4, 5, 4)])
@pytest.mark.parametrize("seed", range(4))
def test_dynamic_tree_keeps_the_best_nodes_and_forwards_only_nodes_whose_children_can_be_kept(depth, top_k, tree_size,
                                                                                               seed):
    token_paths: dict[int, tuple[int, ...]] = {}  # node id -> token path, as the expansion forwards them
    forwarded: list[int] = []

    def forward_frontier(node_ids, node_tokens, parents, positions, mask):
        rows = []
        for node, token, parent in zip(node_ids.tolist(), node_tokens.tolist(), parents.tolist()):
            token_paths[node] = (token_paths[parent] if parent >= 0 else ()) + (token,)
            rows.append(path_logprobs(token_paths[node], seed))
        forwarded.append(len(rows))
        return torch.stack(rows)

    tree = build_dynamic_tree(99, path_logprobs((), seed), 10, forward_frontier, depth, top_k, tree_size)
    assert tree.tokens[0] == 99 and tree.size == tree_size
    # top_k >= tree_size - 1, so EAGLE-2's frontier never drops a node the exhaustive search keeps
    assert tree_paths(tree) == exhaustive_best(depth, tree_size, seed)
    # the frontier at depth d is cut to the tree_size - 1 - d best nodes: only their children can be kept
    assert forwarded == [min(top_k, tree_size - 1 - d) for d in range(1, depth) if tree_size - 1 - d > 0]


@pytest.mark.parametrize("tree_size", [4, 6, 8, 12])
def test_near_certain_children_do_not_push_the_tree_past_its_size(tree_size):
    """A child whose log-probability rounds to 0 scores exactly as its parent. Choosing the child over its parent
    on that tie would add the parent back past the limit: the tree must stay within ``tree_size`` nodes."""
    vocab = 16

    def forward_frontier(node_ids, tokens, parents, positions, mask):
        logits = torch.zeros(len(tokens), vocab)
        logits[torch.arange(len(tokens)), (tokens + 1) % vocab] = 30.0  # one child of probability 1 - 1e-12
        return torch.log_softmax(logits, -1)

    root = torch.log_softmax(torch.tensor([5.0, 5.0] + [0.0] * (vocab - 2)), -1)
    tree = build_dynamic_tree(0, root, 10, forward_frontier, depth=6, top_k=4, tree_size=tree_size)
    assert tree.size == tree_size
    assert tree.max_depth >= 2  # the near-certain chains are among the best nodes


def test_expansions_in_step_build_each_tree_as_alone_with_one_call_per_level():
    """build_dynamic_trees forwards the frontiers of every expansion still growing in one call per level and builds
    the trees build_dynamic_tree builds alone, for expansions of different depths, sizes and drafters."""
    settings = [(3, 4, 5, 0), (2, 4, 4, 1), (4, 5, 8, 2), (1, 3, 3, 3), (3, 5, 2, 4)]  # depth, top_k, size, seed

    def forward_for(seed: int):
        token_paths: dict[int, tuple[int, ...]] = {}

        def forward_frontier(node_ids, node_tokens, parents, positions, mask):
            rows = []
            for node, token, parent in zip(node_ids.tolist(), node_tokens.tolist(), parents.tolist()):
                token_paths[node] = (token_paths[parent] if parent >= 0 else ()) + (token,)
                rows.append(path_logprobs(token_paths[node], seed))
            return torch.stack(rows)
        return forward_frontier

    alone = [build_dynamic_tree(99, path_logprobs((), seed), 10 + seed, forward_for(seed), depth, top_k, size)
             for depth, top_k, size, seed in settings]
    forwards = [forward_for(seed) for *_, seed in settings]
    calls: list[list[int]] = []

    def forward_frontiers(indices, frontiers):
        calls.append(indices)
        return [forwards[i](f.node_ids, f.tokens, f.parents, f.positions, f.mask) for i, f in zip(indices, frontiers)]

    expansions = [expand_dynamic_tree(99, path_logprobs((), seed), 10 + seed, depth, top_k, size)
                  for depth, top_k, size, seed in settings]
    together = build_dynamic_trees(expansions, forward_frontiers)
    for one, both in zip(alone, together):
        assert torch.equal(one.tokens, both.tokens) and torch.equal(one.parents, both.parents)
    # level 1: every expansion with depth > 1 and room for a child of a frontier node; level 2: only the 4-deep one
    # and the 3-deep one of 5 nodes; level 3: the 4-deep one
    assert calls == [[0, 1, 2], [0, 2], [2]]
