"""EAGLE-2 dynamic trees from an EAGLE-1/2 or EAGLE-3 feature head, with the head's own KV cache.

Head rows follow heads/eagle.py: row t carries token t+1 and the target's feature at t, at position t. The
head's cache holds rows 0 .. L-2 for a history of L tokens (the root, history[L-1], enters as row L-2's token).
Draft rows for tree nodes feed the head its own output hidden state of the parent node; they are dropped
after each proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.target.attention import DECODE_KERNEL_MAX_ROWS, tree_attention_for
from runtime.engine.kv_cache import KVCache
from runtime.proposers.base import Proposer, ProposeInput
from runtime.proposers.dynamic import Frontier, build_dynamic_tree, build_dynamic_trees, expand_dynamic_tree
from runtime.proposers.lean_head import LeanEagle3
from runtime.engine.ragged import RaggedRows
from runtime.engine.sampling import SamplingParams
from runtime.engine.tree import Tree


@dataclass
class EagleState:
    cache: KVCache  # head rows for positions 0 .. cache.max_committed - 1
    node_hidden: torch.Tensor  # [max tree nodes, H] head outputs of forwarded tree nodes


def causal_rows_mask(done: int, count: int, device) -> torch.Tensor:
    """[1, 1, count, done + count] bool: new rows see every cached row and the new rows up to themselves."""
    past = torch.ones(count, done, dtype=torch.bool, device=device)
    return torch.cat([past, torch.ones(count, count, dtype=torch.bool, device=device).tril()], dim=1)[None, None]


class EagleProposer(Proposer):
    """``head``: an EAGLE-family head (``heads.eagle.FeatureHead``: EAGLE-1/2 or EAGLE-3) attached to the target's
    weights."""

    needs_hidden = True

    def __init__(self, head, target, depth: int = 6, top_k: int = 8, expected_acceptance: float = 0.6,
                 tree_size: int | None = None):
        self.head, self.target = head, target
        self.tree_size = tree_size
        self.depth, self.top_k = depth, top_k
        self.max_depth = depth
        self.name = head.head_type
        self.hidden_layers = tuple(head.feature_layers)
        self.expected_acceptance = expected_acceptance
        self.token_map = head.draft_to_target
        # where the target's lean pass runs, an EAGLE-3 head drafts through it (runtime.proposers.lean_head)
        lean = getattr(target, "lean", None)
        self.lean = LeanEagle3(head, lean) if LeanEagle3.supports(head, lean) else None

    def _hidden_states(self, tokens, features, positions, mask, cache) -> torch.Tensor:
        """The head's ``hidden_states`` over rows of equal counts: through the lean layer up to the decode kernels'
        rows, else (a prompt's rows) through the head's modules."""
        if self.lean is not None and tokens.shape[1] <= DECODE_KERNEL_MAX_ROWS:
            return self.lean.hidden_states(tokens, features, positions, mask, cache)
        return self.head.hidden_states(tokens, features, positions, mask, cache)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lean or self.head).logits(hidden)

    @classmethod
    def from_head(cls, head, target, tree: dict, tree_size: int | None) -> EagleProposer:
        """The proposer for a loaded ``head`` with its config's tree defaults ``tree`` (depth, top_k, the measured
        acceptance) and a measured verified-tree size (``runtime.proposers.measured_tree_size``)."""
        accuracy = tree.get("acceptance")
        return cls(head, target, depth=int(tree.get("depth", 6)), top_k=int(tree.get("top_k", 8)),
                   expected_acceptance=accuracy[0] if accuracy else 0.6, tree_size=tree_size)

    def start(self, prompt: torch.Tensor, max_length: int, sampling: SamplingParams | None = None) -> EagleState:
        config = self.head.target_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dtype = self.head.fc.weight.dtype
        device = self.head.fc.weight.device
        cache = KVCache(self.head.cache_layers, 1, kv_heads, head_dim, max_length + self.depth * self.top_k + 1, dtype,
                        device)
        return EagleState(cache, torch.zeros(self.depth * self.top_k, config.hidden_size, dtype=dtype, device=device))

    def unread_rows(self, state: EagleState, history: torch.Tensor) -> int:
        """The verified rows of history [L] the head reads before it drafts (``runtime.proposers.base.unread_rows``)."""
        return history.numel() - 1 - state.cache.max_committed

    def _read_verified_rows(self, state: EagleState, step: ProposeInput) -> torch.Tensor:
        """Run the head over the rows verified since it last drafted and keep them in its cache. Returns the
        head's output for the newest row [H]."""
        history, cache = step.history, state.cache
        done, count, features = self._new_rows(state, step)
        tokens = history[done + 1: done + 1 + count]
        positions = torch.arange(done, done + count, device=history.device)
        hidden = self._hidden_states(tokens[None], features[None], positions[None],
                                     causal_rows_mask(done, count, history.device), cache)
        cache.commit(count)
        return hidden[0, -1]

    def _new_rows(self, state: EagleState, step: ProposeInput) -> tuple[int, int, torch.Tensor]:
        """(rows in the head's cache, new rows, their features [count, F]), checked against the history."""
        head = self.head
        done, context = state.cache.max_committed, step.history.numel()
        features = head.select_features(step.new_hidden, step.new_layer_hidden).to(head.fc.weight.dtype)
        if done + features.shape[0] != context - 1:
            raise RuntimeError(f"EAGLE head has {done} rows and got {features.shape[0]} new features for a history "
                               f"of {context}")
        return done, features.shape[0], features

    def _read_verified_rows_together(self, states: list[EagleState],
                                     steps: list[ProposeInput]) -> tuple[torch.Tensor, KVCache]:
        """``_read_verified_rows`` for several generations in one head pass: ([B, H], row b the head's output for
        generation b's newest row; the batch cache, row b holding generation b's rows, with room for its trees).

        Each generation's cache is copied into one ragged batch cache (a head has a layer or a few, so that is a
        small copy), the new rows of every generation go through the head together, and each generation's new
        entries are copied back into its own cache. Where generations have different counts of new rows (one that
        skipped drafting for a while has many), they go packed (``runtime.engine.ragged``) rather than padded to the
        longest, which would compute every padding row; each row sees its own cache and its own new rows causally."""
        head, device = self.head, steps[0].history.device
        rows = [self._new_rows(state, step) for state, step in zip(states, steps)]
        counts = [count for _, count, _ in rows]
        batch, width = len(rows), max(counts)
        longest = max(done for done, _, _ in rows)
        own = states[0].cache.kv  # [L, 2, 1, Hkv, S, D]
        batched = KVCache(own.shape[0], batch, own.shape[3], own.shape[-1],
                          longest + width + self.depth * self.top_k, own.dtype, device)
        kv = batched.kv
        mask = torch.zeros(batch, 1, width, longest + width, dtype=torch.bool, device=device)
        new = torch.arange(width, device=device)
        for b, ((done, _, _), state) in enumerate(zip(rows, states)):
            kv[:, :, b, :, :done] = state.cache.kv[:, :, 0, :, :done]
            mask[b, 0, :, :done] = True
            mask[b, 0, :, done: done + width] = new[None, :] <= new[:, None]
        batched.commit(torch.tensor([done for done, _, _ in rows], device=device))
        positions = torch.cat([torch.arange(done, done + count, device=device) for done, count, _ in rows])
        ragged = None if sum(counts) == batch * width else RaggedRows.from_counts(counts, positions)
        shape = (1, sum(counts)) if ragged is not None else (batch, width)  # packed, or rows of equal counts
        tokens = torch.cat([step.history[done + 1: done + 1 + count]
                            for (done, count, _), step in zip(rows, steps)]).view(shape)
        features = torch.cat([feature for _, _, feature in rows]).view(*shape, -1)
        if ragged is None:
            hidden = self._hidden_states(tokens, features, positions.view(shape), mask, batched)
        else:  # the packed rows need the tree attention, which takes them
            with tree_attention_for(head), batched.packed(ragged):
                hidden = head.hidden_states(tokens, features, positions.view(shape), mask, batched, ragged=ragged)
        for b, ((done, count, _), state) in enumerate(zip(rows, states)):
            state.cache.kv[:, :, 0, :, done: done + count] = kv[:, :, b, :, done: done + count]
            state.cache.commit(count)
        counted = torch.tensor(counts, device=device)
        batched.commit(counted)
        newest = torch.cumsum(counted, 0) - 1  # each generation's newest row in packed (or row-major) order
        return hidden.reshape(-1, hidden.shape[-1])[newest], batched

    @torch.inference_mode()
    def propose(self, state: EagleState, step: ProposeInput) -> Tree:
        root_hidden = self._read_verified_rows(state, step)  # only the newest row drafts: one row through the LM head
        if min(self.depth, step.tree_size - 1) <= 0:
            return Tree.chain(int(step.history[-1]), [], device=step.history.device)
        return self._expand(state, step, root_hidden, self._logits(root_hidden))

    @torch.inference_mode()
    def propose_rows(self, states: list[EagleState], steps: list[ProposeInput]) -> list[Tree]:
        """``propose`` for several generations at once: their verified rows read in one head pass, their roots'
        logits in one product, and each level of their trees in one head pass (``build_dynamic_trees``), in a batch
        copy of their head caches. What a batch of rows costs the head per step is then about what one row costs.
        The trees are those ``propose`` would draft up to rounding (the head's rows are computed in another batch
        shape), so a caller whose random draws depend on the tree (sampling) drafts row by row."""
        root_hidden, cache = self._read_verified_rows_together(states, steps)
        device = steps[0].history.device
        trees = [Tree.chain(int(step.history[-1]), [], device=device) for step in steps]
        depths = [min(self.depth, step.tree_size - 1) for step in steps]
        growing = [b for b, depth in enumerate(depths) if depth > 0]
        if not growing:
            return trees
        logits = self._logits(root_hidden[growing])
        contexts = cache.lengths.tolist()
        expansions = [expand_dynamic_tree(int(steps[b].history[-1]), torch.log_softmax(row_logits.float(), dim=-1),
                                          contexts[b], depths[b], self.top_k, steps[b].tree_size, self.token_map)
                      for b, row_logits in zip(growing, logits)]
        node_hidden = root_hidden.new_zeros(len(steps), self.depth * self.top_k, root_hidden.shape[-1])

        def forward_frontiers(indices: list[int], frontiers: list[Frontier]) -> list[torch.Tensor]:
            return self._forward_frontiers(cache, root_hidden, node_hidden, [growing[i] for i in indices], frontiers)

        for b, tree in zip(growing, build_dynamic_trees(expansions, forward_frontiers)):
            trees[b] = tree
        return trees

    def _forward_frontiers(self, cache: KVCache, root_hidden: torch.Tensor, node_hidden: torch.Tensor,
                           rows: list[int], frontiers: list[Frontier]) -> list[torch.Tensor]:
        """One head pass over the frontiers of several rows' trees: row ``rows[i]`` of the batch cache forwards
        ``frontiers[i]``; the other rows, and each row past its frontier, forward padding that sees only its own
        slot and is not kept. root_hidden [B, H]; node_hidden [B, nodes, H] the head outputs of forwarded nodes,
        filled in here. Returns the children's log-probabilities [F_i, V'] of each frontier."""
        device = root_hidden.device
        batch, width = root_hidden.shape[0], max(frontier.tokens.numel() for frontier in frontiers)
        slots = cache.lengths[:, None] + torch.arange(width, device=device)[None, :]  # [B, width]
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        parent_hidden = root_hidden[:, None, :].repeat(1, width, 1)
        positions = slots.clone()
        mask = torch.zeros(batch, 1, width, cache.max_committed + width, dtype=torch.bool, device=device)
        mask[:, 0].scatter_(2, slots[:, :, None], True)
        counts = torch.zeros(batch, dtype=torch.long, device=device)
        for b, frontier in zip(rows, frontiers):
            count, parents = frontier.tokens.numel(), frontier.parents
            tokens[b, :count] = frontier.tokens
            positions[b, :count] = frontier.positions
            parent_hidden[b, :count] = torch.where(parents[:, None] >= 0, node_hidden[b, parents.clamp_min(0)],
                                                   root_hidden[b][None, :])
            mask[b, 0, :count] = False
            mask[b, 0, :count, :frontier.mask.shape[1]] = frontier.mask
            counts[b] = count
        hidden = self._hidden_states(tokens, parent_hidden, positions, mask, cache)
        cache.commit(counts)
        outputs = []
        for b, frontier in zip(rows, frontiers):
            outputs.append(hidden[b, :frontier.tokens.numel()])
            node_hidden[b, frontier.node_ids] = outputs[-1]
        logprobs = torch.log_softmax(self._logits(torch.cat(outputs)).float(), dim=-1)
        return list(logprobs.split([output.shape[0] for output in outputs]))

    def _expand(self, state: EagleState, step: ProposeInput, root_hidden: torch.Tensor,
                root_logits: torch.Tensor) -> Tree:
        """The dynamic tree from the root's head output [H] and logits [V'] (the head's cache holds the verified
        rows)."""
        history, cache = step.history, state.cache
        context = history.numel()
        depth = min(self.depth, step.tree_size - 1)
        root = int(history[-1])
        if depth <= 0:
            return Tree.chain(root, [], device=history.device)

        def forward_frontier(node_ids, node_tokens, parents, node_positions, mask):
            parent_hidden = torch.where(parents[:, None] >= 0, state.node_hidden[parents.clamp_min(0)],
                                        root_hidden[None, :])
            out_hidden = self._hidden_states(node_tokens[None], parent_hidden[None], node_positions[None],
                                             mask[None, None], cache)
            out_logits = self._logits(out_hidden)
            cache.commit(node_tokens.numel())
            state.node_hidden[node_ids] = out_hidden[0]
            return torch.log_softmax(out_logits[0].float(), dim=-1)

        root_logprobs = torch.log_softmax(root_logits.float(), dim=-1)
        tree = build_dynamic_tree(root, root_logprobs, cache.max_committed, forward_frontier, depth, self.top_k,
                                  step.tree_size, self.token_map)
        cache.crop(context - 1)
        return tree
