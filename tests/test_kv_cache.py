import pytest
import torch

from runtime.engine.kv_cache import KVCache, compact_kv


def filled_cache(batch=2, length=12):
    cache = KVCache(num_layers=3, batch_size=batch, num_kv_heads=2, head_dim=4, max_length=32,
                    dtype=torch.float32, device="cpu")
    # entry value encodes (layer, k/v, row, slot) so moves are easy to check
    layer = torch.arange(3).view(3, 1, 1, 1, 1, 1) * 1000
    kind = torch.arange(2).view(1, 2, 1, 1, 1, 1) * 100
    row = torch.arange(batch).view(1, 1, batch, 1, 1, 1) * 10000
    slot = torch.arange(32).view(1, 1, 1, 1, 32, 1).float()
    cache.kv[:] = (layer + kind + row + slot).float().expand_as(cache.kv)
    return cache


def test_compaction_moves_accepted_entries_after_the_prefix():
    cache = filled_cache(batch=1)
    cache.commit(5)
    # a 6-node tree was written at slots 5..10; nodes 0, 2, 5 are accepted
    cache.compact(torch.tensor([[0, 2, 5]]), torch.tensor([3]))
    assert cache.lengths.tolist() == [8]
    slots = cache.kv[:, :, 0, 0, :8, 0] % 100
    assert slots[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 10]
    assert torch.equal(slots, slots[:1, :1].expand_as(slots))  # the same for every layer, keys and values


def test_compaction_with_per_row_lengths():
    cache = filled_cache(batch=2)
    cache.commit(torch.tensor([4, 7]))
    keep = torch.tensor([[0, 3, 4], [0, 1, 0]])  # row 1 keeps two nodes; its padding is ignored
    cache.compact(keep, torch.tensor([3, 2]))
    assert cache.lengths.tolist() == [7, 9]
    assert (cache.kv[0, 0, 0, 0, :7, 0] % 100).tolist() == [0, 1, 2, 3, 4, 7, 8]
    assert (cache.kv[0, 0, 1, 0, :9, 0] % 100).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_update_writes_at_each_rows_length_and_returns_the_visible_window():
    cache = KVCache(1, 2, 1, 2, 16, torch.float32, "cpu")
    cache.commit(torch.tensor([2, 5]))
    new = torch.ones(2, 1, 3, 2)
    new[1] *= 2
    keys, values = cache.update(new, -new, 0)
    assert keys.shape == (2, 1, 8, 2)  # max length 5 + 3 new
    assert keys[0, 0, 2:5, 0].tolist() == [1, 1, 1] and keys[0, 0, 5:, 0].abs().sum() == 0
    assert keys[1, 0, 5:8, 0].tolist() == [2, 2, 2] and values[1, 0, 5:8, 0].tolist() == [-2, -2, -2]


def test_ragged_writes_land_at_each_rows_slots_in_every_layer_and_after_a_commit():
    """Every (row, head, entry, feature) of a ragged write lands at that row's length + entry, in each layer (which
    reuse the pass's write index) and again once the lengths have moved."""
    batch, heads, dim, new = 3, 2, 4, 2
    cache = KVCache(2, batch, heads, dim, 16, torch.float32, "cpu")
    cache.commit(torch.tensor([3, 6, 4]))
    for _ in range(2):
        start = cache.lengths.clone()
        for layer in range(2):
            # distinct values, laid out [B, T, Hkv, D] and transposed as attention layers hand them over
            keys = torch.arange(batch * new * heads * dim, dtype=torch.float32).view(batch, new, heads, dim)
            keys = (keys + 1000 * layer).transpose(1, 2)
            cache.update(keys, -keys, layer)
            for b in range(batch):
                slots = slice(int(start[b]), int(start[b]) + new)
                assert torch.equal(cache.kv[layer, 0, b, :, slots], keys[b])
                assert torch.equal(cache.kv[layer, 1, b, :, slots], -keys[b])
        cache.commit(torch.tensor([new, 1, 0]))


def test_overflow_is_a_clear_error():
    cache = KVCache(1, 1, 1, 2, 4, torch.float32, "cpu")
    cache.commit(3)
    try:
        cache.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), 0)
    except ValueError as error:
        assert "overflow" in str(error)
    else:
        raise AssertionError("overflow must raise")


def test_compact_kv_overlapping_moves():
    kv = torch.arange(10).float().view(1, 1, 1, 1, 10, 1).clone()
    compact_kv(kv, torch.tensor([0]), torch.tensor([[1, 2, 3, 4]]), torch.tensor([4]))
    assert kv.flatten()[:4].tolist() == [1, 2, 3, 4]


def moved_by_hand(kv, lengths, keep, count):
    """compact_kv's contract, one entry at a time from a copy."""
    old, out = kv.clone(), kv.clone()
    for row in range(kv.shape[2]):
        start = int(lengths[row])
        for i in range(int(count[row])):
            out[:, :, row, :, start + i] = old[:, :, row, :, start + int(keep[row, i])]
    return out


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_cache_compaction_equals_moving_each_entry_by_hand(batch):
    generator = torch.Generator().manual_seed(batch)
    for trial in range(20):
        cache = KVCache(2, batch, 2, 3, 24, torch.float32, "cpu")
        cache.kv.normal_(generator=generator)
        lengths = torch.randint(0, 10, (batch,), generator=generator)
        cache.commit(lengths)
        written = int(torch.randint(1, 8, (1,), generator=generator))
        count = torch.randint(1, written + 1, (batch,), generator=generator)
        keep = torch.zeros(batch, written, dtype=torch.long)  # zero padding past each row's count
        for row in range(batch):
            chosen = torch.randperm(written, generator=generator)[: int(count[row])].sort().values
            keep[row, : len(chosen)] = chosen
        expected = moved_by_hand(cache.kv, lengths, keep, count)
        cache.compact(keep, count)
        assert torch.equal(cache.kv, expected), trial  # nothing else in the buffer moves either
        assert cache.lengths.tolist() == (lengths + count).tolist()
