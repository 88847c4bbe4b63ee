"""The verified tree's size, chosen step by step from what the target's passes cost and what the proposer gets
accepted.

A bigger tree gets more tokens accepted per target pass and makes the pass dearer; the best size depends on the
machine (the cost of a pass of T tokens relative to one token: ``runtime.target.cost_model``) and on the proposer and
the text (acceptance by depth). Neither is known for good in advance: a cost curve measured once can be noisy, a size
tuned on one CPU is wrong on another, acceptance differs between prompts. ``TreeSizer`` starts from the cost curve
and a prior acceptance, then learns per-depth acceptance from every verification (and, when told to, step costs from
timings), re-chooses the size as it goes, and now and then probes a neighbouring size, so a size once dismissed
(speculation switched off included) gets measured again.

Pure bookkeeping: no timing or model calls here; the decoder reports what happened.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DepthAcceptance:
    """Conditional acceptance by depth: of the passes whose tree reached depth d with depth d-1 accepted, how many
    accepted a node at depth d. A Beta prior (``prior`` with the weight of ``prior_weight`` passes) keeps early
    estimates sane. Index d - 1 holds depth d."""

    prior: float
    prior_weight: float = 8.0
    attempts: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    # where given, its rate at each depth is the prior instead of ``prior`` (one batch row's own acceptance, pulled
    # towards what every row of its run gets accepted until it has seen enough of its own)
    parent: DepthAcceptance | None = None

    def observe(self, drafted_depth: int, accepted_depth: int) -> None:
        """One verification: the tree reached ``drafted_depth``; the accepted path has ``accepted_depth`` drafts."""
        for depth in range(1, min(drafted_depth, accepted_depth + 1) + 1):
            while len(self.attempts) < depth:
                self.attempts.append(0)
                self.accepts.append(0)
            self.attempts[depth - 1] += 1
            self.accepts[depth - 1] += accepted_depth >= depth

    def rate(self, depth: int) -> float:
        tried = self.attempts[depth - 1] if depth <= len(self.attempts) else 0
        taken = self.accepts[depth - 1] if depth <= len(self.accepts) else 0
        prior = self.prior if self.parent is None else self.parent.rate(depth)
        return (taken + prior * self.prior_weight) / (tried + self.prior_weight)

    def reach(self, depth: int) -> list[float]:
        """[P(a chain's node at depth d is accepted) for d = 1 .. depth]: the tokens each deeper node adds."""
        found, reach = [], 1.0
        for d in range(1, depth + 1):
            reach *= self.rate(d)
            found.append(reach)
        return found

    def expected_tokens(self, depth: int) -> float:
        """Tokens a pass emits when the tree reaches ``depth``: 1 + a1 + a1 a2 + ... (the bonus token included)."""
        return 1.0 + sum(self.reach(depth))


class TreeSizer:
    """Chooses the tree size for each step.

    curve: {size: cost of a pass of that many tokens relative to one token} (``runtime.target.cost_model.cost_curve``);
    prior_acceptance: the proposer's prior per-depth acceptance; start: the first size (default: the best for the
    prior), kept until the first probe; max_depth: the deepest tree the proposer drafts (None: size - 1, a chain);
    probe_every: steps between probes of a neighbouring size once past the first probes at steps 4, 8 and 16;
    learn_costs: also learn step costs from reported timings (they vary run to run, so a seeded sampling run that
    must repeat exactly keeps to the curve).
    """

    def __init__(self, curve: dict[int, float], prior_acceptance: float, start: int | None = None,
                 max_depth: int | None = None, probe_every: int = 32, learn_costs: bool = True):
        if 1 not in curve:
            raise ValueError(f"the cost curve must include size 1 (one token), got sizes {sorted(curve)}")
        self.curve = {size: curve[size] / curve[1] for size in sorted(curve)}
        self.acceptance = DepthAcceptance(prior_acceptance)
        self.max_depth = max_depth
        self.probe_every = probe_every
        self.learn_costs = learn_costs
        self.seconds: dict[int, float] = {}  # size -> moving average of one step's seconds
        self.steps = 0
        self.probes = 0
        self.chosen: Counter[int] = Counter()
        self.started = start is not None
        if start is not None and start not in self.curve:  # a size measured elsewhere joins the candidates
            self.curve[start] = interpolated_cost(self.curve, start)
        self.current = start if start is not None else self.best()

    @property
    def start_reason(self) -> str:
        """Why the first size is what it is."""
        return ("the proposer's measured size" if self.started
                else "the best size for its prior acceptance on this machine's cost curve")

    @property
    def sizes(self) -> list[int]:
        return sorted(self.curve)

    @property
    def largest(self) -> int:
        return max(self.curve)

    def depth_of(self, size: int) -> int:
        depth = size - 1
        return depth if self.max_depth is None else min(depth, self.max_depth)

    def cost(self, size: int) -> float:
        """A step of ``size`` tokens relative to a step of one token: from timings where both were measured; for
        other sizes, the curve's cost above one token scaled as much as timings scaled it at the nearest timed
        size (a curve measured under load overstates every size alike)."""
        if not self.learn_costs or 1 not in self.seconds:
            return self.curve[size]
        if size in self.seconds:
            return self.seconds[size] / self.seconds[1]
        timed = [s for s in self.seconds if s > 1 and self.curve[s] > 1]
        if not timed:
            return self.curve[size]
        near = min(timed, key=lambda s: abs(s - size))
        scale = (self.seconds[near] / self.seconds[1] - 1) / (self.curve[near] - 1)
        return 1 + (self.curve[size] - 1) * max(scale, 0.0)

    def value(self, size: int) -> float:
        """Expected tokens per unit of target time at ``size``."""
        return self.acceptance.expected_tokens(self.depth_of(size)) / self.cost(size)

    def best(self) -> int:
        return max(self.sizes, key=self.value)

    def choose(self) -> int:
        """The size for the next pass: the best one, or at a probe step a neighbour of it (alternately above and
        below; from plain decoding always above)."""
        self.steps += 1
        best = self.current if self.started and self.probes == 0 else self.best()
        size = best
        if self._probe_step(self.steps):
            self.probes += 1
            index = self.sizes.index(best)
            upward = self.probes % 2 == 1 or index == 0
            neighbour = index + 1 if upward and index + 1 < len(self.sizes) else max(index - 1, 0)
            size = self.sizes[neighbour]
        self.current = size
        self.chosen[size] += 1
        return size

    def _probe_step(self, step: int) -> bool:
        return probe_step(step, self.probe_every)

    def observe(self, size: int, drafted_depth: int, accepted_depth: int, seconds: float | None = None) -> None:
        """What a step of ``size`` tokens gave: its tree's depth, the accepted drafts and (optionally) the seconds
        the step took (drafting and verification)."""
        self.acceptance.observe(drafted_depth, accepted_depth)
        if seconds is not None and self.learn_costs and size in self.curve:
            previous = self.seconds.get(size)
            self.seconds[size] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def report(self) -> dict:
        """Sizes chosen so far (size -> passes) and the current per-depth acceptance estimates."""
        depths = len(self.acceptance.attempts)
        return {"sizes": dict(sorted(self.chosen.items())),
                "acceptance_by_depth": [round(self.acceptance.rate(d), 3) for d in range(1, depths + 1)]}


class DraftingTrial:
    """Whether drafting pays in a greedy run of many rows, measured rather than predicted, and measured again as the
    run goes on.

    The size a batched run drafts at comes from the cost curve at its batch size, which holds verification alone:
    at many rows a head's drafting over every row, ragged passes dearer than the curve's uniform ones, or acceptance
    below the proposer's prior can make drafting slower than plain decoding. So the run's first 2 ``passes`` passes
    alternate, ``block`` passes drafting at ``size``, then ``block`` decoding plainly, and the faster is chosen.

    Speed is compared only between adjacent blocks: the ratio of drafting's tokens per second to plain decoding's
    in each pair of neighbouring blocks of the two, averaged (geometrically, recent pairs weighing more: ``decay`` per
    pair). A run's rate moves with more than the choice: the machine's speed drifts by tens of percent within
    minutes on a shared CPU, and rows finish, so a pass later in a run serves fewer of them; neighbouring blocks see
    nearly the same of both. The first ``warmup`` passes of the first block and of each block that follows a switch
    are left out (a head catches up there on the rows it has not read).

    What pays changes within a run (lookup finds more to copy early in a reply than later), so after the first
    choice the last block of every ``every`` passes goes to the other choice, which takes over where the pairs it
    closes move the average to its side.

    Pure bookkeeping: the decoder asks ``size()`` before each pass and reports ``observe``; ``decided`` is the current
    choice once the first passes are measured.
    """

    def __init__(self, size: int, passes: int = 32, warmup: int = 1, block: int = 4, every: int = 64,
                 decay: float = 0.8):
        warmup = min(warmup, block - 1)
        if size < 2 or block < 1 or passes < block or every <= block:
            raise ValueError(f"a trial needs a drafting size >= 2 (got {size}), at least a block of passes (block "
                             f"{block}, {passes} passes) each way and rechecks further apart than a block ({every})")
        self.drafting_size = size
        self.passes = passes
        self.block = block
        self.warmup = warmup
        self.every = every
        self.decay = decay
        self.count = 0
        self.decided: int | None = None
        self.chosen_on = 1.0  # advantage() when the choice was last made
        self.switches = 0
        self.counts = {size: 0, 1: 0}  # passes of each size after the first choice
        # the block being measured: its size, passes, whether it follows a switch, measured tokens and seconds
        self._block = [0, 0, False, 0.0, 0.0]
        self._previous: tuple[int, float] | None = None  # the last finished block's size and tokens per second
        self._log_ratio = 0.0  # decayed sums over pairs of adjacent blocks: log(drafting rate / plain rate), weight
        self._weight = 0.0
        self.pairs = 0

    def _other(self, size: int) -> int:
        return 1 if size == self.drafting_size else self.drafting_size

    def _rechecking(self, count: int) -> bool:
        """Whether pass ``count`` (from 0), after the first choice, belongs to a block of the other choice."""
        return (count - 2 * self.passes) % self.every >= self.every - self.block

    def size(self) -> int:
        """The tree size of the next pass."""
        if self.decided is None:
            return self.drafting_size if (self.count // self.block) % 2 == 0 else 1
        return self._other(self.decided) if self._rechecking(self.count) else self.decided

    def observe(self, size: int, tokens: int, seconds: float) -> None:
        """A pass of ``size`` emitted ``tokens`` (all rows, bonus tokens included) in ``seconds`` (drafting and
        verification)."""
        if self.decided is not None:
            self.counts[size] += 1
        block = self._block
        if block[1] and block[0] != size:
            self._end_block()
        if not block[1]:
            block[0], block[2] = size, self._previous is None or self._previous[0] != size
        if not (block[2] and block[1] < self.warmup):
            block[3] += tokens
            block[4] += seconds
        block[1] += 1
        if block[1] == self.block:
            self._end_block()
        self.count += 1
        first = self.decided is None and self.count >= 2 * self.passes and self.count % (2 * self.block) == 0
        recheck_done = (self.decided is not None and self._rechecking(self.count - 1)
                        and not self._rechecking(self.count))
        if first or recheck_done:
            self.chosen_on = self.advantage()
            choice = self.drafting_size if self.chosen_on > 1.0 else 1
            self.switches += self.decided is not None and choice != self.decided
            self.decided = choice

    def next_run(self) -> None:
        """Carry what was measured into another run of the same shape: the choice and the average stay, and no pair
        of blocks spans the two runs."""
        self._block = [0, 0, False, 0.0, 0.0]
        self._previous = None

    def _end_block(self) -> None:
        size, _, _, tokens, seconds = self._block
        self._block = [0, 0, False, 0.0, 0.0]
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        if self._previous is not None and self._previous[0] != size:
            drafting, plain = (rate, self._previous[1]) if size == self.drafting_size else (self._previous[1], rate)
            self._log_ratio = self.decay * self._log_ratio + math.log(drafting / plain)
            self._weight = self.decay * self._weight + 1.0
            self.pairs += 1
        self._previous = (size, rate)

    def advantage(self) -> float:
        """Drafting's tokens per second over plain decoding's, from adjacent blocks (1.0 before any pair)."""
        return math.exp(self._log_ratio / self._weight) if self._weight else 1.0

    def report(self) -> str:
        def measured(ratio: float) -> str:
            return (f"drafting at {self.drafting_size} emitted {ratio:.2f}x plain decoding's tokens per second in "
                    f"adjacent blocks")

        if self.decided is None:
            return f"on trial ({measured(self.advantage())})"
        # pairs completed after the last choice move the ratio before the next recheck acts on them
        why = measured(self.chosen_on) + " at the last choice"
        if f"{self.advantage():.2f}" != f"{self.chosen_on:.2f}":
            why += f", {self.advantage():.2f}x since"
        return (f"{self.decided}: {'drafting' if self.decided > 1 else 'plain decoding'} measured faster ({why}; "
                f"{self.counts[self.drafting_size]} drafting and {self.counts[1]} plain passes since the first "
                f"choice, {self.switches} switches)")


@dataclass
class CurveScale:
    """How far a run's passes cost above a one-node pass, against what the cost curve says.

    The curve is measured once per machine and cached; measured while the machine was busy or its clock was elsewhere,
    its cost above one node can be off by half (and a drafting decision at many rows turns on exactly that: whether a
    node's price is below its acceptance). Each pass reports ``extra``, the curve's cost above a one-node pass at the
    pass's nodes per row (in one-node passes), and its seconds; a least-squares line seconds = a + b * extra over the
    passes, recent ones weighing more (``decay`` per pass), gives ``scale`` = b / a, the factor by which the curve's
    extra cost is off. It moves only once the passes' extras spread enough to tell a slope (weighted variance at least
    ``min_spread``, ``min_passes`` passes' weight) and stays within [``1 / limit``, ``limit``]. Pure bookkeeping."""

    decay: float = 0.97
    min_spread: float = 0.002
    min_passes: float = 8.0
    limit: float = 3.0
    scale: float = 1.0
    _sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, x, y, xx, xy

    def observe(self, extra: float, seconds: float) -> None:
        weight, sx, sy, sxx, sxy = (self.decay * s for s in self._sums)
        self._sums = (weight + 1, sx + extra, sy + seconds, sxx + extra * extra, sxy + extra * seconds)
        weight, sx, sy, sxx, sxy = self._sums
        spread = sxx / weight - (sx / weight) ** 2
        if weight < self.min_passes or spread < self.min_spread:
            return
        slope = (sxy / weight - sx / weight * sy / weight) / spread
        base = sy / weight - slope * sx / weight
        if base > 0:
            self.scale = min(max(slope / base, 1 / self.limit), self.limit)

    def curve(self, curve: dict[int, float]) -> dict[int, float]:
        """``curve`` ({nodes: cost relative to one}) with its cost above one node scaled."""
        return {size: 1 + self.scale * (cost - 1) for size, cost in curve.items()}


def probe_step(step: int, every: int = 32) -> bool:
    """Whether step ``step`` (counting from 1) probes a size other than the best: steps 4, 8 and 16, then every
    ``every``th (never when ``every`` is 0)."""
    if not every:
        return False
    return step in (4, 8, 16) if step < every else step % every == 0


def interpolated_cost(curve: dict[int, float], size: int) -> float:
    """The cost of a pass of ``size`` rows on ``curve`` ({rows: cost relative to one row}): linear between the
    measured sizes, proportional past the largest, the smallest's cost below it."""
    sizes = sorted(curve)
    below = max((s for s in sizes if s <= size), default=sizes[0])
    above = [s for s in sizes if s >= size]
    if not above:
        return curve[below] * size / below
    upper = min(above)
    if upper == below:
        return curve[below]
    weight = (size - below) / (upper - below)
    return curve[below] * (1 - weight) + curve[upper] * weight


def allocate_nodes(gains: Sequence[Sequence[float]], curve: dict[int, float], fixed: float = 0.0) -> list[int]:
    """Tree sizes (nodes, root included) for the B rows of one packed pass (``runtime.engine.ragged``), which costs
    ``curve`` at R total nodes: {nodes per row: cost of a pass of B rows of that many, relative to one each},
    interpolated at R / B, plus ``fixed``: what a step costs beside its verification pass (drafting, bookkeeping) in
    the same unit.

    gains[b]: the tokens row b's 1st, 2nd, ... draft node adds (``DepthAcceptance.reach``: non-increasing). Nodes
    are added best first, whichever row they belong to, while they raise the step's expected tokens per unit of
    cost; each row gets at most len(gains[b]) drafts. A row whose drafts are likely right gets a deep tree and one
    whose drafts are not gets none, so the pass pays only for nodes worth their cost at this batch size. A fixed
    cost makes a step dearer per token, so nodes pay sooner.
    """
    batch = len(gains)
    sizes = [1] * batch
    nodes, tokens, cost = batch, float(batch), interpolated_cost(curve, 1) + fixed
    waiting = [(-row_gains[0], b) for b, row_gains in enumerate(gains) if row_gains]
    heapq.heapify(waiting)
    while waiting:
        gain, b = heapq.heappop(waiting)
        more = interpolated_cost(curve, (nodes + 1) / batch) + fixed
        if (tokens - gain) * cost <= tokens * more:  # (tokens + gain) / more <= tokens / cost: it does not pay
            break
        sizes[b] += 1
        nodes, tokens, cost = nodes + 1, tokens - gain, more
        if sizes[b] - 1 < len(gains[b]):
            heapq.heappush(waiting, (-gains[b][sizes[b] - 1], b))
    return sizes


def allocation_value(gains: Sequence[Sequence[float]], sizes: Sequence[int], curve: dict[int, float],
                     fixed: float = 0.0) -> float:
    """Expected tokens per unit of cost of a step that verifies ``sizes`` (as ``allocate_nodes``)."""
    tokens = sum(1 + sum(row_gains[:size - 1]) for row_gains, size in zip(gains, sizes))
    return tokens / (interpolated_cost(curve, sum(sizes) / len(sizes)) + fixed)


def expected_tokens(tree_size: int, acceptance: float) -> float:
    """Tokens per pass for a chain of tree_size - 1 drafts, each accepted with probability ``acceptance``
    given its parent was: 1 + a + a^2 + ... (the bonus token included)."""
    return sum(acceptance ** k for k in range(tree_size))


def best_tree_size(curve: dict[int, float], acceptance: float) -> int:
    """The size maximising expected tokens per unit cost."""
    return max(curve, key=lambda size: expected_tokens(size, acceptance) / curve[size])
