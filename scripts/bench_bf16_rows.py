"""Time one bf16 pass's worth of linear layers: PyTorch's product against the compiled row kernel, in one process.

    python scripts/bench_bf16_rows.py --rows 1 2 4 8

The layers have SmolLM2-135M's shapes (30 decoder layers of 7 linears, then the 49152 x 576 LM head), each with its
own random bf16 weights, so that the 270 MB stream from memory as in a real pass rather than from cache. Reports the
median milliseconds of --repeats passes per row count: PyTorch (``F.linear``), the AVX2 row kernel (runtime.kernels,
what ``runtime.decode_layers.decode_linear`` uses for 2-16 bf16 rows on CPUs without AVX512-BF16) and, on CPUs with
AVX512-BF16, the dot-product kernel (``bf16_dot_linear``, which it uses there up to DOT_KERNEL_MAX_ROWS rows).
Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import sys

import torch

from runtime.kernels import bf16_dot_linear, bf16_rows_matmul

from bench_vocab_projection import median_ms  # scripts/bench_vocab_projection.py

# q, k, v, o, gate, up, down of one decoder layer: [out, in]
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    kernel = bf16_rows_matmul()
    if kernel is None:
        raise SystemExit("the bf16 row kernel is not available on this machine (needs AVX2, a C++ compiler, ninja)")
    weights = [torch.randn(n, k).bfloat16() for _ in range(args.layers) for n, k in LAYER_SHAPES]
    weights.append(torch.randn(args.vocab, LAYER_SHAPES[0][1]).bfloat16())
    print(f"{torch.get_num_threads()} threads, {sum(w.numel() for w in weights) * 2 / 1e6:.0f} MB of bf16 weights")
    dot = bf16_dot_linear()
    columns = "| rows | F.linear ms | kernel ms | F.linear / kernel |" + (" AVX512-BF16 kernel ms | F.linear / it |"
                                                                        if dot is not None else "")
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
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
