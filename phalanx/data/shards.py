"""Binary token shards: a 32-byte header followed by the raw token ids, read back as a memory map.

Header (little-endian): magic b"PHXTOKS1" (8 bytes), format version (u32), bytes per token (u32: 2 for
uint16, 4 for uint32), token count (u64), 8 bytes of zero padding. The count lets a reader tell a
complete shard from a truncated one; shards are also written under a temporary name and renamed only
when complete, so a crash never leaves a shard that looks whole.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from phalanx.errors import PhalanxError

MAGIC = b"PHXTOKS1"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # 32 bytes
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
DEFAULT_MAX_TOKENS_PER_SHARD = 100_000_000


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return DTYPES[2] if vocab_size <= 2**16 else DTYPES[4]  # ids run 0..vocab_size-1


class ShardWriter:
    """Append token arrays; they land in <dir>/<prefix>_00000.bin, _00001.bin, ... of at most
    `max_tokens_per_shard` tokens each. Use as a context manager; `paths` lists the finished shards."""

    def __init__(
        self, dir: Path, prefix: str, vocab_size: int, max_tokens_per_shard: int = DEFAULT_MAX_TOKENS_PER_SHARD
    ):
        if max_tokens_per_shard < 1:
            raise ValueError("max_tokens_per_shard must be positive")
        self.dir, self.prefix, self.vocab_size = Path(dir), prefix, vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.max_tokens = max_tokens_per_shard
        self.paths: list[Path] = []
        self.total_tokens = 0
        self._file = None
        self._count = 0  # tokens in the open shard

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"token id out of range for vocab_size {self.vocab_size}")  # would wrap silently
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self._open()
            room = self.max_tokens - self._count
            self._file.write(tokens[:room].tobytes())
            written = min(room, tokens.size)
            self._count += written
            self.total_tokens += written
            tokens = tokens[room:]
            if self._count == self.max_tokens:
                self._finish()

    def close(self) -> list[Path]:
        if self._file is not None:
            self._finish()
        return self.paths

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._file is not None:  # leave no partial shard behind
            self._file.close()
            os.unlink(self._tmp_path)
            self._file = None

    def _open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._path = self.dir / f"{self.prefix}_{len(self.paths):05d}.bin"
        self._tmp_path = self._path.with_suffix(".bin.tmp")
        self._file = open(self._tmp_path, "wb")
        self._file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, 0))  # count filled in at the end
        self._count = 0

    def _finish(self) -> None:
        self._file.seek(0)
        self._file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self._count))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp_path, self._path)
        self.paths.append(self._path)


def read_shard(path: Path) -> np.ndarray:
    """The shard's tokens as a read-only memory map (nothing is read until it is indexed)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER.size)
        size = path.stat().st_size
    except OSError as e:
        raise PhalanxError(f"cannot read token shard {path}: {e.strerror}") from None
    if len(header) < HEADER.size:
        raise PhalanxError(f"corrupt token shard {path}: {size} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, itemsize, count = HEADER.unpack(header)
    if magic != MAGIC:
        raise PhalanxError(f"corrupt token shard {path}: bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION or itemsize not in DTYPES:
        raise PhalanxError(f"corrupt token shard {path}: unknown format version {version} or token size {itemsize}")
    expected = HEADER.size + count * itemsize
    if size != expected:
        raise PhalanxError(f"corrupt token shard {path}: {size} bytes on disk, header says {expected} ({count} tokens)")
    if count == 0:
        return np.empty(0, dtype=DTYPES[itemsize])  # np.memmap refuses an empty map
    return np.memmap(path, dtype=DTYPES[itemsize], mode="r", offset=HEADER.size, shape=(count,))
