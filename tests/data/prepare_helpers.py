"""A corpus cut into many small units, its preparation with worker processes, and the reference every
way of preparing it must match to the byte: the corpus read straight through in one process, each
document's tail to val by the sequential rule, written with ShardWriter."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from phalanx.data.corpus import iter_sourced_documents, resolve_sources
from phalanx.data.shards import ShardWriter, dtype_for_vocab
from phalanx.data.tokenizer import encode_documents, load_tokenizer

WORDS = "the king and queen of verona speak softly to a ghost while night falls on elsinore é 日本".split()
UNIT_BYTES = 4000  # tiny units, so a small corpus still makes dozens


def make_corpus(dir: Path, seed: int = 0) -> Path:
    """Two .txt files, a .jsonl of 1,500 short records (blank lines among them), a .jsonl.gz and a
    Parquet file of 8 row groups: every kind of unit."""
    rng = np.random.default_rng(seed)
    text = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    dir.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        (dir / f"a{i}.txt").write_text(text(300))
    lines = [
        json.dumps({"text": text(int(rng.integers(1, 40)))}) + ("\n\n" if i % 9 == 0 else "\n") for i in range(1500)
    ]
    (dir / "b.jsonl").write_text("".join(lines))
    with gzip.open(dir / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": text(30)}) + "\n" for _ in range(100))
    table = pa.table({"text": [text(int(rng.integers(1, 40))) for _ in range(400)]})
    pq.write_table(table, dir / "d.parquet", row_group_size=50)
    return dir


def shard_hashes(data) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in [*data.shards, data.tokenizer_path]}


def straight_through(data, corpus: Path, val_fraction: float, out: Path) -> dict[str, str]:
    """The shards one process writes reading the corpus straight through with `data`'s tokenizer."""
    sources = resolve_sources([str(corpus)], corpus.parent)
    docs = (doc for _, doc in iter_sourced_documents(sources))
    seen = val = 0
    with ShardWriter(out, "train", data.vocab_size) as train, ShardWriter(out, "val", data.vocab_size) as held:
        for ids in encode_documents(load_tokenizer(data.tokenizer_path), docs):
            seen += len(ids)
            n_val = len(ids) if round(seen * val_fraction) - val >= len(ids) else int(len(ids) * val_fraction)
            train.write(ids[: len(ids) - n_val])
            held.write(ids[len(ids) - n_val :])
            val += n_val
    assert dtype_for_vocab(data.vocab_size) == np.dtype("<u2")
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in [*train.paths, *held.paths]}
