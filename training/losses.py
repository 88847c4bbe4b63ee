"""Loss functions of the draft heads (pure torch). Rows are flattened valid positions: [N, ...]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cross_entropy(logits: torch.Tensor, target_logprobs: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log q(v) per row. logits [N, V] (draft), target_logprobs [N, V] (log p) -> [N]."""
    return -(target_logprobs.exp() * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def sparse_soft_cross_entropy(logits: torch.Tensor, target_logprobs: torch.Tensor,
                              target_ids: torch.Tensor) -> torch.Tensor:
    """Soft CE against a top-k target: logits [N, V]; target_logprobs, target_ids [N, k] -> [N].

    The k probabilities are renormalised (the mass outside the top-k is dropped); entries with log p = -inf
    (ids outside the draft vocabulary) contribute nothing, and a row of only such entries is 0 with a zero
    gradient (its softmax is NaN: zeroing the product afterwards would leave NaN in the backward pass).
    """
    finite = torch.isfinite(target_logprobs)
    weights = torch.where(finite, torch.softmax(target_logprobs.float(), dim=-1), 0.0)
    log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, target_ids.clamp_min(0))
    return -(weights * log_q).sum(-1)


def hard_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """-log q(target) per row: logits [N, V] (draft), target_ids [N] (the target's greedy token; -1, outside the
    draft vocabulary, contributes nothing) -> [N]."""
    log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, target_ids.clamp_min(0)[:, None])[:, 0]
    return -log_q.masked_fill(target_ids < 0, 0.0)


def feature_regression_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's SmoothL1 between predicted and true next features, averaged over H. [N, H], [N, H] -> [N]."""
    return F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)


def decay_weights(count: int, decay: float) -> list[float]:
    """Per-step (EAGLE-3 training-time test) or per-head (Medusa) loss weights: decay**k for k = 0..count-1."""
    return [decay ** k for k in range(count)]


def uniform_noise(shape: torch.Size, std: float, seed: int, device, dtype) -> torch.Tensor:
    """EAGLE's feature noise: uniform on [-std/2, std/2], from a seeded generator (reproducible per micro-batch)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return ((torch.rand(shape, generator=generator) - 0.5) * std).to(device=device, dtype=dtype)
