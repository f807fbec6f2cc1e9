"""Batches drawn from several sources by weight: deterministic, resumable, the same on any number of ranks.

Window k of the run (counted over every global batch) goes to the source furthest behind its share:
the s maximising (k + 1) * weight_s - drawn_s (the lowest index on a tie). That is largest remainder
applied one window at a time: after any number of windows each source's count is within one window of
its exact share, so shares hold in every batch, not only on average. The source then gives its next
window, in a seeded permutation of its windows per epoch. The plan depends only on the weights, the
seed and the windows drawn so far, never on the ranks: each rank plans the whole global batch and takes
its contiguous slice, as the single-source BatchLoader does (data/loader.py), and a checkpoint keeps
each source's count, so a resumed run draws what an uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from phalanx.data.loader import Batch, _inputs_targets, check_batch_sizes
from phalanx.data.source_windows import SourceWindows
from phalanx.errors import PhalanxError

EXHAUSTED = ("repeat", "stop")


class MixtureLoader:
    def __init__(
        self,
        sources: Sequence[SourceWindows],
        weights: Sequence[float],
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        exhausted: str = "repeat",
        pin_memory: bool = False,
        on_repeat: Callable[..., None] | None = None,
    ):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        if exhausted not in EXHAUSTED:
            raise ValueError(f"exhausted must be one of {EXHAUSTED}, got {exhausted!r}")
        if any(s.seq_len != seq_len for s in sources):
            raise ValueError(f"loader seq_len {seq_len} differs from a source's")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_world {dp_world}")
        check_batch_sizes(global_batch_size, micro_batch_size, dp_world)
        self.sources, self.seq_len, self.seed, self.exhausted = list(sources), seq_len, seed, exhausted
        self.raw_weights = [float(w) for w in weights]  # as configured: a checkpoint compares these
        self.weights = np.asarray(self.raw_weights, dtype=np.float64) / sum(self.raw_weights)
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.accum_steps = global_batch_size // (dp_world * micro_batch_size)
        self.pin_memory = pin_memory
        self.on_repeat = on_repeat  # called (line, source=, epoch=) when a source starts again from its start
        self.samples_seen = 0  # global windows drawn: the same on every rank
        self.drawn = np.zeros(len(self.sources), dtype=np.int64)  # global windows drawn from each source
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def tokens_by_source(self) -> dict[str, int]:
        """Tokens trained on from each source so far (seq_len per window: the inputs), over every rank."""
        return {s.name: int(n) * self.seq_len for s, n in zip(self.sources, self.drawn)}

    @property
    def epochs_by_source(self) -> dict[str, int]:
        """The epoch each source is in (1 until it first runs out and repeats)."""
        return {s.name: int(max(n - 1, 0)) // len(s) + 1 for s, n in zip(self.sources, self.drawn)}

    def next_batch(self) -> Batch:
        """This rank's share of the next global batch, as accum_steps (inputs, targets) micro batches."""
        source_of, position = self._plan(self.global_batch_size)
        per_rank = self.global_batch_size // self.dp_world
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        source_of, position = source_of[mine], position[mine]
        tokens = np.empty((per_rank, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(source_of):
            rows = source_of == s
            tokens[rows] = self.sources[s].gather(self._window_indices(int(s), position[rows]))
        rows, m = torch.from_numpy(tokens), self.micro_batch_size
        return [_inputs_targets(rows[i * m : (i + 1) * m], self.pin_memory) for i in range(self.accum_steps)]

    def _plan(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The next `count` global windows: each one's source and its position in that source's stream
        (window j of a source of n windows is in its epoch j // n); advances the counts."""
        source_of = np.empty(count, dtype=np.int64)
        position = np.empty(count, dtype=np.int64)
        for i in range(count):
            k = self.samples_seen + i
            s = int(np.argmax((k + 1) * self.weights - self.drawn))
            source_of[i], position[i] = s, self.drawn[s]
            self._check_exhausted(s, int(self.drawn[s]))
            self.drawn[s] += 1
        self.samples_seen += count
        return source_of, position

    def _check_exhausted(self, s: int, position: int) -> None:
        source = self.sources[s]
        n = len(source)
        if position == 0 or position % n:
            return
        epoch = position // n + 1
        used = f"data source {source.name} ran out: its {n} windows ({n * self.seq_len:,} tokens) are all used"
        if self.exhausted == "stop":
            raise PhalanxError(f"{used} (data.mixture_exhausted=stop); add data or set data.mixture_exhausted=repeat")
        if self.on_repeat is not None:
            self.on_repeat(f"{used}; repeating it from its start (epoch {epoch})", source=source.name, epoch=epoch)

    def _window_indices(self, s: int, positions: np.ndarray) -> np.ndarray:
        n = len(self.sources[s])
        epochs = positions // n
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            rows = epochs == epoch
            out[rows] = self._permutation(s, int(epoch))[positions[rows] % n]
        return out

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._perms:
            older = [k for k in self._perms if k[0] == s]
            if len(older) >= 2:  # keep a source's current epoch and the next one, no more
                del self._perms[min(older)]
            self._perms[key] = np.random.default_rng([self.seed, s, epoch]).permutation(len(self.sources[s]))
        return self._perms[key]

    def state_dict(self) -> dict:
        return {
            "samples_seen": self.samples_seen,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "sources": self.names,
            "weights": self.raw_weights,
            "windows_by_source": [len(s) for s in self.sources],
            "drawn_by_source": [int(n) for n in self.drawn],
        }

    def load_state_dict(self, state: dict) -> None:
        # As BatchLoader: the rank count and batch sizes may change across a resume; what decides the
        # windows drawn (the sources, their windows, the weights, the seed) may not.
        if "drawn_by_source" not in state:
            raise PhalanxError(
                "cannot resume the data loader exactly: the checkpoint was saved by a run without weighted "
                "data.sources; resume it with its own data.sources"
            )
        mine = self.state_dict()
        for key in ("seed", "seq_len", "sources", "weights", "windows_by_source"):
            if state.get(key) != mine[key]:
                raise PhalanxError(
                    f"cannot resume the data loader exactly: checkpoint has {key}={state.get(key)}, "
                    f"this run has {mine[key]} (were data.sources, their weights, the data, seq_len or seed changed?)"
                )
        self.samples_seen = int(state["samples_seen"])
        self.drawn = np.asarray(state["drawn_by_source"], dtype=np.int64)
