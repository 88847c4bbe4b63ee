"""The decode loop: prefill, then propose, verify in one target pass, accept, compact, emit."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from runtime.engine.acceptance import greedy_accept, rejection_accept, typical_accept
from runtime.engine.monitor import monitor_for
from runtime.engine.sampling import SamplingParams, greedy_tokens, new_generator, processed_probs, sample
from runtime.engine.sizing import adaptive_sizers, batch_tree_size
from runtime.engine.tree import Draft, Tree, verification_mask
from runtime.proposers.base import NoProposer, Proposer, ProposeInput
from runtime.target.attention import BACKENDS, default_backend
from runtime.target.machine import synchronized_seconds
from runtime.target.model import Target


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
    features: dict | None = None  # the target's hidden states, when the batched decoder records them

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification pass (bonus included); 1.0 for plain decoding."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def depth_acceptance(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepts, self.depth_attempts)]



@dataclass
class _Generation:
    """One generation in progress: its cache, history (prompt + emitted tokens; the first ``length`` valid), its
    proposer's state, its result so far, the tokens of the last pass not yet emitted, and what the next proposal
    reads (the features of the rows verified since the last one; the extra rows' logits)."""

    cache: object
    history: torch.Tensor
    length: int
    state: object
    result: GenerationResult
    pending: list[int]
    new_hidden: torch.Tensor | None
    new_layer_hidden: tuple[torch.Tensor, ...]
    extra_logits: torch.Tensor | None = None

class Stops:
    """When a generation ends: a stop token, a stop string in the decoded text, or the length limit."""

    def __init__(self, token_ids: set[int], strings: tuple[str, ...], tokenizer):
        if strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode the output: pass tokenizer=, or give the "
                             "Target a tokenizer")
        if any(not isinstance(text, str) or not text for text in strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {list(strings)}")
        self.token_ids, self.strings, self.tokenizer = token_ids, strings, tokenizer
        # A stop string of n UTF-8 bytes spans at most n tokens: every token decodes to at least one byte, while a
        # character outside ASCII may take several tokens (byte-level pieces), so characters would undercount. The
        # text to search is the new tokens plus that many before (and a few more for pieces at either end).
        self.lookback = max((len(text.encode()) for text in strings), default=0) + 4

    @classmethod
    def for_target(cls, target: Target, token_ids: Sequence[int] | None, strings: Sequence[str] | None,
                   tokenizer) -> Stops:
        """Stops for a generation on ``target``: ``token_ids`` (default its EOS ids), ``strings`` decoded with
        ``tokenizer`` (default its tokenizer)."""
        # one id or one string is a single stop (a string is not a sequence of one-character stops)
        if isinstance(token_ids, int) or (isinstance(token_ids, torch.Tensor) and token_ids.dim() == 0):
            token_ids = [int(token_ids)]
        if isinstance(strings, str):
            strings = [strings]
        return cls(set(token_ids) if token_ids is not None else target.eos_token_ids, tuple(strings or ()),
                   tokenizer or target.tokenizer)

    def emit(self, tokens: list[int], result: GenerationResult, max_new_tokens: int) -> list[int]:
        """Append ``tokens`` up to the first stop or the length limit to ``result``; sets ``result.stop_reason``
        and returns what was appended."""
        emitted = tokens[: max_new_tokens - len(result.tokens)]
        stop = next((i for i, token in enumerate(emitted) if token in self.token_ids), None)
        if stop is not None:
            emitted = emitted[: stop + 1]
        if self.strings:
            cut = self._string_stop(result.tokens, emitted)
            if cut is not None:
                emitted, stop = emitted[:cut], cut - 1
        result.tokens.extend(emitted)
        if stop is not None:
            result.stop_reason = "stop"
        elif len(result.tokens) >= max_new_tokens:
            result.stop_reason = "length"
        else:
            result.stop_reason = "running"
        return emitted

    def _string_stop(self, before: list[int], new: list[int]) -> int | None:
        """The number of ``new`` tokens up to the one that completes a stop string, or None."""
        context = before[-self.lookback:]

        def contains(count: int) -> bool:
            text = self.tokenizer.decode(context + new[:count])
            return any(stop in text for stop in self.strings)

        if not new or not contains(len(new)):
            return None
        return next(count for count in range(1, len(new) + 1) if contains(count))


class SpeculativeDecoder:
    """Generate with ``target``, drafting with ``proposer``.

    tree_size: the verified tree's size (nodes, root included) for every step; None (the default) lets a
    ``runtime.engine.tree_sizing.TreeSizer`` choose it step by step, starting from this machine's cost curve
    (``runtime.target.cost_model``) and the proposer's prior acceptance (or its measured size), learning acceptance as
    it goes, unless the proposer sizes its own trees (``Proposer.sizes_own_tree``). A proposer drafting
    with one of several drafters at each step (lookup first, a head otherwise) gets a sizer for each
    (``Proposer.drafters``). Sampling keeps the starting size instead, so that a seed repeats its
    draws (``sampled_size``). ``tree_size_reason`` says which and why; each result's ``tree_sizes`` lists the sizes
    used.

    A proposer may return a ``Draft`` with extra rows (``runtime.engine.tree.Draft``): they go into the same pass after
    the tree's nodes, and their logits go back to the proposer in the next ``ProposeInput.extra_logits``.

    acceptance: "exact" (greedy at temperature 0, lossless rejection sampling otherwise) or "typical" (Medusa's
    lossy typical acceptance, opt-in). attention: a backend of runtime.target.attention, or "auto": the flash-attn
    cascade where flash-attn runs (CUDA, fp16/bf16, installed), SDPA otherwise.

    ``monitor``: the proposer's rolling depth-1 acceptance over every generation of this decoder, updated at each
    verification, with a warning when it stays far below what its head measured in training
    (``runtime.engine.monitor.AcceptanceMonitor``; ``decoder.monitor.report()``).
    """

    def __init__(self, target: Target, proposer: Proposer | None = None, tree_size: int | None = None,
                 attention: str = "auto", acceptance: str = "exact"):
        self.target = target
        self.proposer = proposer if proposer is not None else NoProposer()
        self.attention = checked_backend(target, attention, acceptance, tree_size)
        self.acceptance = acceptance
        self.extra_rows = self.proposer.extra_rows
        own = tree_size is None and self.proposer.sizes_own_tree
        if own:
            tree_size = self.proposer.tree_size
        # one sizer per drafter (lookup first and a head otherwise are two), each learning its own acceptance
        sized = self.proposer.drafters
        self.sizers = {} if tree_size is not None else adaptive_sizers(target, sized)
        # beside sized drafters, one that sizes its own trees (lookahead behind lookup) keeps its size
        self.own_sizes = {name: drafter.tree_size for name, drafter in sized.items()
                          if self.sizers and drafter.sizes_own_tree}
        if own:
            why = self.proposer.tree_size_reason
            self.tree_size_reason = (f"{tree_size}, the {self.proposer.name} proposer's own size"
                                     + (f" ({why})" if why else ""))
        elif tree_size is not None:
            self.tree_size_reason = f"fixed at {tree_size} (tree_size={tree_size})"
        elif not self.sizers:
            tree_size, self.tree_size_reason = 1, f"1: the {self.proposer.name} proposer drafts nothing"
        else:
            tree_size = max([sizer.largest for sizer in self.sizers.values()] + list(self.own_sizes.values()))
            starts = {name: f"starting at {sizer.current} ({sizer.start_reason})"
                      for name, sizer in self.sizers.items()}
            starts.update({name: f"its own size {size}" for name, size in self.own_sizes.items()})
            if len(starts) == 1:
                self.tree_size_reason = f"adaptive, {next(iter(starts.values()))}, up to {tree_size}"
            else:
                each = "; ".join(f"{name}: {start}" for name, start in starts.items())
                self.tree_size_reason = f"adaptive for each drafter ({each}), up to {tree_size}"
        # the largest tree a step may ask for: what buffers are sized for
        self.tree_size = tree_size
        # A sampled generation's draws depend on its trees. With a seed they must repeat whatever this decoder
        # generated before, and match the prompt decoded in a batch (runtime.engine.batched), so sampling keeps the
        # one-row starting size there rather than what the sizers learnt.
        self.sampled_size = min(batch_tree_size(target, self.proposer, 1)[0], tree_size) if self.sizers else None
        self.monitor = monitor_for(self.proposer)

    def tree_size_report(self) -> dict:
        """How the tree size was chosen and, when adaptive, the sizes used so far (size: passes) and for each drafter
        sized apart its own sizes and learnt acceptance by depth (``drafters``)."""
        report = {"reason": self.tree_size_reason}
        if self.sizers:
            each = {name: sizer.report() for name, sizer in self.sizers.items()}
            sizes = Counter()
            for drafter in each.values():
                sizes.update(drafter["sizes"])
            report.update(sizes=dict(sorted(sizes.items())), drafters=each)
        return report

    def generate(self, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stream: Callable[[list[int]], None] | None = None,
                 stop_token_ids: Sequence[int] | None = None,
                 stop_strings: Sequence[str] | None = None, tokenizer=None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after the prompt (ids [P] or [1, P]).

        Stops at a stop token (default: the target's EOS ids) or once the text contains one of ``stop_strings``
        (decoded with ``tokenizer``, default the target's; the tokens up to and including the one that completes the
        string are kept). ``stream`` is called with each chunk of accepted tokens; ``stream_tokens`` is the same
        generation as an iterator.
        """
        chunks = self.stream_tokens(input_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                    stop_strings, tokenizer)
        while True:
            try:
                chunk = next(chunks)
            except StopIteration as finished:
                return finished.value
            if stream is not None:
                stream(chunk)

    def stream_tokens(self, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                      top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                      stop_token_ids: Sequence[int] | None = None, stop_strings: Sequence[str] | None = None,
                      tokenizer=None) -> Generator[list[int], None, GenerationResult]:
        """``generate`` as an iterator: yields each chunk of accepted tokens (a list of ids) as it is verified; the
        GenerationResult is the iterator's return value (``StopIteration.value``). The proposer's rolling acceptance
        is ``self.monitor.rate`` as each chunk is yielded (the chunk's own verification included)."""
        prompt = prompt_tensor(self.target, input_ids, max_new_tokens)
        sampling = SamplingParams(temperature, top_k, top_p)
        generator = None if sampling.greedy else new_generator(seed)
        stops = Stops.for_target(self.target, stop_token_ids, stop_strings, tokenizer)
        started = time.perf_counter()
        with torch.inference_mode():
            run = self._prefill(prompt, max_new_tokens, sampling, generator)
        while True:
            emitted = stops.emit(run.pending, run.result, max_new_tokens)
            if run.result.target_forwards > 1:
                run.result.accept_lengths.append(len(emitted))
            if emitted:
                yield emitted
            if run.result.stop_reason != "running":
                break
            with torch.inference_mode():
                run.history[run.length:run.length + len(emitted)] = torch.tensor(emitted, device=self.target.device)
                run.length += len(emitted)
                self._step(run, sampling, generator)
        run.result.seconds = time.perf_counter() - started
        return run.result

    def _prefill(self, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                 generator) -> _Generation:
        """The prompt's pass into a new cache, and the generation's first token (pending)."""
        target, device, proposer = self.target, self.target.device, self.proposer
        prompt_len = prompt.numel()
        max_length = prompt_len + max_new_tokens + self.tree_size + self.extra_rows + 1
        cache = target.new_cache(1, max_length)
        history = torch.empty(max_length, dtype=torch.long, device=device)
        history[:prompt_len] = prompt
        out = target.forward(prompt[None], torch.arange(prompt_len, device=device)[None], cache, None,
                             logits_from=prompt_len - 1, hidden_layers=proposer.hidden_layers,
                             backend=self.attention, prefix_len=0)
        cache.commit(prompt_len)
        first = pick_token(out.logits[0, -1], sampling, generator)
        return _Generation(cache, history, prompt_len, proposer.start(prompt, max_length, sampling),
                           GenerationResult([], [], 1, 0.0, "length"), [first],
                           out.hidden[0] if proposer.needs_hidden else None, tuple(h[0] for h in out.layer_hidden))

    def _step(self, run: _Generation, sampling: SamplingParams, generator) -> None:
        """Draft a tree at the size its drafter's sizer chooses, verify it in one target pass, accept, and keep what
        the next step needs: the pending tokens, the accepted rows' features, the extra rows' logits."""
        proposer, device, result = self.proposer, self.target.device, run.result
        history = run.history[:run.length]
        # who drafts this step: what sizes its tree, and whose acceptance the monitor holds it to
        needs_source = self.sizers or self.monitor.drafter is not None
        source = proposer.draft_source(run.state, history) if needs_source else None
        if self.sizers and not sampling.greedy:
            sizer, size = None, self.sampled_size
        else:
            sizer = self.sizers.get(source)
            size = sizer.choose() if sizer is not None else self.own_sizes.get(source, self.tree_size)
        step = ProposeInput(history, run.new_hidden, run.new_layer_hidden, size, sampling, generator,
                            run.extra_logits)
        drafting = time.perf_counter()
        draft = checked_draft(proposer.propose(run.state, step), proposer, self.tree_size)
        tree = draft.tree
        result.draft_seconds += time.perf_counter() - drafting
        path, bonus, out = self._verify(draft, run.cache, sampling, generator, proposer.hidden_layers)
        run.extra_logits = out.logits[0, tree.size:] if draft.extra_count else None
        proposer.observe(run.state, step.history, tree, None if out.logits is None else out.logits[0, :tree.size])
        if sizer is not None and not draft.extra_count:
            # A pass with extra rows (lookahead's window behind lookup) is sized by its proposer: its acceptance and
            # time would teach the sizer about another drafter than the one it sizes. A step's time counts when the
            # tree had the size asked for (lookup that finds nothing drafts less). Sampled steps never get here:
            # their size is fixed (``sampled_size``).
            timed = tree.size == size
            seconds = synchronized_seconds(device, drafting) if timed else None
            sizer.observe(size, tree.max_depth, len(path) - 1, seconds)
        self.monitor.observe(tree.max_depth, len(path) - 1, source)
        result.target_forwards += 1
        result.tree_sizes.append(tree.size)
        count_depths(result, tree, len(path) - 1)
        run.pending = tree.tokens[path[1:]].tolist() + [bonus]
        if proposer.needs_hidden:
            index = torch.tensor(path, device=device)
            run.new_hidden = out.hidden[0, index]
            run.new_layer_hidden = tuple(h[0, index] for h in out.layer_hidden)

    def _verify(self, draft: Draft, cache, sampling: SamplingParams, generator, hidden_layers):
        """One target pass over the tree (and the draft's extra rows); accept; keep only the accepted path in the
        cache."""
        target, device = self.target, self.target.device
        tree = draft.tree
        prefix = cache.max_committed
        ancestors = tree.ancestor_mask()
        # A lone root sees the whole cache: no mask lets SDPA take its fastest kernel.
        mask = verification_mask(draft.row_mask(ancestors), prefix) if draft.rows > 1 else None
        positions = draft.position_ids(prefix)
        greedy = sampling.greedy and self.acceptance == "exact"
        # a greedy pass whose logits nobody reads (no extra rows, a proposer that does not learn from them) may
        # compute only their argmax
        only_argmax = greedy and not draft.extra_count and not self.proposer.observes_logits
        out = target.forward(draft.tokens()[None], positions[None], cache, mask, hidden_layers=hidden_layers,
                             backend=self.attention, prefix_len=prefix, argmax=only_argmax)
        if greedy:
            chosen = out.argmax[0, :tree.size] if only_argmax else greedy_tokens(out.logits[0, :tree.size])
            path, bonus = greedy_accept(tree.tokens, tree.parents, ancestors, chosen)
        else:
            path, bonus = drawn_accept(tree, out.logits[0, :tree.size], sampling, self.acceptance, generator)
        keep = torch.tensor([path], dtype=torch.long, device=device)
        cache.compact(keep, torch.tensor([len(path)], device=device))
        return path, bonus, out


def checked_draft(proposal: Tree | Draft, proposer, tree_size: int) -> Draft:
    """``proposer``'s proposal as a Draft, checked against what the cache was sized for: at most ``tree_size`` nodes
    and the proposer's ``extra_rows``."""
    draft = Draft.of(proposal)
    most = proposer.extra_rows
    if draft.tree.size > tree_size or draft.extra_count > most:
        raise ValueError(f"the {proposer.name} proposer drafted {draft.tree.size} nodes and {draft.extra_count} extra "
                         f"rows; the cache holds at most {tree_size} and {most} (the proposer's extra_rows)")
    return draft


def checked_backend(target: Target, attention: str, acceptance: str, tree_size: int | None) -> str:
    """The attention backend a decoder runs (``auto`` resolved for the target), after checking its options."""
    if acceptance not in ("exact", "typical"):
        raise ValueError(f"acceptance must be 'exact' or 'typical' (lossy), got {acceptance!r}")
    if attention != "auto" and attention not in BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; choose auto or one of {', '.join(BACKENDS)}")
    if tree_size is not None and tree_size < 1:
        raise ValueError(f"tree_size must be >= 1, got {tree_size}")
    return default_backend(target.device, target.dtype) if attention == "auto" else attention


def prompt_tensor(target: Target, input_ids, max_new_tokens: int, which: str = "the prompt") -> torch.Tensor:
    """One prompt's ids [P] on the target's device, checked before any work: token ids [P] or [1, P] (a [B, P] batch
    is several prompts, which ``runtime.engine.batched.BatchedDecoder`` decodes; flattening it would decode one prompt
    made of all of them), integers inside the vocabulary, and room in the context for ``max_new_tokens``."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise ValueError(f"{which} has shape {list(ids.shape)}: give one prompt's token ids, [P] or [1, P]; for "
                         f"several prompts pass a list of them to runtime.engine.batched.BatchedDecoder.generate")
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise ValueError(f"{which} holds {ids.dtype} values: give integer token ids")
    ids = ids.reshape(-1).to(device=target.device, dtype=torch.long)
    check_prompt_length(target, ids.numel(), max_new_tokens, which)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= target.vocab_size:
        raise ValueError(f"{which} holds token id {low if low < 0 else high}, outside the target's vocabulary of "
                         f"{target.vocab_size}: encode it with the target's tokenizer")
    return ids


def check_prompt_length(target: Target, prompt_len: int, max_new_tokens: int, which: str = "the prompt") -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if prompt_len == 0:
        raise ValueError(f"{which} is empty: give at least one token")
    limit = target.max_positions
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"{which} of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the target's context of "
            f"{limit} positions{getattr(target, 'context_note', '')}; shorten the prompt or lower max_new_tokens")


def pick_token(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
    """The next token from logits [V]: the argmax, or a draw from the processed distribution."""
    if sampling.greedy:
        return int(greedy_tokens(logits))
    return sample(processed_probs(logits, sampling), generator)


def drawn_accept(tree: Tree, logits: torch.Tensor, sampling: SamplingParams, acceptance: str,
                 generator) -> tuple[list[int], int]:
    """(accepted path, bonus token) of a tree by the acceptance rules that draw: lossless rejection sampling, or
    typical acceptance (which at temperature 0 judges against the argmax). logits [N, V] at the tree's nodes."""
    if sampling.greedy:
        probs = torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
    else:
        probs = processed_probs(logits, sampling)
    if acceptance == "typical":
        return typical_accept(tree.tokens, tree.children(), probs, generator)
    return rejection_accept(tree.tokens, tree.children(), probs, tree.proposal_probs, generator)


def count_depths(result: GenerationResult, tree: Tree, accepted: int) -> None:
    """Add one verification to ``result``'s per-depth attempts and accepts (``accepted`` drafts were taken)."""
    depth = tree.max_depth
    while len(result.depth_attempts) < depth:
        result.depth_attempts.append(0)
        result.depth_accepts.append(0)
    for d in range(depth):
        result.depth_attempts[d] += 1
        result.depth_accepts[d] += d < accepted
