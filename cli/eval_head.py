"""Acceptance of any head directory (EAGLE, EAGLE-3, Medusa), by the trainer's own evaluation.

    python scripts/eval_head.py --head DIR --data FILE [--max-samples N] [--out result.json]
    python scripts/eval_head.py --head DIR --prompts [FILE] [--max-new-tokens 256] [--out result.json]

The head may be ours or one trained elsewhere, in any layout ``heads.formats.load_any_head`` reads (ours, the
EAGLE-1/3 reference layouts, vLLM's, Medusa's); the report is ``training.head_report.evaluate_head``'s. The numbers
are what a training run's evaluation reports: acc@1..K of a greedy drafting chain (Medusa: of its heads) and its
expected length tau (``training.evaluate.samples_acceptance``), with ``decoding_tau``, the tokens per pass greedy
decoding gets drafting that chain where the previous pass left off (``training.metrics.decoding_tau``; tau averages
over every position and overstates it, since decoding skips the positions its accepted drafts covered), on one of:

- ``--data FILE``: the held-out conversations that ``training/train.py data=selfdistill data.path=FILE`` holds out
  for the same data settings (pass the run's ``--max-samples``, ``--val-samples``, ``--max-length`` and
  ``--data-seed``);
- ``--prompts [FILE]``: the target's own greedy replies to prompts (default: MT-bench's 80 first turns; a JSONL file
  of ``{"prompt": ...}`` or ``{"turns": [...]}``), generated here by the runtime's batched plain decoding and scored
  on the very tokens it generated (``training.evaluate.reply_samples``). This scores the head on a benchmark's
  distribution without any tree: the gap to the held-out figure is how far the benchmark is from the training data
  for this head; in fp32, where the benchmark's outputs are these replies, a Medusa tree's ``decoding_tau_by_size*``
  at the benchmark's tree size is the benchmark's tau.

For a Medusa head the report also holds the static tree measured on the same positions (``tree``: the most frequent
rank paths, ``runtime.proposers.medusa.measured_rank_paths``) and the tau each tree size gets there, over every
position and as decoding gets it (``decoding_tau_by_size``: what the benchmark measures on that text); a head ships
with it (``scripts/ship_head.py --rank-paths REPORT``). Measure it on text the benchmark does not use.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.prompts import read_prompts
from heads.formats import detect_layout
from runtime.target.model import DEFAULT_TARGET
from training.head_report import evaluate_head

from cli.args import non_negative_int, positive_int

# Options of one source of conversations, with their defaults (None: given only when set); a flag of the source not
# chosen is an error rather than silently ignored.
SOURCE_OPTIONS = {
    "--data": {"max_samples": None, "val_samples": 32, "data_seed": 0, "eval_samples": 16},
    "--prompts": {"limit": None, "stride": 1, "max_new_tokens": 256, "reply_batch": 16},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", type=Path, required=True, help="head directory (any layout we read)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="the training run's JSONL of conversations: score its held-out "
                                                  "split")
    source.add_argument("--prompts", nargs="?", const="mtbench", metavar="FILE",
                        help="score on the target's greedy replies to these prompts (default: MT-bench)")
    parser.add_argument("--target", default=None, help="target model (default: the project's default target; a "
                                                       "Medusa-2 head needs its merged target)")
    parser.add_argument("--max-samples", type=positive_int, help="--data: the run's data.max_samples")
    parser.add_argument("--val-samples", type=positive_int, help="--data: the run's data.val_samples (32)")
    parser.add_argument("--max-length", type=positive_int,
                        help="tokens of a conversation scored (--data: the run's data.max_length, 512; --prompts: "
                             "every prompt and reply whole unless given)")
    parser.add_argument("--data-seed", type=int, help="--data: the run's data.seed (0)")
    parser.add_argument("--eval-samples", type=positive_int, help="--data: held-out conversations scored (16)")
    parser.add_argument("--limit", type=positive_int, help="--prompts: score the first N prompts (after --stride)")
    parser.add_argument("--stride", type=positive_int, help="--prompts: every Nth prompt, as benchmark.py's --stride")
    parser.add_argument("--max-new-tokens", type=positive_int, help="--prompts: reply length (256)")
    parser.add_argument("--reply-batch", type=positive_int, help="--prompts: rows decoded at once (16)")
    parser.add_argument("--eval-batch", type=positive_int, default=4)
    parser.add_argument("--depth", type=positive_int, default=5, help="draft steps of an EAGLE chain (Medusa: its "
                                                                      "heads)")
    parser.add_argument("--max-rank-paths", type=non_negative_int, default=255,
                        help="Medusa: measure a static tree of at most this many paths (0: none)")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, help="also write the result JSON here")
    args = parser.parse_args(argv)
    try:  # before anything loads: a wrong directory is named at once
        detect_layout(args.head)
    except (OSError, ValueError) as error:
        parser.error(f"--head {args.head}: {error}")
    for source, chosen in (("--data", args.data is not None), ("--prompts", args.prompts is not None)):
        for name, default in SOURCE_OPTIONS[source].items():
            if getattr(args, name) is None:
                setattr(args, name, default)
            elif not chosen:
                flag = "--" + name.replace("_", "-")
                parser.error(f"{flag} applies to {source} only; drop it or score with {source}")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file; give the JSONL of conversations the run trained on")
    prompts = None
    if args.prompts is not None:
        try:
            chosen = read_prompts(None if args.prompts == "mtbench" else args.prompts)[:: args.stride][: args.limit]
            prompts = [p["prompt"] for p in chosen]
        except (OSError, ValueError) as error:
            parser.error(f"--prompts {args.prompts}: {error}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    report = evaluate_head(args.head, args.target or DEFAULT_TARGET, args.eval_samples, args.eval_batch,
                           args.depth, data=args.data, max_samples=args.max_samples, val_samples=args.val_samples,
                           max_length=args.max_length, data_seed=args.data_seed, prompts=prompts,
                           max_new_tokens=args.max_new_tokens, reply_batch=args.reply_batch,
                           max_rank_paths=args.max_rank_paths)
    report["seconds"] = time.perf_counter() - started
    if args.prompts is not None:
        report["prompts"] = args.prompts
    shown = dict(report)
    if "tree" in report:  # hundreds of paths: the file keeps them
        shown["tree"] = {**{key: value for key, value in report["tree"].items() if "tau_by_size" in key},
                         "rank_paths": f"{len(report['tree']['rank_paths'])} paths" + (" in --out" if args.out else "")}
    print(json.dumps(shown, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
