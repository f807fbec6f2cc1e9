"""Putting the parts back together: documents in corpus order into the train and val shards, each
document's tail to val by the same sequential rule as always, so the shards are the same bytes however
many workers (or nodes) made the parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from phalanx.data.shards import ShardWriter


class ShardMerge:
    """Feed it each part's (file index, tokens, document lengths) in unit order; `close` gives the
    manifest's counts. A context manager: an error leaves no partial shard."""

    def __init__(self, dir: Path, vocab_size: int, val_fraction: float, files: int):
        self.train = ShardWriter(dir, "train", vocab_size)
        self.val = ShardWriter(dir, "val", vocab_size)
        self.val_fraction = val_fraction
        self.seen = self.val_tokens = self.documents = 0
        self.file_tokens = [[0, 0] for _ in range(files)]

    def add(self, file: int, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """The last `val_fraction` of each document's tokens goes to val, so even a corpus of a few long
        documents gets a held-out split. Documents shorter than 1/val_fraction tokens would contribute
        nothing that way; when the val share falls behind by a whole such document, it goes to val entire.
        The rule runs document by document on counts alone (cheap); the tokens then move in two copies."""
        n_val = np.empty(len(lengths), dtype=np.int64)
        f, seen, val = self.val_fraction, self.seen, self.val_tokens
        for i, n in enumerate(lengths.tolist()):
            seen += n
            v = int(n * f)
            if round(seen * f) - val >= n:
                v = n
            n_val[i] = v
            val += v
        self.seen, self.val_tokens = seen, val
        self.documents += len(lengths)
        # is_val marks each document's tail: +1 where its val part starts, -1 where the document ends.
        ends = np.cumsum(lengths)
        marks = np.zeros(tokens.size + 1, dtype=np.int8)
        np.add.at(marks, ends - n_val, 1)
        np.add.at(marks, ends, -1)
        is_val = np.cumsum(marks[:-1], dtype=np.int8).astype(bool)
        self.train.write(tokens[~is_val])
        self.val.write(tokens[is_val])
        val_here = int(n_val.sum())
        self.file_tokens[file][0] += tokens.size - val_here
        self.file_tokens[file][1] += val_here

    def __enter__(self) -> ShardMerge:
        self.train.__enter__()
        self.val.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.val.__exit__(*exc)
        self.train.__exit__(*exc)

    def counts(self) -> dict:
        """The manifest's entries; call after the context has closed the shards."""
        return {
            "documents": self.documents,
            "train_shards": [p.name for p in self.train.paths],
            "val_shards": [p.name for p in self.val.paths],
            "train_tokens": self.train.total_tokens,
            "val_tokens": self.val.total_tokens,
            "file_tokens": self.file_tokens,
        }
