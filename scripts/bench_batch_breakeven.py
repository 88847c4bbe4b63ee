"""Where drafting stops paying at a batch size: the acceptance a draft node needs there, against what proposers get.

    python scripts/bench_batch_breakeven.py --batch-size 16 --methods ngram,eagle3 --tree-sizes 2,4

One target pass at N rows with one token per row and with two (after 256 cached tokens, median of a few) gives the
cost of one more node per row as a fraction of a plain decoding token
(``runtime.target.cost_model.break_even_acceptance``): a node must be accepted at least that often to pay for its
own verification, before its drafting costs anything.
Then each method decodes MT-bench first turns (every 5th) at N rows with each fixed tree size, and the run's pooled
acceptance by depth (``runtime.target.cost_model.pooled_depth_acceptance``: P(accepted >= k | a node at depth k was
drafted), and how many passes drafted at all) shows which depths clear it. Greedy; acceptance does not depend on
the machine's speed, the pass costs do: run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys


from bench.prompts import read_prompts
from bench.timing import environment_line, run_environment
from runtime.engine.batched import BatchedDecoder
from runtime.engine.prompts import encode_prompt
from runtime.proposers import build_proposer
from runtime.target.cost_model import break_even_acceptance, measure_pass_seconds, pooled_depth_acceptance
from runtime.target.model import load_target

from cli.args import check_head_directories, check_output_path, parse_proposer, positive_int, positive_int_list


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--methods", default="ngram,eagle3")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--tree-sizes", type=positive_int_list, default=[2, 4])
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--output", help="JSON results file")
    args = parser.parse_args(argv)
    check_output_path(args.output)  # before the work, not when writing its results
    specs = {name: parse_proposer(name.strip(), flag="--methods") for name in args.methods.split(",") if name.strip()}
    check_head_directories(specs.values())
    target = load_target(args.target, dtype=args.dtype, quiet=True)
    prompts = [encode_prompt(target.tokenizer, record["prompt"]) for record in read_prompts()[::5][:args.prompts]]
    environment = run_environment(target.device)
    rows = args.batch_size
    seconds = measure_pass_seconds(target, sizes=(1, 2), batch_size=rows)
    needed = break_even_acceptance(seconds)
    print(f"{environment_line(environment)}, {args.dtype}, "
          f"{rows} rows: a pass {seconds[1] * 1000:.1f} ms with one token per row, {seconds[2] * 1000:.1f} ms with "
          f"two; a draft node pays for its verification when accepted at least {needed:.2f} of the time")
    print("| method | tree size | passes drafting | P(accepted >= k), k = 1.. | depths that pay |\n"
          "|---|---:|---:|---|---|")
    found = []
    for name, spec in specs.items():
        proposer = build_proposer(spec, target)
        for size in args.tree_sizes:
            results = BatchedDecoder(target, proposer, tree_size=size).generate(prompts, args.max_new_tokens,
                                                                                batch_size=rows)
            drafting, acceptance = pooled_depth_acceptance(results)
            paying = [k + 1 for k, rate in enumerate(acceptance) if rate >= needed]
            found.append({"method": name, "tree_size": size, "drafting": drafting, "acceptance": acceptance,
                          "paying_depths": paying})
            print(f"| {name} | {size} | {drafting:.2f} | {', '.join(f'{rate:.2f}' for rate in acceptance)} | "
                  f"{', '.join(map(str, paying)) or 'none'} |")
    if args.output:
        results = {**environment, "dtype": args.dtype, "rows": rows,
                   "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                   "pass_seconds": {str(k): v for k, v in seconds.items()}, "break_even_acceptance": needed,
                   "methods": found}
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
