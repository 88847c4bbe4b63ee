"""The decode loop: prefill, then propose, verify in one target pass, accept, compact, emit."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import torch

from runtime.acceptance import greedy_accept, rejection_accept, typical_accept
from runtime.attention import BACKENDS, default_backend
from runtime.proposers.base import NoProposer, Proposer, ProposeInput
from runtime.sampling import SamplingParams, processed_probs, sample
from runtime.target import Target
from runtime.tree import verification_mask


@dataclass
class GenerationResult:
    """tokens: the new tokens only. accept_lengths: tokens emitted by each verification pass (bonus included;
    a pass cut short by a stop token or the length limit counts what it emitted).
    depth_attempts / depth_accepts: per tree depth d (index d - 1), how many passes proposed a node at depth d
    and how many of those accepted one."""

    tokens: list[int]
    accept_lengths: list[int]
    target_forwards: int
    seconds: float
    stop_reason: str
    tree_sizes: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # time spent in the proposer (the rest is target passes and bookkeeping)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification pass (bonus included); 1.0 for plain decoding."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def depth_acceptance(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepts, self.depth_attempts)]


class SpeculativeDecoder:
    """Generate with ``target``, drafting with ``proposer``. ``tree_size`` caps the verified tree (root
    included); None sizes it from the target's measured cost curve (runtime.cost_model) on this machine.

    acceptance: "exact" (greedy at temperature 0, lossless rejection sampling otherwise) or "typical" (Medusa's
    lossy typical acceptance, opt-in). attention: a backend of runtime.attention, or "auto": the flash-attn cascade
    on CUDA when flash-attn is installed, SDPA otherwise.
    """

    def __init__(self, target: Target, proposer: Proposer | None = None, tree_size: int | None = None,
                 attention: str = "auto", acceptance: str = "exact"):
        if acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical' (lossy), got {acceptance!r}")
        self.target = target
        self.proposer = proposer if proposer is not None else NoProposer()
        if attention != "auto" and attention not in BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r}; choose auto or one of {', '.join(BACKENDS)}")
        self.attention = default_backend(target.device) if attention == "auto" else attention
        self.acceptance = acceptance
        if tree_size is None:
            from runtime.cost_model import choose_tree_size

            tree_size = choose_tree_size(target, self.proposer)
        if tree_size < 1:
            raise ValueError(f"tree_size must be >= 1, got {tree_size}")
        self.tree_size = tree_size

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty: give at least one token")
        limit = self.target.max_positions
        if prompt_len + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the target's context of "
                f"{limit} positions; shorten the prompt or lower max_new_tokens")

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stream: Callable[[list[int]], None] | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after the prompt (ids [P] or [1, P]); stops at EOS/stop tokens."""
        target, device = self.target, self.target.device
        prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(-1)
        prompt_len = prompt.numel()
        self._check_length(prompt_len, max_new_tokens)
        sampling = SamplingParams(temperature, top_k, top_p)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed if seed is not None else torch.seed())
        stops = set(stop_token_ids) if stop_token_ids is not None else target.eos_token_ids
        proposer = self.proposer
        hidden_layers = proposer.hidden_layers

        started = time.perf_counter()
        max_length = prompt_len + max_new_tokens + self.tree_size + 1
        cache = target.new_cache(1, max_length)
        history = torch.empty(max_length, dtype=torch.long, device=device)
        history[:prompt_len] = prompt
        out = target.forward(prompt[None], torch.arange(prompt_len, device=device)[None], cache, None,
                             logits_from=prompt_len - 1, hidden_layers=hidden_layers, backend=self.attention)
        cache.commit(prompt_len)
        first = self._pick(out.logits[0, -1], sampling, generator)
        result = GenerationResult([], [], 1, 0.0, "length")
        length = prompt_len
        state = proposer.start(prompt, max_length)
        new_hidden = out.hidden[0] if proposer.needs_hidden else None
        new_layer_hidden = tuple(h[0] for h in out.layer_hidden)
        pending = [first]
        while True:
            emitted = self._emit(pending, result, stops, max_new_tokens, stream)
            if result.target_forwards > 1:
                result.accept_lengths.append(len(emitted))
            history[length:length + len(emitted)] = torch.tensor(emitted, device=device)
            length += len(emitted)
            if result.stop_reason != "running":
                break
            step = ProposeInput(history[:length], new_hidden, new_layer_hidden, self.tree_size, sampling,
                                generator)
            drafting = time.perf_counter()
            tree = proposer.propose(state, step)
            result.draft_seconds += time.perf_counter() - drafting
            path, bonus, out = self._verify(tree, cache, sampling, generator, hidden_layers)
            result.target_forwards += 1
            result.tree_sizes.append(tree.size)
            self._count_depths(result, tree, len(path) - 1)
            pending = tree.tokens[path[1:]].tolist() + [bonus]
            if proposer.needs_hidden:
                index = torch.tensor(path, device=device)
                new_hidden = out.hidden[0, index]
                new_layer_hidden = tuple(h[0, index] for h in out.layer_hidden)
        result.seconds = time.perf_counter() - started
        return result

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return sample(processed_probs(logits, sampling), generator)

    @staticmethod
    def _emit(tokens: list[int], result: GenerationResult, stops: set[int], max_new_tokens: int,
              stream) -> list[int]:
        """Append tokens up to the first stop token or the length limit; sets result.stop_reason."""
        room = max_new_tokens - len(result.tokens)
        emitted = tokens[:room]
        for i, token in enumerate(emitted):
            if token in stops:
                emitted = emitted[: i + 1]
                break
        result.tokens.extend(emitted)
        if emitted and emitted[-1] in stops:
            result.stop_reason = "stop"
        elif len(result.tokens) >= max_new_tokens:
            result.stop_reason = "length"
        else:
            result.stop_reason = "running"
        if stream is not None and emitted:
            stream(emitted)
        return emitted

    def _verify(self, tree, cache, sampling: SamplingParams, generator, hidden_layers):
        """One target pass over the tree; accept; keep only the accepted path in the cache."""
        target, device = self.target, self.target.device
        prefix = cache.max_committed
        ancestors = tree.ancestor_mask()
        # A lone root sees the whole cache: no mask lets SDPA take its fastest kernel.
        mask = verification_mask(ancestors, prefix) if tree.size > 1 else None
        positions = tree.position_ids(prefix)
        out = target.forward(tree.tokens[None], positions[None], cache, mask, hidden_layers=hidden_layers,
                             backend=self.attention, prefix_len=prefix)
        logits = out.logits[0]
        if sampling.greedy and self.acceptance == "exact":
            path, bonus = greedy_accept(tree.tokens, tree.parents, ancestors, logits.argmax(-1))
        else:
            if sampling.greedy:  # typical acceptance at temperature 0 falls back to the argmax distribution
                probs = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
            else:
                probs = processed_probs(logits, sampling)
            if self.acceptance == "typical":
                path, bonus = typical_accept(tree.tokens, tree.children(), probs, generator)
            else:
                proposal = tree.proposal_probs
                path, bonus = rejection_accept(tree.tokens, tree.children(), probs, proposal, generator)
        keep = torch.tensor([path], dtype=torch.long, device=device)
        cache.compact(keep, torch.tensor([len(path)], device=device))
        return path, bonus, out

    @staticmethod
    def _count_depths(result: GenerationResult, tree, accepted: int) -> None:
        depth = tree.max_depth
        while len(result.depth_attempts) < depth:
            result.depth_attempts.append(0)
            result.depth_accepts.append(0)
        for d in range(depth):
            result.depth_attempts[d] += 1
            result.depth_accepts[d] += d < accepted
