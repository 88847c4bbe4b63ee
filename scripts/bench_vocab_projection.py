"""Time the decode-sized LM-head product: F.linear against runtime.target.decode_layers.decode_linear, in one process.

    python scripts/bench_vocab_projection.py --vocab 49152 8192 --hidden 576 --rows 1 2 4 8 16 32

Reports the median of --repeats runs per row count and the ratio (above 1: decode_linear is faster). With
scripts/bench_verify_pass.py (whole passes, stock against decode linears) it decides
runtime.target.decode_layers.WEIGHT_MAJOR_MAX_ROWS on a new machine. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.timing import median_ms
from runtime.target.decode_layers import decode_linear


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 8192])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print("| vocab | rows | F.linear ms | decode_linear ms | ratio |\n|---:|---:|---:|---:|---:|")
    for vocab in args.vocab:
        weight = torch.randn(vocab, args.hidden)
        for rows in args.rows:
            hidden = torch.randn(rows, args.hidden)
            linear = median_ms(lambda: torch.nn.functional.linear(hidden, weight), args.repeats)
            ours = median_ms(lambda: decode_linear(hidden, weight), args.repeats)
            print(f"| {vocab} | {rows} | {linear:.2f} | {ours:.2f} | {linear / ours:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
