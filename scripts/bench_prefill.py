"""Time the batched decoder's first prefill: the first --rows MT-bench first turns in one pass padded to the longest,
against the passes of similar length ``runtime.target.cost_model.prefill_groups`` splits them into (what
``runtime.engine.batched.BatchedDecoder`` does), in one process.

    python scripts/bench_prefill.py --rows 16 --stride 5

Prompts are every --stride-th MT-bench first turn through the target's chat template; the split uses this machine's
cost curve (``runtime.target.cost_model.pass_overhead_tokens``). Reports the prompts' lengths, the groups, and the
median milliseconds of --repeats prefills each way. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.prompts import read_prompts
from bench.timing import median_ms, run_environment
from runtime.engine.batched import prefill_inputs
from runtime.engine.prompts import encode_prompt
from runtime.target.cost_model import cost_curve, pass_overhead_tokens, prefill_groups
from runtime.target.model import DEFAULT_TARGET, load_target

from cli.args import check_output_path, positive_int


def prefill(target, prompts: list[torch.Tensor]) -> None:
    """One prefill pass over ``prompts`` into a fresh cache of as many rows, as the batched decoder makes it."""
    tokens, positions, mask = prefill_inputs(prompts)
    cache = target.new_cache(len(prompts), tokens.shape[1])
    target.forward(tokens, positions, cache, mask, logits_from=tokens.shape[1], prefix_len=0)


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--rows", type=positive_int, default=16)
    parser.add_argument("--stride", type=positive_int, default=5)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    check_output_path(args.output)  # before the work, not when writing its results
    target = load_target(args.target, dtype=args.dtype)
    records = read_prompts()[::args.stride][:args.rows]
    prompts = [encode_prompt(target.tokenizer, record["prompt"]).to(target.device) for record in records]
    lengths = [prompt.numel() for prompt in prompts]
    overhead = pass_overhead_tokens(cost_curve(target))
    groups = prefill_groups(lengths, overhead)
    padded = median_ms(lambda: prefill(target, prompts), args.repeats)
    grouped = median_ms(lambda: [prefill(target, [prompts[i] for i in group]) for group in groups], args.repeats)
    result = {**run_environment(target.device), "dtype": args.dtype, "lengths": lengths, "overhead_tokens": overhead,
              "groups": [[lengths[i] for i in g] for g in groups],
              "padded_tokens": len(prompts) * max(lengths), "real_tokens": sum(lengths),
              "padded_ms": padded, "grouped_ms": grouped}
    print(f"{len(prompts)} prompts, {sum(lengths)} tokens ({len(prompts) * max(lengths)} padded to the longest); "
          f"a pass's fixed cost: {overhead:.0f} tokens' worth; groups by length: {result['groups']}")
    print(f"| prefill | ms |\n|---|---:|\n| one padded pass | {padded:.1f} |\n| {len(groups)} passes of similar "
          f"length | {grouped:.1f} ({padded / grouped:.2f}x faster) |")
    if args.output:
        with open(args.output, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
