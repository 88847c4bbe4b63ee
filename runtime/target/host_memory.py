"""Host memory for the weight copies a decode pass streams every step, on 2 MB pages where Linux grants them.

A decode pass on a CPU reads every weight once, hundreds of megabytes in products of one to a few MB each. With 4 KB
pages each product's stream crosses a page, and misses the TLB, every 4 KB; the page walks and the prefetcher
stopping at each page boundary leave the stream well short of the memory's bandwidth. On 2 MB pages (transparent huge
pages, which Linux grants to anonymous memory marked with madvise where its setting is ``madvise`` or ``always``)
the same products run markedly faster (``scripts/bench_bf16_rows.py --pages`` times both in one process). PyTorch's
allocator does not ask for them, so the packed copies (``runtime.target.decode_layers.PackedWeights``) and the LM
head's int8 copy are carved from chunks of such memory here. Where the system gives no huge pages the chunks are
ordinary memory, and where madvise is missing (not Linux) tensors come from PyTorch's allocator.
"""

from __future__ import annotations

import math
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # a cache line: the kernels' rows and blocks start on one
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_requestable() -> bool:
    """Whether this system lets a process ask for huge pages on anonymous memory (Linux with madvise)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def transparent_huge_pages() -> str | None:
    """The system's transparent huge page setting (``always``, ``madvise`` or ``never``), None where unknown; results
    files record it beside the CPU."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


class HugePageArena:
    """Tensors carved one after another from chunks of anonymous memory marked for huge pages (``chunk_bytes`` each, 2
    MB aligned; a tensor larger than a chunk gets a chunk of its own). Nothing is freed one tensor at a time: a chunk
    goes back to the system when every tensor carved from it is gone (each holds its chunk), so the arena suits copies
    made once and kept, not memory that churns. ``enabled``: False hands out PyTorch's ordinary tensors."""

    def __init__(self, chunk_bytes: int = 64 << 20, enabled: bool | None = None):
        if chunk_bytes < HUGE_PAGE_BYTES:
            raise ValueError(f"chunk_bytes must be at least one huge page ({HUGE_PAGE_BYTES}), got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.enabled = huge_pages_requestable() if enabled is None else enabled and huge_pages_requestable()
        self._chunk: torch.Tensor | None = None  # uint8 [chunk bytes], 2 MB aligned
        self._used = 0
        self.chunks = 0

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.enabled or nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        start = -(-self._used // ALIGN_BYTES) * ALIGN_BYTES
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = self._new_chunk(max(self.chunk_bytes, nbytes)), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes].view(dtype).view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU ``tensor`` in the arena (``tensor`` itself is untouched)."""
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor.detach())
        return out

    def _new_chunk(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        # private anonymous memory (a shared mapping would be shmem, which the anonymous setting does not cover), one
        # huge page larger so that a 2 MB aligned start fits; marked before anything touches it, so the first touch
        # of each 2 MB takes a huge page where the system has one free
        buffer = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: ordinary pages, the same values
            pass
        whole = torch.frombuffer(buffer, dtype=torch.uint8)  # holds the mapping for as long as a view lives
        skip = -whole.data_ptr() % HUGE_PAGE_BYTES
        self.chunks += 1
        return whole[skip:skip + size]
