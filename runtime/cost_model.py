"""How much a verification pass over T tokens costs relative to T = 1, measured on this machine, and the tree
size that maximises expected tokens per unit of target time.

The curve is measured once per (target, dtype, device, thread count, CPU) and cached as JSON in the cache dir. It
is only the starting point: ``runtime.tree_sizing.TreeSizer`` corrects it with the costs and acceptance it sees.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time

import torch

from runtime.assets import cache_dir, write_json_atomically
from runtime.proposers.base import sizes_own_tree
from runtime.target import Target
from runtime.tree import Tree, verification_mask
from runtime.tree_sizing import TreeSizer

SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
ADAPTIVE_MAX_SIZE = 32  # the largest tree adaptive sizing considers


BATCH_SIZES = (1, 2, 4, 6, 8, 12, 16)  # tree sizes measured for several rows: larger passes cost too much to try

# Part of the cache key: raised whenever the runtime's own pass changes what its sizes cost (a kernel choice, the
# cache's bookkeeping), so that curves measured with the old pass are measured again rather than trusted.
CURVE_VERSION = 9


CPUINFO_FIELDS = {"model name": "cpu", "cpu family": "family", "model": "model", "stepping": "stepping",
                  "cpu MHz": "mhz", "cache size": "cache", "flags": "flags"}


def cpu_info() -> dict[str, str]:
    """The first processor's entry of /proc/cpuinfo under short names (``CPUINFO_FIELDS``): the model name alone
    ("AMD EPYC") does not tell two generations apart, family, model and stepping do. Empty off Linux."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor's entry ends here
                key, _, value = line.partition(":")
                if key.strip() in CPUINFO_FIELDS:
                    found[CPUINFO_FIELDS[key.strip()]] = value.strip()
    except OSError:
        pass
    return found


def usable_cores() -> int | None:
    """The cores this process may run on (its affinity), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine_key(device: torch.device) -> str:
    """What a cached cost curve was measured on: the CPU (model, family/model/stepping, cores this process may use,
    threads) and the GPU when the device is one."""
    info = cpu_info()
    cpu = "/".join(info.get(name, "") for name in ("cpu", "family", "model", "stepping")) or platform.machine()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return f"{cpu}-{platform.machine()}-{usable_cores()}-{torch.get_num_threads()}-{gpu}"


def _curve_path(target: Target, batch_size: int = 1):
    machine = machine_key(target.device)
    key = f"{target.identity}|{target.dtype}|{target.device}|{machine}|{torch.__version__}|v{CURVE_VERSION}"
    if batch_size > 1:
        key += f"|rows={batch_size}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "cost_curves" / f"{digest}.json"


def synchronized_seconds(device: torch.device, started: float) -> float:
    """Seconds since ``started`` (a time.perf_counter() value) once the device's queued work is done: CUDA runs
    kernels asynchronously, so without the synchronisation a timing would measure only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


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
            target.forward(tree.tokens.expand(rows, -1), positions.expand(rows, -1), cache, mask)
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


def expected_tokens(tree_size: int, acceptance: float) -> float:
    """Tokens per pass for a chain of tree_size - 1 drafts, each accepted with probability ``acceptance``
    given its parent was: 1 + a + a^2 + ... (the bonus token included)."""
    return sum(acceptance ** k for k in range(tree_size))


def best_tree_size(curve: dict[int, float], acceptance: float) -> int:
    """The size maximising expected tokens per unit cost."""
    return max(curve, key=lambda size: expected_tokens(size, acceptance) / curve[size])


def max_draft_depth(proposer) -> int | None:
    """The deepest node ``proposer`` drafts (its ``depth`` or ``max_depth``), or None where it does not say."""
    return getattr(proposer, "depth", None) or getattr(proposer, "max_depth", None)


def adaptive_sizer(target: Target, proposer) -> TreeSizer | None:
    """A TreeSizer for ``proposer`` on ``target``, starting at the proposer's measured size when it has one; None
    for a proposer that never drafts (plain decoding)."""
    if proposer.expected_acceptance <= 0:
        return None
    curve = {size: cost for size, cost in cost_curve(target).items() if size <= ADAPTIVE_MAX_SIZE}
    return TreeSizer(curve, proposer.expected_acceptance, start=proposer.tree_size,
                     max_depth=max_draft_depth(proposer))


def adaptive_sizers(target: Target, drafters: dict) -> dict[str, TreeSizer]:
    """``adaptive_sizer`` for each of a proposer's drafters ({name: drafter}, ``runtime.proposers.base.drafters``)
    that drafts and does not size its own trees: their acceptance by depth differs, so each learns its own."""
    sizers = {}
    for name, drafter in drafters.items():
        if sizes_own_tree(drafter):
            continue
        sizer = adaptive_sizer(target, drafter)
        if sizer is not None:
            sizers[name] = sizer
    return sizers


def batch_tree_size(target: Target, proposer, batch_size: int) -> tuple[int, str]:
    """(tree size, why) for ``batch_size`` rows verified together: the best size for the proposer's prior acceptance
    on the cost curve measured at that batch size. A pass of many rows is compute-bound sooner, so extra tree nodes
    cost more as the batch grows, and the size shrinks, down to 1 (plain decoding) where drafting no longer pays.
    One row starts where adaptive sizing starts (a measured size, or the batch-1 curve)."""
    if proposer.expected_acceptance <= 0:
        return 1, f"1: the {proposer.name} proposer drafts nothing"
    if batch_size == 1:
        sizer = adaptive_sizer(target, proposer)
        return sizer.current, f"{sizer.current} ({sizer.start_reason})"
    size = best_tree_size(cost_curve(target, batch_size), proposer.expected_acceptance)
    why = f"the best size for its prior acceptance on this machine's cost curve at {batch_size} rows"
    if size == 1:
        why += ": drafting does not pay at this batch size"
    return size, f"{size} ({why})"


def break_even_acceptance(pass_seconds: dict[int, float]) -> float:
    """The acceptance a draft node must have to pay, from one pass's seconds at some number of rows with 1 and 2
    tokens per row ({1: s1, 2: s2}): one more node per row costs s2 - s1, and each row's token of plain decoding
    costs s1, so a node accepted with probability p adds p tokens for (s2 - s1) / s1 of a token's time. Drafting
    itself costs more on top. Above 1: no node pays; 0 where the second token costs nothing (timing noise)."""
    return max((pass_seconds[2] - pass_seconds[1]) / pass_seconds[1], 0.0)


def pooled_depth_acceptance(results) -> tuple[float, list[float]]:
    """(fraction of passes that drafted at all, [P(accepted >= k | a node at depth k was drafted)] for k = 1..)
    pooled over ``results`` (``runtime.decoder.GenerationResult``s: their depth_attempts / depth_accepts, and one
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
