"""Greedy rows drafting together against drafting one by one, in the batched decoder, in one process.

    python scripts/bench_batch_drafting.py --batch-size 4 --prompts 8 --max-new-tokens 128 --methods eagle3+ngram

The same MT-bench first turns (every 10th) decode with ``BatchedDecoder(draft_together=True)`` (one proposer call for
all rows: an EAGLE head reads every row's new rows in one pass) and with ``draft_together=False`` (one call per row),
in interleaved rounds (the order flips each round, so drift of the machine hits both alike), after a warm-up.
Reports total tokens/s per mode and method, and whether both modes' outputs are the same (greedy: they must be).
Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from runtime.batched import BatchedDecoder
from runtime.benchmark import machine_description
from runtime.prompts import encode_prompt, read_prompts
from runtime.proposers import build_proposer
from runtime.target import load_target

from cli import check_head_directories, parse_proposer, positive_int  # scripts/cli.py


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--methods", default="eagle3+ngram,medusa+ngram")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--prompts", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    specs = {name: parse_proposer(name.strip(), flag="--methods") for name in args.methods.split(",") if name.strip()}
    check_head_directories(specs.values())
    target = load_target(args.target, dtype=args.dtype, quiet=True)
    prompts = [encode_prompt(target.tokenizer, record["prompt"]) for record in read_prompts()[::10][:args.prompts]]
    machine = machine_description(target.device)
    print(f"{machine['cpu']} ({', '.join(machine['cpu_flags'])}), {torch.get_num_threads()} threads, {args.dtype}, "
          f"{len(prompts)} prompts at {args.batch_size} rows, {args.max_new_tokens} new tokens")
    print("| method | together tok/s | alone tok/s | together / alone | same outputs |\n|---|---:|---:|---:|---|")
    for name, spec in specs.items():
        proposer = build_proposer(spec, target)
        decoders = {mode: BatchedDecoder(target, proposer, draft_together=mode) for mode in (True, False)}
        for decoder in decoders.values():  # warm-up, and the tree size for this batch size
            decoder.generate(prompts[:args.batch_size], 8, batch_size=args.batch_size)
        rates: dict[bool, list[float]] = {True: [], False: []}
        outputs = {}
        for round_index in range(args.rounds):
            for mode in (True, False) if round_index % 2 == 0 else (False, True):
                started = time.perf_counter()
                results = decoders[mode].generate(prompts, args.max_new_tokens, batch_size=args.batch_size)
                rates[mode].append(sum(len(r.tokens) for r in results) / (time.perf_counter() - started))
                outputs[mode] = [r.tokens for r in results]
        together, alone = statistics.mean(rates[True]), statistics.mean(rates[False])
        print(f"| {name} | {together:.1f} | {alone:.1f} | {together / alone:.2f} | "
              f"{'yes' if outputs[True] == outputs[False] else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
