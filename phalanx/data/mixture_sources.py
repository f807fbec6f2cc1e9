"""A run's training loader: the single-stream BatchLoader, or a MixtureLoader over weighted data.sources.

Plain `data.sources` (no weights) train exactly as before: one stream of every file's tokens. Weighted
sources read where each entry's tokens lie from the prepared data (the manifest's tokens per file and
the entries' grouping of the files, data/source_groups.py) and draw from each by weight.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from phalanx.data.loader import BatchLoader, TokenDataset
from phalanx.data.mixture import MixtureLoader
from phalanx.data.prepare import PreparedData
from phalanx.data.shards import VerifiedShard
from phalanx.data.source_groups import load_source_groups
from phalanx.data.source_windows import SourceWindows
from phalanx.errors import PhalanxError


def train_loader(
    data: PreparedData,
    train_data: TokenDataset,
    sources: Sequence[str],
    weights: Sequence[float] | None,
    exhausted: str,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    pin_memory: bool = False,
    on_repeat: Callable[..., None] | None = None,
) -> BatchLoader | MixtureLoader:
    if weights is None:
        return BatchLoader(
            train_data, seq_len, global_batch_size, micro_batch_size, dp_rank, dp_world, seed, pin_memory=pin_memory
        )
    return MixtureLoader(
        mixture_sources(data, list(sources), seq_len),
        weights,
        seq_len,
        global_batch_size,
        micro_batch_size,
        dp_rank,
        dp_world,
        seed,
        exhausted=exhausted,
        pin_memory=pin_memory,
        on_repeat=on_repeat,
    )


def mixture_sources(data: PreparedData, entries: list[str], seq_len: int) -> list[SourceWindows]:
    """The windows of each entry of data.sources, in order, over the prepared training split."""
    if data.kind != "text":
        raise PhalanxError("weighted data.sources mix text; fine-tuning (data.kind: sft) takes no weights")
    entry_of_file = load_source_groups(data.dir, entries)
    if not data.file_tokens or entry_of_file is None or len(entry_of_file) != len(data.file_tokens):
        raise PhalanxError(
            f"prepared data in {data.dir} does not say which source each token came from (it was prepared "
            f"before weighted sources, or by another list of sources); delete it and `phalanx data prepare` rebuilds it"
        )
    train_tokens = np.asarray([train for train, _ in data.file_tokens], dtype=np.int64)
    starts = np.cumsum(train_tokens) - train_tokens  # files lie end to end in the train shards, in order
    ranges: list[list[tuple[int, int]]] = [[] for _ in entries]
    for start, count, entry in zip(starts.tolist(), train_tokens.tolist(), entry_of_file):
        own = ranges[entry]
        if own and own[-1][1] == start:  # the entry's files follow one another: one range, no window lost
            own[-1] = (own[-1][0], start + count)
        elif count:
            own.append((start, start + count))
    shards = [VerifiedShard(p) for p in data.train_shards]  # shared: each chunk verified once
    names = source_names(entries)
    for name, own in zip(names, ranges):
        if not own:
            raise PhalanxError(f"data source {name} has no files of its own: an earlier source names all of them")
    return [SourceWindows(shards, own, seq_len, name) for name, own in zip(names, ranges)]


def source_names(entries: Sequence[str]) -> list[str]:
    """Short names for metrics: paths relative to the folder all path entries share (`slim/`, `code/`);
    `builtin:` and `hf:` entries as written. A name taken twice falls back to the whole entry."""
    paths = [e for e in entries if not e.startswith(("builtin:", "hf:"))]
    try:
        common = os.path.commonpath([str(Path(p).parent) for p in paths]) if paths else ""
    except ValueError:  # relative and absolute paths together: no common folder
        common = ""
    names = [e if e not in paths else os.path.relpath(e, common) if common else e for e in entries]
    return [n if names.count(n) == 1 else e for n, e in zip(names, entries)]
