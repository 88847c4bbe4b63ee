"""Acceptance evaluation on the held-out split: acc@1..K of a greedy drafting chain and its expected length.

For every position t of a held-out conversation the target's own greedy continuation g_1..g_D from the prefix
x_0..x_t is computed once, all positions at a time: pass j feeds g_j of every position, each attending to its
prefix and its own branch (the chain mask); the branches do not depend on the head, so they are computed once per
run (Medusa-2 changes the target: then once per evaluation).
Each head type's objective scores its drafts against them (``HeadObjective.matches``, training/objectives/): draft
step k of EAGLE at row t starts from the context x_0..x_{t+1} (features up to t): its top-1 must equal the target's
g_k from prefix t+1; a step counts only while every earlier step was accepted. Medusa head i at hidden t must equal
g_{i+1} from prefix t (g_1 is the target's bonus token). Rows count where the context ends inside an assistant reply.
"""

from __future__ import annotations

import contextlib

import torch

from training.data import build_splits, collate, pad_token_id
from training.features import target_features
from training.masks import chain_attention_mask, next_token_mask, reply_ends, run_lengths
from training.metrics import acceptance_counts, acceptance_rates, decoding_walk
from training.objectives import build_objective, objective_class


@torch.no_grad()
def greedy_branches(target, input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """input_ids [B, T] -> [B, T, depth]: out[b, t, j] = target's greedy token j+1 steps after prefix x_0..x_t."""
    batch_size, length = input_ids.shape
    cache = target.new_cache(batch_size, length * depth)
    positions = torch.arange(length, device=input_ids.device)[None].expand(batch_size, -1)
    output = target.forward(input_ids, positions, cache, None)
    cache.commit(length)
    branches = [output.logits.argmax(-1)]
    for step in range(1, depth):
        mask = chain_attention_mask(length, step, input_ids.device).expand(batch_size, -1, -1, -1)
        output = target.forward(branches[-1], positions + step, cache, mask)
        cache.commit(length)
        branches.append(output.logits.argmax(-1))
    return torch.stack(branches, dim=-1)


def eval_depth(head_conf, eval_conf) -> int:
    """Draft steps an evaluation checks: ``eval.depth``, unless the head type fixes them (Medusa: its heads)."""
    return objective_class(head_conf.head_type).eval_depth(head_conf, eval_conf)


@torch.no_grad()
def prepare_batch(target, batch: dict, head_conf, eval_conf, feature_layers: list[int],
                  teacher_context=contextlib.nullcontext) -> dict:
    """Target features and greedy branches of one held-out batch (kept on the target's device).

    ``teacher_context`` wraps the feature pass (Medusa-2: the base target with its adapters disabled is the teacher,
    while the branches come from the target being trained)."""
    ids = batch["input_ids"].to(target.device)
    prepared = {"input_ids": ids, "assistant_mask": batch["assistant_mask"].to(target.device)}
    with teacher_context():
        prepared.update(target_features(target, ids, feature_layers))
    extra = objective_class(head_conf.head_type).extra_branch_steps  # Medusa's: its first head drafts after the bonus
    prepared["branches"] = greedy_branches(target, ids, eval_depth(head_conf, eval_conf) + extra)
    # the replies as the decoding walk takes them: each one's positions, in the order the matches list them, and
    # how many of them decoding reaches before the end of turn stops it
    predict = next_token_mask(prepared["assistant_mask"])
    prepared["run_lengths"] = torch.tensor(run_lengths(predict), dtype=torch.long)
    prepared["reached"] = torch.tensor(reply_ends(ids, predict, target.eos_token_ids), dtype=torch.long)
    return prepared


@torch.no_grad()
def evaluate_acceptance(objective, prepared_batches: list[dict], depth: int, rank: int, world: int,
                        all_reduce=lambda tensor: tensor) -> dict:
    """Acceptance over this rank's share of the held-out batches, summed over ranks. ``objective`` is the
    engine's module (``training.objectives``): each batch is one call of its forward in evaluation mode.
    {"reached": counts for ``acceptance_rates``, "val_loss", "decoding_tau": the chain's tokens per pass as greedy
    decoding gets it (``training.metrics.decoding_walk``; 1.0 where no pass is taken)}.

    Every rank makes the same number of calls (ZeRO-3 gathers parameters inside them): ranks with fewer batches
    repeat one and do not count it.
    """
    was_training = objective.training
    objective.eval()
    per_rank = max(1, -(-len(prepared_batches) // world))
    device = prepared_batches[0]["input_ids"].device
    reached = torch.zeros(depth + 1, dtype=torch.float64, device=device)
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, batches)
    walk = torch.zeros(2, dtype=torch.float64, device=device)  # decoding's (tokens, passes)
    for slot in range(per_rank):
        index = rank + slot * world
        counted = index < len(prepared_batches)
        batch = prepared_batches[index if counted else 0]
        loss, matches = objective(batch, depth=depth)
        if counted:
            counts, accepted = acceptance_counts(matches)
            reached += counts.double()
            loss_sum += torch.tensor([float(loss), 1.0], dtype=torch.float64, device=device)
            walk += torch.tensor(decoding_walk(accepted, batch["run_lengths"].tolist(), batch["reached"].tolist()),
                                 dtype=torch.float64, device=device)
    totals = all_reduce(torch.cat((reached, loss_sum, walk)))
    objective.train(was_training)
    return {"reached": totals[: depth + 1].cpu(), "val_loss": float(totals[-4] / totals[-3].clamp_min(1)),
            "decoding_tau": float(totals[-2] / totals[-1]) if totals[-1] > 0 else 1.0}


def evaluation_batches(split, eval_conf) -> list[list[dict]]:
    """The held-out samples an evaluation scores: the first ``eval_conf.max_samples`` of ``split``, in batches of
    ``eval_conf.batch_size``."""
    rows = range(min(eval_conf.max_samples, len(split)))
    return [[split[i] for i in rows[start:start + eval_conf.batch_size]]
            for start in range(0, len(rows), eval_conf.batch_size)]


def held_out_acceptance(target, head, head_conf, data_conf, eval_conf, max_rank_paths: int = 0) -> dict:
    """``head``'s acceptance on the conversations a training run with ``data_conf`` holds out, scored as that run's
    evaluations score it (``eval_conf``): {"acc": acc@1..K, "tau", "val_loss", "positions", "conversations"}.

    ``head``: a head of ``head_conf``'s type on ``target`` (ours or one trained elsewhere, as
    ``heads.formats.load_any_head`` reads it), in the dtype to evaluate in; one process, no training engine.
    ``max_rank_paths``: as ``samples_acceptance``'s."""
    if not data_conf.val_samples or eval_conf.max_samples < 1:
        raise ValueError(f"no held-out conversation to evaluate: data.val_samples={data_conf.val_samples}, "
                         f"eval.max_samples={eval_conf.max_samples}; give both at least 1")
    return samples_acceptance(target, head, head_conf, build_splits(data_conf, target.tokenizer)["validation"],
                              eval_conf, max_rank_paths)


def samples_acceptance(target, head, head_conf, samples, eval_conf, max_rank_paths: int = 0) -> dict:
    """``head``'s acceptance on tokenized conversations ``samples`` (items {"input_ids", "assistant_mask"}; the
    first ``eval_conf.max_samples`` count), scored as a training run's evaluation scores its held-out split; the
    result as ``held_out_acceptance``'s. With ``max_rank_paths`` > 0, a head type that drafts a static tree (Medusa)
    adds the tree measured on the same positions, that many paths at most (``HeadObjective.evaluation_report``):
    "rank_paths" and "rank_path_frequencies", "path_frequency" of every path seen, and "ranks" [N, heads] with
    "run_lengths" and "reached".

    "decoding_tau" is the chain's tokens per pass as greedy decoding gets it, drafting only where the previous pass
    left off (``training.metrics.decoding_tau``); "tau" averages over every position and overstates it."""
    pad_id = pad_token_id(target.tokenizer)
    batches = evaluation_batches(samples, eval_conf)
    prepared = [prepare_batch(target, collate(rows, pad_id), head_conf, eval_conf, head.feature_layers)
                for rows in batches]
    objective = build_objective(head, head_conf, target.lm_head.weight, target.softcap, pad_id=pad_id)
    result = evaluate_acceptance(objective, prepared, eval_depth(head_conf, eval_conf), 0, 1)
    acc, tau = acceptance_rates(result["reached"])
    report = {"acc": acc, "tau": tau, "decoding_tau": result["decoding_tau"], "val_loss": result["val_loss"],
              "positions": int(result["reached"][0]),
              "conversations": sum(len(rows) for rows in batches)}
    if max_rank_paths:
        report.update(objective.evaluation_report(prepared, max_rank_paths))
    return report


def reply_samples(prompts: list[list[int]], replies: list[list[int]], max_length: int | None = None) -> list[dict]:
    """Samples {"input_ids", "assistant_mask"} of the target's replies exactly as it generated them: each prompt's
    token ids (as the decoder was given them) followed by its reply's, only the reply scored (with its end of turn
    where the target generated one; a reply cut by the length limit has none). A sample over ``max_length`` (None:
    no limit) keeps its start. These are the positions decoding drafted at, token for token, so ``decoding_tau`` on
    them is the tau a benchmark decoding those prompts measures."""
    if len(prompts) != len(replies):
        raise ValueError(f"{len(prompts)} prompts but {len(replies)} replies: one reply for every prompt")
    samples = []
    for prompt, reply in zip(prompts, replies):
        prompt, reply = torch.as_tensor(prompt).reshape(-1).tolist(), torch.as_tensor(reply).reshape(-1).tolist()
        samples.append({"input_ids": (prompt + reply)[:max_length],
                        "assistant_mask": ([False] * len(prompt) + [True] * len(reply))[:max_length]})
    return samples
