"""EAGLE-2 dynamic trees from an EAGLE-1/2 or EAGLE-3 feature head, with the head's own KV cache.

Head rows follow heads/eagle.py: row t carries token t+1 and the target's feature at t, at position t. The
head's cache holds rows 0 .. L-2 for a history of L tokens (the root, history[L-1], enters as row L-2's token).
Draft rows for tree nodes feed the head its own output hidden state of the parent node; they are dropped
after each proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv_cache import KVCache
from runtime.proposers.base import ProposeInput
from runtime.proposers.dynamic import build_dynamic_tree
from runtime.tree import Tree


@dataclass
class EagleState:
    cache: KVCache  # head rows for positions 0 .. cache.max_committed - 1
    node_hidden: torch.Tensor  # [max tree nodes, H] head outputs of forwarded tree nodes


def causal_rows_mask(done: int, count: int, device) -> torch.Tensor:
    """[1, 1, count, done + count] bool: new rows see every cached row and the new rows up to themselves."""
    past = torch.ones(count, done, dtype=torch.bool, device=device)
    return torch.cat([past, torch.ones(count, count, dtype=torch.bool, device=device).tril()], dim=1)[None, None]


class EagleProposer:
    """``head``: an EAGLE-family head (``heads.eagle.FeatureHead``: EAGLE-1/2 or EAGLE-3) attached to the target's
    weights."""

    needs_hidden = True

    def __init__(self, head, target, depth: int = 6, top_k: int = 8, expected_acceptance: float = 0.6,
                 tree_size: int | None = None):
        self.head, self.target = head, target
        self.tree_size = tree_size
        self.depth, self.top_k = depth, top_k
        self.name = head.head_type
        self.hidden_layers = tuple(head.feature_layers)
        self.expected_acceptance = expected_acceptance
        self.token_map = head.draft_to_target

    def start(self, prompt: torch.Tensor, max_length: int) -> EagleState:
        config = self.head.target_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dtype = self.head.fc.weight.dtype
        device = self.head.fc.weight.device
        cache = KVCache(self.head.cache_layers, 1, kv_heads, head_dim, max_length + self.depth * self.top_k + 1, dtype,
                        device)
        return EagleState(cache, torch.zeros(self.depth * self.top_k, config.hidden_size, dtype=dtype, device=device))

    def _read_verified_rows(self, state: EagleState, step: ProposeInput) -> torch.Tensor:
        """Run the head over the rows verified since it last drafted and keep them in its cache. Returns the
        head's output for the newest row [H]."""
        history, cache, head = step.history, state.cache, self.head
        context = history.numel()
        done = cache.max_committed
        features = head.select_features(step.new_hidden, step.new_layer_hidden).to(head.fc.weight.dtype)
        count = features.shape[0]
        if done + count != context - 1:
            raise RuntimeError(f"EAGLE head has {done} rows and got {count} new features for a history of {context}")
        tokens = history[done + 1: context]
        positions = torch.arange(done, done + count, device=history.device)
        hidden = head.hidden_states(tokens[None], features[None], positions[None],
                                    causal_rows_mask(done, count, history.device), cache)
        cache.commit(count)
        return hidden[0, -1]

    @torch.inference_mode()
    def propose(self, state: EagleState, step: ProposeInput) -> Tree:
        history, cache, head = step.history, state.cache, self.head
        context = history.numel()
        root_hidden = self._read_verified_rows(state, step)  # only the newest row drafts: one row through the LM head
        depth = min(self.depth, step.tree_size - 1)
        root = int(history[-1])
        if depth <= 0:
            return Tree.chain(root, [], device=history.device)

        def forward_frontier(node_ids, node_tokens, parents, node_positions, mask):
            parent_hidden = torch.where(parents[:, None] >= 0, state.node_hidden[parents.clamp_min(0)],
                                        root_hidden[None, :])
            out_hidden, out_logits = head(node_tokens[None], parent_hidden[None], node_positions[None],
                                          mask[None, None], cache)
            cache.commit(node_tokens.numel())
            state.node_hidden[node_ids] = out_hidden[0]
            return torch.log_softmax(out_logits[0].float(), dim=-1)

        root_logprobs = torch.log_softmax(head.logits(root_hidden).float(), dim=-1)
        tree = build_dynamic_tree(root, root_logprobs, cache.max_committed, forward_frontier, depth, self.top_k,
                                  step.tree_size, self.token_map)
        cache.crop(context - 1)
        return tree
