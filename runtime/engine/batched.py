"""Batched speculative decoding: several prompts decode together, and every row's output is exactly what that prompt
gives decoded alone, whatever the other rows accept.

Each row has its own committed length, proposer state, accepted path, stop state and random stream (a CPU generator
from its own seed), so nothing a row computes or draws depends on its neighbours; the rows share only the target
passes. A step drafts a tree per row and verifies them all in one target pass (rows of different sizes packed, no
padding computed: ``Tree sizes`` below), then compacts each row of the KV cache to its own accepted path
(``KVCache.compact`` with per-row keep lists).

Masks. Row b's cache slots ``0 .. c_b - 1`` hold its committed positions ``0 .. c_b - 1``; a pass writes its N new
entries at slots ``c_b .. c_b + N - 1`` and attends over ``max(c) + N`` slots, so row b's mask is: its committed
slots, then its tree's ancestor mask at offset c_b, and nothing else (the slots past a row's own entries hold stale
entries: rejected nodes, another prompt's leftovers). Padding nodes (row b's tree has fewer than N nodes) see the
row's committed slots and their own slot: a valid softmax row, so no NaN reaches any key or value, and no real node
ever sees them; they are never accepted. A proposer's extra rows (``runtime.engine.tree.Draft``: lookahead's window)
follow their row's tree nodes and count towards its N; ``Draft.row_mask`` places them (they see the root and each other
as the draft says, no node sees them), and their logits go back to that row's proposer state in its next proposal.
Sliding-window layers get each key slot's position explicitly (``key_positions``), since a row's new entries are not
the last keys of the pass. The cascade backend's maskless prefix is the shortest row's committed length, which every
row sees whole.

Prefill. The first prompts are prefilled in passes of prompts of similar length
(``runtime.target.cost_model.prefill_groups``: padding is computed like any token, so one pass over prompts of 50 and
300 tokens costs six passes' worth of the short one; the split weighs that against a pass's fixed cost, measured on this
machine), each pass right-padded into its own rows of the cache (``KVCache.rows``): a causal mask without the padding (a
padding query sees itself), each row's first token from its own last prompt position, per-row lengths committed.
Continuous batching: a batch holds ``batch_size`` rows; when a row finishes, the next prompt takes over its row of the
cache with a prefill of its own (a batch-1 pass over that row's slots), and joins the next verification
pass, so no row waits for the longest one. Once no prompt is left to take a finished row's place, the cache drops
that row (``KVCache.keep_rows``).

Drafting. Greedy rows draft together where the proposer can (``propose_rows``: an EAGLE head reads every row's newly
verified rows in one pass, takes every root through its LM head in one product and forwards each level of every row's
tree in one pass), since greedy output does not depend on the trees. Sampled rows draft one by one: a head's trees may
differ by rounding with the shape of the batch, and a sampled row's draws depend on its tree.

Tree sizes. Rows of different sizes verify packed (``runtime.engine.ragged``): no padding token is computed, so a row
pays only for its own nodes. By default greedy rows of a run of several get their sizes per pass
(``runtime.engine.tree_sizing.allocate_nodes``): each row's acceptance by depth, learnt from its own passes at each
drafter and level (prompt lookup's level is the length of the suffix it matched, and 4-token matches are right far more
often than 2-token ones) and pulled towards what every row of the run gets accepted there, says what each further node
would add, and the nodes worth their cost go in, best first, whichever row they belong to: a row in repetitive text
drafts deep while its neighbours draft nothing. The cost is the curve measured at the run's batch size (verification
alone), its cost above one node re-priced by the run's own full-width passes (``runtime.engine.tree_sizing.CurveScale``:
a cached curve measured on a busy machine misprices a node, and at many rows a node's price decides whether it pays),
plus what the run's steps measure beside it: bookkeeping, and a model drafter's call, which costs about as much for
one row as for all, so rows are sized with and without it. A row given no node skips its proposer; the features a head
would have read wait in the row for its next draft, and that call, which reads them all, is not taken as the price of
drafting once more (``BatchedDecoder._reads_one_pass``). ``per_row_sizes=False`` keeps one size for every row and step
of a run instead, and a sampled row always keeps the one-row size, since its draws depend on its tree and must not
depend on its neighbours. A proposer that sizes its own trees (``runtime.proposers.base.sizes_own_tree``) keeps its
size at every batch size.

The cost curve holds uniform passes, and a proposer's prior acceptance is an average over other text; at many rows a
head's drafting, ragged passes or lower acceptance can make drafting lose to plain decoding. So a greedy run of
several rows that drafts measures it (``runtime.engine.tree_sizing.DraftingTrial``): blocks of drafting passes alternate
with blocks of plain ones, the faster is chosen, and now and then a block of the other choice measures it again. Through
the plain passes the rows keep what the proposer reads (a head's hidden states), so drafting can resume where it
left off.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.engine.acceptance import greedy_accept
from runtime.engine.decoder import (GenerationResult, Stops, checked_backend, checked_draft, count_depths, drawn_accept,
                                    pick_token, prompt_tensor)
from runtime.engine.kv_cache import KVCache
from runtime.engine.monitor import monitor_for
from runtime.engine.ragged import RaggedRows
from runtime.engine.sampling import SamplingParams, greedy_tokens, new_generator
from runtime.engine.sizing import Allocation, BatchSizing, RunPlan
from runtime.engine.tree import Draft, Tree
from runtime.engine.tree_sizing import DepthAcceptance, DraftingTrial
from runtime.proposers.base import NoProposer, Proposer, ProposeInput
from runtime.target.cost_model import prefill_groups
from runtime.target.machine import synchronized_seconds
from runtime.target.model import Target


def prefill_inputs(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One prefill pass over ``prompts`` (each [P_b] long, on one device), right-padded to the longest, W:
    (tokens [B, W], position_ids [B, W], mask [B, 1, W, W] bool, or None for a lone prompt: causal, the batch-1
    decoder's prefill). The mask is causal without the padding keys; a padding query sees the real keys before it
    and itself, a valid row whose output nothing reads."""
    device = prompts[0].device
    lengths = torch.tensor([prompt.numel() for prompt in prompts], device=device)
    batch, width = len(prompts), int(lengths.max())
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        tokens[b, :prompt.numel()] = prompt
    positions = torch.arange(width, device=device).expand(batch, width)
    if batch == 1:
        return tokens, positions, None
    slots = torch.arange(width, device=device)
    causal = slots[None, :] <= slots[:, None]  # [query, key]
    real = slots[None, :] < lengths[:, None]  # [B, key]
    mask = causal[None] & (real[:, None, :] | torch.eye(width, dtype=torch.bool, device=device)[None])
    return tokens, positions, mask[:, None]


@dataclass
class BatchStats:
    """What one batched run did, all rows together.

    passes: verification passes (one target pass over every running row); prefill_passes: prefill passes (the first
    batch's in groups of similar length, each joining prompt's alone); row_passes: the rows those verification
    passes verified, summed; tokens: tokens the verification passes emitted (bonus tokens included), summed over
    rows."""

    passes: int = 0
    prefill_passes: int = 0
    row_passes: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens a row gets from a verification pass (bonus included), over every row of every pass."""
        return self.tokens / max(self.row_passes, 1)

    @property
    def rows_per_pass(self) -> float:
        return self.row_passes / max(self.passes, 1)

    def as_dict(self) -> dict:
        return {"passes": self.passes, "prefill_passes": self.prefill_passes, "row_passes": self.row_passes,
                "tokens": self.tokens, "tau": round(self.tau, 3), "rows_per_pass": round(self.rows_per_pass, 3),
                "seconds": round(self.seconds, 4)}


@dataclass
class _Row:
    """One running prompt: where it is in the cache and in its generation."""

    index: int  # the prompt's position in the input
    history: torch.Tensor  # [max length] prompt + emitted tokens; the first ``length`` are valid
    length: int
    state: Any  # the proposer's per-generation state
    generator: torch.Generator | None
    result: GenerationResult
    started: float
    # the target's features of rows verified since the proposer last drafted for this row, one entry per pass: the
    # last hidden states [n, H] and the proposer's layers' inputs (a tuple of [n, H]); its next proposal reads them
    hidden_parts: list[torch.Tensor] = field(default_factory=list)
    layer_parts: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    pending: list[int] | None = None  # tokens from the last pass not yet emitted
    verified: int = 0  # rows the last verification pass added (0 before the first: the prefill is not one)
    extra_logits: torch.Tensor | None = None  # [E, V]: the last pass's logits at this row's extra rows
    recorded: list[tuple[torch.Tensor, ...]] | None = None  # record_layers: (hidden, layer inputs...) per pass
    # per drafter and level (``Allocation.learners``), where sizes are allocated per pass
    acceptance: dict[tuple[str, int], DepthAcceptance] | None = None


@dataclass
class _Drafted:
    """What a step's drafting gave: each row's draft (a lone root where its proposer did not draft), the rows whose
    proposer drafted, who drafted each (``sources``: drafter and level where sizes are allocated per pass; ``named``:
    the drafter the monitor judges), the seconds a model drafted, and whether its call read one pass's rows."""

    drafts: list[Draft]
    drafting: list[int]
    sources: list[tuple[str, int] | None]
    named: list[str | None]
    model_seconds: float = 0.0
    one_pass: bool = False


@dataclass
class _Verification:
    """One verification pass over every row's draft: its inputs (packed where rows differ in size) and, once run,
    each row's outputs: ``spans`` (its slice of the pass's rows), ``lead`` (its batch index in the output) and the
    trees' tokens, parents and ancestor masks on the CPU."""

    tokens: torch.Tensor  # [B, N] or [1, sum of rows] packed
    positions: torch.Tensor
    mask: torch.Tensor  # [B, 1, N, keys]
    key_positions: torch.Tensor  # [B, keys]
    ragged: RaggedRows | None
    counts: list[int]  # each row's rows (tree nodes and extra rows)
    committed: list[int]  # each row's committed cache length
    cpu_trees: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    spans: list[slice] = field(default_factory=list)
    lead: list[int] = field(default_factory=list)


class BatchedDecoder:
    """Generate for several prompts at once with ``target``, drafting with ``proposer`` (one proposer state per row).

    sizing: the policy that sizes each row's tree (``runtime.engine.sizing.BatchSizing``: one size for the run, per-row
    sizes each pass, and trials of drafting against plain decoding, carried across this decoder's runs); tree_size:
    shorthand for ``BatchSizing(tree_size=...)``. A row given no draft node skips its proposer that pass. attention
    and acceptance as in ``runtime.engine.decoder.SpeculativeDecoder``. ``stats`` describes the latest run
    (``BatchStats``), ``plan`` how it sized its trees (``RunPlan``). ``monitor``: the proposer's rolling depth-1
    acceptance over every row of every run, with a warning when it stays far below what its head measured in
    training (``runtime.engine.monitor.AcceptanceMonitor``); a row's own rate is its result's
    ``depth_acceptance[0]``. draft_together: greedy rows draft in one proposer call where the proposer can
    (``propose_rows``); False drafts every row alone, as sampled rows always do (``scripts/bench_batch_drafting.py``
    measures one against the other).

    record_layers: when given, each result carries ``features`` (``recorded_features``): the target's hidden
    states at every position of prompt + output that the passes computed, the last hidden state and the inputs of
    these decoder layers, as training reads them (``training.recorded``). They come from the passes that verified
    the tokens, so recording costs no extra target pass.
    """

    def __init__(self, target: Target, proposer: Proposer | None = None, tree_size: int | None = None,
                 attention: str = "auto", acceptance: str = "exact", draft_together: bool = True,
                 record_layers: Sequence[int] | None = None, sizing: BatchSizing | None = None):
        if tree_size is not None and sizing is not None and sizing.tree_size not in (None, tree_size):
            raise ValueError(f"tree_size={tree_size} and sizing.tree_size={sizing.tree_size} disagree; give one")
        self.target = target
        self.draft_together = draft_together
        self.proposer = proposer if proposer is not None else NoProposer()
        self.record_layers = None if record_layers is None else tuple(int(i) for i in record_layers)
        self.attention = checked_backend(target, attention, acceptance, tree_size)
        self.acceptance = acceptance
        self.sizing = sizing if sizing is not None else BatchSizing()
        if tree_size is not None:
            self.sizing.tree_size = tree_size
        reason = (self.sizing.fixed_reason() if self.sizing.tree_size is not None
                  else "chosen per run from the cost curve at its batch size")
        self.plan = RunPlan(self.sizing.tree_size or 1, reason)
        self.stats = BatchStats()
        self.monitor = monitor_for(self.proposer)
        self._layers()

    def _layers(self) -> None:
        """The layer inputs every pass of the current plan returns: the proposer's first (none where the run drafts
        nothing: its passes need not return, nor its rows gather, anything for the proposer to read), then the
        recorded ones."""
        self.proposer_layers = tuple(self.proposer.hidden_layers) if self.plan.drafting else ()
        self.pass_layers = self.proposer_layers + (self.record_layers or ())

    # the current run's sizing, as earlier versions named it
    @property
    def tree_size(self) -> int:
        return self.plan.tree_size

    @property
    def tree_size_reason(self) -> str:
        return self.plan.reason

    @property
    def allocation(self) -> Allocation | None:
        return self.plan.allocation

    @property
    def trials(self) -> dict[int, DraftingTrial]:
        return self.plan.trials

    @property
    def drafting(self) -> bool:
        """Whether the current run's trees hold drafts (its tree size, set per run, is above 1)."""
        return self.plan.drafting

    @staticmethod
    def _record(row: _Row, hidden: torch.Tensor, layer_hidden: tuple[torch.Tensor, ...]) -> None:
        """Keep a pass's hidden states [n, H] and recorded layers' inputs of ``row``'s newly verified positions, on
        the CPU: a generation's features are read when it ends."""
        row.recorded.append(tuple(t.to("cpu", copy=True) for t in (hidden, *layer_hidden)))

    def tree_size_report(self) -> dict:
        """How the tree size was chosen (as ``SpeculativeDecoder.tree_size_report``), with each drafter's acceptance
        by depth over the latest run where sizes were allocated per pass and the factor its passes scaled the cost
        curve's cost above one node by (``CurveScale``)."""
        report: dict = {"reason": self.tree_size_reason}
        if self.allocation is not None:
            report.update(self.allocation.report())
        return report

    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seeds: Sequence[int] | None = None, batch_size: int = 8,
                 stop_token_ids: Sequence[int] | None = None, stop_strings: Sequence[str] | None = None,
                 tokenizer=None) -> list[GenerationResult]:
        """One GenerationResult per prompt, in input order; see ``results``."""
        found: list[GenerationResult | None] = [None] * len(prompts)
        for index, result in self.results(prompts, max_new_tokens, temperature, top_k, top_p, seeds, batch_size,
                                          stop_token_ids, stop_strings, tokenizer):
            found[index] = result
        return found  # type: ignore[return-value]

    def results(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int,
                temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                seeds: Sequence[int] | None = None, batch_size: int = 8,
                stop_token_ids: Sequence[int] | None = None, stop_strings: Sequence[str] | None = None,
                tokenizer=None) -> Iterator[tuple[int, GenerationResult]]:
        """Decode ``prompts`` (each ids [P] or [1, P]) ``batch_size`` rows at a time; yields (prompt index,
        GenerationResult) as each row finishes.

        Each prompt's output is the one ``SpeculativeDecoder.generate`` gives for it alone with the same seed:
        ``seeds[i]`` seeds prompt i's random stream when sampling (None: fresh random seeds). Stops as there: at a
        stop token (default: the target's EOS ids), a stop string (decoded with ``tokenizer``, default the
        target's) or ``max_new_tokens``. Arguments are checked before the first row starts.
        """
        if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
            prompts = list(prompts)  # a [B, P] tensor: B prompts of P tokens
        ids = [prompt_tensor(self.target, prompt, max_new_tokens, f"prompt {index}")
               for index, prompt in enumerate(prompts)]
        if seeds is not None and len(seeds) != len(ids):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(ids)} prompts: give one seed per prompt")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        sampling = SamplingParams(temperature, top_k, top_p)
        stops = Stops.for_target(self.target, stop_token_ids, stop_strings, tokenizer)
        return self._run(ids, max_new_tokens, sampling, list(seeds) if seeds is not None else None, batch_size,
                         stops)

    # ----- the run: plan, first prefill, then passes until every prompt is done

    def _run(self, prompts: list[torch.Tensor], max_new_tokens: int, sampling: SamplingParams,
             seeds: list[int] | None, batch_size: int, stops: Stops) -> Iterator[tuple[int, GenerationResult]]:
        self.stats = stats = BatchStats()
        if not prompts:
            return
        started = time.perf_counter()
        queue = deque(range(len(prompts)))
        width = min(batch_size, len(prompts))
        self.plan = self.sizing.plan(self.target, self.proposer, sampling, self.acceptance == "exact", width)
        self._layers()
        settings = (prompts, max_new_tokens, sampling, seeds)
        cache, rows = self._first_rows(queue, width, settings)
        while True:
            yield from self._emit(rows, stops, max_new_tokens, started)
            free = [slot for slot, row in enumerate(rows) if row is None]
            if free and queue:
                self._refill(cache, rows, free, queue, settings)
                continue  # the new rows emit their first token (and may be done at once)
            if free:  # nothing will take these rows' place: stop computing them
                live = [slot for slot, row in enumerate(rows) if row is not None]
                if not live:
                    break
                with torch.inference_mode():
                    rows = [rows[slot] for slot in cache.keep_rows(live)]
            self._pass(rows, cache, sampling)
            stats.seconds = time.perf_counter() - started
        stats.seconds = time.perf_counter() - started
        if self.plan.trials:
            self.plan.reason += ": " + "; ".join(f"{bucket}+ rows: {self.plan.trials[bucket].report()}"
                                                 for bucket in sorted(self.plan.trials, reverse=True))

    def _first_rows(self, queue: deque, width: int, settings: tuple) -> tuple[KVCache, list[_Row | None]]:
        """The run's cache and its first ``width`` rows, prefilled. Prompts of very different lengths padded into
        one pass would mostly compute padding: passes of prompts of similar length instead, as many as the pass's
        fixed cost on this machine makes worth it."""
        prompts, max_new_tokens = settings[0], settings[1]
        max_length = (max(prompt.numel() for prompt in prompts) + max_new_tokens + self.plan.tree_size
                      + self.proposer.extra_rows + 1)
        with torch.inference_mode():
            cache = self.target.new_cache(width, max_length)
            rows: list[_Row | None] = []
            first = [queue.popleft() for _ in range(width)]
            overhead = self.sizing.prefill_overhead(self.target)
            for group in prefill_groups([prompts[i].numel() for i in first], overhead):
                start = len(rows)
                rows += self._prefill(cache.rows(start, start + len(group)), [first[g] for g in group], *settings)
                for slot in range(start, len(rows)):
                    cache.set_row_length(slot, rows[slot].length)
                self.stats.prefill_passes += 1
        return cache, rows

    def _emit(self, rows: list[_Row | None], stops: Stops, max_new_tokens: int,
              started: float) -> Iterator[tuple[int, GenerationResult]]:
        """Emit each row's pending tokens; a row that is done leaves its slot (None) and is yielded."""
        for slot, row in enumerate(rows):
            if row is None or row.pending is None:
                continue
            emitted = stops.emit(row.pending, row.result, max_new_tokens)
            row.pending = None
            if row.result.target_forwards > 1:
                row.result.accept_lengths.append(len(emitted))
                self.stats.tokens += len(emitted)
            if row.result.stop_reason != "running":
                row.result.seconds = time.perf_counter() - row.started
                if row.recorded is not None:
                    row.result.features = recorded_features(row.recorded, self.record_layers,
                                                            row.length + len(emitted))
                rows[slot] = None
                yield row.index, row.result
                continue
            with torch.inference_mode():
                row.history[row.length:row.length + len(emitted)] = torch.tensor(emitted, device=row.history.device)
            row.length += len(emitted)

    def _refill(self, cache: KVCache, rows: list[_Row | None], free: list[int], queue: deque,
                settings: tuple) -> None:
        """Continuous batching: the next prompts take the ``free`` slots, each with a prefill of its own."""
        with torch.inference_mode():
            for slot in free[:len(queue)]:
                rows[slot] = self._prefill(cache.rows(slot, slot + 1), [queue.popleft()], *settings)[0]
                cache.set_row_length(slot, rows[slot].length)  # the prompt; its first token is pending
                self.stats.prefill_passes += 1

    def _pass(self, rows: list[_Row], cache: KVCache, sampling: SamplingParams) -> None:
        """One verification pass over every running row, at the size the plan (or its drafting trial) gives."""
        trial = self.sizing.trial_for(self.plan, len(rows)) if self.plan.trying else None
        size = self.plan.tree_size if trial is None else trial.size()
        step_started = time.perf_counter()
        with torch.inference_mode():
            emitted = self._step(rows, cache, sampling, size)
        if trial is not None:
            trial.observe(size, emitted, time.perf_counter() - step_started)
        self.stats.passes += 1
        self.stats.row_passes += len(rows)

    def _prefill(self, cache: KVCache, indices: list[int], prompts: list[torch.Tensor], max_new_tokens: int,
                 sampling: SamplingParams, seeds: list[int] | None) -> list[_Row]:
        """One pass over the prompts ``indices`` (right-padded), into an empty ``cache`` of as many rows; commits each
        row's prompt and picks its first token. Returns the rows, first token pending."""
        target, device, proposer = self.target, self.target.device, self.proposer
        started = time.perf_counter()
        batch = len(indices)
        lengths = [prompts[i].numel() for i in indices]
        tokens, positions, mask = prefill_inputs([prompts[i] for i in indices])
        width = tokens.shape[1]
        # the cascade has nothing to gain over an empty cache, and its masked path is the reference kernel: a ragged
        # batch's prefill goes to SDPA with its mask; a lone prompt keeps the causal fast path
        backend = "sdpa" if mask is not None and self.attention == "cascade" else self.attention
        out = target.forward(tokens, positions, cache, mask, logits_from=width, hidden_layers=self.pass_layers,
                             backend=backend, prefix_len=0)
        proposer_layers = len(self.proposer_layers)
        count = torch.tensor(lengths, device=device)
        cache.commit(count)
        last = out.hidden[torch.arange(batch, device=device), count - 1]  # [B, H]
        logits = target.logits(last)
        rows = []
        for b, i in enumerate(indices):
            length = lengths[b]
            generator = None if sampling.greedy else new_generator(seeds[i] if seeds is not None else None)
            first = pick_token(logits[b], sampling, generator)
            row_max = length + max_new_tokens + self.plan.tree_size + 1
            history = torch.empty(row_max, dtype=torch.long, device=device)
            history[:length] = prompts[i]
            state = proposer.start(prompts[i], row_max, sampling)
            row = _Row(i, history, length, state, generator,
                       GenerationResult([], [], 1, 0.0, "length"), started)
            if self.plan.allocation is not None:
                row.acceptance = {}
            if proposer.needs_hidden and self.drafting:
                row.hidden_parts.append(out.hidden[b, :length])
            if proposer_layers:
                row.layer_parts.append(tuple(h[b, :length] for h in out.layer_hidden[:proposer_layers]))
            if self.record_layers is not None:
                row.recorded = []
                self._record(row, out.hidden[b, :length],
                             tuple(h[b, :length] for h in out.layer_hidden[proposer_layers:]))
            row.pending = [first]
            rows.append(row)
        return rows

    # ----- one step: draft rows, build the verification batch, verify, accept, commit

    def _step(self, rows: list[_Row], cache: KVCache, sampling: SamplingParams, size: int) -> int:
        """Draft a tree of up to ``size`` nodes per row (1: none), verify every row's tree in one target pass, accept
        per row, compact the cache. Returns the tokens the pass emitted over all rows."""
        step_started = time.perf_counter()
        greedy = sampling.greedy and self.acceptance == "exact"
        drafted = self._draft_rows(rows, sampling, size, greedy)
        batch = self._verification_batch(rows, drafted.drafts, self.target.device)
        out, forward_seconds = self._verify(batch, cache)
        paths = self._accept(rows, drafted.drafts, batch, out, sampling, greedy)
        self._commit(rows, drafted, batch, out, paths, cache)
        allocation = self.plan.allocation
        if allocation is not None:
            allocation.observe_step(sum(batch.counts) / len(rows), forward_seconds, drafted.model_seconds,
                                    time.perf_counter() - step_started,
                                    drafted.model_seconds if drafted.one_pass else None, rows=len(rows))
        return sum(len(path) for path, _ in paths)

    def _draft_rows(self, rows: list[_Row], sampling: SamplingParams, size: int, greedy: bool) -> _Drafted:
        """Each row's draft of up to ``size`` nodes (per-row sizes where the plan allocates them); a row given no
        node skips its proposer (an EAGLE head would still read its rows), and what it would have read waits in the
        row for its next draft."""
        proposer, device = self.proposer, self.target.device
        drafts = [Draft(Tree.chain(int(row.history[row.length - 1]), [], device=device)) for row in rows]
        done = _Drafted(drafts, [], [None] * len(rows), [None] * len(rows))
        if not (self.drafting and size > 1):
            return done
        allocation = self.plan.allocation
        sizes = [size] * len(rows)
        if allocation is not None:
            sizes, done.sources = self.sizing.row_sizes(self.plan, proposer, rows, self.stats.passes + 1)
        done.drafting = drafting = [b for b, size in enumerate(sizes) if size > 1]
        if self.monitor.drafter is not None:
            for b in drafting:
                done.named[b] = (done.sources[b][0] if done.sources[b] is not None
                                 else proposer.draft_source(rows[b].state, rows[b].history[:rows[b].length]))
        done.one_pass = allocation is not None and self._reads_one_pass(rows, drafting, done.sources)
        models = allocation.models if allocation is not None else set()
        steps = [self._propose_input(rows[b], sizes[b], sampling) for b in drafting]
        if drafting and greedy and self.draft_together:
            # Greedy output does not depend on the trees, so a head may draft for all rows in one pass (its trees can
            # differ by rounding with the batch's shape); a sampled row's draws depend on its tree, which must not
            # depend on its neighbours, so it drafts alone.
            started = time.perf_counter()
            proposals = proposer.propose_rows([rows[b].state for b in drafting], steps)
            seconds = time.perf_counter() - started
            for b in drafting:
                rows[b].result.draft_seconds += seconds / len(drafting)
            if any(done.sources[b] is not None and done.sources[b][0] in models for b in drafting):
                done.model_seconds = seconds
        else:
            proposals = []
            for b, step in zip(drafting, steps):
                started = time.perf_counter()
                proposals.append(proposer.propose(rows[b].state, step))
                seconds = time.perf_counter() - started
                rows[b].result.draft_seconds += seconds
                if done.sources[b] is not None and done.sources[b][0] in models:
                    done.model_seconds += seconds
        for b, proposal in zip(drafting, proposals):
            drafts[b] = checked_draft(proposal, proposer, sizes[b])
        return done

    @staticmethod
    def _verification_batch(rows: list[_Row], drafts: list[Draft], device: torch.device) -> _Verification:
        """The pass's inputs: row b's nodes at its cache slots ``c_b ..``, its mask (its committed slots, then its
        draft's mask; padding nodes see the committed slots and themselves), each key slot's position. Rows of
        different sizes go packed: padding tokens would cost real tokens' arithmetic in every linear layer (a row
        drafting a deep tree would make every other row pay for its depth); attention still sees them padded, each
        row over its own keys (``runtime.engine.ragged``)."""
        batch = len(rows)
        counts = [draft.rows for draft in drafts]
        nodes = max(counts)
        committed = [row.length - 1 for row in rows]  # the root is the last history token, not in the cache yet
        keys = max(committed) + nodes
        tokens = torch.zeros(batch, nodes, dtype=torch.long)
        positions = torch.zeros(batch, nodes, dtype=torch.long)
        mask = torch.zeros(batch, 1, nodes, keys, dtype=torch.bool)
        key_positions = torch.arange(keys).repeat(batch, 1)
        cpu_trees = []
        for b, draft in enumerate(drafts):
            used, start, tree = draft.rows, committed[b], draft.tree
            tree_tokens, parents, ancestors = tree.tokens.cpu(), tree.parents.cpu(), tree.ancestor_mask().cpu()
            cpu_trees.append((tree_tokens, parents, ancestors))
            tokens[b, :used] = draft.tokens().cpu()
            tokens[b, used:] = tree_tokens[0]
            positions[b, :used] = draft.position_ids(start).cpu()
            positions[b, used:] = start
            mask[b, 0, :, :start] = True
            mask[b, 0, :used, start:start + used] = draft.row_mask(ancestors)
            padding = torch.arange(used, nodes)
            mask[b, 0, padding, start + padding] = True
            key_positions[b, start:start + nodes] = positions[b]
        ragged = None
        if sum(counts) < batch * nodes:
            real = torch.arange(nodes)[None, :] < torch.tensor(counts)[:, None]  # [B, N]
            tokens, positions = tokens[real][None], positions[real][None]
            ragged = RaggedRows.from_counts(counts, positions[0].to(device))
        return _Verification(tokens, positions, mask, key_positions, ragged, counts, committed, cpu_trees)

    def _verify(self, batch: _Verification, cache: KVCache):
        """The target pass over ``batch`` -> (its output, its seconds); fills each row's ``spans`` and ``lead``."""
        device, ragged = self.target.device, batch.ragged
        started = time.perf_counter()
        out = self.target.forward(batch.tokens.to(device), batch.positions.to(device), cache, batch.mask.to(device),
                                  hidden_layers=self.pass_layers, backend=self.attention,
                                  prefix_len=min(batch.committed), key_positions=batch.key_positions.to(device),
                                  ragged=ragged)
        # on a GPU the pass runs asynchronously: its seconds price the run's nodes (``Allocation``) only once it ends
        seconds = synchronized_seconds(device, started)
        rows, nodes = len(batch.counts), max(batch.counts)
        batch.spans = ragged.row_slices() if ragged is not None else [slice(0, nodes)] * rows
        batch.lead = [0] * rows if ragged is not None else list(range(rows))
        return out, seconds

    def _accept(self, rows: list[_Row], drafts: list[Draft], batch: _Verification, out, sampling: SamplingParams,
                greedy: bool) -> list[tuple[list[int], int]]:
        """Each row's accepted path (node indices from the root) and bonus token: greedy from the pass's argmax, or
        drawn from its row's logits with its own random stream."""
        argmax = greedy_tokens(out.logits).cpu() if greedy else None
        paths = []
        for b, (row, draft) in enumerate(zip(rows, drafts)):
            tree, (tree_tokens, parents, ancestors) = draft.tree, batch.cpu_trees[b]
            if greedy:
                paths.append(greedy_accept(tree_tokens, parents, ancestors,
                                           argmax[batch.lead[b], batch.spans[b]][:tree.size]))
            else:
                logits = out.logits[batch.lead[b], batch.spans[b]][:tree.size]
                paths.append(drawn_accept(tree, logits, sampling, self.acceptance, row.generator))
        return paths

    def _commit(self, rows: list[_Row], drafted: _Drafted, batch: _Verification, out,
                paths: list[tuple[list[int], int]], cache: KVCache) -> None:
        """Compact each row of the cache to its accepted path, and record the pass in each row: what its proposer
        learns, its result's counts, the monitor, its pending tokens, and the features of its accepted rows for its
        proposer to read (and to record)."""
        device, proposer = self.target.device, self.proposer
        kept = max(len(path) for path, _ in paths)
        keep = torch.zeros(len(rows), kept, dtype=torch.long)
        for b, (path, _) in enumerate(paths):
            keep[b, :len(path)] = torch.tensor(path)
        cache.compact(keep.to(device), torch.tensor([len(path) for path, _ in paths], device=device))
        drafting, allocation = set(drafted.drafting), self.plan.allocation
        proposer_layers = len(self.proposer_layers)
        reads_hidden = proposer.needs_hidden and self.drafting
        for b, (row, draft, (path, bonus)) in enumerate(zip(rows, drafted.drafts, paths)):
            tree, logits = draft.tree, out.logits[batch.lead[b], batch.spans[b]]
            row.extra_logits = logits[tree.size:draft.rows] if draft.extra_count else None
            if b in drafting:
                proposer.observe(row.state, row.history[:row.length], tree, logits[:tree.size])
                if allocation is not None:
                    for learner in allocation.learners(row.acceptance, drafted.sources[b]):
                        learner.observe(tree.max_depth, len(path) - 1)
            result = row.result
            result.target_forwards += 1
            result.tree_sizes.append(tree.size)
            count_depths(result, tree, len(path) - 1)
            self.monitor.observe(tree.max_depth, len(path) - 1, drafted.named[b])
            row.pending = batch.cpu_trees[b][0][path[1:]].tolist() + [bonus]
            row.verified = len(path)
            if reads_hidden or proposer_layers or row.recorded is not None:
                index = torch.tensor(path, device=device) + batch.spans[b].start
                hidden = out.hidden[batch.lead[b], index]
                layer_hidden = tuple(h[batch.lead[b], index] for h in out.layer_hidden)
                if reads_hidden:
                    row.hidden_parts.append(hidden)
                if proposer_layers:
                    row.layer_parts.append(layer_hidden[:proposer_layers])
                if row.recorded is not None:
                    self._record(row, hidden, layer_hidden[proposer_layers:])

    def _reads_one_pass(self, rows: list[_Row], drafting: list[int], sources: list[tuple[str, int] | None]) -> bool:
        """Whether the model that drafts for ``drafting`` reads only the rows they verified in the last pass
        (``unread_rows``). A head reads every row verified since it last drafted, so a call after passes it skipped
        (or the first, after the prompt) costs more than drafting once more does: counting it as that price would
        keep the head from drafting. Only calls that read one pass are measured; until one is, a model's call is
        taken as free, and the head then drafts in successive passes, which measures it."""
        for b in drafting:
            if sources[b] is None or sources[b][0] not in self.plan.allocation.models:
                continue
            row = rows[b]
            unread = self.proposer.unread_rows(row.state, row.history[:row.length])
            if unread is None:
                return True  # a model that does not say: every call counts
            if unread > row.verified:
                return False
        return True

    @staticmethod
    def _propose_input(row: _Row, size: int, sampling: SamplingParams) -> ProposeInput:
        """What ``row``'s proposer drafts a tree of up to ``size`` nodes from: its history and the target features
        of every row verified since it last drafted (which it then has read)."""
        parts, layer_parts = row.hidden_parts, row.layer_parts
        hidden = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
        layer_hidden = (() if not layer_parts else layer_parts[0] if len(layer_parts) == 1
                        else tuple(torch.cat(layer) for layer in zip(*layer_parts)))
        row.hidden_parts, row.layer_parts = [], []
        return ProposeInput(row.history[:row.length], hidden, layer_hidden, size, sampling, row.generator,
                            row.extra_logits)


def recorded_features(recorded: list[tuple[torch.Tensor, ...]], layers: tuple[int, ...],
                      length: int) -> dict[str, torch.Tensor]:
    """A finished row's features over its first ``length`` positions (prompt + output) or as many as its passes
    computed (all but the last output token, whose pass never ran; fewer when a stop cut a pass short):
    {"hidden": [n, H]} (after the final norm), with "layer_hidden": [n, len(layers) * H] (the recorded layers'
    inputs side by side) when ``layers``."""
    parts = list(zip(*recorded))
    hidden = torch.cat(parts[0])[:length]
    features = {"hidden": hidden}
    if layers:
        features["layer_hidden"] = torch.cat([torch.cat(layer) for layer in parts[1:]], dim=-1)[:length]
    return features
