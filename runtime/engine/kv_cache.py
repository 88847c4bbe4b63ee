"""A preallocated KV cache that appends a tree's keys/values and then keeps only the accepted path.

All layers live in one buffer ``kv [L, 2, B, Hkv, S_max, D]`` so that compaction is one gather for the whole
model, not one per layer. Each batch row has its own length. The model writes new entries at
``lengths[b] .. lengths[b] + T - 1`` during a forward (``update``); nothing becomes permanent until the caller says
which entries to keep (``commit`` for plain appends, ``compact`` for a verified tree). Rejected entries stay in the
buffer but beyond the row's length, so no mask ever lets them be read again.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from runtime.engine.ragged import RaggedRows


def compact_kv(kv: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
    """Move kept entries to the contiguous slots after each row's length, in place.

    kv: [L, 2, B, Hkv, S_max, D]; lengths: [B] committed lengths; keep: [B, K] node indices (relative to
    ``lengths[b]``, ascending, padded arbitrarily past ``n_keep[b]``); n_keep: [B].
    Row b's entries at ``lengths[b] + keep[b, i]`` move to ``lengths[b] + i`` for i < n_keep[b].

    Only entries that change slot are copied (an accepted path is often already in place: always so in plain
    decoding), and as an indexed copy of those (row, slot) pairs: a gather and scatter over the whole window cost
    milliseconds per step at many rows (scripts/bench_kv_cache.py).
    """
    offsets = torch.arange(keep.shape[1], device=keep.device)
    moved = (offsets[None, :] < n_keep[:, None]) & (keep != offsets[None, :])  # [B, K]
    if not bool(moved.any()):
        return
    rows, index = moved.nonzero(as_tuple=True)  # [M] each
    source = lengths[rows] + keep[rows, index]
    dest = lengths[rows] + index
    # the right side is read into a new tensor first, so overlapping sources and destinations are safe
    kv[:, :, rows, :, dest] = kv[:, :, rows, :, source]


class KVCache:
    """Preallocated cache shaped for a transformers model; pass it with ``heads.common.cache_argument``.

    Only ``update`` is called by the model. ``lengths`` is the committed length per row (LongTensor [B]).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_length: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.kv = torch.zeros(num_layers, 2, batch_size, num_kv_heads, max_length, head_dim, dtype=dtype,
                              device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_length = max_length
        self.is_compileable = False
        # A Python int copy of max(lengths) for batch 1 fast paths, and the slots a pass writes (``_write_index``),
        # both kept in step with `lengths` (``_lengths_changed``).
        self._max_len = 0
        self._index: tuple[int, torch.Tensor | None] | None = None
        self._ragged: tuple[RaggedRows, torch.Tensor] | None = None  # set for one packed pass (``packed``)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def max_committed(self) -> int:
        return self._max_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write [B, Hkv, T, D] at each row's length; return keys/values [B, Hkv, max_len + T, D]. Inside
        ``packed(ragged)`` the new entries come packed, [1, Hkv, T', D] for T' tokens of ragged rows, and row b's
        go to its slots ``length_b .. length_b + n_b - 1``; keys/values are then [B, Hkv, max_len + N, D]."""
        new = key_states.shape[2] if self._ragged is None else self._ragged[0].width
        end = self._max_len + new
        if end > self.max_length:
            raise ValueError(f"KV cache overflow: {end} positions needed, {self.max_length} allocated")
        layer = self.kv[layer_idx]
        index = self._write_index(new) if self._ragged is None else self._ragged[1]
        if index is None:
            start = self._max_len
            layer[0, :, :, start:end] = key_states
            layer[1, :, :, start:end] = value_states
        else:
            dim = layer.shape[-1]
            layer[0].view(-1, dim).index_copy_(0, index, key_states.reshape(-1, dim))
            layer[1].view(-1, dim).index_copy_(0, index, value_states.reshape(-1, dim))
        return layer[0, :, :, :end], layer[1, :, :, :end]

    def pass_views(self, new: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a pass of ``new`` entries per row when every row has the same length and nothing is packed: (where the
        pass writes, [L, 2, B, Hkv, new, D]; what it reads, [L, 2, B, Hkv, max_len + new, D]), views shared by every
        layer of the pass, as ``update`` would write and return them layer by layer; else None (``update``)."""
        end = self._max_len + new
        if self._ragged is not None or self._write_index(new) is not None:
            return None
        if end > self.max_length:
            raise ValueError(f"KV cache overflow: {end} positions needed, {self.max_length} allocated")
        return self.kv[:, :, :, :, self._max_len:end], self.kv[:, :, :, :, :end]

    def _write_index(self, new: int) -> torch.Tensor | None:
        """Where a pass of ``new`` entries per row writes: None when every row has the same length (one slice);
        for ragged rows [B * Hkv * new] long, each (row, head, entry) in key_states' order as an index into a
        layer's keys viewed as [B * Hkv * max_length, D] (one index_copy_, far faster than scatter_ or an indexed
        assignment). Every layer of a pass writes the same slots, so it is computed once until lengths change."""
        if self._index is not None and self._index[0] == new:
            return self._index[1]
        index = None
        batch, heads, length = self.kv.shape[2], self.kv.shape[3], self.kv.shape[4]
        if batch > 1 and not bool((self.lengths == self._max_len).all()):
            device = self.lengths.device
            slots = self.lengths[:, None] + torch.arange(new, device=device)[None, :]  # [B, T]
            base = torch.arange(batch * heads, device=device).view(batch, heads, 1) * length  # [B, Hkv, 1]
            index = (base + slots[:, None, :]).reshape(-1)
        self._index = (new, index)
        return index

    @contextmanager
    def packed(self, ragged: RaggedRows):
        """Take the next pass's new entries packed (``runtime.engine.ragged``): row b's n_b entries are written at its
        own length, as a padded pass would write them, without the padding."""
        batch, heads, length = self.kv.shape[2], self.kv.shape[3], self.kv.shape[4]
        if ragged.batch != batch:
            raise ValueError(f"a ragged pass of {ragged.batch} rows over a cache of {batch}")
        slots = self.lengths[ragged.rows] + ragged.offsets  # [T]
        base = (ragged.rows[None, :] * heads + torch.arange(heads, device=slots.device)[:, None]) * length
        self._ragged = (ragged, (base + slots[None, :]).reshape(-1))  # [Hkv * T]: key_states' (head, token) order
        try:
            yield self
        finally:
            self._ragged = None

    def _lengths_changed(self) -> None:
        self._max_len = int(self.lengths.max()) if self.lengths.numel() else 0
        self._index = None

    def commit(self, count: int | torch.Tensor) -> None:
        """Keep the next ``count`` written entries of every row (or per row, a LongTensor [B])."""
        self.lengths += count
        self._lengths_changed()

    def compact(self, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """Keep written entries ``keep[b, :n_keep[b]]`` (indices relative to the row's length); see compact_kv."""
        compact_kv(self.kv, self.lengths, keep, n_keep)
        self.commit(n_keep)

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows ``start .. stop - 1`` as an empty cache over the same storage: a pass on it writes into those rows
        alone (the prefill of prompts that take over rows of a running batch). Its own lengths start at 0; once
        their entries are committed there, ``set_row_length`` tells this cache."""
        view = KVCache.__new__(KVCache)
        view.kv = self.kv[:, :, start:stop]
        view.lengths = torch.zeros(stop - start, dtype=torch.long, device=self.lengths.device)
        view.max_length = self.max_length
        view.is_compileable = False
        view._max_len = 0
        view._index = None
        view._ragged = None
        return view

    def set_row_length(self, index: int, length: int) -> None:
        """Row ``index`` now holds ``length`` committed entries (0: empty it)."""
        self.lengths[index] = length
        self._lengths_changed()

    def keep_rows(self, rows: list[int]) -> list[int]:
        """Keep only batch rows ``rows``: a batch whose finished rows nothing will replace stops paying for them.
        Returns the old row of each kept one, in the new order.

        The kept rows become the first len(rows): a kept row beyond them moves into a dropped row's slots (its
        committed entries alone), the others stay where they are, and the buffer is narrowed to a view, rather than
        every kept row copied into a smaller buffer each time a row of a draining batch finishes
        (``scripts/bench_kv_cache.py`` times both)."""
        kept = sorted(set(rows))
        count = len(kept)
        origin = [slot if slot in kept else -1 for slot in range(count)]
        holes = [slot for slot, old in enumerate(origin) if old < 0]
        movers = [slot for slot in kept if slot >= count]
        used = self._max_len
        for hole, mover in zip(holes, movers):
            self.kv[:, :, hole, :, :used] = self.kv[:, :, mover, :, :used]
            origin[hole] = mover
        self.kv = self.kv[:, :, :count]  # [L, 2, count, Hkv, S, D]: each layer's keys stay one contiguous block
        self.lengths = self.lengths[origin]
        self._lengths_changed()
        return origin

    def crop(self, length: int) -> None:
        """Forget everything after ``length`` in every row."""
        self.lengths.clamp_(max=length)
        self._lengths_changed()

    # Methods transformers may query; we always pass position ids and 4D masks, so these are informational.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._max_len

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._max_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._max_len + query_length, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_length

    def __len__(self) -> int:
        return self.num_layers
