"""Prepare training data once, ahead of training runs.

  features     dump the target's features (hidden states, EAGLE-3 layer inputs, optional top-k log-probs) for the
               training split to sharded safetensors, exactly where `features.mode=offline` runs look for them:
                 python scripts/prepare_data.py features head=eagle3 data.max_samples=2000 [features.topk=32]
  selfdistill  regenerate the assistant turns with the target itself (on the batched speculative runtime, greedy
               or sampled, resumable) into a JSONL that `data=selfdistill data.path=FILE` selects:
                 python scripts/prepare_data.py selfdistill --out sd.jsonl --max-new-tokens 256 \
                     --proposer eagle3+ngram --dtype bfloat16 data.max_samples=500
               with --features DIR, the target's hidden states from the passes that generated the replies are
               recorded too (the layers the configured head= reads), and training reads them without a target pass:
                 python training/train.py head=eagle3 features.mode=recorded features.dir=DIR
  prompts      write the first user turns of conversations SKIP .. SKIP+COUNT-1 as a prompts JSONL (for
               scripts/eval_head.py --prompts, on conversations no training run used):
                 python scripts/prepare_data.py prompts --out prompts.jsonl --skip 16000 --count 200

Trailing key=value arguments are the training config's overrides (target, data, head, features, ...). The work is
done by training.recipe.prepare_features and training.selfdistill.self_distill.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.args import non_negative_float, parse_proposer, positive_int, probability


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    features = sub.add_parser("features", help="dump target features for features.mode=offline")
    features.add_argument("overrides", nargs="*", help="training config overrides (key=value)")
    prompts = sub.add_parser("prompts", help="write conversations' first user turns as a prompts JSONL")
    prompts.add_argument("--out", type=Path, required=True, help="output JSONL ({\"id\", \"prompt\"} a line)")
    prompts.add_argument("--skip", type=int, default=0, help="conversations skipped first")
    prompts.add_argument("--count", type=positive_int, required=True, help="conversations read after them")
    prompts.add_argument("overrides", nargs="*", help="training config overrides (key=value): data")
    distill = sub.add_parser("selfdistill", help="regenerate assistant turns with the target")
    distill.add_argument("--out", type=Path, required=True, help="output JSONL (appended; resumable)")
    distill.add_argument("--max-new-tokens", type=positive_int, default=256)
    distill.add_argument("--batch-size", type=positive_int, default=16,
                         help="rows decoded at once (continuous batching)")
    distill.add_argument("--chunk", type=positive_int, default=64,
                         help="conversations written at a time: the most a kill loses; rows idle while a chunk's "
                              "last reply finishes, so a chunk several times --batch-size keeps them busy")
    distill.add_argument("--max-turns", type=positive_int, default=1, help="assistant turns regenerated per "
                                                                           "conversation")
    distill.add_argument("--proposer", default="none",
                         help="what drafts while generating (lossless either way): none, ngram, or a head as in "
                              "scripts/generate.py --proposer (eagle3+ngram: the shipped EAGLE-3 head behind "
                              "prompt lookup)")
    distill.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy replies")
    distill.add_argument("--top-p", type=probability)
    distill.add_argument("--seed", type=int, default=0)
    distill.add_argument("--dtype", choices=("float32", "bfloat16"),
                         help="the target's dtype while generating (default: the config's target.dtype)")
    distill.add_argument("--features", help="also record the target's features into this directory (a recorded "
                                            "store, resumable) for features.mode=recorded")
    distill.add_argument("overrides", nargs="*", help="training config overrides (key=value): target, data, head")
    args = parser.parse_args(argv)

    from training.config import compose_config

    if args.command == "features":
        from training.recipe import prepare_features

        result = prepare_features(compose_config(args.overrides + ["features.mode=offline"]))
        if result["is_main"]:
            print(f"offline features of {result['samples']} samples in {result['store']}")
    elif args.command == "prompts":
        import json

        from training.data import first_turn_prompts

        if args.skip < 0:
            parser.error(f"--skip must be >= 0, got {args.skip}")
        if args.out.exists():
            parser.error(f"--out {args.out} exists; choose another path (prompts are never written over a file)")
        prompts = first_turn_prompts(compose_config(args.overrides).data, args.skip, args.count)
        if not prompts:
            parser.error(f"no conversation from number {args.skip} on in the data: lower --skip")
        args.out.write_text("".join(json.dumps(prompt) + "\n" for prompt in prompts))
        print(f"{len(prompts)} prompts (conversations {prompts[0]['id']}..{prompts[-1]['id']}) written to {args.out}")
    else:
        from training.selfdistill import DistillSettings, self_distill

        settings = DistillSettings(max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                                   batch_size=args.batch_size, chunk=args.chunk, temperature=args.temperature,
                                   top_p=args.top_p, seed=args.seed, dtype=args.dtype, features_dir=args.features,
                                   proposer=None if args.proposer == "none" else parse_proposer(args.proposer))
        stats = self_distill(compose_config(args.overrides), args.out, settings)
        print(f"{stats.conversations} self-distilled conversations added to {args.out} ({stats.tokens} reply "
              f"tokens, {stats.tokens_per_s:.1f} tokens/s); train on them with data=selfdistill "
              f"data.path={args.out}" + (f", or on the recorded features with features.mode=recorded "
                                         f"features.dir={args.features}" if args.features else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
