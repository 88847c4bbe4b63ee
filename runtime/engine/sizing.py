"""Sizing policies: how big a tree each row verifies, starting from this machine's measured cost curve and the
proposer's prior acceptance, then from what the run's own passes cost and get accepted.

One prompt (``runtime.engine.decoder``): ``adaptive_sizers`` give each drafter a ``TreeSizer`` that starts at its
measured size (or the best size on the cost curve) and learns as it goes.

Several rows (``runtime.engine.batched``): ``BatchSizing`` is the policy a ``BatchedDecoder`` is handed (tests hand
over one with their own curve, allocation or trial). For each run it makes a ``RunPlan``: one size for the run
(``batch_tree_size``, the best size at the run's batch size, or the proposer's own), per-row sizes each pass
(``Allocation``: nodes go to the rows whose drafts are likely right, as many as pay on the curve re-priced by the
run's own passes), and a ``DraftingTrial`` per power-of-two count of live rows that measures drafting against plain
decoding (carried across the decoder's runs).

The bookkeeping itself (acceptance by depth, the trials' pairs of blocks, the allocation of nodes) is pure, in
``runtime.engine.tree_sizing``; this module wires it to the measured curve and the proposer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.sampling import SamplingParams
from runtime.engine.tree_sizing import (CurveScale, DepthAcceptance, DraftingTrial, TreeSizer, allocate_nodes,
                                        allocation_value, best_tree_size, interpolated_cost, probe_step)
from runtime.proposers.base import Proposer
from runtime.target.cost_model import cost_curve, pass_overhead_tokens
from runtime.target.model import Target

ADAPTIVE_MAX_SIZE = 32  # the largest tree adaptive sizing considers


# ----- one prompt, and the starting size of a run

def adaptive_sizer(target: Target, proposer: Proposer, curve: Callable | None = None) -> TreeSizer | None:
    """A TreeSizer for ``proposer`` on ``target``, starting at the proposer's measured size when it has one; None
    for a proposer that never drafts (plain decoding). ``curve(target, batch_size)``: the cost curve (None: this
    machine's, ``cost_curve``)."""
    if proposer.expected_acceptance <= 0:
        return None
    costs = {size: cost for size, cost in (curve or cost_curve)(target, 1).items() if size <= ADAPTIVE_MAX_SIZE}
    return TreeSizer(costs, proposer.expected_acceptance, start=proposer.tree_size, max_depth=proposer.max_depth)


def adaptive_sizers(target: Target, drafters: dict[str, Proposer]) -> dict[str, TreeSizer]:
    """``adaptive_sizer`` for each of a proposer's drafters ({name: drafter}, ``Proposer.drafters``) that drafts and
    does not size its own trees: their acceptance by depth differs, so each learns its own."""
    sizers = {}
    for name, drafter in drafters.items():
        if drafter.sizes_own_tree:
            continue
        sizer = adaptive_sizer(target, drafter)
        if sizer is not None:
            sizers[name] = sizer
    return sizers


def batch_tree_size(target: Target, proposer: Proposer, batch_size: int,
                    curve: Callable | None = None) -> tuple[int, str]:
    """(tree size, why) for ``batch_size`` rows verified together: the best size for the proposer's prior acceptance
    on the cost curve measured at that batch size. A pass of many rows is compute-bound sooner, so extra tree nodes
    cost more as the batch grows, and the size shrinks, down to 1 (plain decoding) where drafting no longer pays.
    One row starts where adaptive sizing starts (a measured size, or the batch-1 curve)."""
    if proposer.expected_acceptance <= 0:
        return 1, f"1: the {proposer.name} proposer drafts nothing"
    if batch_size == 1:
        sizer = adaptive_sizer(target, proposer, curve)
        return sizer.current, f"{sizer.current} ({sizer.start_reason})"
    size = best_tree_size((curve or cost_curve)(target, batch_size), proposer.expected_acceptance)
    why = f"the best size for its prior acceptance on this machine's cost curve at {batch_size} rows"
    if size == 1:
        why += ": drafting does not pay at this batch size"
    return size, f"{size} ({why})"


def row_bucket(rows: int) -> int:
    """The largest power of two at most ``rows`` (>= 1): passes of 16-31 live rows share a drafting trial, 8-15
    another, and so on."""
    return 1 << (max(rows, 1).bit_length() - 1)


# ----- per-row sizes each pass

@dataclass
class Allocation:
    """Per-pass tree sizes for a greedy run (``allocate_nodes``): the cost curve at the run's batch size, the
    drafters' largest trees and prior acceptance, and acceptance by depth over every row of the run for each drafter
    and level (``Proposer.draft_key``: prompt lookup's longer matches are right more often than its shorter ones, and
    learnt apart)."""

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

    def learners(self, row_acceptance: dict, key: tuple[str, int]) -> tuple[DepthAcceptance, DepthAcceptance]:
        """(a row's own acceptance for drafter and level ``key`` (``row_acceptance``: the row's learners by key),
        pulled towards the run's until it has passes of its own; the run's), each made on first use."""
        run = self.acceptance.get(key)
        if run is None:
            run = self.acceptance[key] = DepthAcceptance(self.priors[key[0]])
        own = row_acceptance.get(key)
        if own is None:
            own = row_acceptance[key] = DepthAcceptance(run.prior, parent=run)
        return own, run

    def report(self) -> dict:
        """The factor the run's passes scaled the curve's cost above one node by, and each drafter's acceptance by
        depth over the run."""
        return {"curve_scale": round(self.scale.scale, 3),
                "acceptance_by_depth": {
                    name if not level else f"{name}@{level}": [round(run.rate(d), 3)
                                                               for d in range(1, len(run.attempts) + 1)]
                    for (name, level), run in sorted(self.acceptance.items())}}


# ----- the policy a batched decoder is handed

@dataclass
class RunPlan:
    """How one batched run sizes its trees: ``tree_size`` for every row and pass (with ``allocation``: the largest a
    row may get), why, per-row sizes (``allocation``, None: one size), and whether drafting is measured against plain
    decoding (``trying``; ``trials``: this run's trial per bucket of live rows)."""

    tree_size: int
    reason: str
    allocation: Allocation | None = None
    trying: bool = False
    trials: dict[int, DraftingTrial] = field(default_factory=dict)
    last_bucket: int = 0

    @property
    def drafting(self) -> bool:
        """Whether the run's trees hold drafts (its tree size is above 1)."""
        return self.tree_size > 1


@dataclass
class BatchSizing:
    """A batched decoder's sizing policy.

    tree_size: the verified tree's size (nodes, root included) for every row and step; None chooses sizes per run
    from the cost curve measured at the run's batch size. per_row_sizes (with tree_size None): None (the default) has
    a greedy run allocate each row's size per pass (``Allocation``) where one size for the run would draft at all or a
    drafter looks its drafts up, and decode plainly where neither holds; False keeps one size for the run
    (``batch_tree_size``: it shrinks as the batch grows, to plain decoding where drafting stops paying); True always
    allocates (``scripts/bench_batch_drafting.py --compare per-row-sizes`` measures one against the other). A sampling
    run keeps the one-row size, so a sampled row's trees never depend on its neighbours. trial_passes: a greedy run of
    several rows that drafts measures drafting against plain decoding, this many passes each in alternating blocks,
    chooses the faster and measures the other again now and then (``DraftingTrial``), apart for each power-of-two
    count of live rows (``row_bucket``); the policy's later runs carry on from what it measured; 0 trusts the cost
    curve.

    curve(target, batch_size): the cost curve (None: ``runtime.target.cost_model.cost_curve``, measured once per
    machine);
    probe(pass_number): whether a pass drafts one node more than its estimate pays for (``probe_step``);
    allocation and trial: the classes of per-pass sizes and of trials.
    """

    tree_size: int | None = None
    per_row_sizes: bool | None = None
    trial_passes: int = 32
    curve: Callable[[Target, int], dict[int, float]] | None = None
    probe: Callable[[int], bool] = probe_step
    allocation: type[Allocation] = Allocation
    trial: type[DraftingTrial] = DraftingTrial
    # trials carried across runs, by (bucket of live rows, drafting size)
    trials: dict[tuple[int, int], DraftingTrial] = field(default_factory=dict)

    def fixed_reason(self) -> str:
        return f"fixed at {self.tree_size} (tree_size={self.tree_size})"

    def plan(self, target: Target, proposer: Proposer, sampling: SamplingParams, exact: bool, width: int) -> RunPlan:
        """The plan of a run of ``width`` rows (``exact``: exact acceptance)."""
        if self.tree_size is not None:
            return RunPlan(self.tree_size, self.fixed_reason())
        if proposer.sizes_own_tree:
            why = proposer.tree_size_reason
            return RunPlan(proposer.tree_size, f"{proposer.tree_size}, the {proposer.name} proposer's own size"
                           + (f" ({why})" if why else ""))
        # Greedy output does not depend on the tree, so the size may follow the batch; a sampled row's draws do, and
        # must not depend on how many rows share its batch: sampling keeps the one-row size.
        size, reason = batch_tree_size(target, proposer, width if sampling.greedy else 1, self.curve)
        plan = RunPlan(size, f"fixed for this run at {reason}")
        if self._allocates(proposer, sampling, exact, width, size):
            plan.allocation = self._allocation(target, proposer, width)
            plan.tree_size = max(plan.allocation.largest.values())
            plan.reason = (f"up to {plan.tree_size}, allocated per row and pass on this machine's cost curve at "
                           f"{width} rows from each row's acceptance")
        plan.trying = bool(self.trial_passes and width > 1 and plan.tree_size > 1 and sampling.greedy and exact)
        if plan.trying:
            # the curve holds verification alone, and a packed pass of ragged rows costs more than the curve's
            # uniform ones: whether drafting pays is measured
            source = plan.reason if plan.allocation is not None else f"from the cost curve at {reason}"
            plan.reason = f"{source}, then measured against plain decoding by live rows"
        return plan

    def _allocates(self, proposer: Proposer, sampling: SamplingParams, exact: bool, width: int, size: int) -> bool:
        """Whether a run's tree sizes are allocated per row and pass (``size``: the run's one size): greedy, exact
        acceptance, a proposer that drafts and does not size its own trees, and ``per_row_sizes`` True, or None where
        the run has several rows and either one size for it would draft at all (else the head's every pass would
        cost what plain decoding does not; a lone row keeps the one-row decoder's sizing) or a drafter looks its
        drafts up: a lookup costs nothing where it finds nothing, and its long matches pay at batch sizes where its
        average match does not."""
        if self.per_row_sizes is False or not (sampling.greedy and exact):
            return False
        if proposer.expected_acceptance <= 0 or proposer.sizes_own_tree:
            return False
        looks_up = not all(drafter.drafts_with_a_model for drafter in proposer.drafters.values())
        return self.per_row_sizes is True or (width > 1 and (size > 1 or looks_up))

    def _allocation(self, target: Target, proposer: Proposer, width: int) -> Allocation:
        """Per-pass sizes for a greedy run of ``width`` rows: the cost curve measured at that batch size (one row:
        the sizes adaptive sizing considers), each drafter's largest tree, acceptance learnt from the priors."""
        curve = (self.curve or cost_curve)(target, width)
        if width == 1:
            curve = {size: cost for size, cost in curve.items() if size <= ADAPTIVE_MAX_SIZE}
        largest, priors = {}, {}
        for name, drafter in proposer.drafters.items():
            depth = drafter.max_depth
            largest[name] = max(curve) if depth is None else min(max(curve), depth + 1)
            if drafter.drafts_with_a_model:
                # A model drafts a tree level by level, a cost the curve (verification alone) does not hold: its
                # rows go no deeper than one size for the whole run would make them.
                largest[name] = min(largest[name], batch_tree_size(target, drafter, width, self.curve)[0])
            priors[name] = drafter.expected_acceptance
        models = {name for name, drafter in proposer.drafters.items() if drafter.drafts_with_a_model}
        return self.allocation(curve, largest, priors, models, width=width)

    def trial_for(self, plan: RunPlan, live: int) -> DraftingTrial:
        """The drafting trial for a pass over ``live`` rows. Whether drafting pays depends on how many rows share a
        pass (a pass of few rows is bound by reading the weights, one of many by arithmetic), and a run's rows
        finish one by one: each power-of-two bucket of live rows keeps its own trial, carried across this policy's
        runs; entering a bucket starts a new stretch of its blocks."""
        bucket = row_bucket(live)
        trial = plan.trials.get(bucket)
        if trial is None:
            trial = self.trials.get((bucket, plan.tree_size))
            if trial is None:
                trial = self.trial(plan.tree_size, self.trial_passes, block=min(4, self.trial_passes))
                self.trials[(bucket, plan.tree_size)] = trial
            plan.trials[bucket] = trial
            trial.next_run()
        elif plan.last_bucket != bucket:
            trial.next_run()
        plan.last_bucket = bucket
        return trial

    def row_sizes(self, plan: RunPlan, proposer: Proposer, rows: list[Any],
                  pass_number: int) -> tuple[list[int], list[tuple[str, int] | None]]:
        """(each row's tree size for pass ``pass_number``, the drafter and level that draft it: None where it finds
        nothing to draft), from each row's acceptance at that drafter and level (``allocate_nodes``). ``rows``: the
        running rows (``state``, ``history``, ``length`` and ``acceptance``, their learners)."""
        allocation = plan.allocation
        keys = [proposer.draft_key(row.state, row.history[:row.length]) for row in rows]
        gains = [[] if key is None else
                 allocation.learners(row.acceptance, key)[0].reach(allocation.largest[key[0]] - 1)
                 for row, key in zip(rows, keys)]
        sizes = allocation.sizes(gains, keys)
        # Now and then every row drafts one node more than its estimate pays for: acceptance is learnt only from
        # nodes drafted, so a row whose estimate once fell below the cost would otherwise never draft again. All rows
        # probe in the same pass, where one call of a model drafts for all of them.
        probe = self.probe(pass_number)
        return [min(size + 1, allocation.largest[key[0]]) if key is not None and probe else size
                for size, key in zip(sizes, keys)], keys

    def prefill_overhead(self, target: Target) -> float:
        """A prefill pass's fixed cost in tokens' worth on this machine (``pass_overhead_tokens``)."""
        return pass_overhead_tokens((self.curve or cost_curve)(target, 1))
