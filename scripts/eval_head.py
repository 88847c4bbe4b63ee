"""Acceptance of any head directory (EAGLE, EAGLE-3, Medusa), by the trainer's own evaluation.

    python scripts/eval_head.py --head DIR --data FILE [--max-samples N] [--out result.json]
    python scripts/eval_head.py --head DIR --prompts [FILE] [--max-new-tokens 256] [--out result.json]

The head may be ours or one trained elsewhere, in any layout ``heads.formats.load_any_head`` reads (ours, the
EAGLE-1/3 reference layouts, vLLM's, Medusa's). The numbers are what a training run's evaluation reports: acc@1..K
of a greedy drafting chain (Medusa: of its heads) and its expected length tau
(``training.evaluate.samples_acceptance``), with ``decoding_tau``, the tokens per pass greedy decoding gets
drafting that chain where the previous pass left off (``training.metrics.decoding_tau``; tau averages over every
position and overstates it, since decoding skips the positions its accepted drafts covered), on one of:

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

from cli import non_negative_int, positive_int  # scripts/cli.py

# the tree sizes a Medusa report gives the trees' tau for
TREE_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# Options of one source of conversations, with their defaults (None: given only when set); a flag of the source not
# chosen is an error rather than silently ignored.
SOURCE_OPTIONS = {
    "--data": {"max_samples": None, "val_samples": 32, "data_seed": 0, "eval_samples": 16},
    "--prompts": {"limit": None, "stride": 1, "max_new_tokens": 256, "reply_batch": 16},
}


def head_conf_for(head):
    """The training config of ``head``'s type that scores it (the fields evaluation reads come from the head)."""
    from training.config import Eagle3HeadConf, EagleHeadConf, MedusaHeadConf

    if head.head_type == "eagle3":
        return Eagle3HeadConf(feature_layers=list(head.feature_layers), draft_vocab_size=head.draft_vocab_size)
    if head.head_type == "medusa":
        return MedusaHeadConf(num_heads=head.num_heads)
    return EagleHeadConf()


def prompt_replies(target, encoded: list[torch.Tensor], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """The target's greedy reply (token ids) to each encoded prompt, decoded in batches without speculation."""
    from tqdm import tqdm

    from runtime.batched import BatchedDecoder
    from runtime.proposers.base import NoProposer

    decoder = BatchedDecoder(target, NoProposer())
    replies: list[list[int]] = [[] for _ in encoded]
    for number, result in tqdm(decoder.results(encoded, max_new_tokens, batch_size=batch_size), total=len(encoded),
                               desc="target replies", unit="prompt"):
        replies[number] = list(result.tokens)
    return replies


def evaluate_head(head_dir: Path, target_name: str, eval_samples: int, eval_batch: int, depth: int,
                  data: Path | None = None, max_samples: int | None = None, val_samples: int = 32,
                  max_length: int | None = None, data_seed: int = 0, prompts: list[str] | None = None,
                  max_new_tokens: int = 256, reply_batch: int = 16, max_rank_paths: int = 255) -> dict:
    from heads.formats import load_any_head
    from runtime.benchmark import machine_description
    from runtime.prompts import encode_prompt
    from runtime.proposers import check_target_adapters
    from runtime.target import load_target
    from training.config import DataConf, EvalConf
    from training.evaluate import held_out_acceptance, reply_samples, samples_acceptance

    target = load_target(target_name, dtype="float32")  # as a training run evaluates
    head, saved = load_any_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer)
    check_target_adapters(str(head_dir), saved, target)  # a Medusa-2 head scores on its merged target only
    head = head.float().eval()
    head_conf = head_conf_for(head)
    report = {"head": str(head_dir), "head_type": head.head_type, "layout": saved.get("layout", saved.get("format")),
              "target": target.identity, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": machine_description(target.device)}
    if head.head_type == "eagle3":
        report.update(feature_layers=list(head.feature_layers), draft_vocab=head.draft_vocab_size)
    if prompts is not None:
        started = time.perf_counter()
        encoded = [encode_prompt(target.tokenizer, text) for text in prompts]
        replies = prompt_replies(target, encoded, max_new_tokens, reply_batch)
        report["reply_seconds"] = time.perf_counter() - started
        report["reply_tokens"] = sum(len(reply) for reply in replies)
        samples = reply_samples(encoded, replies, max_length)
        eval_conf = EvalConf(depth=depth, max_samples=len(samples), batch_size=eval_batch)
        result = samples_acceptance(target, head, head_conf, samples, eval_conf, max_rank_paths)
        report["scored_on"] = "the target's greedy replies to the prompts"
    else:
        data_conf = DataConf(source="json", path=str(data), max_samples=max_samples, val_samples=val_samples,
                             max_length=max_length or 512, seed=data_seed, cache=False)
        eval_conf = EvalConf(depth=depth, max_samples=eval_samples, batch_size=eval_batch)
        result = held_out_acceptance(target, head, head_conf, data_conf, eval_conf, max_rank_paths)
        report["scored_on"] = f"the held-out split of {data}"
    report.update(conversations=result["conversations"], positions=result["positions"], acc=result["acc"],
                  tau=result["tau"], decoding_tau=result["decoding_tau"])
    if "rank_paths" in result:
        frequencies = result["rank_path_frequencies"]
        sizes = [size for size in TREE_SIZES if size <= len(frequencies) + 1]
        measured = {size: result["rank_paths"][: size - 1] for size in sizes}
        report["tree"] = {"tau_by_size": {str(size): 1 + sum(frequencies[: size - 1]) for size in sizes},
                          "decoding_tau_by_size": decoding_taus(measured, result),
                          **head_tree_taus(head, saved.get("tree", {}), result, sizes),
                          "rank_paths": [list(path) for path in result["rank_paths"]],
                          "rank_path_frequencies": frequencies}
    return report


def decoding_taus(trees: dict[int, list[tuple[int, ...]]], result: dict) -> dict:
    """Tokens per pass greedy decoding gets drafting, at every pass, the tree of each size's choices in ``trees``, on
    the positions and replies of ``result`` (``samples_acceptance``'s): what a benchmark on that text would get."""
    from runtime.proposers.medusa import tree_accepted
    from training.metrics import decoding_tau

    lengths, reached = result["run_lengths"], result["reached"]
    return {str(size): decoding_tau(tree_accepted(choices, result["ranks"]), lengths, reached)
            for size, choices in trees.items()}


def head_tree_taus(head, tree: dict, result: dict, sizes: list[int]) -> dict:
    """Tau by size, on the scored text, of the trees the head's config makes the runtime draft: its measured rank
    paths where it has them (every size of ``TREE_SIZES`` they make), and the estimate from its acceptance (what a
    head without them drafts; at ``sizes``, those of the tree measured on the text); averaged over every position
    (``tau_by_size_*``) and as decoding gets it (``decoding_tau_by_size_*``)."""
    from runtime.proposers.medusa import MedusaProposer, tree_tau

    accuracy = tree.get("acceptance")
    proposers = {"estimated": (MedusaProposer(head, head_accuracy=accuracy[: head.num_heads] if accuracy else None),
                               sizes)}
    if tree.get("rank_paths"):
        paths = tree["rank_paths"]
        proposers["head"] = (MedusaProposer(head, rank_paths=paths), [n for n in TREE_SIZES if n <= len(paths) + 1])
    taus = {}
    for name, (proposer, tree_sizes) in proposers.items():
        trees = {size: proposer.tree_choices(size) for size in tree_sizes}
        taus[f"tau_by_size_{name}_tree"] = {str(size): tree_tau(choices, result["path_frequency"])
                                            for size, choices in trees.items()}
        taus[f"decoding_tau_by_size_{name}_tree"] = decoding_taus(trees, result)
    return taus


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
    from heads.formats import detect_layout

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
        from runtime.prompts import read_prompts

        try:
            chosen = read_prompts(None if args.prompts == "mtbench" else args.prompts)[:: args.stride][: args.limit]
            prompts = [p["prompt"] for p in chosen]
        except (OSError, ValueError) as error:
            parser.error(f"--prompts {args.prompts}: {error}")
    from runtime.target import DEFAULT_TARGET

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
