"""Prepare a corpus once: tokenizer + train/val token shards in a content-addressed cache directory.

Plain text (kind "text") becomes documents framed [BOS] + text + [EOS], laid end to end. Fine-tuning
records (kind "sft", data/sft.py) become examples: tokens plus trained flags and example lengths, each
example whole in one shard and in one split.

The directory is `cache_root/<key>`, the key hashing everything the tokens depend on (source files with
their sizes and mtimes, vocab size, tokenizer file, val fraction, text field, format version; for
fine-tuning also its options and the chat template). A directory
with a manifest is complete and is reused as is. It is built under a temporary name and renamed into place
in one step, so a crash leaves no half-prepared directory, and when two processes prepare the same key at
once the loser of the rename simply uses the winner's result.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from phalanx.data.chat_template import CHAT_TEMPLATE
from phalanx.data.corpus import entry_of_files, iter_documents, iter_sourced_documents, sources_fingerprint
from phalanx.data.sft import (
    ExampleWriter,
    SftOptions,
    SftStats,
    iter_examples,
    resolve_sft_sources,
    template_for,
    tokenizer_texts,
)
from phalanx.data.shards import ShardWriter, VerifiedShard
from phalanx.data.source_groups import save_source_groups
from phalanx.data.tokenizer import companion_files, encode_documents, load_tokenizer, train_tokenizer
from phalanx.errors import PhalanxError

FORMAT_VERSION = 2  # 2: shards carry chunk checksums (data/shards.py)
MANIFEST = "manifest.json"
# Reused data this small is checked in full (about a second of CRC-32 per GiB) before anything trains on
# it; larger data is checked chunk by chunk as the loader first reads each chunk.
VERIFY_ON_REUSE_BYTES = 1 << 30
KINDS = ("text", "sft")


@dataclass
class PreparedData:
    dir: Path
    tokenizer_path: Path
    train_shards: list[Path]
    val_shards: list[Path]
    vocab_size: int  # the tokenizer's (largest id + 1); may be below the vocab_size asked for
    train_tokens: int
    val_tokens: int
    # Fine-tuning examples (kind "sft") add a trained flag per token and a length per example, in shards
    # that pair with the token shards one to one; text has none. A manifest from before kinds is text.
    kind: str = "text"
    train_mask_shards: list[Path] = field(default_factory=list)
    train_length_shards: list[Path] = field(default_factory=list)
    val_mask_shards: list[Path] = field(default_factory=list)
    val_length_shards: list[Path] = field(default_factory=list)
    examples: dict = field(default_factory=dict)  # counts: records, train, val, truncated, dropped, ...
    # Text: the [train, val] tokens of each source file, in the manifest's `files` order (none in data
    # prepared before sources could be mixed by weight): where each file's tokens lie in the splits.
    file_tokens: list[list[int]] = field(default_factory=list)

    @property
    def shards(self) -> list[Path]:
        """Every shard file, of every stream and split."""
        return [
            *self.train_shards,
            *self.val_shards,
            *self.train_mask_shards,
            *self.train_length_shards,
            *self.val_mask_shards,
            *self.val_length_shards,
        ]

    @classmethod
    def load(cls, dir: str | Path) -> PreparedData:
        dir = Path(dir)
        try:
            m = json.loads((dir / MANIFEST).read_text())
            paths = lambda key: [dir / name for name in m.get(key, [])]
            if m.get("kind", "text") not in KINDS:
                raise ValueError(f"unknown kind {m['kind']!r}")
            return cls(
                dir=dir,
                tokenizer_path=dir / m["tokenizer"],
                train_shards=[dir / name for name in m["train_shards"]],
                val_shards=[dir / name for name in m["val_shards"]],
                vocab_size=m["vocab_size"],
                train_tokens=m["train_tokens"],
                val_tokens=m["val_tokens"],
                kind=m.get("kind", "text"),
                train_mask_shards=paths("train_mask_shards"),
                train_length_shards=paths("train_length_shards"),
                val_mask_shards=paths("val_mask_shards"),
                val_length_shards=paths("val_length_shards"),
                examples=dict(m.get("examples", {})),
                file_tokens=[list(pair) for pair in m.get("file_tokens", [])],
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
    sft: SftOptions | None = None,
) -> PreparedData:
    """sft: prepare fine-tuning records (data/sft.py) as examples; None: plain text."""
    if not 0.0 <= val_fraction < 1.0:
        raise PhalanxError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    base_dir, cache_root = Path(base_dir), Path(cache_root)
    owners = entry_of_files(sources, base_dir) if sft is None else None  # text: each file's data.sources entry
    resolved = sorted(owners) if sft is None else resolve_sft_sources(sources, base_dir)
    tokenizer_file = None
    if tokenizer is not None:
        tokenizer_file = base_dir / Path(tokenizer).expanduser()
        if not tokenizer_file.is_file():
            raise PhalanxError(f"tokenizer file {tokenizer_file} not found (data.tokenizer)")
    template = None if sft is None else template_for(tokenizer_file)
    key = _cache_key(resolved, vocab_size, tokenizer_file, val_fraction, text_field, sft, template)
    final = cache_root / key
    if (final / MANIFEST).is_file():
        data = PreparedData.load(final)
        shards = data.shards
        if sum(p.stat().st_size for p in shards if p.is_file()) <= VERIFY_ON_REUSE_BYTES:
            for path in shards:
                VerifiedShard(path).verify_all()
        if owners is not None:  # these entries may group the same files differently from the first ones
            save_source_groups(final, sources, [owners[s] for s in resolved])
        return data

    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _build(tmp, resolved, sources, vocab_size, tokenizer_file, val_fraction, text_field, progress, sft, template)
        if owners is not None:
            save_source_groups(tmp, sources, [owners[s] for s in resolved])
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not a concurrent winner: something else is in the way
                message = f"cannot create prepared data directory {final}; is a stale one in the way?"
                raise PhalanxError(message) from None
        return PreparedData.load(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def _build(
    dir, resolved, sources, vocab_size, tokenizer_file, val_fraction, text_field, progress, sft=None, template=None
) -> None:
    """Write tokenizer.json, the shards and, last of all, manifest.json (its presence means complete)."""
    with _progress(progress) as bar:

        def docs(label):  # a fresh pass over the corpus: one to train the tokenizer, one to encode
            if sft is not None:  # the records as the template renders them
                return _counting(tokenizer_texts(resolved, sft, template), bar, label, "records")
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
        if sft is None:
            file_of_doc: deque[int] = deque()  # the file of each document handed to the encoder, in order

            def sourced_docs():
                for index, doc in iter_sourced_documents(resolved, text_field):
                    file_of_doc.append(index)
                    yield doc

            token_docs = encode_documents(tok, _counting(sourced_docs(), bar, "tokenising"))
            counts = _write_shards(token_docs, dir, actual_vocab, val_fraction, file_of_doc, len(resolved))
        else:
            stats = SftStats()
            examples = _counting(iter_examples(resolved, sft, tok, template, stats), bar, "tokenising", "examples")
            counts = _write_examples(examples, dir, actual_vocab, val_fraction, sft.max_tokens)
            counts = _sft_manifest(counts, stats, sft, template)
    manifest = {
        "kind": "text" if sft is None else "sft",
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


def _cache_key(resolved, vocab_size, tokenizer_file, val_fraction, text_field, sft=None, template=None) -> str:
    tokenizer_hash = None
    if tokenizer_file:
        # The companion files decide the framing (BOS or none) and travel with the prepared tokenizer.
        digest = hashlib.sha256(tokenizer_file.read_bytes())
        for companion in companion_files(tokenizer_file.parent):
            digest.update(f"\0{companion.name}\0".encode() + companion.read_bytes())
        tokenizer_hash = digest.hexdigest()
    parts = [FORMAT_VERSION, sources_fingerprint(resolved), vocab_size, tokenizer_hash, val_fraction, text_field]
    if sft is not None:  # text keeps its key: caches prepared before fine-tuning existed stay valid
        parts += ["sft", asdict(sft), template]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def _write_shards(
    token_docs: Iterator[np.ndarray],
    dir: Path,
    vocab_size: int,
    val_fraction: float,
    file_of_doc: deque[int],
    files: int,
) -> dict:
    """The last `val_fraction` of each document's tokens goes to val, so even a corpus of a few long
    documents gets a held-out split. Documents shorter than 1/val_fraction tokens would contribute
    nothing that way; when the val share falls behind by a whole such document, it goes to val entire.
    `file_of_doc` yields the file of each document in turn: each file's [train, val] tokens are counted."""
    seen = val = documents = 0
    file_tokens = [[0, 0] for _ in range(files)]
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
            counts = file_tokens[file_of_doc.popleft()]
            counts[0] += len(ids) - n_val
            counts[1] += n_val
    return {
        "documents": documents,
        "train_shards": [p.name for p in train_w.paths],
        "val_shards": [p.name for p in val_w.paths],
        "train_tokens": train_w.total_tokens,
        "val_tokens": val_w.total_tokens,
        "file_tokens": file_tokens,
    }


def _write_examples(examples, dir: Path, vocab_size: int, val_fraction: float, max_length: int) -> dict:
    """Whole examples, in record order, each to train or val: example k (from 0) goes to val while val
    holds fewer than ceil(k * val_fraction), the share falling behind as in _write_shards. So val gets
    about val_fraction of the examples; the first goes to train, the second to val (val_fraction > 0)."""
    with (
        ExampleWriter(dir, "train", vocab_size, max_length) as train,
        ExampleWriter(dir, "val", vocab_size, max_length) as val,
    ):
        for k, (ids, trained) in enumerate(examples):
            behind = val.examples < math.ceil(round(k * val_fraction, 9))  # round: 0.07 * 100 is 7.000000000000001
            (val if behind else train).write(ids, trained)
    return {
        **{f"{name}_shards": [p.name for p in w.tokens.paths] for name, w in (("train", train), ("val", val))},
        **{f"{name}_mask_shards": [p.name for p in w.masks.paths] for name, w in (("train", train), ("val", val))},
        **{f"{name}_length_shards": [p.name for p in w.lengths.paths] for name, w in (("train", train), ("val", val))},
        "train_tokens": train.tokens.total_tokens,
        "val_tokens": val.tokens.total_tokens,
        "examples": {
            "train": train.examples,
            "val": val.examples,
            "train_trained_tokens": train.trained_tokens,
            "val_trained_tokens": val.trained_tokens,
        },
    }


def _sft_manifest(counts: dict, stats: SftStats, sft: SftOptions, template: str) -> dict:
    """The manifest's fine-tuning entries: shards, counts, the options and the template examples used."""
    examples = {"records": stats.records, **counts["examples"], "truncated": stats.truncated, "dropped": stats.dropped}
    return {
        **counts,
        "examples": examples,
        "sft": asdict(sft),
        "record_shapes": stats.shapes,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "chat_template_source": "phalanx" if template == CHAT_TEMPLATE else "tokenizer",
    }


def _progress(enabled: bool):
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    return Progress(*columns, transient=True, console=Console(stderr=True))  # stdout stays for results


def _counting(docs: Iterator, bar, label: str, unit: str = "documents") -> Iterator:
    task = bar.add_task(label) if bar is not None else None
    for n, doc in enumerate(docs, start=1):
        if task is not None:
            bar.update(task, description=f"{label}: {n} {unit}")
        yield doc
