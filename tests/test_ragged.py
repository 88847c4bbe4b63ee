"""Packed (ragged) passes: the bookkeeping by hand, and the cache's packed writes against padded ones."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.kv_cache import KVCache
from runtime.engine.ragged import RaggedRows


def test_layout_by_hand():
    # rows of 2, 1 and 3 tokens: packed a0 a1 | b0 | c0 c1 c2, padded to 3 per row
    positions = torch.tensor([10, 11, 20, 30, 31, 32])
    ragged = RaggedRows.from_counts([2, 1, 3], positions)
    assert ragged.width == 3 and ragged.batch == 3 and ragged.tokens == 6
    assert ragged.rows.tolist() == [0, 0, 1, 2, 2, 2]
    assert ragged.offsets.tolist() == [0, 1, 0, 0, 1, 2]
    assert ragged.packed_slot.tolist() == [0, 1, 3, 6, 7, 8]
    # padding slots read their row's first token
    assert ragged.padded_token.tolist() == [0, 1, 0, 2, 2, 2, 3, 4, 5]
    assert ragged.positions.tolist() == [[10, 11, 10], [20, 20, 20], [30, 31, 32]]
    assert ragged.row_slices() == [slice(0, 2), slice(2, 3), slice(3, 6)]


def test_pad_and_pack_round_trip():
    ragged = RaggedRows.from_counts([2, 1, 3], torch.arange(6))
    query = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(1, 2, 6, 4)  # [1, H, T, D]
    padded = ragged.pad(query, 2)  # [B, H, N, D]
    assert padded.shape == (3, 2, 3, 4)
    assert torch.equal(padded[2, :, 1], query[0, :, 4])
    assert torch.equal(padded[1, :, 2], query[0, :, 2])  # padding: the row's first token
    back = ragged.pack(padded.transpose(1, 2))  # [B, N, H, D] -> [1, T, H, D]
    assert torch.equal(back, query.transpose(1, 2))


def test_every_row_needs_a_token():
    with pytest.raises(ValueError, match="at least one token"):
        RaggedRows.from_counts([2, 0], torch.arange(2))


def test_packed_writes_land_where_padded_writes_do():
    """Rows of committed lengths 3, 1 and 2 write 2, 1 and 3 new entries: packed, each lands at its row's own slots,
    as in a padded pass; the padded pass's padding entries are the only difference."""
    torch.manual_seed(0)
    counts, lengths = [2, 1, 3], torch.tensor([3, 1, 2])
    ragged = RaggedRows.from_counts(counts, torch.arange(sum(counts)))
    new_keys, new_values = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)  # [1, Hkv, T, D]
    packed, padded = (KVCache(1, 3, 2, 4, 16, torch.float32, "cpu") for _ in range(2))
    for cache in (packed, padded):
        cache.kv.normal_()
        cache.commit(lengths)
    padded.kv.copy_(packed.kv)
    with packed.packed(ragged):
        keys, values = packed.update(new_keys, new_values, 0)
    assert keys.shape == (3, 2, 3 + 3, 4)  # the longest row's length plus the widest row
    padded.update(ragged.pad(new_keys, 2), ragged.pad(new_values, 2), 0)  # [B, Hkv, N, D]
    for b, (count, length) in enumerate(zip(counts, lengths.tolist())):
        real = slice(0, length + count)
        assert torch.equal(packed.kv[0, :, b, :, real], padded.kv[0, :, b, :, real]), f"row {b}"
    assert packed._ragged is None  # the packing holds for one pass
