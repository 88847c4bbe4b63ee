"""Acceptance metrics of a drafting chain (pure torch)."""

from __future__ import annotations

import torch


def acceptance_counts(matches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """matches [N, K] bool (draft top-1 == target greedy at step k, each row a start position).

    Returns (reached [K+1] counts: rows whose first k steps were all accepted, for k = 0..K; accepted [N] number of
    accepted draft tokens per row). Counts add up across batches and ranks; see ``acceptance_rates``.
    """
    accepted_prefix = matches.long().cumprod(dim=1)  # [N, K]: 1 while every step so far matched
    reached = torch.cat((torch.tensor([matches.shape[0]], device=matches.device), accepted_prefix.sum(0)))
    return reached, accepted_prefix.sum(1)


def acceptance_rates(reached: torch.Tensor) -> tuple[list[float], float]:
    """reached [K+1] -> (acc@1..K, expected accepted length tau).

    acc@k = P(step k accepted | steps 1..k-1 accepted) (the chain's per-position acceptance);
    tau = 1 + E[accepted draft tokens] (each verification also emits the target's bonus token).
    """
    reached = reached.double()
    total = reached[0].clamp_min(1)
    conditional = [float(reached[k] / reached[k - 1]) if reached[k - 1] > 0 else 0.0
                   for k in range(1, reached.shape[0])]
    tau = 1.0 + float(reached[1:].sum() / total)
    return conditional, tau


def decoding_passes(accepted: torch.Tensor, lengths: list[int]) -> int:
    """Verification passes greedy decoding takes over text on which a drafter gets accepted[n] drafts accepted at
    position n: accepted [N] long over consecutive runs of positions (one reply each), ``lengths`` their sizes in
    order (sum N).

    Decoding drafts at a run's first position, emits accepted[n] + 1 tokens there and drafts next at n +
    accepted[n] + 1: the positions its drafts covered are never drafted at. Tokens per pass, sum(lengths) / passes,
    is what a benchmark measures on that text (``decoding_tau``).
    """
    if accepted.dim() != 1 or sum(lengths) != accepted.shape[0]:
        raise ValueError(f"accepted must be [N] with N = sum(lengths) = {sum(lengths)}, got shape "
                         f"{tuple(accepted.shape)}")
    steps = (accepted + 1).tolist()
    passes, start = 0, 0
    for length in lengths:
        position = 0
        while position < length:
            position += steps[start + position]
            passes += 1
        start += length
    return passes


def decoding_tau(accepted: torch.Tensor, lengths: list[int]) -> float:
    """Tokens per pass greedy decoding gets (``decoding_passes``'s arguments). tau (``acceptance_rates``) averages
    over every position instead; acceptance comes in stretches (what a head gets right at one position it tends to
    get right at the next), so the positions decoding skips are easier than those it drafts at, and tau overstates
    what decoding gets."""
    return sum(lengths) / max(decoding_passes(accepted, lengths), 1)
