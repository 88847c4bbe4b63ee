"""EAGLE-2 dynamic tree expansion over any drafter that can run a frontier of nodes with a tree mask.

The drafter's cache already holds the accepted context (committed length L, root included). Each expansion
forwards the current frontier; its keys/values are appended after the context, so the mask for a frontier row is:
the whole context, then the slots of the node's forwarded ancestors and its own slot.

Only frontier nodes whose children could still be kept are forwarded. A child of the frontier node ranked r at
depth d scores no higher than that node, its d - 1 ancestors and the r - 1 frontier nodes ranked above it, so it
is among the best ``tree_size - 1`` nodes only if d + r <= tree_size - 1. Forwarding the best
``tree_size - 1 - d`` frontier nodes instead of all ``top_k`` gives the same tree (up to ties in score) for less
drafting: with 4-node trees, 2 rows instead of 8 at depth 1.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from runtime.engine.tree import Tree, keep_best_nodes, select_frontier

# forward_frontier(node_ids [F], tokens [F], parent_ids [F] (-1 = root), positions [F], mask [F, L + slots])
#   -> log-probabilities [F, V] of each node's children
ForwardFrontier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Frontier:
    """The nodes one expansion step forwards: node_ids [F], tokens [F], parents [F] (-1 = root), positions [F],
    mask [F, L + slots] (L the context, then the slots of every node forwarded so far, these included)."""

    node_ids: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


# an expansion in steps: yields each Frontier, is sent its children's log-probabilities [F, V], returns the Tree
Expansion = Generator[Frontier, torch.Tensor, Tree]
# forward_frontiers(indices of the expansions that wait, their frontiers) -> log-probabilities [F_i, V] for each
ForwardFrontiers = Callable[[list[int], list[Frontier]], list[torch.Tensor]]


def build_dynamic_tree(root_token: int, root_logprobs: torch.Tensor, context_len: int,
                       forward_frontier: ForwardFrontier, depth: int, top_k: int, tree_size: int,
                       token_map: torch.Tensor | None = None) -> Tree:
    """Expand ``depth`` levels keeping the global top-k frontier by cumulative log-probability, then keep the best
    ``tree_size - 1`` nodes of all levels (parent-before-child). root_logprobs [V']; the root's children sit at
    position ``context_len``. ``token_map`` [V'] maps a drafter's reduced vocabulary to target ids (EAGLE-3).
    """
    expansion = expand_dynamic_tree(root_token, root_logprobs, context_len, depth, top_k, tree_size, token_map)
    try:
        frontier = next(expansion)
        while True:
            frontier = expansion.send(forward_frontier(frontier.node_ids, frontier.tokens, frontier.parents,
                                                       frontier.positions, frontier.mask))
    except StopIteration as done:
        return done.value


def build_dynamic_trees(expansions: Sequence[Expansion], forward_frontiers: ForwardFrontiers) -> list[Tree]:
    """Run several expansions (``expand_dynamic_tree``) in step: each level's frontiers of every expansion still
    growing go to one ``forward_frontiers`` call (a drafter runs them as one batch), so a batch of rows costs the
    drafter one call per level rather than one per row and level. Each tree is the one ``build_dynamic_tree`` builds
    from the same log-probabilities."""
    trees: list[Tree | None] = [None] * len(expansions)
    waiting: dict[int, Frontier] = {}

    def advance(index: int, sent: torch.Tensor | None) -> None:
        try:
            waiting[index] = next(expansions[index]) if sent is None else expansions[index].send(sent)
        except StopIteration as done:
            trees[index] = done.value

    for index in range(len(expansions)):
        advance(index, None)
    while waiting:
        indices = list(waiting)
        outputs = forward_frontiers(indices, [waiting.pop(index) for index in indices])
        for index, logprobs in zip(indices, outputs):
            advance(index, logprobs)
    return trees


def expand_dynamic_tree(root_token: int, root_logprobs: torch.Tensor, context_len: int, depth: int, top_k: int,
                        tree_size: int, token_map: torch.Tensor | None = None) -> Expansion:
    """``build_dynamic_tree`` as a generator: it yields each frontier to forward and is sent their children's
    log-probabilities, so that a caller may forward the frontiers of several trees together."""
    device = root_logprobs.device
    max_nodes = depth * top_k
    scores, tokens = root_logprobs.topk(min(top_k, root_logprobs.numel()))
    if token_map is not None:
        tokens = token_map[tokens]
    node_tokens = [tokens]
    node_parents = [torch.full_like(tokens, -1)]
    node_scores = [scores]
    node_depths = [torch.ones_like(tokens)]
    frontier = torch.arange(tokens.numel(), device=device)
    ancestors = torch.zeros(max_nodes, max_nodes, dtype=torch.bool, device=device)  # [node, forwarded slot]
    slots_used = 0
    for level in range(1, depth):
        frontier = frontier[: tree_size - 1 - level]  # best first: topk and select_frontier both sort
        if frontier.numel() == 0:
            break
        all_tokens = torch.cat(node_tokens)
        all_parents = torch.cat(node_parents)
        all_depths = torch.cat(node_depths)
        count = frontier.numel()
        parents = all_parents[frontier]
        rows = torch.where(parents[:, None] >= 0, ancestors[parents.clamp_min(0)],
                           torch.zeros_like(ancestors[:count]))
        rows[torch.arange(count, device=device), slots_used + torch.arange(count, device=device)] = True
        ancestors[frontier] = rows
        slots_used += count
        mask = torch.cat([torch.ones(count, context_len, dtype=torch.bool, device=device),
                          rows[:, :slots_used]], dim=1)
        logprobs = yield Frontier(frontier, all_tokens[frontier], parents, context_len - 1 + all_depths[frontier],
                                  mask)
        parent_pick, child_tokens, child_scores = select_frontier(torch.cat(node_scores)[frontier], logprobs, top_k)
        if token_map is not None:
            child_tokens = token_map[child_tokens]
        first_new = all_tokens.numel()
        node_tokens.append(child_tokens)
        node_parents.append(frontier[parent_pick])
        node_scores.append(child_scores)
        node_depths.append(all_depths[frontier][parent_pick] + 1)
        frontier = torch.arange(first_new, first_new + child_tokens.numel(), device=device)
    all_tokens = torch.cat(node_tokens)
    all_parents = torch.cat(node_parents)
    keep = keep_best_nodes(torch.cat(node_scores), all_parents, tree_size - 1)
    new_index = torch.full((all_tokens.numel() + 1,), -1, dtype=torch.long, device=device)
    new_index[keep] = torch.arange(1, keep.numel() + 1, device=device)
    kept_parents = all_parents[keep]
    tree_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], torch.zeros_like(kept_parents))
    tokens_out = torch.cat([torch.tensor([root_token], device=device), all_tokens[keep]])
    parents_out = torch.cat([torch.tensor([-1], device=device), tree_parents])
    return Tree(tokens_out, parents_out)
