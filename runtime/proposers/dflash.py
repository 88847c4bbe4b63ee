"""DFlash drafting: one drafter pass over ``[root, MASK x (B - 1)]`` drafts a whole block.

The drafter's cache holds the keys and values it projects from the target's features of every verified token
(``heads.dflash.DFlashHead.context_kv``), appended after each verification: the root, history[-1], has no feature
yet, so the context is history[:-1]. The block's rows sit at positions L - 1 .. L + B - 2 for a history of L tokens;
their keys and values go into the cache only for the pass (never committed). Row k's distribution drafts the token
k steps after the root, independently of the other rows' drafts: the tree takes each depth's top-k tokens and keeps
the ``tree_size - 1`` rank paths most probable under those distributions (a chain with ``top_k`` 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.kv_cache import KVCache
from runtime.engine.tree import Tree
from runtime.proposers.base import Proposer, ProposeInput
from runtime.proposers.lean_head import LeanDFlash
from runtime.proposers.medusa import best_rank_paths
from runtime.engine.sampling import SamplingParams
from runtime.target.attention import DECODE_KERNEL_MAX_ROWS


@dataclass
class DFlashState:
    cache: KVCache  # the context's keys and values, positions 0 .. cache.max_committed - 1


def block_tree(root: int, logprobs: torch.Tensor, tree_size: int, top_k: int,
               token_map: torch.Tensor | None = None) -> Tree:
    """The tree of ``tree_size`` nodes (at most) from a block's rows: logprobs [D, V'] the distributions of the D
    tokens after the root (draft ids; ``token_map`` [V'] maps them to target ids, None: they are target ids). A node
    at depth d holds rank r of row d; the kept rank paths are the most probable under the rows' distributions."""
    depth = logprobs.shape[0]
    if tree_size <= 1 or depth == 0:
        return Tree.chain(root, [], device=logprobs.device)
    top = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    probabilities = top.values.exp().tolist()
    choices = best_rank_paths(lambda d, r: probabilities[d][r], depth, len(probabilities[0]), tree_size - 1)
    candidates = top.indices if token_map is None else token_map[top.indices]
    return Tree.from_choices(root, choices, candidates)


class DFlashProposer(Proposer):
    """``head``: a ``heads.dflash.DFlashHead`` attached to the target's weights. ``top_k`` ranks per depth a tree
    may take (1: a chain of up to B - 1 drafts)."""

    needs_hidden = True

    def __init__(self, head, target, top_k: int = 4, expected_acceptance: float = 0.5,
                 tree_size: int | None = None):
        self.head, self.target = head, target
        self.name = head.head_type
        self.top_k = top_k
        self.tree_size = tree_size
        self.expected_acceptance = expected_acceptance
        self.hidden_layers = tuple(head.feature_layers)
        self.max_depth = head.block_size - 1
        self.token_map = head.draft_to_target
        # where the target's lean pass runs, the head drafts through its kernels (runtime.proposers.lean_head)
        lean = getattr(target, "lean", None)
        self.lean = LeanDFlash(head, lean) if LeanDFlash.supports(head, lean) else None

    def _drafter(self, rows: int):
        """What computes ``rows`` rows: the lean drafter up to the decode kernels' rows, else (a prompt's context)
        the head's modules."""
        return self.lean if self.lean is not None and rows <= DECODE_KERNEL_MAX_ROWS else self.head

    @classmethod
    def from_head(cls, head, target, tree: dict, tree_size: int | None) -> DFlashProposer:
        """The proposer for a loaded ``head`` with its config's tree defaults ``tree`` (top_k, the measured
        acceptance by block row) and a measured verified-tree size (``runtime.proposers.measured_tree_size``)."""
        accuracy = tree.get("acceptance")
        return cls(head, target, top_k=int(tree.get("top_k", 4)),
                   expected_acceptance=accuracy[0] if accuracy else 0.5, tree_size=tree_size)

    def start(self, prompt: torch.Tensor, max_length: int, sampling: SamplingParams | None = None) -> DFlashState:
        return DFlashState(self._cache(1, max_length + self.head.block_size + 1))

    def _cache(self, batch: int, length: int) -> KVCache:
        config = self.head.layer_config
        weight = self.head.fc.weight
        return KVCache(self.head.cache_layers, batch, config.num_key_value_heads, config.head_dim, length,
                       weight.dtype, weight.device)

    def unread_rows(self, state: DFlashState, history: torch.Tensor) -> int:
        """The verified rows of history [L] whose context the drafter has yet to project."""
        return history.numel() - 1 - state.cache.max_committed

    def _read_context(self, state: DFlashState, step: ProposeInput) -> None:
        """Project the features of the rows verified since the last proposal into the drafter's cache."""
        cache = state.cache
        done, context = cache.max_committed, step.history.numel()
        features = torch.cat(step.new_layer_hidden, dim=-1)
        count = features.shape[0]
        if done + count != context - 1:
            raise RuntimeError(f"DFlash drafter has {done} context rows and got {count} new features for a history "
                               f"of {context}")
        if count == 0:
            return
        positions = torch.arange(done, done + count, device=features.device)[None]
        drafter = self._drafter(count)
        for layer, (keys, values) in enumerate(drafter.context_kv(drafter.context(features[None]), positions)):
            cache.kv[layer, 0, 0, :, done: done + count] = keys[0]
            cache.kv[layer, 1, 0, :, done: done + count] = values[0]
        cache.commit(count)

    def _block_logprobs(self, cache: KVCache, roots: torch.Tensor, depth: int) -> torch.Tensor:
        """One drafter pass over the blocks of roots [B] after each row's cached context -> log-probabilities
        [B, depth, V'] of the tokens 1 .. depth after each root."""
        head, size = self.head, self.head.block_size
        batch = roots.shape[0]
        lengths = cache.lengths
        positions = lengths[:, None] + torch.arange(size, device=roots.device)[None]  # the root at L - 1
        columns = torch.arange(cache.max_committed + size, device=roots.device)
        mask = (columns[None, :] < (lengths + size)[:, None])[:, None, None, :].expand(batch, 1, size, -1)
        embeddings = head.block_embeddings(roots[:, None], head.fc.weight.dtype)
        drafter = self._drafter(size)
        hidden = drafter.block_hidden(embeddings, positions, mask, cache)  # its keys are written past the lengths only
        return torch.log_softmax(drafter.logits(hidden[:, 1: depth + 1]).float(), dim=-1)

    @torch.inference_mode()
    def propose(self, state: DFlashState, step: ProposeInput) -> Tree:
        self._read_context(state, step)
        root = int(step.history[-1])
        depth = min(self.max_depth, step.tree_size - 1)
        if depth <= 0:
            return Tree.chain(root, [], device=step.history.device)
        logprobs = self._block_logprobs(state.cache, step.history[-1:], depth)[0]
        return block_tree(root, logprobs, step.tree_size, self.top_k, self.token_map)

    @torch.inference_mode()
    def propose_rows(self, states: list[DFlashState], steps: list[ProposeInput]) -> list[Tree]:
        """``propose`` for several generations: each projects its new context rows into its own cache, then one
        drafter pass drafts every block, over a batch copy of their caches (a drafter of a layer or two: a small
        copy). The trees are those ``propose`` drafts up to rounding."""
        for state, step in zip(states, steps):
            self._read_context(state, step)
        depths = [min(self.max_depth, step.tree_size - 1) for step in steps]
        growing = [b for b, depth in enumerate(depths) if depth > 0]
        trees = [Tree.chain(int(step.history[-1]), [], device=step.history.device) for step in steps]
        if not growing:
            return trees
        lengths = [states[b].cache.max_committed for b in growing]
        cache = self._cache(len(growing), max(lengths) + self.head.block_size)
        for row, (b, length) in enumerate(zip(growing, lengths)):
            cache.kv[:, :, row, :, :length] = states[b].cache.kv[:, :, 0, :, :length]
        cache.commit(torch.tensor(lengths, device=cache.lengths.device))
        roots = torch.stack([steps[b].history[-1] for b in growing])
        logprobs = self._block_logprobs(cache, roots, max(depths))
        for row, b in enumerate(growing):
            trees[b] = block_tree(int(roots[row]), logprobs[row, : depths[b]], steps[b].tree_size, self.top_k,
                                  self.token_map)
        return trees
