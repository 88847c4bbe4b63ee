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
ever sees them; they are never accepted. A proposer's extra rows (``runtime.tree.Draft``: lookahead's window) follow
their row's tree nodes and count towards its N; ``Draft.row_mask`` places them (they see the root and each other as
the draft says, no node sees them), and their logits go back to that row's proposer state in its next proposal.
Sliding-window layers get each key slot's position explicitly (``key_positions``), since a row's new entries are not
the last keys of the pass. The cascade backend's maskless prefix is the shortest row's committed length, which every
row sees whole.

Prefill. The first prompts are prefilled in passes of prompts of similar length (``runtime.cost_model.prefill_groups``:
padding is computed like any token, so one pass over prompts of 50 and 300 tokens costs six passes' worth of the
short one; the split weighs that against a pass's fixed cost, measured on this machine), each pass right-padded
into its own rows of the cache (``KVCache.rows``): a causal mask without the padding (a padding query sees itself),
each row's first token from its own last prompt position, per-row lengths committed. Continuous batching: a batch
holds ``batch_size`` rows; when a row finishes, the next prompt takes over its row of the cache with a prefill of
its own (a batch-1 pass over that row's slots), and joins the next verification
pass, so no row waits for the longest one. Once no prompt is left to take a finished row's place, the cache drops
that row (``KVCache.keep_rows``).

Drafting. Greedy rows draft together where the proposer can (``propose_rows``: an EAGLE head reads every row's newly
verified rows in one pass, takes every root through its LM head in one product and forwards each level of every row's
tree in one pass), since greedy output does not depend on the trees. Sampled rows draft one by one: a head's trees may
differ by rounding with the shape of the batch, and a sampled row's draws depend on its tree.

Tree sizes. Rows of different sizes verify packed (``runtime.ragged``): no padding token is computed, so a row pays
only for its own nodes. By default greedy rows of a run of several get their sizes per pass
(``runtime.tree_sizing.allocate_nodes``): each row's acceptance by depth, learnt from its own passes at each drafter
and level (prompt lookup's level is the length of the suffix it matched, and 4-token matches are right far more often
than 2-token ones) and pulled towards what every row of the run gets accepted there, says what each further node would
add, and the nodes worth their cost go in, best first, whichever row they belong to: a row in repetitive text drafts
deep while its neighbours draft nothing. The cost is the curve measured at the run's batch size (verification alone),
its cost above one node re-priced by the run's own full-width passes (``runtime.tree_sizing.CurveScale``: a cached
curve measured on a busy machine misprices a node, and at many rows a node's price decides whether it pays), plus
what the run's steps measure beside it: bookkeeping, and a model drafter's call, which costs about as much for
one row as for all, so rows are sized with and without it. A row given no node skips its proposer; the features a head
would have read wait in the row for its next draft, and that call, which reads them all, is not taken as the price of
drafting once more (``BatchedDecoder._reads_one_pass``). ``per_row_sizes=False`` keeps one size for every row and step
of a run instead, and a sampled row always keeps the one-row size, since its draws depend on its tree and must not
depend on its neighbours. A proposer that sizes its own trees (``runtime.proposers.base.sizes_own_tree``) keeps its
size at every batch size.

The cost curve holds uniform passes, and a proposer's prior acceptance is an average over other text; at many rows a
head's drafting, ragged passes or lower acceptance can make drafting lose to plain decoding. So a greedy run of
several rows that drafts measures it (``runtime.tree_sizing.DraftingTrial``): blocks of drafting passes alternate with
blocks of plain ones, the faster is chosen, and now and then a block of the other choice measures it again. Through
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

from runtime.acceptance import greedy_accept
from runtime.cost_model import (ADAPTIVE_MAX_SIZE, batch_tree_size, cost_curve, max_draft_depth,
                                pass_overhead_tokens, prefill_groups, synchronized_seconds)
from runtime.decoder import (GenerationResult, Stops, checked_backend, checked_draft, count_depths, drawn_accept,
                             pick_token, prompt_tensor)
from runtime.kv_cache import KVCache
from runtime.ragged import RaggedRows
from runtime.monitor import monitor_for
from runtime.proposers.base import (NoProposer, Proposer, ProposeInput, draft_key, draft_source, drafters,
                                    drafts_with_a_model, extra_rows, observe, propose_rows, sizes_own_tree,
                                    start_generation, unread_rows)
from runtime.sampling import SamplingParams, greedy_tokens, new_generator
from runtime.target import Target
from runtime.tree import Draft, Tree
from runtime.tree_sizing import (CurveScale, DepthAcceptance, DraftingTrial, allocate_nodes, allocation_value,
                                 interpolated_cost, probe_step)


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
class Allocation:
    """Per-pass tree sizes for a greedy run (``allocate_nodes``): the cost curve at the run's batch size, the
    drafters' largest trees and prior acceptance, and acceptance by depth over every row of the run for each drafter
    and level (``runtime.proposers.base.draft_key``: prompt lookup's longer matches are right more often than its
    shorter ones, and learnt apart)."""

    curve: dict[int, float]
    largest: dict[str, int]  # drafter -> its largest tree (nodes, root included)
    priors: dict[str, float]  # drafter -> its prior per-node acceptance
    models: set[str]  # the drafters that draft with a model (a head, a draft model): their calls cost time
    acceptance: dict[tuple[str, int], DepthAcceptance] = field(default_factory=dict)
    # Learnt from the run's steps (moving averages): the seconds of a verification pass of one node per row (from
    # each pass's seconds and the curve at its size), what a step costs beside its pass and a model's drafting (in
    # such passes), and the seconds of a call that drafts with a model. The curve holds verification alone.
    pass_seconds: float | None = None
    overhead: float = 0.0
    model_call: float = 0.0
    # The curve's cost above one node per row, corrected by what the run's passes at its full width (``width``; 0:
    # every pass) measure (``CurveScale``).
    width: int = 0
    scale: CurveScale = field(default_factory=CurveScale)

    @property
    def priced(self) -> dict[int, float]:
        """The corrected curve the sizes come from."""
        return self.scale.curve(self.curve)

    def observe_step(self, nodes_per_row: float, forward: float, model: float, step: float,
                     model_call: float | None = None, rows: int | None = None) -> None:
        """One step's seconds: its verification pass (``nodes_per_row`` nodes per row on average over its ``rows``
        rows), a model's drafting (0: no row drafted with a model), the whole step; ``model_call``: the model's
        call, where it costs what drafting once more costs (None: not such a call,
        ``BatchedDecoder._reads_one_pass``). A pass of the run's full width also prices the curve (``scale``)."""
        if rows is not None and (not self.width or rows == self.width):
            self.scale.observe(interpolated_cost(self.curve, nodes_per_row) - 1, forward)
        one = forward / interpolated_cost(self.priced, nodes_per_row)
        self.pass_seconds = one if self.pass_seconds is None else 0.9 * self.pass_seconds + 0.1 * one
        self.overhead = 0.9 * self.overhead + 0.1 * max(step - forward - model, 0.0) / self.pass_seconds
        if model_call:
            self.model_call = model_call if not self.model_call else 0.9 * self.model_call + 0.1 * model_call

    def sizes(self, gains: list[list[float]], keys: list[tuple[str, int] | None]) -> list[int]:
        """Each row's tree size for one step (``allocate_nodes``), ``gains`` being what each row's draft nodes would
        add and ``keys`` who drafts them. A model's call costs about as much for one row as for all (a decode-sized
        pass is bound by reading weights and per-call overhead), so the rows lookup drafts are sized without it, then
        all rows with it, and the step that gets more tokens per unit of cost is taken."""
        fixed, curve = self.overhead, self.priced
        models = [key is not None and key[0] in self.models for key in keys]
        free = [[] if model else row_gains for row_gains, model in zip(gains, models)]
        sizes = allocate_nodes(free, curve, fixed)
        if any(model and row_gains for row_gains, model in zip(gains, models)):
            call = self.model_call / self.pass_seconds if self.pass_seconds else 0.0
            with_models = allocate_nodes(gains, curve, fixed + call)
            if (allocation_value(gains, with_models, curve, fixed + call)
                    > allocation_value(free, sizes, curve, fixed)):
                return with_models
        return sizes

    def learners(self, row: _Row, key: tuple[str, int]) -> tuple[DepthAcceptance, DepthAcceptance]:
        """(``row``'s own acceptance for drafter and level ``key``, pulled towards the run's until it has passes of
        its own; the run's), each made on first use."""
        run = self.acceptance.get(key)
        if run is None:
            run = self.acceptance[key] = DepthAcceptance(self.priors[key[0]])
        own = row.acceptance.get(key)
        if own is None:
            own = row.acceptance[key] = DepthAcceptance(run.prior, parent=run)
        return own, run


class BatchedDecoder:
    """Generate for several prompts at once with ``target``, drafting with ``proposer`` (one proposer state per row).

    tree_size: the verified tree's size (nodes, root included) for every row and step; None chooses sizes per run from
    the cost curve measured at the run's batch size. per_row_sizes (with tree_size None): None (the default) has a
    greedy run allocate each row's size per pass (``runtime.tree_sizing.allocate_nodes``: from that curve, what a step
    costs beside it, and each row's acceptance at its drafter and level) where one size for the run would draft at all
    or a drafter looks its drafts up, and decode plainly where neither holds; False keeps one size for the run
    (``runtime.cost_model.batch_tree_size``: it shrinks as the batch grows, to plain decoding where drafting stops
    paying); True always allocates (``scripts/bench_batch_drafting.py --compare per-row-sizes`` measures per-row sizes
    against one size per run). A row given no draft node skips its proposer that pass. A sampling run keeps the one-row
    size, so a sampled row's trees never depend on its neighbours. attention and acceptance as in
    ``runtime.decoder.SpeculativeDecoder``. ``stats`` describes the latest run (``BatchStats``). trial_passes: a greedy
    run of several rows that drafts measures drafting against plain decoding, this many passes each in alternating
    blocks, chooses the faster and measures the other again now and then (``runtime.tree_sizing.DraftingTrial``), apart
    for each power-of-two count of live rows (``row_bucket``); the decoder's later runs carry on from what it measured;
    0 trusts the cost curve. ``monitor``: the proposer's rolling depth-1 acceptance over every row of every run, with a
    warning when it stays far below what its head measured in training (``runtime.monitor.AcceptanceMonitor``); a row's
    own rate is its result's ``depth_acceptance[0]``. draft_together: greedy rows draft in one proposer call where the
    proposer can (``propose_rows``); False drafts every row alone, as sampled rows always do
    (``scripts/bench_batch_drafting.py`` measures one against the other).

    record_layers: when given, each result carries ``features`` (``recorded_features``): the target's hidden
    states at every position of prompt + output that the passes computed, the last hidden state and the inputs of
    these decoder layers, as training reads them (``training.recorded``). They come from the passes that verified
    the tokens, so recording costs no extra target pass.
    """

    def __init__(self, target: Target, proposer: Proposer | None = None, tree_size: int | None = None,
                 attention: str = "auto", acceptance: str = "exact", draft_together: bool = True,
                 record_layers: Sequence[int] | None = None, per_row_sizes: bool | None = None,
                 trial_passes: int = 32):
        self.target = target
        self.draft_together = draft_together
        self.proposer = proposer if proposer is not None else NoProposer()
        self.record_layers = None if record_layers is None else tuple(int(i) for i in record_layers)
        # the layer inputs every pass returns: the proposer's first, then the recorded ones (set per run: a run that
        # drafts nothing reads none for its proposer)
        self.proposer_layers = tuple(self.proposer.hidden_layers)
        self.pass_layers = self.proposer_layers + (self.record_layers or ())
        self.attention = checked_backend(target, attention, acceptance, tree_size)
        self.acceptance = acceptance
        self.fixed_tree_size = tree_size
        if tree_size is not None:
            self.tree_size_reason = f"fixed at {tree_size} (tree_size={tree_size})"
        else:  # chosen for the batch size of each run (``batch_tree_size``)
            self.tree_size_reason = "chosen per run from the cost curve at its batch size"
        self.tree_size = tree_size
        self.per_row_sizes = per_row_sizes
        self.trial_passes = trial_passes
        # Greedy runs of several rows that draft measure drafting against plain decoding per number of live rows
        # (``row_bucket``), kept across runs by (bucket, drafting size); ``trials`` holds the latest run's by bucket.
        self._trials: dict[tuple[int, int], DraftingTrial] = {}
        self.trials: dict[int, DraftingTrial] = {}
        self._last_bucket = 0
        self.allocation: Allocation | None = None  # set per greedy run whose sizes are allocated per pass
        self.stats = BatchStats()
        self.monitor = monitor_for(self.proposer)

    @property
    def drafting(self) -> bool:
        """Whether the current run's trees hold drafts (its tree size, set per run, is above 1)."""
        return self.tree_size > 1

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
            report["curve_scale"] = round(self.allocation.scale.scale, 3)
            report["acceptance_by_depth"] = {
                name if not level else f"{name}@{level}": [round(run.rate(d), 3)
                                                           for d in range(1, len(run.attempts) + 1)]
                for (name, level), run in sorted(self.allocation.acceptance.items())}
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

    def _run(self, prompts: list[torch.Tensor], max_new_tokens: int, sampling: SamplingParams,
             seeds: list[int] | None, batch_size: int, stops: Stops) -> Iterator[tuple[int, GenerationResult]]:
        self.stats = stats = BatchStats()
        self.allocation = None
        self.trials = {}
        if not prompts:
            return
        started = time.perf_counter()
        queue = deque(range(len(prompts)))
        width = min(batch_size, len(prompts))
        trying = False  # whether this run measures drafting against plain decoding (``_trial``)
        if self.fixed_tree_size is None and sizes_own_tree(self.proposer):
            self.tree_size = self.proposer.tree_size
            why = getattr(self.proposer, "tree_size_reason", None)
            self.tree_size_reason = (f"{self.tree_size}, the {self.proposer.name} proposer's own size"
                                     + (f" ({why})" if why else ""))
        elif self.fixed_tree_size is None:
            # Greedy output does not depend on the tree, so the size may follow the batch; a sampled row's draws
            # do, and must not depend on how many rows share its batch: sampling keeps the one-row size.
            self.tree_size, reason = batch_tree_size(self.target, self.proposer, width if sampling.greedy else 1)
            self.tree_size_reason = f"fixed for this run at {reason}"
            if self._allocates(sampling, width):
                self._start_allocation(width)
            trying = bool(self.trial_passes and width > 1 and self.tree_size > 1 and sampling.greedy
                          and self.acceptance == "exact")
            if trying:
                # the curve holds verification alone, and a packed pass of ragged rows costs more than the curve's
                # uniform ones: whether drafting pays is measured
                source = self.tree_size_reason if self.allocation is not None else f"from the cost curve at {reason}"
                self.tree_size_reason = f"{source}, then measured against plain decoding by live rows"
        # A run of 1-node trees never drafts, so its passes need not return, nor its rows gather, anything for the
        # proposer to read: the step then costs what plain decoding's does.
        self.proposer_layers = tuple(self.proposer.hidden_layers) if self.drafting else ()
        self.pass_layers = self.proposer_layers + (self.record_layers or ())
        max_length = (max(prompt.numel() for prompt in prompts) + max_new_tokens + self.tree_size
                      + extra_rows(self.proposer) + 1)
        settings = (prompts, max_new_tokens, sampling, seeds)
        with torch.inference_mode():
            cache = self.target.new_cache(width, max_length)
            rows: list[_Row | None] = []
            first = [queue.popleft() for _ in range(width)]
            # Prompts of very different lengths padded into one pass would mostly compute padding: passes of
            # prompts of similar length instead, as many as the pass's fixed cost on this machine makes worth it.
            overhead = pass_overhead_tokens(cost_curve(self.target))
            for group in prefill_groups([prompts[i].numel() for i in first], overhead):
                start = len(rows)
                rows += self._prefill(cache.rows(start, start + len(group)), [first[g] for g in group], *settings)
                for slot in range(start, len(rows)):
                    cache.set_row_length(slot, rows[slot].length)
                stats.prefill_passes += 1
        while True:
            for slot, row in enumerate(rows):
                if row is None or row.pending is None:
                    continue
                emitted = stops.emit(row.pending, row.result, max_new_tokens)
                row.pending = None
                if row.result.target_forwards > 1:
                    row.result.accept_lengths.append(len(emitted))
                    stats.tokens += len(emitted)
                if row.result.stop_reason != "running":
                    row.result.seconds = time.perf_counter() - row.started
                    if row.recorded is not None:
                        row.result.features = recorded_features(row.recorded, self.record_layers,
                                                                row.length + len(emitted))
                    rows[slot] = None
                    yield row.index, row.result
                    continue
                with torch.inference_mode():
                    row.history[row.length:row.length + len(emitted)] = torch.tensor(emitted,
                                                                                     device=row.history.device)
                row.length += len(emitted)
            free = [slot for slot, row in enumerate(rows) if row is None]
            if free and queue:
                with torch.inference_mode():
                    for slot in free[:len(queue)]:
                        rows[slot] = self._prefill(cache.rows(slot, slot + 1), [queue.popleft()], *settings)[0]
                        cache.set_row_length(slot, rows[slot].length)  # the prompt; its first token is pending
                        stats.prefill_passes += 1
                continue  # the new rows emit their first token (and may be done at once)
            if free:  # nothing will take these rows' place: stop computing them
                live = [slot for slot, row in enumerate(rows) if row is not None]
                if not live:
                    break
                with torch.inference_mode():
                    rows = [rows[slot] for slot in cache.keep_rows(live)]
            trial = self._trial(len(rows)) if trying else None
            size = self.tree_size if trial is None else trial.size()
            step_started = time.perf_counter()
            with torch.inference_mode():
                emitted = self._step(rows, cache, sampling, size)  # type: ignore[arg-type]
            if trial is not None:
                trial.observe(size, emitted, time.perf_counter() - step_started)
            stats.passes += 1
            stats.row_passes += len(rows)
            stats.seconds = time.perf_counter() - started
        stats.seconds = time.perf_counter() - started
        if self.trials:
            self.tree_size_reason += ": " + "; ".join(f"{bucket}+ rows: {self.trials[bucket].report()}"
                                                      for bucket in sorted(self.trials, reverse=True))

    def _trial(self, live: int) -> DraftingTrial:
        """The drafting trial for a pass over ``live`` rows. Whether drafting pays depends on how many rows share a
        pass (a pass of few rows is bound by reading the weights, one of many by arithmetic), and a run's rows
        finish one by one: each power-of-two bucket of live rows keeps its own trial, carried across this
        decoder's runs; entering a bucket starts a new stretch of its blocks."""
        bucket = row_bucket(live)
        trial = self.trials.get(bucket)
        if trial is None:
            trial = self._trials.get((bucket, self.tree_size))
            if trial is None:
                trial = DraftingTrial(self.tree_size, self.trial_passes, block=min(4, self.trial_passes))
                self._trials[(bucket, self.tree_size)] = trial
            self.trials[bucket] = trial
            trial.next_run()
        elif self._last_bucket != bucket:
            trial.next_run()
        self._last_bucket = bucket
        return trial

    def _allocates(self, sampling: SamplingParams, width: int) -> bool:
        """Whether this run's tree sizes are allocated per row and pass (``tree_size`` holds the run's one size):
        greedy, exact acceptance, a proposer that drafts and does not size its own trees, and ``per_row_sizes``
        True, or None where the run has several rows and either one size for it would draft at all (else the head's
        every pass would cost what plain decoding does not; a lone row keeps the one-row decoder's sizing) or a
        drafter looks its drafts up: a lookup costs nothing where it finds nothing, and its long matches pay at
        batch sizes where its average match does not."""
        if self.per_row_sizes is False or not (sampling.greedy and self.acceptance == "exact"):
            return False
        if self.proposer.expected_acceptance <= 0 or sizes_own_tree(self.proposer):
            return False
        looks_up = not all(map(drafts_with_a_model, drafters(self.proposer).values()))
        return self.per_row_sizes is True or (width > 1 and (self.tree_size > 1 or looks_up))

    def _start_allocation(self, width: int) -> None:
        """Per-pass sizes for a greedy run of ``width`` rows: the cost curve measured at that batch size (one row:
        the sizes adaptive sizing considers), each drafter's largest tree, acceptance learnt from the priors."""
        curve = cost_curve(self.target, width)
        if width == 1:
            curve = {size: cost for size, cost in curve.items() if size <= ADAPTIVE_MAX_SIZE}
        largest, priors = {}, {}
        for name, drafter in drafters(self.proposer).items():
            depth = max_draft_depth(drafter)
            largest[name] = max(curve) if depth is None else min(max(curve), depth + 1)
            if drafts_with_a_model(drafter):
                # A model drafts a tree level by level, a cost the curve (verification alone) does not hold: its
                # rows go no deeper than one size for the whole run would make them.
                largest[name] = min(largest[name], batch_tree_size(self.target, drafter, width)[0])
            priors[name] = drafter.expected_acceptance
        models = {name for name, drafter in drafters(self.proposer).items() if drafts_with_a_model(drafter)}
        self.allocation = Allocation(curve, largest, priors, models, width=width)
        self.tree_size = max(largest.values())
        self.tree_size_reason = (f"up to {self.tree_size}, allocated per row and pass on this machine's cost curve at "
                                 f"{width} rows from each row's acceptance")

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
        # prefill (a mask) goes through SDPA's masked kernels instead; a lone prompt keeps the causal fast path
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
            row_max = length + max_new_tokens + self.tree_size + 1
            history = torch.empty(row_max, dtype=torch.long, device=device)
            history[:length] = prompts[i]
            state = start_generation(proposer, prompts[i], row_max, sampling)
            row = _Row(i, history, length, state, generator,
                       GenerationResult([], [], 1, 0.0, "length"), started)
            if self.allocation is not None:
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

    def _step(self, rows: list[_Row], cache: KVCache, sampling: SamplingParams, size: int) -> int:
        """Draft a tree of up to ``size`` nodes per row (1: none), verify every row's tree in one target pass, accept
        per row, compact the cache. Returns the tokens the pass emitted over all rows."""
        target, device, proposer = self.target, self.target.device, self.proposer
        step_started = time.perf_counter()
        model_seconds = 0.0  # drafting with a model, where sizes are allocated per pass
        one_pass = False  # ... whether that drafting costs what drafting once more costs (``_reads_one_pass``)
        greedy = sampling.greedy and self.acceptance == "exact"
        drafts = [Draft(Tree.chain(int(row.history[row.length - 1]), [], device=device)) for row in rows]
        drafting: list[int] = []  # the rows whose proposer drafts this pass
        named: list[str | None] = [None] * len(rows)  # who drafts each row, where the monitor judges one drafter
        if self.drafting and size > 1:
            sizes, sources = [size] * len(rows), [None] * len(rows)
            if self.allocation is not None:
                sizes, sources = self._allocate(rows)
            # a row given no draft node skips its proposer (an EAGLE head would still read its rows); what it would
            # have read waits in the row for its next draft
            drafting = [b for b, size in enumerate(sizes) if size > 1]
            if self.monitor.drafter is not None:
                for b in drafting:
                    named[b] = (sources[b][0] if sources[b] is not None
                                else draft_source(proposer, rows[b].state, rows[b].history[:rows[b].length]))
            one_pass = self.allocation is not None and self._reads_one_pass(rows, drafting, sources)
            steps = [self._propose_input(rows[b], sizes[b], sampling) for b in drafting]
            if not drafting:
                proposals = []
            elif greedy and self.draft_together:
                # Greedy output does not depend on the trees, so a head may draft for all rows in one pass (its
                # trees can differ by rounding with the batch's shape); a sampled row's draws depend on its tree,
                # which must not depend on its neighbours, so it drafts alone.
                started = time.perf_counter()
                proposals = propose_rows(proposer, [rows[b].state for b in drafting], steps)
                seconds = time.perf_counter() - started
                for b in drafting:
                    rows[b].result.draft_seconds += seconds / len(drafting)
                if self.allocation is not None and any(sources[b][0] in self.allocation.models for b in drafting):
                    model_seconds = seconds
            else:
                proposals = []
                for b, step in zip(drafting, steps):
                    started = time.perf_counter()
                    proposals.append(proposer.propose(rows[b].state, step))
                    seconds = time.perf_counter() - started
                    rows[b].result.draft_seconds += seconds
                    if self.allocation is not None and sources[b][0] in self.allocation.models:
                        model_seconds += seconds
            for b, proposal in zip(drafting, proposals):
                drafts[b] = checked_draft(proposal, proposer, sizes[b])
        drafted = set(drafting)
        trees = [draft.tree for draft in drafts]
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
        for b, (tree, draft) in enumerate(zip(trees, drafts)):
            used, start = draft.rows, committed[b]
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
        # Rows of different sizes go packed: padding tokens would cost real tokens' arithmetic in every linear layer
        # (a row drafting a deep tree would make every other row pay for its depth); attention still sees them
        # padded, each row over its own keys (``runtime.ragged``).
        ragged = None
        if sum(counts) < batch * nodes:
            real = torch.arange(nodes)[None, :] < torch.tensor(counts)[:, None]  # [B, N]
            tokens, positions = tokens[real][None], positions[real][None]
            ragged = RaggedRows.from_counts(counts, positions[0].to(device))
        forward_started = time.perf_counter()
        out = target.forward(tokens.to(device), positions.to(device), cache, mask.to(device),
                             hidden_layers=self.pass_layers, backend=self.attention,
                             prefix_len=min(committed), key_positions=key_positions.to(device), ragged=ragged)
        # on a GPU the pass runs asynchronously: its seconds price the run's nodes (``Allocation``) only once it ends
        forward_seconds = synchronized_seconds(device, forward_started)
        # each row's outputs [n_b, ...]: its slice of the packed pass, or its padded row
        spans = ragged.row_slices() if ragged is not None else [slice(0, nodes)] * batch
        lead = [0] * batch if ragged is not None else list(range(batch))
        logits = [out.logits[b, span] for b, span in zip(lead, spans)]
        proposer_layers = len(self.proposer_layers)
        reads_hidden = proposer.needs_hidden and self.drafting
        argmax = greedy_tokens(out.logits).cpu() if greedy else None
        paths: list[tuple[list[int], int]] = []
        for b, (row, tree) in enumerate(zip(rows, trees)):
            tree_tokens, parents, ancestors = cpu_trees[b]
            size = tree.size
            if greedy:
                paths.append(greedy_accept(tree_tokens, parents, ancestors, argmax[lead[b], spans[b]][:size]))
                continue
            paths.append(drawn_accept(tree, logits[b][:size], sampling, self.acceptance, row.generator))
        kept = max(len(path) for path, _ in paths)
        keep = torch.zeros(batch, kept, dtype=torch.long)
        for b, (path, _) in enumerate(paths):
            keep[b, :len(path)] = torch.tensor(path)
        cache.compact(keep.to(device), torch.tensor([len(path) for path, _ in paths], device=device))
        for b, (row, tree, (path, bonus)) in enumerate(zip(rows, trees, paths)):
            row.extra_logits = logits[b][tree.size:drafts[b].rows] if drafts[b].extra_count else None
            if b in drafted:
                observe(proposer, row.state, row.history[:row.length], tree, logits[b][:tree.size])
                if self.allocation is not None:
                    for learner in self.allocation.learners(row, sources[b]):
                        learner.observe(tree.max_depth, len(path) - 1)
            result = row.result
            result.target_forwards += 1
            result.tree_sizes.append(tree.size)
            count_depths(result, tree, len(path) - 1)
            self.monitor.observe(tree.max_depth, len(path) - 1, named[b])
            row.pending = cpu_trees[b][0][path[1:]].tolist() + [bonus]
            row.verified = len(path)
            if reads_hidden or proposer_layers or row.recorded is not None:
                index = torch.tensor(path, device=device) + spans[b].start
                hidden = out.hidden[lead[b], index]
                layer_hidden = tuple(h[lead[b], index] for h in out.layer_hidden)
                if reads_hidden:
                    row.hidden_parts.append(hidden)
                if proposer_layers:
                    row.layer_parts.append(layer_hidden[:proposer_layers])
                if row.recorded is not None:
                    self._record(row, hidden, layer_hidden[proposer_layers:])
        if self.allocation is not None:
            self.allocation.observe_step(sum(counts) / batch, forward_seconds, model_seconds,
                                         time.perf_counter() - step_started, model_seconds if one_pass else None,
                                         rows=batch)
        return sum(len(path) for path, _ in paths)

    def _reads_one_pass(self, rows: list[_Row], drafting: list[int], sources: list[tuple[str, int] | None]) -> bool:
        """Whether the model that drafts for ``drafting`` reads only the rows they verified in the last pass
        (``unread_rows``). A head reads every row verified since it last drafted, so a call after passes it skipped
        (or the first, after the prompt) costs more than drafting once more does: counting it as that price would
        keep the head from drafting. Only calls that read one pass are measured; until one is, a model's call is
        taken as free, and the head then drafts in successive passes, which measures it."""
        for b in drafting:
            if sources[b] is None or sources[b][0] not in self.allocation.models:
                continue
            row = rows[b]
            unread = unread_rows(self.proposer, row.state, row.history[:row.length])
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

    def _allocate(self, rows: list[_Row]) -> tuple[list[int], list[tuple[str, int] | None]]:
        """(each row's tree size for this pass, the drafter and level that draft it: None where it finds nothing to
        draft), from each row's acceptance at that drafter and level (``allocate_nodes``)."""
        allocation = self.allocation
        keys = [draft_key(self.proposer, row.state, row.history[:row.length]) for row in rows]
        gains = [[] if key is None else allocation.learners(row, key)[0].reach(allocation.largest[key[0]] - 1)
                 for row, key in zip(rows, keys)]
        sizes = allocation.sizes(gains, keys)
        # Now and then every row drafts one node more than its estimate pays for: acceptance is learnt only from
        # nodes drafted, so a row whose estimate once fell below the cost would otherwise never draft again. All rows
        # probe in the same pass, where one call of a model drafts for all of them.
        probe = probe_step(self.stats.passes + 1)
        return [min(size + 1, allocation.largest[key[0]]) if key is not None and probe else size
                for size, key in zip(sizes, keys)], keys


def row_bucket(rows: int) -> int:
    """The largest power of two at most ``rows`` (>= 1): passes of 16-31 live rows share a drafting trial, 8-15
    another, and so on."""
    return 1 << (max(rows, 1).bit_length() - 1)


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
