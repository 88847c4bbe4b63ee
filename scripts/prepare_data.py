"""Prepare training data once, ahead of training runs.

  features     dump the target's features (hidden states, EAGLE-3 layer inputs, optional top-k log-probs) for the
               training split to sharded safetensors, exactly where `features.mode=offline` runs look for them:
                 python scripts/prepare_data.py features head=eagle3 data.max_samples=2000 [features.topk=32]
  selfdistill  regenerate the assistant turns with the target itself (greedy, batched, resumable) into a JSONL
               that `data=selfdistill data.path=FILE` selects:
                 python scripts/prepare_data.py selfdistill --out sd.jsonl --max-new-tokens 256 data.max_samples=500

Trailing key=value arguments are the training config's overrides (target, data, head, features, ...). The work is
done by training.recipe.prepare_features and training.selfdistill.self_distill.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    features = sub.add_parser("features", help="dump target features for features.mode=offline")
    features.add_argument("overrides", nargs="*", help="training config overrides (key=value)")
    distill = sub.add_parser("selfdistill", help="regenerate assistant turns with the target")
    distill.add_argument("--out", type=Path, required=True, help="output JSONL (appended; resumable)")
    distill.add_argument("--max-new-tokens", type=int, default=256)
    distill.add_argument("--batch-size", type=int, default=8)
    distill.add_argument("--max-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    distill.add_argument("overrides", nargs="*", help="training config overrides (key=value): target, data")
    args = parser.parse_args(argv)

    from training.config import compose_config

    if args.command == "features":
        from training.recipe import prepare_features

        result = prepare_features(compose_config(args.overrides + ["features.mode=offline"]))
        if result["is_main"]:
            print(f"offline features of {result['samples']} samples in {result['store']}")
    else:
        from training.selfdistill import self_distill

        out = self_distill(compose_config(args.overrides), args.out, args.max_new_tokens, args.batch_size,
                           args.max_turns)
        print(f"self-distilled conversations in {out}; train on them with data=selfdistill data.path={out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
