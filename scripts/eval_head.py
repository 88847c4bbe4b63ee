"""Held-out acceptance of any EAGLE-3 head directory, by the trainer's own evaluation.

    python scripts/eval_head.py --head DIR --data FILE [--max-samples N] [--out result.json]

The head may be ours or one trained elsewhere, in any layout ``heads.formats.load_any_head`` reads (ours, the
EAGLE-3 reference layout, vLLM's). The held-out conversations are the validation split that ``training/train.py
data=selfdistill data.path=FILE`` holds out for the same data settings (pass the run's ``--max-samples``,
``--val-samples``, ``--max-length`` and ``--data-seed``); the numbers are what that run's evaluation reports:
acc@1..K of a greedy drafting chain and its expected length tau (``training.evaluate.held_out_acceptance``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cli import positive_int  # scripts/cli.py


def evaluate_head(head_dir: Path, data: Path, max_samples: int | None, val_samples: int, max_length: int,
                  data_seed: int, eval_samples: int, eval_batch: int, depth: int) -> dict:
    from heads.formats import load_any_head
    from runtime.target import DEFAULT_TARGET, load_target
    from training.config import DataConf, Eagle3HeadConf, EvalConf
    from training.evaluate import held_out_acceptance

    data_conf = DataConf(source="json", path=str(data), max_samples=max_samples, val_samples=val_samples,
                         max_length=max_length, seed=data_seed, cache=False)
    target = load_target(DEFAULT_TARGET, dtype="float32")
    head, saved = load_any_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer)
    if head.head_type != "eagle3":
        raise SystemExit(f"--head {head_dir} holds a {head.head_type} head; this script evaluates EAGLE-3 heads")
    head_conf = Eagle3HeadConf(feature_layers=list(head.feature_layers), draft_vocab_size=head.draft_vocab_size)
    eval_conf = EvalConf(depth=depth, max_samples=eval_samples, batch_size=eval_batch)
    result = held_out_acceptance(target, head.float().eval(), head_conf, data_conf, eval_conf)
    return {"head": str(head_dir), "layout": saved.get("layout", saved.get("format")),
            "feature_layers": list(head.feature_layers), "draft_vocab": head.draft_vocab_size,
            "held_out_conversations": result["conversations"], "positions": result["positions"],
            "acc": result["acc"], "tau": result["tau"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", type=Path, required=True, help="EAGLE-3 head directory (any layout we read)")
    parser.add_argument("--data", type=Path, required=True, help="the training run's JSONL of conversations")
    parser.add_argument("--max-samples", type=positive_int, help="the run's data.max_samples")
    parser.add_argument("--val-samples", type=positive_int, default=32, help="the run's data.val_samples")
    parser.add_argument("--max-length", type=positive_int, default=512, help="the run's data.max_length")
    parser.add_argument("--data-seed", type=int, default=0, help="the run's data.seed")
    parser.add_argument("--eval-samples", type=positive_int, default=16, help="held-out conversations evaluated")
    parser.add_argument("--eval-batch", type=positive_int, default=4)
    parser.add_argument("--depth", type=positive_int, default=5, help="draft steps of the chain")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, help="also write the result JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    report = evaluate_head(args.head, args.data, args.max_samples, args.val_samples, args.max_length,
                                 args.data_seed, args.eval_samples, args.eval_batch, args.depth)
    report["seconds"] = time.perf_counter() - started
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
