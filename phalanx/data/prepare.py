"""Prepare a corpus once: tokenizer + train/val token shards in a content-addressed cache directory.

The directory is `cache_root/<key>`, the key hashing everything the tokens depend on (source files with
their sizes and mtimes, vocab size, tokenizer file, val fraction, text field, format version). A directory
with a manifest is complete and is reused as is. It is built under a temporary name and renamed into place
in one step, so a crash leaves no half-prepared directory, and when two processes prepare the same key at
once the loser of the rename simply uses the winner's result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.data.corpus import iter_documents, resolve_sources, sources_fingerprint
from phalanx.data.shards import ShardWriter, VerifiedShard
from phalanx.data.tokenizer import companion_files, encode_documents, load_tokenizer, train_tokenizer
from phalanx.errors import PhalanxError

FORMAT_VERSION = 2  # 2: shards carry chunk checksums (data/shards.py)
MANIFEST = "manifest.json"
# Reused data this small is checked in full (about a second of CRC-32 per GiB) before anything trains on
# it; larger data is checked chunk by chunk as the loader first reads each chunk.
VERIFY_ON_REUSE_BYTES = 1 << 30


@dataclass
class PreparedData:
    dir: Path
    tokenizer_path: Path
    train_shards: list[Path]
    val_shards: list[Path]
    vocab_size: int  # the tokenizer's (largest id + 1); may be below the vocab_size asked for
    train_tokens: int
    val_tokens: int

    @classmethod
    def load(cls, dir: str | Path) -> PreparedData:
        dir = Path(dir)
        try:
            m = json.loads((dir / MANIFEST).read_text())
            return cls(
                dir=dir,
                tokenizer_path=dir / m["tokenizer"],
                train_shards=[dir / name for name in m["train_shards"]],
                val_shards=[dir / name for name in m["val_shards"]],
                vocab_size=m["vocab_size"],
                train_tokens=m["train_tokens"],
                val_tokens=m["val_tokens"],
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            message = f"prepared data in {dir} is unreadable ({e}); delete the directory to rebuild it"
            raise PhalanxError(message) from None


def prepare_data(
    sources: list[str],
    base_dir: Path,
    cache_root: Path,
    vocab_size: int,
    tokenizer: str | None,
    val_fraction: float,
    text_field: str = "text",
    progress: bool = False,
) -> PreparedData:
    if not 0.0 <= val_fraction < 1.0:
        raise PhalanxError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    base_dir, cache_root = Path(base_dir), Path(cache_root)
    resolved = resolve_sources(sources, base_dir)
    tokenizer_file = None
    if tokenizer is not None:
        tokenizer_file = base_dir / Path(tokenizer).expanduser()
        if not tokenizer_file.is_file():
            raise PhalanxError(f"tokenizer file {tokenizer_file} not found (data.tokenizer)")
    key = _cache_key(resolved, vocab_size, tokenizer_file, val_fraction, text_field)
    final = cache_root / key
    if (final / MANIFEST).is_file():
        data = PreparedData.load(final)
        shards = data.train_shards + data.val_shards
        if sum(p.stat().st_size for p in shards if p.is_file()) <= VERIFY_ON_REUSE_BYTES:
            for path in shards:
                VerifiedShard(path).verify_all()
        return data

    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _build(tmp, resolved, sources, vocab_size, tokenizer_file, val_fraction, text_field, progress)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not a concurrent winner: something else is in the way
                message = f"cannot create prepared data directory {final}; is a stale one in the way?"
                raise PhalanxError(message) from None
        return PreparedData.load(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def _build(dir, resolved, sources, vocab_size, tokenizer_file, val_fraction, text_field, progress) -> None:
    """Write tokenizer.json, the shards and, last of all, manifest.json (its presence means complete)."""
    with _progress(progress) as bar:

        def docs(label):  # a fresh pass over the corpus: one to train the tokenizer, one to encode
            return _counting(iter_documents(resolved, text_field), bar, label)

        if tokenizer_file is None:
            tok = train_tokenizer(docs("training tokenizer"), vocab_size)
        else:
            tok = load_tokenizer(tokenizer_file)
        tok.save(str(dir / "tokenizer.json"))
        if tokenizer_file is not None:  # its specials and chat template stay beside it (data/tokenizer.py)
            for companion in companion_files(tokenizer_file.parent):
                shutil.copyfile(companion, dir / companion.name)
        actual_vocab = max(tok.get_vocab().values()) + 1
        if actual_vocab > vocab_size:
            raise PhalanxError(
                f"tokenizer {tokenizer_file} has {actual_vocab} token ids but vocab_size is {vocab_size}; "
                f"set vocab_size to at least {actual_vocab}"
            )
        counts = _write_shards(encode_documents(tok, docs("tokenising")), dir, actual_vocab, val_fraction)
    manifest = {
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sources": list(sources),
        "files": [str(s.path) for s in resolved],
        "tokenizer": "tokenizer.json",
        "tokenizer_source": str(tokenizer_file) if tokenizer_file else "trained",
        "vocab_size": actual_vocab,
        "vocab_size_requested": vocab_size,
        "val_fraction": val_fraction,
        "text_field": text_field,
        **counts,
    }
    (dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _cache_key(resolved, vocab_size, tokenizer_file, val_fraction, text_field) -> str:
    tokenizer_hash = None
    if tokenizer_file:
        # The companion files decide the framing (BOS or none) and travel with the prepared tokenizer.
        digest = hashlib.sha256(tokenizer_file.read_bytes())
        for companion in companion_files(tokenizer_file.parent):
            digest.update(f"\0{companion.name}\0".encode() + companion.read_bytes())
        tokenizer_hash = digest.hexdigest()
    parts = [FORMAT_VERSION, sources_fingerprint(resolved), vocab_size, tokenizer_hash, val_fraction, text_field]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def _write_shards(token_docs: Iterator[np.ndarray], dir: Path, vocab_size: int, val_fraction: float) -> dict:
    """The last `val_fraction` of each document's tokens goes to val, so even a corpus of a few long
    documents gets a held-out split. Documents shorter than 1/val_fraction tokens would contribute
    nothing that way; when the val share falls behind by a whole such document, it goes to val entire."""
    seen = val = documents = 0
    with ShardWriter(dir, "train", vocab_size) as train_w, ShardWriter(dir, "val", vocab_size) as val_w:
        for ids in token_docs:
            documents += 1
            seen += len(ids)
            n_val = int(len(ids) * val_fraction)
            if round(seen * val_fraction) - val >= len(ids):
                n_val = len(ids)
            train_w.write(ids[: len(ids) - n_val])
            val_w.write(ids[len(ids) - n_val :])
            val += n_val
    return {
        "documents": documents,
        "train_shards": [p.name for p in train_w.paths],
        "val_shards": [p.name for p in val_w.paths],
        "train_tokens": train_w.total_tokens,
        "val_tokens": val_w.total_tokens,
    }


def _progress(enabled: bool):
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    return Progress(*columns, transient=True, console=Console(stderr=True))  # stdout stays for results


def _counting(docs: Iterator[str], bar, label: str) -> Iterator[str]:
    task = bar.add_task(label) if bar is not None else None
    for n, doc in enumerate(docs, start=1):
        if task is not None:
            bar.update(task, description=f"{label}: {n} documents")
        yield doc
