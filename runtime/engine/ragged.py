"""Ragged passes: rows of different token counts packed into one sequence, so that no padding token is computed.

A batched verification pass over rows of n_b tokens each could pad them to N = max n_b, but every padding token
then costs a real token's arithmetic in every linear layer: where one row drafts a deep tree and the others draft
nothing, the others pay for the deep one. Packed, the pass's linears, norms and activations see the T = sum n_b
real tokens as one sequence [1, T]; only attention (each row over its own cache) and the cache's writes need the
rows apart, and there the packed tokens are laid out padded [B, N] and back (``pad`` and ``pack``), which costs a
gather of the few query rows per layer.

Packed order is row-major: row 0's tokens, then row 1's, ... Padding slots of the padded layout take the row's first
token; what the pass computes there is never read (the caller's mask gives a padding query a valid row of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RaggedRows:
    """Where each packed token sits in the padded layout.

    counts [B] (each >= 1); width N = max counts; rows [T], offsets [T]: each packed token's row and its index
    within the row; packed_slot [T] = rows * N + offsets (its slot in the padded layout flattened to [B * N]);
    padded_token [B * N]: the packed token each padded slot reads (a padding slot: its row's first token);
    positions [B, N]: the padded layout's position ids (a padding slot: its row's first position).
    """

    counts: torch.Tensor
    width: int
    rows: torch.Tensor
    offsets: torch.Tensor
    packed_slot: torch.Tensor
    padded_token: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def from_counts(counts: list[int], position_ids: torch.Tensor) -> RaggedRows:
        """counts: tokens per row (each >= 1); position_ids [T] (packed order, T = sum(counts))."""
        if not counts or min(counts) < 1:
            raise ValueError(f"every row of a ragged pass needs at least one token, got counts {counts}")
        device = position_ids.device
        count = torch.tensor(counts, dtype=torch.long, device=device)
        batch, width = len(counts), max(counts)
        rows = torch.repeat_interleave(torch.arange(batch, device=device), count)
        starts = torch.cumsum(count, 0) - count  # [B] each row's first packed token
        offsets = torch.arange(rows.numel(), device=device) - starts[rows]
        slot = torch.arange(width, device=device)[None, :]  # [1, N]
        padded_token = torch.where(slot < count[:, None], starts[:, None] + slot, starts[:, None])  # [B, N]
        return RaggedRows(count, width, rows, offsets, rows * width + offsets, padded_token.reshape(-1),
                          position_ids[padded_token])

    @property
    def batch(self) -> int:
        return self.counts.numel()

    @property
    def tokens(self) -> int:
        return self.rows.numel()

    def pad(self, packed: torch.Tensor, dim: int) -> torch.Tensor:
        """packed [..., T, ...] (tokens along ``dim``, a leading batch dim of 1 first) -> [B, ..., N, ...]: the
        padded layout, batch rows first."""
        picked = packed[0].index_select(dim - 1, self.padded_token)  # [..., B * N, ...]
        shape = list(picked.shape)
        shape[dim - 1:dim] = [self.batch, self.width]
        return picked.reshape(shape).movedim(dim - 1, 0)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """padded [B, N, ...] -> [1, T, ...]: the real tokens, packed."""
        return padded.reshape(self.batch * self.width, *padded.shape[2:]).index_select(0, self.packed_slot)[None]

    def row_slices(self) -> list[slice]:
        """Each row's tokens in packed order."""
        ends = torch.cumsum(self.counts, 0).tolist()
        return [slice(end - count, end) for end, count in zip(ends, self.counts.tolist())]
