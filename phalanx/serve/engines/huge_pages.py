"""One block of memory, in 2 MiB pages where Linux grants them, for the weights a decode step streams.

A decode step of a few rows reads every linear weight once (decode_kernel.py). On the CI machine (a
2-core AMD EPYC, Linux with transparent huge pages on `madvise`) one core read a float32 tensor at
18 GB/s from torch's ordinary 4 KiB pages and at 31 GB/s from 2 MiB pages, and a one-row decode step of
the `125m` shape took 25 ms against 17 ms (BENCHMARKS.md, issue 33). The hardware prefetcher stops at
each 4 KiB page; a 2 MiB page is one TLB entry and one long stream. torch asks for huge pages only when
THP_MEM_ALLOC_ENABLE is set before its first allocation, which a library cannot count on, so the engine
takes one private anonymous mapping, advises the kernel (madvise MADV_HUGEPAGE) and lays the packed
weights in it end to end, in the order the step reads them.

Where the advice does not exist (not Linux) or is refused, the memory is ordinary pages: the same bits,
only slower.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each tensor starts on a cache line


class HugePageArena:
    """`nbytes` of memory, 2 MiB aligned, handed out front to back by `put`. The memory lives as long as
    any tensor `put` returned."""

    def __init__(self, nbytes: int):
        self._memory = _huge_page_bytes(max(nbytes, 1))
        self._used = 0

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` (contiguous, on CPU) in the arena's next free bytes."""
        start = -(-self._used // ALIGN) * ALIGN
        size = tensor.numel() * tensor.element_size()
        if start + size > self._memory.numel():
            raise ValueError(f"arena of {self._memory.numel()} bytes has no room for {size} more")
        self._used = start + size
        placed = self._memory[start : start + size].view(tensor.dtype).view(tensor.shape)
        return placed.copy_(tensor)

    @staticmethod
    def room_for(tensors_bytes: list[int]) -> int:
        """The bytes an arena needs to take tensors of these sizes, in this order."""
        return sum(-(-size // ALIGN) * ALIGN for size in tensors_bytes)


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes starting on a 2 MiB boundary, advised into huge pages (Linux)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # Private and anonymous: a shared mapping would be shmem, whose huge pages follow another setting.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError:  # a kernel without transparent huge pages: ordinary pages serve
        pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive while any view lives
    offset = -whole.data_ptr() % HUGE_PAGE
    return whole[offset : offset + nbytes]
