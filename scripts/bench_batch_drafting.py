"""Two settings of the batched decoder against each other, in one process.

    python scripts/bench_batch_drafting.py --batch-size 4 --prompts 8 --max-new-tokens 128 --methods eagle3+ngram
    python scripts/bench_batch_drafting.py --compare per-row-sizes --batch-size 16 --prompts 48 --stride 1 \
        --methods ngram,eagle3+ngram

``--compare draft-together`` (the default): ``BatchedDecoder(draft_together=True)`` (one proposer call for all rows:
an EAGLE head reads every row's new rows in one pass) against ``draft_together=False`` (one call per row).
``--compare per-row-sizes``: tree sizes allocated per row and pass (``per_row_sizes=True``, at any batch size) against
one size per run (``per_row_sizes=False``).
The same MT-bench first turns (every ``--stride``th) decode in both settings in interleaved rounds (the order flips each
round, so drift of the machine hits both alike), after a warm-up. Reports total tokens/s per setting and method, tau,
and whether both settings' outputs are the same (greedy: they must be). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


from bench.prompts import read_prompts
from bench.timing import environment_line, run_environment
from runtime.engine.batched import BatchedDecoder
from runtime.engine.prompts import encode_prompt
from runtime.proposers import build_proposer
from runtime.target.model import load_target

from cli.args import check_head_directories, parse_proposer, positive_int


# --compare: two settings of BatchedDecoder, by label
SETTINGS = {"draft-together": {"together": {"draft_together": True}, "alone": {"draft_together": False}},
            "per-row-sizes": {"per row": {"per_row_sizes": True}, "per run": {"per_row_sizes": False}}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--methods", default="eagle3+ngram,medusa+ngram")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--prompts", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--compare", default="draft-together", choices=tuple(SETTINGS))
    parser.add_argument("--stride", type=positive_int, default=10, help="every STRIDE-th MT-bench first turn")
    args = parser.parse_args(argv)
    specs = {name: parse_proposer(name.strip(), flag="--methods") for name in args.methods.split(",") if name.strip()}
    check_head_directories(specs.values())
    target = load_target(args.target, dtype=args.dtype, quiet=True)
    prompts = [encode_prompt(target.tokenizer, record["prompt"])
               for record in read_prompts()[::args.stride][:args.prompts]]
    print(f"{environment_line(run_environment(target.device))}, {args.dtype}, "
          f"{len(prompts)} prompts at {args.batch_size} rows, {args.max_new_tokens} new tokens")
    (first, first_settings), (second, second_settings) = SETTINGS[args.compare].items()
    print(f"| method | {first} tok/s (tau) | {second} tok/s (tau) | {first} / {second} | same outputs |\n"
          "|---|---:|---:|---:|---|")
    for name, spec in specs.items():
        proposer = build_proposer(spec, target)
        decoders = {first: BatchedDecoder(target, proposer, **first_settings),
                    second: BatchedDecoder(target, proposer, **second_settings)}
        for decoder in decoders.values():  # warm-up, and the cost curve for this batch size
            decoder.generate(prompts[:args.batch_size], 8, batch_size=args.batch_size)
        rates: dict[str, list[float]] = {first: [], second: []}
        outputs, tau = {}, {}
        for round_index in range(args.rounds):
            for mode in (first, second) if round_index % 2 == 0 else (second, first):
                started = time.perf_counter()
                results = decoders[mode].generate(prompts, args.max_new_tokens, batch_size=args.batch_size)
                rates[mode].append(sum(len(r.tokens) for r in results) / (time.perf_counter() - started))
                outputs[mode] = [r.tokens for r in results]
                tau[mode] = decoders[mode].stats.tau
        one, other = statistics.mean(rates[first]), statistics.mean(rates[second])
        print(f"| {name} | {one:.1f} ({tau[first]:.2f}) | {other:.1f} ({tau[second]:.2f}) | {one / other:.2f} | "
              f"{'yes' if outputs[first] == outputs[second] else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
