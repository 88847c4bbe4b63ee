"""EAGLE-3's draft vocabulary: the most frequent target tokens of the training data, and the maps between id spaces.

d2t [V'] (long): offsets, target_id = draft_id + d2t[draft_id] (the SGLang/vLLM convention).
t2d [V] (bool): True for target ids that are in the draft vocabulary.
Draft ids are ordered by target id, so every offset is >= 0.
"""

from __future__ import annotations

import torch


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_counts [V] -> (d2t [size], t2d [V]). Ties and unseen tokens go to the lowest ids (stable order)."""
    vocab = token_counts.shape[0]
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab} (the target's vocabulary), got {size}")
    # stable descending sort: equal counts keep ascending id order, so the choice is deterministic
    order = torch.sort(token_counts.to(torch.long), descending=True, stable=True).indices
    chosen = torch.sort(order[:size]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(size)
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[V'] offsets -> [V'] target ids."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def target_to_draft_ids(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V'] offsets -> [V] draft id of each target id, -1 where the target id is not in the draft vocabulary."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    index[draft_to_target_ids(d2t)] = torch.arange(d2t.shape[0], device=d2t.device)
    return index


def count_tokens(sequences, mask_sequences, vocab_size: int) -> torch.Tensor:
    """Counts [V] of the tokens where the mask is set (assistant tokens: what the head must predict)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(sequences, mask_sequences):
        ids = torch.as_tensor(ids, dtype=torch.long)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts
