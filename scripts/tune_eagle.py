"""Grid over an EAGLE head's tree settings (depth, top-k, tree size) against plain decoding, in one process.

    python scripts/tune_eagle.py --head heads/shipped/smollm2-135m-eagle3 --grid 2,8,8 3,4,8 4,8,16

Prompts default to MT-bench first turns 21-24 (outside the benchmark's usual first prompts). Prints tokens/s, the
ratio to plain decoding and tau per setting; write the best depth and top-k into a shipped head with
``scripts/ship_head.py --depth D --top-k K``. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from runtime.decoder import SpeculativeDecoder  # noqa: E402
from runtime.prompts import encode_prompt, read_prompts  # noqa: E402
from runtime.proposers import NoProposer, build_proposer  # noqa: E402
from runtime.proposers.eagle import EagleProposer  # noqa: E402
from runtime.target import DEFAULT_TARGET, load_target  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--proposer", default="eagle3", choices=("eagle", "eagle3"))
    parser.add_argument("--head", help="head directory (default: the shipped head for the target)")
    parser.add_argument("--grid", nargs="+", default=["2,8,8", "3,4,8", "3,8,12", "4,4,8", "4,8,16", "6,8,16"],
                        help="DEPTH,TOP_K,TREE_TOKENS settings")
    parser.add_argument("--first", type=int, default=20, help="index of the first MT-bench prompt used")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    target = load_target(args.target)
    prompts = [encode_prompt(target.tokenizer, p["prompt"])
               for p in read_prompts(limit=args.first + args.count)[args.first:]]
    head = build_proposer(args.proposer, target, head=args.head).head
    decoders = {"none": SpeculativeDecoder(target, NoProposer())}
    for setting in args.grid:
        depth, top_k, tree_tokens = (int(x) for x in setting.split(","))
        decoders[setting] = SpeculativeDecoder(target, EagleProposer(head, target, depth=depth, top_k=top_k),
                                               tree_tokens=tree_tokens)
    for decoder in decoders.values():  # warm-up
        decoder.generate(prompts[0], 8)
    totals = {name: [0, 0.0, []] for name in decoders}
    for ids in prompts:
        for name, decoder in decoders.items():
            result = decoder.generate(ids, args.max_new_tokens)
            totals[name][0] += len(result.tokens)
            totals[name][1] += result.seconds
            totals[name][2] += result.accept_lengths
    base = totals["none"][0] / totals["none"][1]
    print("| depth,top-k,tree | tokens/s | vs plain | tau |\n|---|---:|---:|---:|")
    for name, (tokens, seconds, accepted) in totals.items():
        tau = statistics.mean(accepted) if accepted else 1.0
        print(f"| {name} | {tokens / seconds:.2f} | {tokens / seconds / base:.2f}x | {tau:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
