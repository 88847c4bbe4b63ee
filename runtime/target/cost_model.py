"""How much a verification pass over T tokens costs relative to T = 1, measured on this machine (the tree sizes
that maximise expected tokens per unit of target time: ``runtime.engine.tree_sizing``).

The curve is measured once per (target, dtype, device, thread count, CPU) and cached as JSON in the cache dir. It
is only the starting point: ``runtime.engine.tree_sizing.TreeSizer`` corrects it with the costs and acceptance it sees.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time

import torch

from runtime.target.assets import cache_dir, write_json_atomically
from runtime.target.machine import machine_key, synchronized_seconds
from runtime.target.model import Target
from runtime.engine.tree import Tree, verification_mask

SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


BATCH_SIZES = (1, 2, 4, 6, 8, 12, 16)  # tree sizes measured for several rows: larger passes cost too much to try

# Part of the cache key: raised whenever the runtime's own pass changes what its sizes cost (a kernel choice, the
# cache's bookkeeping), so that curves measured with the old pass are measured again rather than trusted.
CURVE_VERSION = 11


def _curve_path(target: Target, batch_size: int = 1):
    machine = machine_key(target.device)
    key = f"{target.identity}|{target.dtype}|{target.device}|{machine}|{torch.__version__}|v{CURVE_VERSION}"
    if batch_size > 1:
        key += f"|rows={batch_size}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "cost_curves" / f"{digest}.json"


def measure_cost_curve(target: Target, context: int = 256, sizes=SIZES, repeats: int = 5,
                       batch_size: int = 1) -> dict[int, float]:
    """Median seconds of a pass of ``batch_size`` rows of T-token trees after ``context`` cached tokens, divided by
    the T = 1 time at the same batch size."""
    seconds = measure_pass_seconds(target, context, sizes, repeats, batch_size)
    return {size: value / seconds[1] for size, value in seconds.items()}


@torch.inference_mode()
def measure_pass_seconds(target: Target, context: int = 256, sizes=SIZES, repeats: int = 5,
                         batch_size: int = 1) -> dict[int, float]:
    """{T: median seconds of one target pass over ``batch_size`` rows of a T-token tree after ``context`` cached
    tokens}; T = 1 is always measured."""
    sizes = sorted(set(sizes) | {1})
    device = target.device
    rows = batch_size
    cache = target.new_cache(rows, context + max(sizes) + 1)
    prompt = torch.randint(0, target.vocab_size, (rows, context), device=device)
    target.forward(prompt, torch.arange(context, device=device).expand(rows, -1), cache, None,
                   logits_from=context - 1)
    cache.commit(context)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for size in sizes:
            tree = Tree.chain(0, [1] * (size - 1), device=device)
            mask = verification_mask(tree.ancestor_mask(), context) if size > 1 else None
            positions = tree.position_ids(context)[None]
            started = time.perf_counter()
            # a greedy pass of one sequence computes only its argmax (``SpeculativeDecoder``), a batch its logits
            target.forward(tree.tokens.expand(rows, -1), positions.expand(rows, -1), cache, mask,
                           argmax=rows == 1)
            timings[size].append(synchronized_seconds(device, started))
    return {size: statistics.median(values[1:]) for size, values in timings.items()}


def cost_curve(target: Target, batch_size: int = 1) -> dict[int, float]:
    """The cached curve for this target, machine and batch size, measured on first use (a few seconds)."""
    path = _curve_path(target, batch_size)
    if path.is_file():
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    rows = f" at {batch_size} rows" if batch_size > 1 else ""
    print(f"[headstart] measuring the target's verification cost curve{rows} on this machine (once) ...",
          file=sys.stderr)
    sizes = SIZES if batch_size == 1 else BATCH_SIZES
    curve = measure_cost_curve(target, sizes=sizes, batch_size=batch_size)
    write_json_atomically(path, curve)
    return curve


def pass_overhead_tokens(curve: dict[int, float]) -> float:
    """A pass's fixed cost in tokens' worth, from a cost curve ({tokens: cost}): the line through its two largest
    sizes, cost = a + b T (where a pass is bound by arithmetic, as a prefill is), gives a / b; 0 where the line
    starts at or below 0, and unbounded where extra tokens cost nothing (a GPU's curve can be flat)."""
    small, large = sorted(curve)[-2:]
    slope = (curve[large] - curve[small]) / (large - small)
    fixed = curve[large] - slope * large
    if slope <= 0:
        return float("inf")
    return max(fixed / slope, 0.0)


def prefill_groups(lengths: list[int], overhead: float) -> list[list[int]]:
    """Prompts (their token counts) split into prefill passes, each padded to its longest prompt: the indices of
    ``lengths`` in groups, shortest prompts first, that minimise the tokens computed, padding included, plus
    ``overhead`` tokens' worth per pass (``pass_overhead_tokens``). Consecutive runs of the prompts sorted by length
    suffice (a group's cost depends only on its longest prompt), so a dynamic program over them finds the best."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = [0.0] + [float("inf")] * len(order)  # best[j]: the first j sorted prompts
    start = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            cost = best[i] + overhead + (j - i) * lengths[order[j - 1]]
            if cost < best[j]:
                best[j], start[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1]


def break_even_acceptance(pass_seconds: dict[int, float]) -> float:
    """The acceptance a draft node must have to pay, from one pass's seconds at some number of rows with 1 and 2
    tokens per row ({1: s1, 2: s2}): one more node per row costs s2 - s1, and each row's token of plain decoding
    costs s1, so a node accepted with probability p adds p tokens for (s2 - s1) / s1 of a token's time. Drafting
    itself costs more on top. Above 1: no node pays; 0 where the second token costs nothing (timing noise)."""
    return max((pass_seconds[2] - pass_seconds[1]) / pass_seconds[1], 0.0)


def pooled_depth_acceptance(results) -> tuple[float, list[float]]:
    """(fraction of passes that drafted at all, [P(accepted >= k | a node at depth k was drafted)] for k = 1..)
    pooled over ``results`` (``runtime.engine.decoder.GenerationResult``s: their depth_attempts / depth_accepts, and one
    pass per target forward after the prefill)."""
    depth = max((len(result.depth_attempts) for result in results), default=0)
    attempts, accepts = [0] * depth, [0] * depth
    passes = 0
    for result in results:
        passes += max(result.target_forwards - 1, 0)
        for d, (tried, took) in enumerate(zip(result.depth_attempts, result.depth_accepts)):
            attempts[d] += tried
            accepts[d] += took
    drafting = attempts[0] / passes if passes and depth else 0.0
    return drafting, [took / tried if tried else 0.0 for tried, took in zip(attempts, accepts)]
