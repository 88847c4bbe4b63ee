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


def decoding_walk(accepted: torch.Tensor, lengths: list[int], reached: list[int] | None = None) -> tuple[int, int]:
    """(tokens, verification passes) of greedy decoding over text on which a drafter gets accepted[n] drafts
    accepted at position n: accepted [N] long over consecutive runs of positions (one reply each, position n
    predicting reply token n), ``lengths`` their sizes in order (sum N).

    The prefill pass emits a reply's token 0 and is no verification pass (the runtime's tau leaves it out). The
    first pass drafts at position 0 and emits tokens 1 .. accepted[0] + 1; each next one drafts where the previous
    left off, n + accepted[n] + 1, so the positions its drafts covered are never drafted at. The walk ends once
    the reply's last token (its end of turn) is emitted: a reply of L tokens gives L - 1 tokens over its passes.
    ``reached``: how many of each run's positions decoding reaches (``training.masks.reply_ends``: a run may go on
    past the end of turn; default: all). tokens / passes is what a benchmark measures on that text
    (``decoding_tau``).
    """
    if accepted.dim() != 1 or sum(lengths) != accepted.shape[0]:
        raise ValueError(f"accepted must be [N] with N = sum(lengths) = {sum(lengths)}, got shape "
                         f"{tuple(accepted.shape)}")
    steps = (accepted + 1).tolist()
    tokens, passes, start = 0, 0, 0
    for length, walked in zip(lengths, lengths if reached is None else reached, strict=True):
        position = 0
        while position < walked - 1:
            position += steps[start + position]
            passes += 1
        tokens += max(walked - 1, 0)
        start += length
    return tokens, passes


def decoding_tau(accepted: torch.Tensor, lengths: list[int], reached: list[int] | None = None) -> float:
    """Tokens per verification pass greedy decoding gets (``decoding_walk``'s arguments; 1.0 where no pass is
    taken, as for plain decoding). tau (``acceptance_rates``) averages over every position instead; acceptance comes
    in stretches (what a head gets right at one position it tends to get right at the next), so the positions
    decoding skips are easier than those it drafts at, and tau overstates what decoding gets."""
    tokens, passes = decoding_walk(accepted, lengths, reached)
    return tokens / passes if passes else 1.0
