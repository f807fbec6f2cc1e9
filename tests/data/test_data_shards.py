"""Token shards: header round trip, dtype choice, roll-over, atomic writes, corruption detection (size,
header, and bytes overwritten in place, caught by the chunk checksums)."""

import numpy as np
import pytest

from phalanx.data.shards import (
    CHUNK_BYTES,
    HEADER,
    MAGIC,
    VERSION,
    ShardWriter,
    VerifiedShard,
    dtype_for_vocab,
    read_shard,
)
from phalanx.errors import PhalanxError


@pytest.mark.parametrize("vocab_size, dtype", [(1000, np.uint16), (65536, np.uint16), (70000, np.uint32)])
def test_round_trip_and_dtype(tmp_path, vocab_size, dtype):
    tokens = np.array([0, 1, 7, vocab_size - 1, 42], dtype=np.int64)
    with ShardWriter(tmp_path, "train", vocab_size) as w:
        w.write(tokens)
    (path,) = w.paths
    assert path.name == "train_00000.bin"
    shard = read_shard(path)
    assert isinstance(shard, np.memmap) and shard.dtype == dtype and not shard.flags.writeable
    np.testing.assert_array_equal(shard, tokens)
    magic, version, itemsize, count, chunk_tokens, vocab = HEADER.unpack(path.read_bytes()[: HEADER.size])
    assert (magic, version, itemsize, count, vocab) == (MAGIC, 2, np.dtype(dtype).itemsize, 5, vocab_size)
    assert chunk_tokens * itemsize == CHUNK_BYTES
    assert path.stat().st_size == 32 + 5 * itemsize + 4  # one chunk, one CRC-32


def test_rolls_over_to_new_shards(tmp_path):
    tokens = np.arange(25)
    with ShardWriter(tmp_path, "val", vocab_size=100, max_tokens_per_shard=10) as w:
        for start in range(0, 25, 7):  # writes that straddle shard boundaries
            w.write(tokens[start : start + 7])
    assert [p.name for p in w.paths] == ["val_00000.bin", "val_00001.bin", "val_00002.bin"]
    assert [len(read_shard(p)) for p in w.paths] == [10, 10, 5]
    np.testing.assert_array_equal(np.concatenate([read_shard(p) for p in w.paths]), tokens)
    assert w.total_tokens == 25
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val_00000.bin", "val_00001.bin", "val_00002.bin"]


def test_a_failed_write_leaves_no_shard_behind(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, "train", vocab_size=100) as w:
            w.write(np.arange(10))
            assert list(tmp_path.iterdir())[0].name == "train_00000.bin.tmp"  # in progress: not a shard name
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_out_of_range_ids_are_refused_not_wrapped(tmp_path):
    with ShardWriter(tmp_path, "train", vocab_size=100) as w:
        with pytest.raises(ValueError, match="out of range"):
            w.write(np.array([5, 100]))


def write_one(tmp_path, n=10):
    with ShardWriter(tmp_path, "train", vocab_size=1000) as w:
        w.write(np.arange(n))
    return w.paths[0]


def test_truncated_shard_is_corrupt(tmp_path):
    path = write_one(tmp_path)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(PhalanxError, match="corrupt token shard .*train_00000.bin: 55 bytes on disk, header says 56"):
        read_shard(path)


def test_bad_magic_version_dtype_and_short_header_are_corrupt(tmp_path):
    path = write_one(tmp_path)
    data = path.read_bytes()
    body = data[HEADER.size :]
    cases = {
        "bad magic": b"NOTTOKS1" + data[8:],
        "unknown format version 9": HEADER.pack(MAGIC, 9, 2, 10, 1000, 1000) + body,
        "unknown format version 1": HEADER.pack(MAGIC, 1, 2, 10, 1000, 1000) + body,  # before checksums
        "token size 3": HEADER.pack(MAGIC, VERSION, 3, 10, 1000, 1000) + body,
        "shorter than the 32-byte header": data[:20],
    }
    for message, content in cases.items():
        path.write_bytes(content)
        with pytest.raises(PhalanxError, match="corrupt token shard") as e:
            read_shard(path)
        assert message in str(e.value)


def test_dtype_for_vocab():
    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(65537) == np.uint32


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bytes_overwritten_in_place_are_caught_by_their_chunk(tmp_path):
    """Zeros written inside a shard keep its size, so only the checksum can tell: the chunk they fall in
    is refused when first read, naming it; chunks before it still read."""
    tokens = np.arange(3 * CHUNK_BYTES // 2, dtype=np.int64) % 999 + 1  # three chunks of uint16, no zeros
    with ShardWriter(tmp_path, "train", vocab_size=1000) as w:
        w.write(tokens)
    path = w.paths[0]
    chunk_tokens = CHUNK_BYTES // 2
    overwrite(path, HEADER.size + 2 * (chunk_tokens + 10), bytes(4096))  # inside chunk 1
    shard = VerifiedShard(path)
    np.testing.assert_array_equal(shard.windows(np.array([0, 100]), 50)[1], tokens[100:150])
    with pytest.raises(
        PhalanxError,
        match=r"corrupt token shard .*\(chunk 1, tokens 524288-1048575\): its bytes "
        r"do not match the shard's checksum; delete .* rebuilds it",
    ):
        shard.windows(np.array([chunk_tokens + 5]), 50)
    with pytest.raises(PhalanxError, match="chunk 1"):
        VerifiedShard(path).verify_all()


def test_ids_at_or_above_the_vocabulary_are_named(tmp_path):
    """A shard whose checksum matches but whose ids do not fit the vocabulary (written for another one)."""
    path = write_one(tmp_path)
    data = bytearray(path.read_bytes())
    magic, version, itemsize, count, chunk_tokens, _ = HEADER.unpack(bytes(data[: HEADER.size]))
    data[: HEADER.size] = HEADER.pack(magic, version, itemsize, count, chunk_tokens, 5)  # ids 0-9, vocabulary 5
    path.write_bytes(bytes(data))
    with pytest.raises(PhalanxError, match="token id 9 is not below the vocabulary size 5"):
        VerifiedShard(path).verify_all()


def test_windows_spanning_several_chunks_verify_each(tmp_path):
    tokens = np.arange(CHUNK_BYTES, dtype=np.int64) % 997  # two chunks of uint16
    with ShardWriter(tmp_path, "train", vocab_size=1000) as w:
        w.write(tokens)
    shard = VerifiedShard(w.paths[0])
    out = shard.windows(np.array([10]), CHUNK_BYTES // 2 + 10)  # longer than a chunk
    np.testing.assert_array_equal(out[0], tokens[10 : 10 + CHUNK_BYTES // 2 + 10])
    assert shard._verified.all()
