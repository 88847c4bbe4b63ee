"""Speculative generation from the command line.

    python scripts/generate.py --proposer ngram --prompt "Write a haiku about rain." --max-new-tokens 64
    python scripts/generate.py --proposer eagle --head runs/eagle/head --prompts prompts.jsonl

Writes one JSON line per prompt to --output (and prints the text): {"id", "prompt", "output_ids", "text",
"accept_lengths", "target_forwards", "seconds"}.
The proposer spellings are parsed by scripts/cli.py into a runtime.proposers.ProposerSpec.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from runtime.decoder import SpeculativeDecoder
from runtime.prompts import encode_prompt, read_prompts
from runtime.target import DEFAULT_TARGET, load_target

from cli import PROPOSER_CHOICES, build_proposer_or_exit, parse_proposer  # scripts/cli.py


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="HF id, local dir, .gguf file or alias")
    parser.add_argument("--proposer", default="ngram", metavar="{" + ",".join(PROPOSER_CHOICES) + "}",
                        help="none, ngram, draft (--draft-model), or a head: medusa, eagle, eagle3 (--head, or "
                             "HEAD:DIR); HEAD+ngram drafts by prompt lookup where it finds a match, by the head "
                             "elsewhere")
    parser.add_argument("--draft-model", help="draft model for --proposer draft")
    parser.add_argument("--head", help="trained head directory for --proposer medusa/eagle/eagle3")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt (a user turn)")
    source.add_argument("--prompts", help="JSONL with a 'prompt' field or MT-bench 'turns'")
    parser.add_argument("--limit", type=int, help="use only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree-size", type=int, help="verification tree size (default: from the cost curve)")
    parser.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flex", "cascade"),
                        help="tree-attention backend (auto: flash-attn cascade on CUDA when installed, else SDPA)")
    parser.add_argument("--acceptance", default="exact", choices=("exact", "typical"),
                        help="exact (lossless, default) or typical (Medusa's typical acceptance: LOSSY, faster)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="JSONL output file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = parse_proposer(args.proposer, head=args.head, draft_model=args.draft_model)
    prompts = [{"id": 0, "prompt": args.prompt}] if args.prompt is not None else read_prompts(args.prompts,
                                                                                              args.limit)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    proposer = build_proposer_or_exit(spec, target)
    decoder = SpeculativeDecoder(target, proposer, tree_size=args.tree_size, attention=args.attention,
                                 acceptance=args.acceptance)
    if args.acceptance == "typical":
        print("[headstart] typical acceptance is lossy: output may differ from the target's own", file=sys.stderr)
    sink = open(args.output, "w") if args.output else None
    single = len(prompts) == 1
    try:
        for item in tqdm(prompts, desc="generate", disable=single, file=sys.stderr):
            ids = encode_prompt(target.tokenizer, item["prompt"])
            if single:  # stream the one answer to the terminal as it is accepted
                stream = lambda tokens: print(target.tokenizer.decode(tokens), end="", flush=True)  # noqa: E731
            else:
                stream = None
            result = decoder.generate(ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                                      seed=args.seed, stream=stream)
            text = target.tokenizer.decode(result.tokens, skip_special_tokens=True)
            record = {"id": item["id"], "prompt": item["prompt"], "output_ids": result.tokens, "text": text,
                      "accept_lengths": result.accept_lengths, "target_forwards": result.target_forwards,
                      "seconds": round(result.seconds, 4)}
            if sink:
                sink.write(json.dumps(record) + "\n")
            if single:
                print()
            print(f"[{args.proposer}] {len(result.tokens)} tokens in {result.seconds:.2f} s "
                  f"({len(result.tokens) / max(result.seconds, 1e-9):.1f} tok/s), tau {result.tau:.2f}, "
                  f"{result.target_forwards} target forwards", file=sys.stderr)
    finally:
        if sink:
            sink.close()
    if args.output:
        print(f"wrote {Path(args.output).resolve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
