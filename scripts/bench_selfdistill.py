"""How fast self-distillation generates its replies: HF generate on left-padded batches (how replies were generated
before) against the batched speculative runtime that training.selfdistill now uses, on the training prompts.

    python scripts/bench_selfdistill.py --conversations 64 --batch-size 16 --dtype bfloat16 \
        --methods hf-greedy,none,eagle3+ngram --output scripts/results/selfdistill_generation_bf16_cpu_v2.json

The prompts are the first user turns of the training conversations (ShareGPT by default; never MT-bench), through
the chat template as training.selfdistill builds them. Every method generates every prompt greedily, one method after
another per round of ``--batch-size * 2`` prompts (rotated, so drift of the machine hits all alike), after a warm-up.
Reported per method: total reply tokens/s, and for ours whether every reply equals plain decoding's (the runtime is
lossless, so it must). A method named with ``+record`` (``none+record``, ``eagle3+ngram+record``) also records the
target's features as ``prepare_data.py selfdistill --features`` does (the last hidden state and EAGLE-3's default
layers' inputs), which measures what recording costs. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from bench.hf import run_hf_batches
from bench.timing import run_environment
from heads.eagle3 import default_feature_layers
from runtime.engine.batched import BatchedDecoder
from runtime.engine.prompts import batch_pad_token_id
from runtime.proposers import build_proposer
from runtime.proposers.base import NoProposer
from runtime.target.assets import write_json_atomically
from runtime.target.model import load_target
from training.config import compose_config
from training.data import collect_conversations, resolve_template
from training.selfdistill import prompt_ids

from cli.args import check_output_path, parse_proposer, positive_int, usage_error

HF = "hf-greedy"
RECORD = "+record"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--methods", default="hf-greedy,none,eagle3+ngram",
                        help="hf-greedy (HF generate, left-padded batches), none (our plain decoding) and "
                             "proposers as in scripts/generate.py --proposer")
    parser.add_argument("--output", default="selfdistill_generation.json")
    parser.add_argument("overrides", nargs="*", help="training config overrides (key=value): target, data")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_output_path(args.output)
    names = [name.strip() for name in args.methods.split(",") if name.strip()]
    if "none" not in names:
        raise usage_error("--methods", "include none: our other methods' replies are checked against it")
    specs = {name: parse_proposer(name.removesuffix(RECORD), flag="--methods") for name in names
             if name.removesuffix(RECORD) not in (HF, "none")}
    conf = compose_config(args.overrides + [f"data.max_samples={args.conversations}"])
    target = load_target(conf.target.name, dtype=args.dtype)
    template = resolve_template(target.tokenizer, conf.data.chat_template)
    conversations = collect_conversations(conf.data)[: args.conversations]
    prompts = []
    for messages in conversations:
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first:
            prompts.append(prompt_ids(target.tokenizer, template, messages[:first], conf.data.max_length))
    layers = default_feature_layers(target.num_layers)

    def decoder(name):
        proposer = build_proposer(specs[name], target) if name in specs else NoProposer()
        return BatchedDecoder(target, proposer, record_layers=layers if name.endswith(RECORD) else None)

    decoders = {name: decoder(name) for name in names if name != HF}
    eos = sorted(target.eos_token_ids)
    pad = batch_pad_token_id(target.tokenizer)

    def run(name, rows):
        started = time.perf_counter()
        if name == HF:
            outputs = run_hf_batches(target.model, rows, args.max_new_tokens, eos, pad, args.batch_size)[0]
        else:
            outputs = [r.tokens for r in decoders[name].generate(rows, args.max_new_tokens,
                                                                  batch_size=args.batch_size)]
        return outputs, time.perf_counter() - started

    for name in names:  # warm-up (a batched decoder measures its cost curve on first use)
        run(name, prompts[: args.batch_size])
    tokens = {name: 0 for name in names}
    seconds = {name: 0.0 for name in names}
    same = {name: 0 for name in names}
    step = 2 * args.batch_size
    for number, start in enumerate(tqdm(range(0, len(prompts), step), desc="self-distillation generation",
                                        file=sys.stderr)):
        rows = prompts[start:start + step]
        outputs = {}
        for name in names[number % len(names):] + names[: number % len(names)]:
            outputs[name], took = run(name, rows)
            tokens[name] += sum(len(o) for o in outputs[name])
            seconds[name] += took
        for name in names:
            same[name] += sum(a == b for a, b in zip(outputs[name], outputs["none"]))
    summary = {name: {"tokens_per_s": tokens[name] / seconds[name], "tokens": tokens[name],
                      "seconds": seconds[name], "speedup_vs_hf": (tokens[name] / seconds[name])
                      / (tokens[HF] / seconds[HF]) if HF in names else None,
                      "identical_to_none": same[name] / len(prompts),
                      "tree_size": decoders[name].tree_size_report()["reason"] if name in decoders else None}
               for name in names}
    results = {"methods": summary, "config": {
        "target": conf.target.name, "dtype": args.dtype, "data": conf.data.source, "prompts": len(prompts),
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, **run_environment(target.device)}}
    write_json_atomically(Path(args.output), results)
    print("| method | tokens/s | vs HF generate | replies equal to plain decoding |\n|---|---:|---:|---:|")
    for name, row in summary.items():
        speedup = f"{row['speedup_vs_hf']:.2f}x" if row["speedup_vs_hf"] is not None else "-"
        print(f"| {name} | {row['tokens_per_s']:.1f} | {speedup} | {row['identical_to_none']:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
