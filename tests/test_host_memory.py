"""The huge-page arena (runtime.target.host_memory) hands out exact, aligned copies that outlive it, and the packed
weights keep their first copies there and repacked ones out of it."""

from __future__ import annotations

import pytest
import torch

from runtime.target.decode_layers import PackedWeights
from runtime.target.host_memory import ALIGN_BYTES, HUGE_PAGE_BYTES, HugePageArena, huge_pages_requestable
from runtime.target.kernels import bf16_packed_linear
from runtime.target.linear_plan import LinearPlan

needs_madvise = pytest.mark.skipif(not huge_pages_requestable(), reason="no madvise huge pages on this system")


@needs_madvise
def test_copies_are_exact_aligned_and_share_chunks():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    small = [torch.randn(37, 11).bfloat16(), torch.randint(-127, 127, (5, 3), dtype=torch.int8), torch.randn(300)]
    copies = [arena.copy(t) for t in small]
    assert all(torch.equal(c, t) and c.is_contiguous() and c.data_ptr() % ALIGN_BYTES == 0
               for c, t in zip(copies, small))
    assert arena.chunks == 1  # one chunk holds them all, one after another
    big = torch.randn(HUGE_PAGE_BYTES // 4 + 5)  # larger than a chunk: a chunk of its own
    assert torch.equal(arena.copy(big), big) and arena.chunks == 2
    assert arena.copy(torch.randn(4)).data_ptr() % ALIGN_BYTES == 0 and arena.chunks == 2  # in the big one's tail
    with torch.no_grad():
        copies[0].add_(1)  # writable, and apart from its neighbours
    assert torch.equal(copies[1], small[1]) and torch.equal(copies[2], small[2])


@needs_madvise
def test_a_copy_outlives_its_arena():
    arena = HugePageArena()
    kept = arena.copy(torch.arange(1000.0))
    del arena
    assert float(kept.sum()) == 999 * 1000 / 2


def test_a_disabled_arena_hands_out_ordinary_tensors():
    arena = HugePageArena(enabled=False)
    copy = arena.copy(torch.arange(6).view(2, 3))
    assert torch.equal(copy, torch.arange(6).view(2, 3)) and arena.chunks == 0
    with pytest.raises(ValueError, match="at least one huge page"):
        HugePageArena(chunk_bytes=4096)


@needs_madvise
@pytest.mark.skipif(bf16_packed_linear() is None, reason="the block-packed bf16 kernel does not run on this CPU")
def test_packed_weights_keep_first_copies_in_the_arena():
    packed = PackedWeights(LinearPlan("blocks", {}, ((256, True),)))
    weight = torch.randn(64, 32).bfloat16()
    first = packed.of(weight)
    assert packed.arena.enabled and packed.arena.chunks == 1 and packed.of(weight) is first
    with torch.no_grad():
        weight.mul_(2)  # changed in place: packed again, into ordinary memory
    again = packed.of(weight)
    assert again is not first and packed.arena.chunks == 1
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(bf16_packed_linear()(x, again, 64, None), bf16_packed_linear()(x, first, 64, None) * 2)
