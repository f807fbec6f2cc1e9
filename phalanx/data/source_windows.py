"""The windows of one source of a mixture: its token ranges of the training split, cut into windows.

Prepared text lays every file's training tokens end to end in the train shards, so one `data.sources`
entry's tokens are a few ranges of that stream (one per run of its files; usually one). Windows are
seq_len + 1 tokens at stride seq_len, as in TokenDataset (data/loader.py), each inside one range and one
shard, so a window never mixes two sources.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from phalanx.data.shards import VerifiedShard
from phalanx.errors import PhalanxError


class SourceWindows:
    def __init__(self, shards: Sequence[VerifiedShard], ranges: Sequence[tuple[int, int]], seq_len: int, name: str):
        """`ranges`: [start, end) offsets into the train shards laid end to end. The shards are shared with
        the other sources, so each chunk is verified once whichever source reads it first."""
        if seq_len < 1:
            raise PhalanxError(f"seq_len must be positive, got {seq_len}")
        self.shards, self.seq_len, self.name = list(shards), seq_len, name
        shard_ends = np.cumsum([len(s) for s in self.shards], dtype=np.int64)
        pieces = []  # (shard, first token in it, windows): a range cut at the shard boundaries it crosses
        for start, end in ranges:
            while start < end:
                j = int(np.searchsorted(shard_ends, start, side="right"))
                shard_start = int(shard_ends[j]) - len(self.shards[j])
                stop = min(end, int(shard_ends[j]))
                pieces.append((j, start - shard_start, max(0, (stop - start - 1) // seq_len)))
                start = stop
        self.tokens = sum(end - start for start, end in ranges)
        self._shard = np.asarray([p[0] for p in pieces], dtype=np.int64)
        self._first = np.asarray([p[1] for p in pieces], dtype=np.int64)
        windows = np.asarray([p[2] for p in pieces], dtype=np.int64)
        self._ends = np.cumsum(windows)  # window k lives in the first piece whose end > k
        self._starts = self._ends - windows
        if len(self) == 0:
            raise PhalanxError(
                f"data source {name} is too small: {self.tokens} training tokens, but one sample of seq_len "
                f"{seq_len} needs {seq_len + 1} tokens in a row; add data to it, lower seq_len or remove it"
            )

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Windows `indices` as one (len(indices), seq_len + 1) int64 array: one read per shard."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        piece = np.searchsorted(self._ends, indices, side="right")
        starts = self._first[piece] + (indices - self._starts[piece]) * self.seq_len
        shard_of = self._shard[piece]
        for j in np.unique(shard_of):
            rows = shard_of == j
            out[rows] = self.shards[j].windows(starts[rows], self.seq_len + 1)
        return out
