"""Attention masks and shifts for drafting chains (EAGLE-3 training-time test, acceptance evaluation).

A chain of ``steps`` extra draft steps over a sequence of T rows keeps its keys as (steps + 1) blocks of T columns:
block 0 holds the keys of the real context (step 0), block j the keys written at draft step j. Row t at step k sees
block 0 up to column t (the context up to t) and, in blocks 1..k, only column t (its own earlier draft steps).
"""

from __future__ import annotations

import torch


def chain_attention_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """Mask for draft step ``step`` (0 = the plain causal pass): bool [1, 1, T, (step + 1) * T], True = attend."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)[None, None]


def shift_left(values: torch.Tensor, shift: int, fill=0) -> torch.Tensor:
    """values [B, T, ...] -> [B, T, ...] with out[:, t] = values[:, t + shift] and ``fill`` past the end."""
    if shift == 0:
        return values
    out = torch.full_like(values, fill)
    if shift < values.shape[1]:
        out[:, : values.shape[1] - shift] = values[:, shift:]
    return out


def next_token_mask(assistant_mask: torch.Tensor) -> torch.Tensor:
    """Positions whose *next* token is an assistant token: [B, T] -> [B, T] bool (last column False).

    Position j carries the target's distribution p_j over token j+1; a loss against p_j counts only here.
    """
    return shift_left(assistant_mask.bool(), 1, False)


def run_bounds(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs of consecutive True columns of mask [B, T], row by row (the order in which ``mask.nonzero()`` lists
    their positions): (rows, starts, ends) [R] long each, a run covering columns start .. end - 1 of its row."""
    padded = torch.nn.functional.pad(mask.bool(), (1, 1)).int()  # a False column either side of each row
    edges = padded.diff(dim=1)  # [B, T + 1]: +1 where a run starts, -1 just past where it ends
    rows, starts = (edges == 1).nonzero(as_tuple=True)
    ends = (edges == -1).nonzero(as_tuple=True)[1]
    return rows, starts, ends


def run_lengths(mask: torch.Tensor) -> list[int]:
    """Lengths of the runs of consecutive True columns of mask [B, T], in ``run_bounds``'s order (an assistant
    reply's positions make one run)."""
    _, starts, ends = run_bounds(mask)
    return (ends - starts).tolist()


def reply_ends(input_ids: torch.Tensor, predict: torch.Tensor, end_ids: set[int]) -> list[int]:
    """For each run of ``predict`` [B, T] (``run_bounds``'s order; position j of a run at column c predicts
    ``input_ids`` [B, T] at c + j + 1): how many of its positions decoding reaches, up to the one predicting the
    run's first token in ``end_ids`` (the end of turn, after which decoding stops; a chat template's newline after
    it is part of the reply mask but never decoded), or the whole run where it has none (a reply cut short)."""
    is_end = torch.zeros_like(input_ids, dtype=torch.bool)
    for token in end_ids:
        is_end |= input_ids == token
    reached = []
    for row, start, end in zip(*(bound.tolist() for bound in run_bounds(predict))):
        hits = is_end[row, start + 1:end + 1].nonzero()  # among the tokens the run's positions predict
        reached.append(int(hits[0]) + 1 if hits.numel() else end - start)
    return reached


class ChainCache:
    """Keys/values of every draft step, concatenated along the sequence (keeps autograd through earlier steps).

    Implements the ``update(key, value, layer_idx)`` contract the heads' attention calls.
    """

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx in self.keys:
            self.keys[layer_idx] = torch.cat((self.keys[layer_idx], key_states), dim=2)
            self.values[layer_idx] = torch.cat((self.values[layer_idx], value_states), dim=2)
        else:
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return self.keys[layer_idx], self.values[layer_idx]
