"""A rank's snapshot slots: flat files in shared memory that tensors are copied into as raw bytes.

Why not torch.save: pickling one rank's state of the tiny preset (54 MB) into /dev/shm and reading it
back for its CRC took 72 ms of the writer thread per snapshot on the CI machine, against 10 ms for a copy
into a mapped file and 16 ms for the CRC of the mapped bytes; on 2 cores that background work slowed
every step. A raw layout, described by JSON, is also read back without unpickling anything.

A slot is one file, allocated once at its full size with posix_fallocate (on a full tmpfs that fails
with ENOSPC; writing into a sparse mapping would kill the process with SIGBUS instead) and mapped with
with MAP_POPULATE, so a snapshot is one copy_ per tensor into its view. What the bytes are is
in the snapshot's sidecar (memory_checkpoint.py writes it last): each tensor's offset, dtype and shape.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import zlib
from pathlib import Path

import torch

ALIGN = 64  # every tensor starts on a cache line: view(dtype) needs its alignment, copies like 64
DTYPES = {
    str(t): t
    for t in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def as_json(self) -> list:
        return [self.key, self.offset, self.nbytes, self.dtype, list(self.shape)]


def plan_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], int]:
    """Where each tensor goes in a slot (in dict order), and the bytes the slot needs."""
    entries, offset = [], 0
    for key, t in tensors.items():
        if str(t.dtype) not in DTYPES:
            raise TypeError(f"{key}: a snapshot cannot hold {t.dtype}")
        entries.append(Entry(key, offset, t.numel() * t.element_size(), str(t.dtype), tuple(t.shape)))
        offset += -(-entries[-1].nbytes // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def entries_from_json(rows: list, size: int) -> list[Entry]:
    """A sidecar's layout, checked so that no entry reads outside `size` bytes or names another dtype."""
    entries = []
    for key, offset, nbytes, dtype, shape in rows:
        if dtype not in DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{key}: not a tensor layout ({dtype}, {shape})")
        if nbytes != math.prod(shape) * DTYPES[dtype].itemsize or offset % ALIGN or not 0 <= offset <= size - nbytes:
            raise ValueError(f"{key}: {nbytes} bytes at {offset} do not fit the slot's {size}")
        entries.append(Entry(str(key), offset, nbytes, dtype, tuple(shape)))
    return entries


class Slot:
    """One mapped slot file of `nbytes` (created, or reused when it already has that size)."""

    def __init__(self, path: Path, nbytes: int, create: bool = True):
        self.path, self.nbytes = path, nbytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create and os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, 0)  # another size: its old pages go, then all of them come back at once
                os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not SIGBUS at a later copy
            elif os.fstat(fd).st_size < nbytes:
                raise ValueError(f"{path.name} holds {os.fstat(fd).st_size} bytes, its sidecar says {nbytes}")
            # MAP_POPULATE maps every page now: the first copy into a fresh slot would otherwise take
            # a page fault per 4 KiB (28 ms against 15 for the tiny preset's 54 MB on the CI machine).
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, entry: Entry) -> torch.Tensor:
        part = self.flat[entry.offset : entry.offset + entry.nbytes]
        return part.view(DTYPES[entry.dtype]).view(entry.shape)

    def crc32(self) -> int:
        """CRC-32 of the slot's bytes: a torn or overwritten slot's check (speed matters more than
        strength here: a crafted file can do no harm, its bytes are only copied into tensors)."""
        return zlib.crc32(memoryview(self.flat.numpy()))

    def pin(self) -> None:
        """Page-lock the mapping for CUDA, so device-to-host copies into it run asynchronously; best
        effort (a copy into unpinned memory is only slower)."""
        try:
            torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.nbytes, 0)
        except Exception:  # no CUDA runtime, or the driver refuses: synchronous copies
            pass
