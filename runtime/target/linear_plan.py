"""Which product each linear layer of a CPU decode pass runs, chosen by timing them on the machine at hand.

A decode pass multiplies a few rows by every weight matrix, and on a CPU with bf16 instructions several products
compute it: the packed AVX512-BF16 kernel over a copy of the weights in its block layout, the AMX tile kernel over
the same layout (CPUs with AMX), oneDNN over a copy in its own layout (AMX tiles where the CPU has them), and the
stock rules of ``runtime.target.decode_layers.decode_linear`` (the unpacked dot-product kernel for a few rows,
PyTorch's product beyond). Which is fastest differs between CPUs (with and without AMX, AVX512-BF16) and with the
row count, and oneDNN's fixed cost per call weighs on a decode pass of two hundred calls
(``scripts/bench_bf16_rows.py`` times them all on the machine at hand). So the runtime times them over the model's
own weights, once per machine and set of weight shapes, and caches the choice: a ``LinearPlan`` says which packed
copy the model keeps (one form: a second copy of the weights is what packing costs) and, for each weight shape and
row count, whether the packed copy or the stock rules compute it.

fp32 weights have no packed copy, but the operand order matters as much: for a few rows one BLAS streams the weight
faster as ``weight @ rows^T`` while another runs ``F.linear`` faster from two rows on
(``scripts/bench_verify_pass.py`` measures both). So fp32 models get a plan too, of the ``weight_major`` form
against ``F.linear``.

Every product gives the same values up to the order of the fp32 accumulation, so the choice changes speed only.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.target.assets import cache_dir, write_json_atomically
from runtime.target.machine import machine_key

# The packed forms of bf16 weights: the AVX512-BF16 kernel's blocks (runtime.target.kernels.pack_bf16_weight), oneDNN's
# layout (runtime.target.kernels.pack_onednn_weight), the AMX kernel over the blocks' layout
# (runtime.target.kernels.bf16_amx_linear), the AVX2 kernel over the blocks' layout for CPUs without AVX512-BF16
# (runtime.target.kernels.bf16_packed_linear_avx2); and for fp32 weights the weight-major product, which needs no
# copy.
FORMS = ("blocks", "onednn", "amx", "avx2", "weight_major")
STOCK = "stock"
# Row counts timed: decode steps, trees, batches of trees and short prefills. Beyond the largest the stock rules run.
PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
# fp32's weight-major order only ever pays for a few rows: beyond these F.linear runs.
FP32_PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
# A product this many times slower than the best at some row count is not timed at larger ones: a product that
# loses by that much to another does not catch up as rows grow, and the slow ones would make measuring take long.
GIVE_UP_RATIO = 2.0
# Models with fewer bf16 linear weights than this keep the default plan: their products take microseconds whatever
# runs them (the weights sit in cache), and timing them would decide on noise.
MEASURE_MIN_BYTES = 16 << 20
# Part of the cache key: raised whenever a product or the rule for choosing changes.
PLAN_VERSION = 4

Shape = tuple[int, int]  # a weight's [N, K]
Runs = tuple[tuple[int, bool], ...]  # (up to rows, packed?) ascending by rows


@dataclass(frozen=True)
class LinearPlan:
    """``form``: which packed copy of its weights a model keeps (``FORMS``); ``choices``: for each weight shape
    [N, K], runs of (up to this many rows, whether the packed copy computes them), rows ascending; a shape not listed
    follows ``default``. Beyond a shape's last run the stock rules compute it."""

    form: str
    choices: dict[Shape, Runs]
    default: Runs

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"LinearPlan.form must be one of {', '.join(FORMS)}, got {self.form!r}")

    def packed(self, shape: Shape, rows: int) -> bool:
        """Whether ``rows`` rows times a weight of ``shape`` go through the packed copy."""
        for limit, packed in self.choices.get(tuple(shape), self.default):
            if rows <= limit:
                return packed
        return False

    def uses_packed(self, shape: Shape) -> bool:
        """Whether the packed copy of a weight of ``shape`` computes any row count."""
        return any(packed for _, packed in self.choices.get(tuple(shape), self.default))

    def to_json(self) -> dict:
        return {"form": self.form, "default": [list(run) for run in self.default],
                "choices": [[list(shape), [list(run) for run in runs]] for shape, runs in self.choices.items()]}

    @classmethod
    def from_json(cls, data: dict) -> LinearPlan:
        def runs(items) -> Runs:
            return tuple((int(limit), bool(packed)) for limit, packed in items)

        return cls(data["form"], {(int(shape[0]), int(shape[1])): runs(items) for shape, items in data["choices"]},
                   runs(data["default"]))


def default_plan(max_rows: int) -> LinearPlan:
    """The plan without timing: the AVX512-BF16 blocks for every shape up to ``max_rows`` rows (what wins on the CPUs
    without AMX it was tuned on)."""
    return LinearPlan("blocks", {}, ((max_rows, True),))


def choose_plan(seconds: dict[str, dict[Shape, dict[int, float]]]) -> LinearPlan:
    """The plan with the least total time over ``seconds`` [product][shape][rows] (products: the ``FORMS`` measured and
    ``STOCK``; a product missing at a row count was too slow to time there). For each form, each shape and row count
    takes the faster of that form and the stock rules; the form whose plan sums to less is kept (the blocks on a
    tie). A shape not timed follows the form up to the most rows timed."""
    forms = [form for form in FORMS if form in seconds]
    if not forms:
        raise ValueError(f"choose_plan needs the seconds of a packed form ({', '.join(FORMS)}), got {list(seconds)}")
    stock = seconds.get(STOCK, {})
    most_rows = max((rows for timed in seconds.values() for counts in timed.values() for rows in counts),
                    default=max(PLAN_ROWS))
    best: tuple[float, LinearPlan] | None = None
    for form in forms:
        total, choices = 0.0, {}
        for shape, timed in seconds[form].items():
            runs: list[tuple[int, bool]] = []
            for rows in sorted(set(timed) | set(stock.get(shape, {}))):
                packed_time = timed.get(rows, float("inf"))
                stock_time = stock.get(shape, {}).get(rows, float("inf"))
                packed = packed_time < stock_time
                total += min(packed_time, stock_time)
                if runs and runs[-1][1] == packed:
                    runs[-1] = (rows, packed)
                else:
                    runs.append((rows, packed))
            choices[shape] = tuple(runs)
        plan = LinearPlan(form, choices, ((most_rows, True),))
        if best is None or total < best[0]:
            best = (total, plan)
    return best[1]


# A product to time: (prepare: weight -> what it multiplies, run: (rows [M, K], prepared) -> [M, N]).
Product = tuple[Callable[[torch.Tensor], object], Callable[[torch.Tensor, object], torch.Tensor]]


@torch.inference_mode()
def measure_linear_seconds(weights: list[torch.Tensor], products: dict[str, Product], rows=PLAN_ROWS,
                           repeats: int = 3) -> dict[str, dict[Shape, dict[int, float]]]:
    """[product][shape][rows]: median seconds of one pass over ``weights`` (each [N, K] of one dtype, in the model's
    order, so that they stream from memory as in a real pass) spent on the weights of each shape, for each product. Rows
    counts go up; a packed product ``GIVE_UP_RATIO`` times slower than the best over a whole pass is not timed at
    larger counts (the stock rules, which a plan falls back on, are timed at every count)."""
    prepared = {name: [prepare(w) for w in weights] for name, (prepare, _) in products.items()}
    inputs = {k: torch.randn(max(rows), k, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}}
    found: dict[str, dict[Shape, dict[int, float]]] = {name: {} for name in products}
    alive = list(products)
    for count in rows:
        timings = {name: {} for name in alive}
        for repeat in range(repeats + 1):  # the first round warms up and is dropped
            for name in alive:  # interleaved, so that the machine's drift hits every product alike
                run = products[name][1]
                spent: dict[Shape, float] = {}
                for weight, ready in zip(weights, prepared[name]):
                    started = time.perf_counter()
                    run(inputs[weight.shape[1]][:count], ready)
                    shape = tuple(weight.shape)
                    spent[shape] = spent.get(shape, 0.0) + time.perf_counter() - started
                if repeat:
                    for shape, value in spent.items():
                        timings[name].setdefault(shape, []).append(value)
        totals = {name: sum(statistics.median(v) for v in timings[name].values()) for name in alive}
        for name in alive:
            for shape, values in timings[name].items():
                found[name].setdefault(shape, {})[count] = statistics.median(values)
        fastest = min(totals.values())
        alive = [name for name in alive if name == STOCK or totals[name] <= GIVE_UP_RATIO * fastest]
    return found


def _plan_path(weights: list[torch.Tensor], forms: tuple[str, ...]):
    shapes = sorted({tuple(w.shape) for w in weights})
    counts = [sum(tuple(w.shape) == shape for w in weights) for shape in shapes]
    key = (f"{machine_key(torch.device('cpu'))}|{torch.__version__}|{shapes}|{counts}|{forms}|v{PLAN_VERSION}")
    return cache_dir() / "linear_plans" / f"{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def linear_plan(weights: list[torch.Tensor], products: dict[str, Product],
                fallback: LinearPlan | None, rows=PLAN_ROWS) -> LinearPlan | None:
    """The cached plan for ``weights`` (a model's linear weights of one dtype) on this machine, timed on first use
    (seconds) at ``rows`` over ``products`` (the forms this CPU runs for that dtype and ``STOCK``); ``fallback`` for
    a model too small to time (``MEASURE_MIN_BYTES``)."""
    forms = tuple(name for name in products if name in FORMS)
    if not forms or sum(w.numel() * w.element_size() for w in weights) < MEASURE_MIN_BYTES:
        return fallback
    path = _plan_path(weights, forms)
    if path.is_file():
        try:
            return LinearPlan.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, IndexError):
            pass  # a damaged or older file: measured again below
    dtype = str(weights[0].dtype).removeprefix("torch.")
    print(f"[headstart] timing the {dtype} linear products on this machine (once) ...", file=sys.stderr)
    plan = choose_plan(measure_linear_seconds(weights, products, rows))
    write_json_atomically(path, plan.to_json())
    return plan


# Row counts at which a greedy pass's LM head is timed both ways (runtime.target.kernels.int8_argmax: at most 16).
GREEDY_HEAD_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
# Candidates per row the int8 bound leaves on a real hidden state, about (scripts/bench_bf16_rows.py --argmax counts
# them): what the timing gathers and multiplies in bf16 after the int8 pass.
TYPICAL_CANDIDATES = 6


def choose_greedy_rows(seconds: dict[str, dict[int, float]], margin: float = 0.9) -> int:
    """The most rows up to which the int8 path (``seconds["int8"][rows]``) took less than ``margin`` times the bf16
    product's time (``seconds["bf16"][rows]``) at every count timed: 0 where it never did. The int8 path's integer
    products grow with the rows while the bf16 product stays bound on reading the weight, so past the first loss it
    does not win again; the margin covers what the timing leaves out (a real hidden state's candidates vary)."""
    best = 0
    for rows in sorted(seconds["bf16"]):
        if seconds["int8"].get(rows, float("inf")) >= margin * seconds["bf16"][rows]:
            break
        best = rows
    return best


@torch.inference_mode()
def measure_greedy_head_seconds(weight: torch.Tensor, int8, linear: Callable[..., torch.Tensor], packed: torch.Tensor,
                                rows=GREEDY_HEAD_ROWS, repeats: int = 5) -> dict[str, dict[int, float]]:
    """{"bf16" | "int8": {rows: median seconds}} of a greedy pass's LM head (``weight`` [N, K] bf16, ``int8`` its
    ``Int8Rows``, ``packed`` its block-packed copy for ``linear``): the full product's argmax against the int8
    candidates and the bf16 product over ``TYPICAL_CANDIDATES`` rows per input row. Before each timing a buffer twice
    the weight's size streams through the caches, as a pass's layers do before its LM head."""
    from runtime.target.kernels import _int8_module

    flush = torch.ones(2 * weight.numel(), dtype=weight.dtype)
    x = torch.randn(max(rows), weight.shape[1], dtype=weight.dtype)
    gather = _int8_module().gather_packed

    def with_int8(count: int) -> None:
        int8.candidates(x[:count], weight.shape[0])
        chosen = torch.arange(TYPICAL_CANDIDATES * count) * (weight.shape[0] // (TYPICAL_CANDIDATES * count + 1))
        linear(x[:count], gather(weight, chosen), chosen.numel(), None).argmax(-1)

    ways = {"bf16": lambda count: linear(x[:count], packed, weight.shape[0], None).argmax(-1), "int8": with_int8}
    found: dict[str, dict[int, float]] = {name: {} for name in ways}
    for count in rows:
        timings: dict[str, list[float]] = {name: [] for name in ways}
        for repeat in range(repeats + 1):  # the first round warms up and is dropped
            for name, way in ways.items():
                flush.sum()
                started = time.perf_counter()
                way(count)
                if repeat:
                    timings[name].append(time.perf_counter() - started)
        for name, values in timings.items():
            found[name][count] = statistics.median(values)
    return found


def greedy_head_rows(weight: torch.Tensor, int8, linear: Callable[..., torch.Tensor], packed: torch.Tensor,
                     fallback: int) -> int:
    """The most rows for which a greedy pass's LM head takes the int8 path on this machine (``choose_greedy_rows``),
    timed on first use (a second or so) and cached per machine and weight shape; ``fallback`` for a weight too small to
    time (``MEASURE_MIN_BYTES``)."""
    if weight.numel() * weight.element_size() < MEASURE_MIN_BYTES:
        return fallback
    key = f"{machine_key(torch.device('cpu'))}|{torch.__version__}|greedy head|{list(weight.shape)}|v{PLAN_VERSION}"
    path = cache_dir() / "linear_plans" / f"{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    if path.is_file():
        try:
            return int(json.loads(path.read_text())["int8_rows"])
        except (ValueError, KeyError, TypeError):
            pass  # a damaged file: measured again below
    print("[headstart] timing the greedy LM head's int8 path on this machine (once) ...", file=sys.stderr)
    seconds = measure_greedy_head_seconds(weight, int8, linear, packed)
    chosen = choose_greedy_rows(seconds)
    write_json_atomically(path, {"int8_rows": chosen, "seconds": seconds})
    return chosen
