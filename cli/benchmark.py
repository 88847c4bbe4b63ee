"""Side-by-side decoding benchmark: HF generate baselines and our proposers on the same prompts, in one process.

    python scripts/benchmark.py --limit 10 --max-new-tokens 256 --output results.json

Default prompts: the 80 MT-bench first turns. Methods run interleaved per prompt (machine drift hits all alike),
batch 1, after a warm-up. Per method: tokens/s, tau (tokens emitted per target forward after the prefill, bonus
included, for HF and ours alike), speedup over HF greedy, and the fraction of outputs token-identical to HF
greedy. Run it with nothing else on the machine.

    python scripts/benchmark.py --batch-size 4,16 --limit 32 --methods hf-greedy,none,ngram --output batch.json

--batch-size N[,M...] measures throughput instead (greedy), at every size given and at batch 1, in one run: total
tokens/s of HF generate on left-padded batches of N prompts, and of our batched decoder (continuous batching) at N
rows, with every row's output compared with HF greedy decoding that prompt alone (HF greedy is the only HF method
that batches). --pass-costs adds the measured seconds of one target pass per batch size and tree size.
The machinery is bench/ (bench.harness runs the methods); this script parses the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.divergence import describe_divergences, rescore
from bench.harness import encoded_prompts, run_batch_benchmark, run_benchmark
from bench.methods import batch_methods, check_batch_methods, default_methods, method_from_json
from bench.llamacpp import LlamaCppMethod
from bench.peers import PeerMethod
from bench.report import batch_markdown_table, markdown_table
from runtime.proposers import NoShippedHead
from runtime.target.model import DEFAULT_TARGET

from cli.args import (load_target_or_exit, check_context, check_early_exit, check_head_directories, check_output_path,
                      cuda_graphs, device, missing_head, non_negative_float, parse_method, parse_methods, positive_int,
                      positive_int_list, read_prompts_or_exit, usage_error)

DEFAULT_METHODS = "hf-greedy,hf-pld,none,ngram"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--methods", help=f"comma-separated (default: {DEFAULT_METHODS}, the heads "
                                          "shipped for the target, and draft,hf-assisted when --draft-model is "
                                          "given); heads as medusa:DIR, eagle:DIR, eagle3:DIR, dflash:DIR "
                                          "(alone: the shipped head); HEAD+ngram: prompt lookup where it finds a "
                                          "match, "
                                          "the head elsewhere; lookahead, lookahead+ngram (lookahead decoding, "
                                          "prompt lookup first, lookahead where it finds nothing), either as "
                                          "lookahead:W,N,G[,R[,C[,P]]] for its window, n-gram size, candidates, "
                                          "recycled nodes, C=0 to keep recycled successors per generation and "
                                          "P=0 to draft without the target's successor prior; "
                                          "METHOD@N fixes that method's tree size to N nodes; "
                                          "hf-greedy-bf16 and hf-pld-bf16 run HF on a bfloat16 copy of the target; "
                                          "hf-early-exit[:N]: HF assisted generation drafting with the target's first "
                                          "N layers (default: a quarter of them); llama.cpp: llamacpp, "
                                          "llamacpp-ngram[:TYPE], llamacpp-eagle3[:DIR][@N], "
                                          "llamacpp-dflash[:DIR][@N], llamacpp-gguf[:FILE]")
    parser.add_argument("--draft-model")
    parser.add_argument("--prompts", help="JSONL prompts (default: MT-bench first turns)")
    parser.add_argument("--limit", type=positive_int, help="use only the first N prompts (after --stride)")
    parser.add_argument("--stride", type=positive_int, default=1,
                        help="every Nth prompt (4: 20 MT-bench first turns from every category)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--tree-size", type=positive_int, help="fix the tree size (default: from the cost curve)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="verify at fixed shapes, each captured once as a CUDA graph and replayed (--device cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="results.json")
    parser.add_argument("--rescore", metavar="RESULTS",
                        help="only recompute the divergence report of a finished results file")
    parser.add_argument("--plot", help="PNG of per-method accept-length histograms (default: beside --output)")
    parser.add_argument("--batch-size", type=positive_int_list, metavar="N[,M...]",
                        help="measure total tokens/s at N rows (HF greedy on left-padded batches, our batched "
                             "decoder), for each size given and batch 1, greedy (default: the batch-1 benchmark)")
    parser.add_argument("--batch-chunk", type=positive_int,
                        help="with --batch-size: prompts per interleaved round (rounded up to a multiple of the "
                             "largest batch size; default: the largest batch size)")
    parser.add_argument("--pass-costs", action="store_true",
                        help="with --batch-size: also measure one target pass's seconds per batch and tree size")
    return parser.parse_args(argv)


def check_batch_arguments(args, methods) -> None:
    """What the batch benchmark cannot do, as command-line errors before anything loads."""
    if args.batch_size is None:
        for flag, value in (("--batch-chunk", args.batch_chunk), ("--pass-costs", args.pass_costs or None)):
            if value is not None:
                raise usage_error(flag, "is for the batch benchmark; give --batch-size N as well")
        return
    if args.temperature != 0:
        raise usage_error("--temperature", "the batch benchmark is greedy (its baseline is HF greedy); leave "
                                           "--temperature out with --batch-size")
    if args.plot is not None:
        raise usage_error("--plot", "the accept-length histograms are the batch-1 benchmark's; leave --plot out "
                                    "with --batch-size")
    try:
        check_batch_methods(methods)
    except ValueError as error:
        raise usage_error("--methods", str(error)) from None


def run_batch(args, methods, prompts) -> int:
    target = load_target_or_exit(args.target, dtype=args.dtype, device=args.device,
                                 fixed_shapes=cuda_graphs(args))
    check_early_exit(methods, target.num_layers)
    check_prompts_fit(target, prompts, args.max_new_tokens)
    output = Path(args.output)
    try:
        results = run_batch_benchmark(target, args.target, methods, prompts, output, batch_sizes=args.batch_size,
                                      max_new_tokens=args.max_new_tokens, tree_size=args.tree_size,
                                      chunk_size=args.batch_chunk, prompts_source=args.prompts, stride=args.stride,
                                      pass_costs=args.pass_costs)
    except NoShippedHead as error:
        raise missing_head(error, "--methods", f"{error.head_type}:DIR") from None
    print(batch_markdown_table(results["methods"]))
    sizes = ", ".join(map(str, results["config"]["batch_sizes"]))
    print(f"\n{len(prompts)} prompts, batch sizes {sizes}, {args.max_new_tokens} new tokens, greedy, "
          f"{args.dtype}; results in {output}", file=sys.stderr)
    return 0


def rescore_file(path: Path, device: str) -> int:
    try:
        results = json.loads(path.read_text())
        results["config"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise usage_error("--rescore", f"{path} is not a results file of this benchmark ({error})") from None
    if results["config"].get("mode") == "batch":
        raise usage_error("--rescore", f"{path} holds a batch benchmark (--batch-size), which has no divergence "
                                       "report to recompute")
    specs = results["config"].get("method_specs")
    # A file written before the methods were recorded: its method names are the --methods spellings. Rescoring
    # needs only the dtype each ran in, not the draft model of draft or hf-assisted, which the file does not keep.
    methods = ({name: method_from_json(data) for name, data in specs.items()} if specs is not None else
               {name: parse_method(name, draft_model="(not recorded)", flag="--rescore")
                for name in results["methods"]})
    for line in describe_divergences(rescore(path, methods, device)):
        print(line, file=sys.stderr)
    return 0


def check_prompts_fit(target, prompts: list[dict], max_new_tokens: int) -> None:
    """Every prompt fits the context with ``max_new_tokens``, checked before the first method runs."""
    try:
        encoded_prompts(target, prompts, max_new_tokens)
    except ValueError as error:
        raise usage_error("--prompts", str(error)) from None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rescore:
        return rescore_file(Path(args.rescore), args.device)
    methods = (parse_methods(args.methods, draft_model=args.draft_model) if args.methods else
               default_methods(args.target, args.draft_model))
    if args.batch_size is not None and not args.methods:
        methods = batch_methods(methods)  # the HF baselines that batch
    check_batch_arguments(args, methods)
    check_head_directories(methods.values())
    if args.temperature > 0 and any(isinstance(method, (PeerMethod, LlamaCppMethod)) for method in methods.values()):
        raise usage_error("--methods", "the peer decoders (economize-*, flashspec-ngram, llamacpp*) run greedy only "
                                       "here: use --temperature 0 with them")
    prompts = read_prompts_or_exit(args.prompts)[:: args.stride][: args.limit]
    check_output_path(args.output)
    check_output_path(args.plot, "--plot")
    check_context(args.target, args.max_new_tokens)
    if args.batch_size is not None:
        return run_batch(args, methods, prompts)
    target = load_target_or_exit(args.target, dtype=args.dtype, device=args.device,
                                 fixed_shapes=cuda_graphs(args))
    check_early_exit(methods, target.num_layers)
    check_prompts_fit(target, prompts, args.max_new_tokens)
    output = Path(args.output)
    try:
        results = run_benchmark(target, args.target, methods, prompts, output, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, seed=args.seed, tree_size=args.tree_size,
                                prompts_source=args.prompts, stride=args.stride, plot=args.plot)
    except NoShippedHead as error:
        raise missing_head(error, "--methods", f"{error.head_type}:DIR") from None
    for line in describe_divergences(results["divergences"]):
        print(line, file=sys.stderr)
    print(markdown_table(results["methods"]))
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"{args.dtype}; results in {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
