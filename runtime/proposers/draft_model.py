"""A smaller causal LM with the target's tokenizer drafts a chain or an EAGLE-2 style top-k tree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.kv_cache import KVCache
from runtime.proposers.base import Proposer, ProposeInput
from runtime.proposers.dynamic import build_dynamic_tree
from runtime.engine.sampling import SamplingParams, greedy_tokens, processed_probs, sample
from runtime.target.model import Target
from runtime.engine.tree import Tree


def check_same_tokenizer(draft: Target, target: Target) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft.identity!r} has a vocabulary of {draft.vocab_size} tokens but the target "
            f"{target.identity!r} has {target.vocab_size}: a draft must share the target's tokenizer. Pick a "
            f"smaller model of the same family.")
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(
                f"draft model {draft.identity!r} uses a different tokenizer than the target {target.identity!r} "
                f"(same size, different token ids): a draft must share the target's tokenizer.")


@dataclass
class DraftState:
    cache: KVCache  # holds history[:cache.max_committed] between proposals


class DraftModelProposer(Proposer):
    """mode "tree": dynamic top-k tree (deterministic picks); mode "chain": one path, greedy at temperature 0 and
    sampled from the draft's processed distribution otherwise (recorded for lossless acceptance)."""

    name = "draft"
    expected_acceptance = 0.7

    def __init__(self, draft: Target, target: Target, mode: str = "tree", depth: int = 5, top_k: int = 4):
        if mode not in ("tree", "chain"):
            raise ValueError(f"draft mode must be 'tree' or 'chain', got {mode!r}")
        check_same_tokenizer(draft, target)
        self.draft, self.mode, self.depth, self.top_k = draft, mode, depth, top_k
        self.max_depth = depth

    def start(self, prompt: torch.Tensor, max_length: int, sampling: SamplingParams | None = None) -> DraftState:
        return DraftState(self.draft.new_cache(1, max_length + self.depth * self.top_k + 1))

    def _forward(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        out = self.draft.forward(tokens[None], positions[None], cache, mask)
        cache.commit(tokens.numel())
        return out.logits[0].float()

    def propose(self, state: DraftState, step: ProposeInput) -> Tree:
        history, cache = step.history, state.cache
        context = history.numel()
        done = cache.max_committed
        positions = torch.arange(done, context, device=history.device)
        root_logits = self._forward(cache, history[done:], positions, None)[-1]
        depth = min(self.depth, step.tree_size - 1)
        root = int(history[-1])
        if depth <= 0:
            tree = Tree.chain(root, [], device=history.device)
        elif self.mode == "chain":
            tree = self._chain(cache, root, root_logits, context, depth, step)
        else:
            def forward_frontier(node_ids, tokens, parents, node_positions, mask):
                logits = self._forward(cache, tokens, node_positions, mask[None, None])
                return torch.log_softmax(logits, dim=-1)

            tree = build_dynamic_tree(root, torch.log_softmax(root_logits, -1), context, forward_frontier, depth,
                                      self.top_k, step.tree_size)
        cache.crop(context)  # drafted entries are never reused; accepted ones are re-fed with the next context
        return tree

    def _chain(self, cache: KVCache, root: int, logits: torch.Tensor, context: int, depth: int,
               step: ProposeInput) -> Tree:
        tokens: list[int] = []
        proposals: list[torch.Tensor] = []
        for d in range(depth):
            if step.sampling.greedy:
                token = int(greedy_tokens(logits))
            else:
                q = processed_probs(logits, step.sampling)
                token = sample(q, step.generator)
                proposals.append(q)
            tokens.append(token)
            if d < depth - 1:
                position = torch.tensor([context + d], device=logits.device)
                logits = self._forward(cache, torch.tensor([token], device=logits.device), position, None)[-1]
        proposal_probs = None
        if proposals:
            proposals.append(torch.zeros_like(proposals[0]))  # the leaf has no children
            proposal_probs = torch.stack(proposals)
        return Tree.chain(root, tokens, device=logits.device, proposal_probs=proposal_probs)
