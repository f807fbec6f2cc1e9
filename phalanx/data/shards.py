"""Binary token shards: a 32-byte header, the raw token ids, then a CRC-32 of every chunk of them.

Header (little-endian): magic b"PHXTOKS1" (8 bytes), format version (u32, 2), bytes per token (u32: 2
for uint16, 4 for uint32), token count (u64), tokens per checksum chunk (u32), vocabulary size (u32).
The count lets a reader tell a complete shard from a truncated one; shards are also written under a
temporary name and renamed only when complete, so a crash never leaves a shard that looks whole.

The checksums catch what a size check cannot: bytes overwritten in place (a bad disk, a stray `dd`).
Readers verify a chunk the first time they read from it (VerifiedShard), so checking costs one CRC per
megabyte of tokens read, and also that its ids lie below the vocabulary, which an embedding lookup
would otherwise turn into a crash loop deep inside the ranks.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np

from phalanx.errors import PhalanxError

MAGIC = b"PHXTOKS1"
VERSION = 2
HEADER = struct.Struct("<8sIIQII")  # 32 bytes
CRC = np.dtype("<u4")
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
DEFAULT_MAX_TOKENS_PER_SHARD = 100_000_000
CHUNK_BYTES = 1 << 20  # one checksum per MiB of tokens


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
        self.chunk_tokens = CHUNK_BYTES // self.dtype.itemsize
        self.max_tokens = max_tokens_per_shard
        self.paths: list[Path] = []
        self.total_tokens = 0
        self._file = None
        self._count = 0  # tokens in the open shard

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"token id out of range for vocab_size {self.vocab_size}")  # would wrap silently
        tokens = np.ascontiguousarray(tokens.astype(self.dtype, copy=False))  # contiguous: CRC reads its buffer
        while tokens.size:
            if self._file is None:
                self._open()
            room = self.max_tokens - self._count
            self._checksum(tokens[:room])
            self._file.write(tokens[:room].tobytes())
            written = min(room, tokens.size)
            self._count += written
            self.total_tokens += written
            tokens = tokens[room:]
            if self._count == self.max_tokens:
                self._finish()

    def end_shard(self) -> None:
        """Finish the open shard now, short of its maximum: the next write starts a new one. Lets a caller
        keep a unit (a fine-tuning example) inside one shard, and several writers split at the same place."""
        if self._file is not None:
            self._finish()

    def close(self) -> list[Path]:
        self.end_shard()
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
        self._file.write(self._header(0))  # count filled in at the end
        self._count = 0
        self._crcs: list[int] = []
        self._crc, self._in_chunk = 0, 0  # the running CRC of the chunk being written, and its tokens

    def _header(self, count: int) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, count, self.chunk_tokens, self.vocab_size)

    def _checksum(self, tokens: np.ndarray) -> None:
        """Fold `tokens` (about to be written) into the chunk checksums."""
        while tokens.size:
            take = min(self.chunk_tokens - self._in_chunk, tokens.size)
            self._crc = zlib.crc32(tokens[:take], self._crc)
            self._in_chunk += take
            tokens = tokens[take:]
            if self._in_chunk == self.chunk_tokens:
                self._crcs.append(self._crc)
                self._crc, self._in_chunk = 0, 0

    def _finish(self) -> None:
        if self._in_chunk:
            self._crcs.append(self._crc)
        self._file.write(np.asarray(self._crcs, dtype=CRC).tobytes())
        self._file.seek(0)
        self._file.write(self._header(self._count))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp_path, self._path)
        self.paths.append(self._path)


def read_shard(path: Path) -> np.ndarray:
    """The shard's tokens as a read-only memory map (nothing is read until it is indexed; nothing is
    verified either: read through VerifiedShard for that)."""
    return VerifiedShard(path).tokens


class VerifiedShard:
    """A shard whose chunks are checked (CRC-32, ids below the vocabulary) the first time they are read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tokens, self.chunk_tokens, self.vocab_size, self._crcs = _open(self.path)
        self._verified = np.zeros(len(self._crcs), dtype=bool)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def checksums(self) -> np.ndarray:
        """The stored CRC-32 of each chunk: a digest of the shard's tokens without reading them."""
        return self._crcs

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Token windows tokens[start : start + length] for each start, as one (len(starts), length) array,
        once every chunk they touch is verified."""
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size:
            first, last = starts // self.chunk_tokens, (starts + length - 1) // self.chunk_tokens
            spans = [np.arange(f, l + 1) for f, l in zip(first, last)] if (last - first).max() > 1 else [first, last]
            self.verify_chunks(np.unique(np.concatenate(spans)))
        return self.tokens[starts[:, None] + np.arange(length, dtype=np.int64)]

    def verify_chunks(self, chunks: np.ndarray) -> None:
        for chunk in chunks[~self._verified[chunks]]:
            self._verify(int(chunk))

    def verify_all(self) -> None:
        self.verify_chunks(np.arange(len(self._crcs)))

    def _verify(self, chunk: int) -> None:
        start = chunk * self.chunk_tokens
        data = self.tokens[start : start + self.chunk_tokens]
        where = f"token shard {self.path} (chunk {chunk}, tokens {start}-{start + len(data) - 1})"
        fix = f"; delete {self.path.parent} and `phalanx data prepare` rebuilds it"
        if zlib.crc32(data) != int(self._crcs[chunk]):
            raise PhalanxError(f"corrupt {where}: its bytes do not match the shard's checksum{fix}")
        if data.size and int(data.max()) >= self.vocab_size:
            raise PhalanxError(
                f"corrupt {where}: token id {int(data.max())} is not below the vocabulary size {self.vocab_size}{fix}"
            )
        self._verified[chunk] = True


def _open(path: Path) -> tuple[np.ndarray, int, int, np.ndarray]:
    """(tokens memmap, tokens per chunk, vocabulary size, chunk CRCs) after checking the header and size."""
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER.size)
        size = path.stat().st_size
    except OSError as e:
        raise PhalanxError(f"cannot read token shard {path}: {e.strerror}") from None
    if len(header) < HEADER.size:
        raise PhalanxError(f"corrupt token shard {path}: {size} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, itemsize, count, chunk_tokens, vocab_size = HEADER.unpack(header)
    if magic != MAGIC:
        raise PhalanxError(f"corrupt token shard {path}: bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION or itemsize not in DTYPES or chunk_tokens < 1:
        raise PhalanxError(
            f"corrupt token shard {path}: unknown format version {version} or token size {itemsize} "
            f"(this phalanx writes version {VERSION}; delete the prepared data to rebuild it)"
        )
    chunks = -(-count // chunk_tokens)
    expected = HEADER.size + count * itemsize + chunks * CRC.itemsize
    if size != expected:
        raise PhalanxError(f"corrupt token shard {path}: {size} bytes on disk, header says {expected} ({count} tokens)")
    crcs = np.fromfile(path, dtype=CRC, count=chunks, offset=HEADER.size + count * itemsize)
    if count == 0:
        return np.empty(0, dtype=DTYPES[itemsize]), chunk_tokens, vocab_size, crcs  # np.memmap refuses an empty map
    tokens = np.memmap(path, dtype=DTYPES[itemsize], mode="r", offset=HEADER.size, shape=(count,))
    return tokens, chunk_tokens, vocab_size, crcs
