"""Time one bf16 pass's worth of linear layers: PyTorch's product against the compiled row kernel, in one process.

    python scripts/bench_bf16_rows.py --rows 1 2 4 8

The layers have SmolLM2-135M's shapes (30 decoder layers of 7 linears, then the 49152 x 576 LM head), each with its own
random bf16 weights, so that the 270 MB stream from memory as in a real pass rather than from cache. Reports the median
milliseconds of --repeats passes per row count: PyTorch (``F.linear``), the AVX2 row kernel (runtime.target.kernels,
what ``runtime.target.decode_layers.decode_linear`` uses for 2-16 bf16 rows on CPUs without AVX512-BF16) and, on CPUs
with AVX512-BF16, the dot-product kernels: over the weights as they are (``bf16_dot_linear``) and over a packed copy
(``bf16_packed_linear``), on CPUs with AMX the tile kernel over the same packed copy (``bf16_amx_linear``), the AVX2
kernel over that copy (``bf16_packed_linear_avx2``, the lean pass's products on CPUs without AVX512-BF16), and where
oneDNN takes bf16, oneDNN over a copy reordered once (``onednn_bf16_linear``; AMX tiles where the CPU has them). The
runtime picks among the packed products per weight shape and row count by timing them on the machine at hand
(runtime.target.linear_plan). Run it with nothing else on the machine.

    git show HEAD~1:runtime/target/kernels/bf16_dot_rows.cpp > earlier_dot_rows.cpp
    python scripts/bench_bf16_rows.py --rows 1 8 16 --dot-baseline earlier_dot_rows.cpp

    python scripts/bench_bf16_rows.py --rows 1 2 4 8 16 --argmax

--argmax times a greedy pass's LM head on the default target's own LM head and final hidden states (a chat prompt's):
the packed bf16 product and ``greedy_tokens`` against ``int8_argmax`` (an int8 copy and the rows it cannot rule out,
on CPUs with AVX512-VNNI), each after the decoder layers' products have streamed through the caches as in a pass, and
how many rows the int8 bound leaves.

--pages times the packed kernel over its copies on ordinary 4 KB pages against the same copies on 2 MB pages
(runtime.target.host_memory, where the runtime keeps them), alternating pass by pass.

--dot-baseline, --packed-baseline (--rows-baseline) build another version of an AVX512-BF16 kernel's (the AVX2 row
kernel's) source and times it beside the current one, alternating pass by pass in one process (the only fair
comparison on a machine whose speed drifts), after checking whether both give the same outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

from bench.timing import median_ms, median_of_ms
from runtime.target.kernels import (DOT_KERNEL_FLAGS, ROW_KERNEL_FLAGS, bf16_amx_linear, bf16_dot_linear,
                                    bf16_packed_linear, bf16_packed_linear_avx2, bf16_rows_linear, bf16_rows_matmul,
                                    build_source, onednn_bf16_linear, pack_bf16_weight, pack_onednn_weight)

# q, k, v, o, gate, up, down of one decoder layer: [out, in]
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--dot-baseline", metavar="SOURCE",
                        help="another version of runtime/target/kernels/bf16_dot_rows.cpp to time beside the "
                             "current one")
    parser.add_argument("--packed-baseline", metavar="SOURCE",
                        help="another version of runtime/target/kernels/bf16_packed_rows.cpp to time beside the "
                             "current one")
    parser.add_argument("--rows-baseline", metavar="SOURCE",
                        help="another version of runtime/target/kernels/bf16_rows.cpp to time beside the current one")
    parser.add_argument("--pages", action="store_true",
                        help="time the packed kernel over copies on ordinary pages against copies on huge pages "
                             "(runtime.target.host_memory), alternating pass by pass")
    parser.add_argument("--argmax", action="store_true",
                        help="time the greedy LM head: the bf16 product's argmax against the int8 candidates'")
    args = parser.parse_args(argv)
    kernel = bf16_rows_matmul()
    if kernel is None:
        raise SystemExit("the bf16 row kernel is not available on this machine (needs AVX2, a C++ compiler, ninja)")
    weights = [torch.randn(n, k).bfloat16() for _ in range(args.layers) for n, k in LAYER_SHAPES]
    weights.append(torch.randn(args.vocab, LAYER_SHAPES[0][1]).bfloat16())
    print(f"{torch.get_num_threads()} threads, {sum(w.numel() for w in weights) * 2 / 1e6:.0f} MB of bf16 weights")
    dot, packed = bf16_dot_linear(), bf16_packed_linear()
    amx, avx2 = bf16_amx_linear(), bf16_packed_linear_avx2()  # over the same packed copy
    packed_weights = [pack_bf16_weight(w) for w in weights] if (packed, amx, avx2) != (None, None, None) else []
    columns = "| rows | F.linear ms | kernel ms | F.linear / kernel |" + (" AVX512-BF16 kernel ms | F.linear / it |"
                                                                        if dot is not None else "")
    columns += " packed kernel ms | F.linear / it |" if packed is not None else ""
    columns += " AMX kernel ms | F.linear / it |" if amx is not None else ""
    columns += " AVX2 packed kernel ms | F.linear / it |" if avx2 is not None else ""
    onednn = onednn_bf16_linear()
    onednn_weights = [pack_onednn_weight(w) for w in weights] if onednn is not None else []
    columns += " oneDNN reordered ms | F.linear / it |" if onednn is not None else ""
    print(columns + "\n" + "|---:" * (columns.count("|") - 1) + "|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in LAYER_SHAPES}}
        widened = {k: x.float() for k, x in inputs.items()}
        stock = median_ms(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights], args.repeats)
        ours = median_ms(lambda: [kernel(widened[w.shape[1]], w) for w in weights], args.repeats)
        line = f"| {rows} | {stock:.1f} | {ours:.1f} | {stock / ours:.2f} |"
        if dot is not None:
            dotted = median_ms(lambda: [dot(inputs[w.shape[1]], w, None) for w in weights], args.repeats)
            line += f" {dotted:.1f} | {stock / dotted:.2f} |"
        if packed is not None:
            packed_ms = median_ms(lambda: [packed(inputs[w.shape[1]], p, w.shape[0], None)
                                           for w, p in zip(weights, packed_weights)], args.repeats)
            line += f" {packed_ms:.1f} | {stock / packed_ms:.2f} |"
        if amx is not None:
            amx_ms = median_ms(lambda: [amx(inputs[w.shape[1]], p, w.shape[0], None)
                                        for w, p in zip(weights, packed_weights)], args.repeats)
            line += f" {amx_ms:.1f} | {stock / amx_ms:.2f} |"
        if avx2 is not None:
            avx2_ms = median_ms(lambda: [avx2(inputs[w.shape[1]], p, w.shape[0], None)
                                         for w, p in zip(weights, packed_weights)], args.repeats)
            line += f" {avx2_ms:.1f} | {stock / avx2_ms:.2f} |"
        if onednn is not None:
            onednn_ms = median_ms(lambda: [onednn(inputs[w.shape[1]], p, None)
                                           for w, p in zip(weights, onednn_weights)], args.repeats)
            line += f" {onednn_ms:.1f} | {stock / onednn_ms:.2f} |"
        print(line)
    if args.pages:  # the packed product the lean pass takes here
        if (packed or avx2) is None:
            raise SystemExit("--pages needs a packed kernel, which this machine does not run")
        compare_pages(packed or avx2, weights, packed_weights, args.rows, args.repeats)
    if args.argmax:
        compare_argmax(packed, packed_weights[:-1], args.rows, args.repeats)  # every layer's weights, not the head
    if args.dot_baseline:
        if dot is None:
            raise SystemExit("--dot-baseline needs the AVX512-BF16 kernel, which this machine does not run")
        compare_kernels(dot, args.dot_baseline, "bf16_dot_linear", DOT_KERNEL_FLAGS, weights, args.rows,
                        args.repeats)
    if args.packed_baseline:
        if packed is None:
            raise SystemExit("--packed-baseline needs the AVX512-BF16 kernels, which this machine does not run")
        compare_kernels(packed, args.packed_baseline, "bf16_packed_linear", DOT_KERNEL_FLAGS, weights, args.rows,
                        args.repeats, packed=True)
    if args.rows_baseline:
        compare_kernels(bf16_rows_linear(), args.rows_baseline, "bf16_rows_linear", ROW_KERNEL_FLAGS, weights,
                        args.rows, args.repeats)
    return 0


def compare_pages(product, weights: list[torch.Tensor], packed_weights: list[torch.Tensor], row_counts: list[int],
                  repeats: int) -> None:
    """Time ``product`` over ``packed_weights`` (PyTorch's allocator: ordinary pages) against the same copies in a
    ``HugePageArena``, alternating whole passes so that the machine's drift hits both alike."""
    from runtime.target.host_memory import HugePageArena, transparent_huge_pages

    arena = HugePageArena()
    huge = [arena.copy(w) for w in packed_weights]
    print(f"\npacked kernel by page size (transparent huge pages: {transparent_huge_pages()}; huge pages requested: "
          f"{arena.enabled})\n| rows | ordinary pages ms | huge pages ms | ordinary / huge |\n|---:|---:|---:|---:|")
    for rows in row_counts:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {"ordinary": [], "huge": []}
        for repeat in range(repeats + 1):  # the first round warms up and is dropped
            order = (("ordinary", packed_weights), ("huge", huge))
            for label, copies in order if repeat % 2 else order[::-1]:
                started = time.perf_counter()
                for w, p in zip(weights, copies):
                    product(inputs[w.shape[1]], p, w.shape[0], None)
                if repeat:
                    times[label].append(time.perf_counter() - started)
        ordinary, on_huge = (median_of_ms(times[label]) for label in ("ordinary", "huge"))
        print(f"| {rows} | {ordinary:.1f} | {on_huge:.1f} | {ordinary / on_huge:.2f} |")


def compare_argmax(product, layers: list[torch.Tensor], row_counts: list[int], repeats: int) -> None:
    """Time the default target's greedy LM head both ways after each pass's layer products (``layers``, packed)."""
    from runtime.engine.sampling import greedy_tokens
    from runtime.target.kernels import INT8_ARGMAX_MAX_ROWS, Int8Rows, int8_argmax, int8_candidates
    from runtime.target.model import load_target

    if product is None or int8_candidates() is None:
        raise SystemExit("--argmax needs the AVX512-BF16 packed kernel and AVX512-VNNI, which this machine lacks")
    target = load_target(dtype="bfloat16")
    head = target.model.get_output_embeddings().weight
    packed_head, int8 = pack_bf16_weight(head), Int8Rows(head)
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "Explain how tides work, then write "
                                                    "a short poem about the sea."}], add_generation_prompt=True)
    ids = torch.tensor([prompt if isinstance(prompt, list) else prompt["input_ids"]])
    cache = target.new_cache(1, ids.shape[1])
    hidden = target.forward(ids, torch.arange(ids.shape[1])[None], cache, None).hidden[0]
    inputs = {k: torch.randn(1, k).bfloat16() for k in {k for _, k in LAYER_SHAPES}}
    ways = {"bf16 product + greedy_tokens": lambda x: greedy_tokens(product(x, packed_head, head.shape[0], None)),
            "int8_argmax": lambda x: int8_argmax(x, head, int8, product, packed_head, max_rows=16)}
    print(f"\ngreedy LM head ({head.shape[0]} x {head.shape[1]}; the runtime takes the int8 path up to "
          f"{INT8_ARGMAX_MAX_ROWS} rows)\n| rows | bf16 ms | int8 ms | bf16 / int8 | rows the bound leaves "
          f"(median, most) |\n|---:|---:|---:|---:|---:|")
    for rows in row_counts:
        if rows > 16:  # the most the int8 kernel takes
            continue
        windows = [hidden[i:i + rows].contiguous() for i in range(0, hidden.shape[0] - rows + 1, rows)]
        left = sorted(int8.candidates(x, head.shape[0]).numel() for x in windows)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for repeat in range(repeats + 1):  # the first round warms up and is dropped
            for name, way in ways.items():
                x = windows[repeat % len(windows)]
                assert torch.equal(ways["int8_argmax"](x), ways["bf16 product + greedy_tokens"](x))
                for w in layers:  # the pass's other weights, through the caches (packed: [N / 32, K / 2, 32, 2])
                    product(inputs[2 * w.shape[1]], w, 32 * w.shape[0], None)
                started = time.perf_counter()
                way(x)
                if repeat:
                    times[name].append(time.perf_counter() - started)
        full, ours = (median_of_ms(values) for values in times.values())
        print(f"| {rows} | {full:.2f} | {ours:.2f} | {full / ours:.2f} | {left[len(left) // 2]}, {left[-1]} |")


def compare_kernels(current, source: str, function: str, flags: tuple[str, ...], weights: list[torch.Tensor],
                    row_counts: list[int], repeats: int, packed: bool = False) -> None:
    """Time ``function`` (bf16 rows, weight, bias -> bf16 rows; with ``packed``: bf16 rows, packed weight, N, bias)
    built from ``source`` against ``current`` over ``weights``, alternating pass by pass, after checking whether both
    give the same outputs."""
    text = Path(source).read_bytes()
    name = f"headstart_baseline_{function}_{hashlib.sha1(text).hexdigest()[:10]}"
    built = getattr(build_source(Path(source).resolve(), name, flags), function)
    if packed:  # both take the weight as it is, packed once here
        copies = {id(w): pack_bf16_weight(w) for w in weights}
        current_packed = current

        def baseline(x, w, bias):
            return built(x, copies[id(w)], w.shape[0], bias)

        def current(x, w, bias):
            return current_packed(x, copies[id(w)], w.shape[0], bias)
    else:
        baseline = built
    print(f"\n{function}\n| rows | {source} ms | current ms | baseline / current |\n|---:|---:|---:|---:|")
    for rows in row_counts:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}
        for w in (weights[0], weights[-1]):
            if not torch.equal(current(inputs[w.shape[1]], w, None), baseline(inputs[w.shape[1]], w, None)):
                print(f"note: at {rows} rows the two kernels' outputs differ (another summation order?)")
        times: dict[str, list[float]] = {"baseline": [], "current": []}
        for repeat in range(repeats + 1):  # the first round warms up and is dropped
            order = (("baseline", baseline), ("current", current))
            for label, kernel in order if repeat % 2 else order[::-1]:
                started = time.perf_counter()
                for w in weights:
                    kernel(inputs[w.shape[1]], w, None)
                if repeat:
                    times[label].append(time.perf_counter() - started)
        before, after = (median_of_ms(times[label]) for label in ("baseline", "current"))
        print(f"| {rows} | {before:.1f} | {after:.1f} | {before / after:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
