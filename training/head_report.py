"""The acceptance report of any head directory (EAGLE, EAGLE-3, Medusa), by the trainer's own evaluation: what
scripts/eval_head.py prints and writes.

    report = evaluate_head(head_dir, target_name, eval_samples, eval_batch, depth, data=FILE)     # held-out split
    report = evaluate_head(head_dir, target_name, eval_samples, eval_batch, depth, prompts=[...])  # target replies

The numbers are what a training run's evaluation reports (``training.evaluate.samples_acceptance``): acc@1..K of a
greedy drafting chain (Medusa: of its heads), its expected length tau, and ``decoding_tau``, the tokens per pass
greedy decoding gets drafting that chain where the previous pass left off. For a head type that drafts a static tree
(Medusa) the report also holds the tree measured on the same positions and the tau each tree size gets there
(``tree``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from heads.formats import load_any_head
from runtime.engine.batched import BatchedDecoder
from runtime.engine.prompts import encode_prompt
from runtime.proposers import check_target_adapters
from runtime.proposers.base import NoProposer
from runtime.proposers.medusa import MedusaProposer, tree_accepted, tree_tau
from runtime.target.machine import machine_description
from runtime.target.model import load_target
from training.config import DataConf, EvalConf
from training.evaluate import held_out_acceptance, reply_samples, samples_acceptance
from training.metrics import decoding_tau
from training.objectives import objective_class

# the tree sizes a Medusa report gives the trees' tau for
TREE_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def prompt_replies(target, encoded: list[torch.Tensor], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """The target's greedy reply (token ids) to each encoded prompt, decoded in batches without speculation."""
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
    """The report of the head in ``head_dir`` (any layout ``heads.formats.load_any_head`` reads) on ``target_name``
    in fp32, as a training run evaluates: on the target's greedy replies to ``prompts`` (each up to
    ``max_new_tokens``, ``reply_batch`` rows at a time; the first ``max_length`` tokens of each prompt and reply,
    all when None) when given, else on the held-out split of the JSONL ``data`` that a run with these data settings
    (``max_samples``, ``val_samples``, ``max_length`` (None: 512), ``data_seed``) holds out, its first
    ``eval_samples`` conversations. ``depth``: draft steps of an EAGLE chain (Medusa: its heads); ``eval_batch``:
    conversations per evaluation batch; ``max_rank_paths``: the most paths of a measured static tree (0: none)."""
    target = load_target(target_name, dtype="float32")  # as a training run evaluates
    head, saved = load_any_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer)
    check_target_adapters(str(head_dir), saved, target)  # a Medusa-2 head scores on its merged target only
    head = head.float().eval()
    objective_type = objective_class(head.head_type)
    head_conf = objective_type.head_conf_for(head)
    report = {"head": str(head_dir), "head_type": head.head_type, "layout": saved.get("layout", saved.get("format")),
              "target": target.identity, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": machine_description(target.device)}
    report.update(objective_type.head_description(head))
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
    lengths, reached = result["run_lengths"], result["reached"]
    return {str(size): decoding_tau(tree_accepted(choices, result["ranks"]), lengths, reached)
            for size, choices in trees.items()}


def head_tree_taus(head, tree: dict, result: dict, sizes: list[int]) -> dict:
    """Tau by size, on the scored text, of the trees the head's config makes the runtime draft: its measured rank
    paths where it has them (every size of ``TREE_SIZES`` they make), and the estimate from its acceptance (what a
    head without them drafts; at ``sizes``, those of the tree measured on the text); averaged over every position
    (``tau_by_size_*``) and as decoding gets it (``decoding_tau_by_size_*``)."""
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
