"""Deterministic, resumable, rank-sliced batches of token windows.

The stream of GLOBAL batches depends only on the data and the seed, never on how many data-parallel ranks
share it: a global counter of samples consumed indexes a per-epoch permutation, and each rank takes its
contiguous slice of every global batch. So a run resumed on a different number of ranks (or with
`samples_seen` from a checkpoint) sees exactly the samples an uninterrupted run would have seen.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from phalanx.data.shards import VerifiedShard
from phalanx.errors import PhalanxError


class TokenDataset:
    """Non-overlapping windows of seq_len + 1 tokens at stride seq_len (the +1 is the last target), each
    inside one shard: a window never straddles two shards."""

    def __init__(self, shards: list[Path], seq_len: int, name: str = "token data"):
        if seq_len < 1:
            raise PhalanxError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.shards = [VerifiedShard(p) for p in shards]  # each chunk checked the first time it is read
        windows = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self._ends = np.cumsum(windows, dtype=np.int64)  # window k lives in the first shard whose end > k
        self._starts = self._ends - np.asarray(windows, dtype=np.int64)
        if len(self) == 0:
            total = sum(len(s) for s in self.shards)
            largest = max((len(s) for s in self.shards), default=0)
            raise PhalanxError(
                f"{name} is too small: {total} tokens in {len(self.shards)} shard(s) (largest {largest}), but one "
                f"sample of seq_len {seq_len} needs {seq_len + 1} tokens in one shard; add data or lower seq_len"
            )

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def window(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        return self.gather(np.array([i]))[0]

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Windows `indices` as one (len(indices), seq_len + 1) int64 array: one fancy-index read per shard."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        shard_of = np.searchsorted(self._ends, indices, side="right")
        local = indices - self._starts[shard_of]
        for j in np.unique(shard_of):
            rows = shard_of == j
            out[rows] = self.shards[j].windows(local[rows] * self.seq_len, self.seq_len + 1)
        return out

    def micro_batch(self, indices: np.ndarray, pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows `indices` as (inputs, targets), each (len(indices), seq_len)."""
        return _inputs_targets(torch.from_numpy(self.gather(indices)), pin_memory)


# A micro batch: (inputs, targets), or (inputs, targets, positions) where rows pack several examples
# (data/sft_batches.py: targets -100 where a token is not trained).
Batch = list[tuple[torch.Tensor, ...]]


def check_batch_sizes(global_batch_size: int, micro_batch_size: int | None, dp_world: int) -> None:
    """Each global batch must split evenly into micro batches on every data-parallel rank. A micro batch
    of None is each rank's whole share (train.micro_batch_size null): the ranks must share it evenly."""
    if micro_batch_size is None:
        if global_batch_size < dp_world or global_batch_size % dp_world:
            raise PhalanxError(
                f"train.global_batch_size ({global_batch_size}) must be a multiple of the {dp_world} data-parallel "
                f"ranks, which share each batch evenly"
            )
        return
    if global_batch_size < 1 or micro_batch_size < 1:
        raise PhalanxError(
            f"train.global_batch_size ({global_batch_size}) and train.micro_batch_size ({micro_batch_size}) "
            "must be positive"
        )
    if global_batch_size % (dp_world * micro_batch_size):
        raise PhalanxError(
            f"train.global_batch_size ({global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({micro_batch_size}) x {dp_world} data-parallel ranks = {dp_world * micro_batch_size}"
        )


class BatchLoader:
    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        pin_memory: bool = False,
    ):
        if seq_len != dataset.seq_len:
            raise ValueError(f"loader seq_len {seq_len} differs from the dataset's {dataset.seq_len}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_world {dp_world}")
        check_batch_sizes(global_batch_size, micro_batch_size, dp_world)
        self.dataset, self.seq_len, self.seed = dataset, seq_len, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.accum_steps = global_batch_size // (dp_world * micro_batch_size)
        self.pin_memory = pin_memory
        self.samples_seen = 0  # global: the same on every rank
        self._perms: dict[int, np.ndarray] = {}

    def next_batch(self) -> Batch:
        """This rank's share of the next global batch, as accum_steps (inputs, targets) micro batches."""
        per_rank = self.global_batch_size // self.dp_world
        start = self.samples_seen + self.dp_rank * per_rank
        indices = self._sample_indices(start, start + per_rank)
        self.samples_seen += self.global_batch_size
        m = self.micro_batch_size
        return [
            self.dataset.micro_batch(indices[i * m : (i + 1) * m], self.pin_memory) for i in range(self.accum_steps)
        ]

    def _sample_indices(self, start: int, stop: int) -> np.ndarray:
        n = len(self.dataset)
        positions = np.arange(start, stop, dtype=np.int64)
        epochs = positions // n
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):  # usually one; two where the batch runs into the next epoch
            rows = epochs == epoch
            out[rows] = self._permutation(int(epoch))[positions[rows] % n]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # keep the current epoch and the next one, no more
                del self._perms[min(self._perms)]
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        return self._perms[epoch]

    def state_dict(self) -> dict:
        return {
            "samples_seen": self.samples_seen,
            "seed": self.seed,
            "dataset_len": len(self.dataset),
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        # The rank count and batch sizes may change across a resume; the seed and the windows may not,
        # or the resumed run would silently see different samples from an uninterrupted one.
        for key, mine in (("seed", self.seed), ("dataset_len", len(self.dataset)), ("seq_len", self.seq_len)):
            if state.get(key) != mine:
                raise PhalanxError(
                    f"cannot resume the data loader exactly: checkpoint has {key}={state.get(key)}, "
                    f"this run has {mine} (was the data, seq_len or seed changed?)"
                )
        self.samples_seen = int(state["samples_seen"])


def val_batches(
    dataset: TokenDataset,
    seq_len: int,
    micro_batch_size: int,
    max_batches: int,
    dp_rank: int,
    dp_world: int,
    pin_memory: bool = False,
) -> Batch:
    """The first max_batches * micro_batch_size windows in order, as micro batches dealt round-robin to
    ranks: the union over ranks is the same set for any dp_world, though ranks may get unequal counts and
    the last batch may be short, so callers sum losses and token counts across ranks, never average."""
    if seq_len != dataset.seq_len:
        raise ValueError(f"val_batches seq_len {seq_len} differs from the dataset's {dataset.seq_len}")
    n = min(len(dataset), max_batches * micro_batch_size)
    batches = []
    for k in range(dp_rank, -(-n // micro_batch_size), dp_world):
        indices = np.arange(k * micro_batch_size, min((k + 1) * micro_batch_size, n))
        batches.append(dataset.micro_batch(indices, pin_memory))
    return batches


def _inputs_targets(tokens: torch.Tensor, pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # Contiguous, so that callers may flatten them with .view(-1) as most loss code does.
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if pin_memory:  # lets .to(device, non_blocking=True) overlap the copy with compute
        x, y = x.pin_memory(), y.pin_memory()
    return x, y
