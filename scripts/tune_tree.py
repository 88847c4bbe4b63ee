"""Grid over a head proposer's tree settings against plain decoding, in one process.

    python scripts/tune_tree.py --head heads/shipped/smollm2-135m-eagle3 --grid 1,8,4 2,8,4 2,8,8
    python scripts/tune_tree.py --proposer medusa --grid 1 2 3 4 6

An EAGLE setting is DEPTH,TOP_K,TREE_TOKENS; a DFlash setting TOP_K,TREE_TOKENS (top-k 1: a chain); a Medusa setting
is TREE_TOKENS (the static tree of that many nodes calibrated from the head's measured accuracies). Prompts default to
MT-bench first turns 21-24 (outside the benchmark's usual first prompts). Prints tokens/s, the ratio to plain decoding
and tau per setting; write the best into a shipped head with ``scripts/ship_head.py --depth D --top-k K --tree-size T``.
Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench.prompts import read_prompts
from runtime.engine.decoder import SpeculativeDecoder
from runtime.engine.prompts import encode_prompt
from runtime.proposers import NoProposer, ProposerSpec
from runtime.proposers.dflash import DFlashProposer
from runtime.proposers.eagle import EagleProposer
from runtime.target.model import DEFAULT_TARGET, load_target

from cli.args import build_proposer_or_exit, non_negative_int, parse_grid_setting, positive_int, usage_error


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--proposer", default="eagle3", choices=("eagle", "eagle3", "medusa", "dflash"))
    parser.add_argument("--head", help="head directory (default: the shipped head for the target)")
    parser.add_argument("--grid", nargs="+", help="EAGLE: DEPTH,TOP_K,TREE_TOKENS settings (default 1,8,2 1,8,4 "
                        "2,8,4 2,8,8 3,8,8); DFlash: TOP_K,TREE_TOKENS (default 1,4 1,8 1,16 2,8 4,12); Medusa: "
                        "TREE_TOKENS settings (default 2 3 4 6 8)")
    parser.add_argument("--first", type=non_negative_int, default=20, help="index of the first MT-bench prompt used")
    parser.add_argument("--count", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the target's dtype; a tree size is only right for the dtype it was measured in")
    args = parser.parse_args(argv)
    medusa = args.proposer == "medusa"
    dflash = args.proposer == "dflash"
    default = (["2", "3", "4", "6", "8"] if medusa else ["1,4", "1,8", "1,16", "2,8", "4,12"] if dflash
               else ["1,8,2", "1,8,4", "2,8,4", "2,8,8", "3,8,8"])
    grid = args.grid or default
    fields = ("TREE_TOKENS",) if medusa else ("TOP_K", "TREE_TOKENS") if dflash else ("DEPTH", "TOP_K", "TREE_TOKENS")
    # checked before the target loads, so a typo costs no wait
    settings = {setting: parse_grid_setting(setting, fields) for setting in grid}
    spec = ProposerSpec(args.proposer, head=args.head)
    records = read_prompts(limit=args.first + args.count)[args.first:]
    if not records:
        raise usage_error("--first", f"{args.first} is past the last MT-bench prompt")

    target = load_target(args.target, dtype=args.dtype)
    prompts = [encode_prompt(target.tokenizer, p["prompt"]) for p in records]
    proposer = build_proposer_or_exit(spec, target)
    decoders = {"none": SpeculativeDecoder(target, NoProposer())}
    for setting, values in settings.items():
        if medusa:
            decoders[setting] = SpeculativeDecoder(target, proposer, tree_size=values[0])
        elif dflash:
            top_k, tree_size = values
            decoders[setting] = SpeculativeDecoder(target, DFlashProposer(proposer.head, target, top_k=top_k),
                                                   tree_size=tree_size)
        else:
            depth, top_k, tree_size = values
            decoders[setting] = SpeculativeDecoder(
                target, EagleProposer(proposer.head, target, depth=depth, top_k=top_k), tree_size=tree_size)
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
    setting_name = "tree" if medusa else "top-k,tree" if dflash else "depth,top-k,tree"
    print(f"| {setting_name} | tokens/s | vs plain | tau |\n|---|---:|---:|---:|")
    for name, (tokens, seconds, accepted) in totals.items():
        tau = statistics.mean(accepted) if accepted else 1.0
        print(f"| {name} | {tokens / seconds:.2f} | {tokens / seconds / base:.2f}x | {tau:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
