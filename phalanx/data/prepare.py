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

Text is tokenised in work units (data/units.py: files, byte ranges of big JSON Lines files, Parquet row
groups), by worker processes or Ray tasks (data/dispatch.py), each into a part file kept in a staging
directory `cache_root/.parts-<key>-<units>` (data/parts.py); the parts are then put together in corpus
order (data/merge.py), so the shards are the same bytes for any number of workers. An interrupted
preparation finds the finished parts there and tokenises only the rest; the staging directory goes once
the prepared directory is in place (or when bad input stops preparation: fixing it changes the key).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from phalanx.data.chat_template import CHAT_TEMPLATE
from phalanx.data.corpus import entry_of_files, sources_fingerprint
from phalanx.data.dispatch import available_cores, run_local, run_on_ray
from phalanx.data.merge import ShardMerge
from phalanx.data.parts import PartStore, TokenizerSpec, UnitJob
from phalanx.data.prepare_progress import UnitProgress
from phalanx.data.sft import (
    ExampleWriter,
    SftOptions,
    SftStats,
    iter_examples,
    resolve_sft_sources,
    template_for,
    tokenizer_texts,
)
from phalanx.data.shards import VerifiedShard, dtype_for_vocab
from phalanx.data.source_groups import save_source_groups
from phalanx.data.tokenizer import companion_files, load_tokenizer, special_tokens, train_tokenizer
from phalanx.data.tokenizer_sample import DEFAULT_SAMPLE_BYTES, capped, sample_documents
from phalanx.data.units import UNIT_BYTES, cut_units
from phalanx.errors import PhalanxError

FORMAT_VERSION = 2  # 2: shards carry chunk checksums (data/shards.py)
MANIFEST = "manifest.json"
# Reused data this small is checked in full (about a second of CRC-32 per GiB) before anything trains on
# it; larger data is checked chunk by chunk as the loader first reads each chunk.
VERIFY_ON_REUSE_BYTES = 1 << 30
KINDS = ("text", "sft")
# Less than this left to tokenise is done in this process: starting worker processes would cost more.
POOL_MIN_BYTES = 8 << 20


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
    workers: int | None = None,
    ray_address: str | None = None,
    tokenizer_sample_bytes: int = DEFAULT_SAMPLE_BYTES,
) -> PreparedData:
    """sft: prepare fine-tuning records (data/sft.py) as examples; None: plain text. workers: processes
    tokenising text on this node (None: one per core available); ray_address: tokenise as Ray tasks on
    that cluster instead. Neither changes a byte of the result, so neither is in the key.
    tokenizer_sample_bytes: the most text a trained tokenizer reads (data/tokenizer_sample.py).
    Fine-tuning records are prepared in this process alone: they are small beside pretraining text."""
    if not 0.0 <= val_fraction < 1.0:
        raise PhalanxError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    if workers is not None and workers < 1:
        raise PhalanxError(f"data.workers must be at least 1, got {workers}")
    if tokenizer_sample_bytes < 1:
        raise PhalanxError(f"data.tokenizer_sample_bytes must be at least 1, got {tokenizer_sample_bytes}")
    base_dir, cache_root = Path(base_dir), Path(cache_root)
    owners = entry_of_files(sources, base_dir) if sft is None else None  # text: each file's data.sources entry
    resolved = sorted(owners) if sft is None else resolve_sft_sources(sources, base_dir)
    tokenizer_file = None
    if tokenizer is not None:
        tokenizer_file = base_dir / Path(tokenizer).expanduser()
        if not tokenizer_file.is_file():
            raise PhalanxError(f"tokenizer file {tokenizer_file} not found (data.tokenizer)")
    template = None if sft is None else template_for(tokenizer_file)
    sample = tokenizer_sample_bytes if tokenizer_file is None else None
    key = _cache_key(resolved, vocab_size, tokenizer_file, val_fraction, text_field, sft, template, sample)
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
    run = _Run(workers or available_cores(), ray_address, tokenizer_sample_bytes)
    try:
        if sft is None:
            run.units = cut_units(resolved, UNIT_BYTES)
            digest = hashlib.sha256(json.dumps([u.as_json() for u in run.units]).encode()).hexdigest()[:8]
            run.staging = cache_root / f".parts-{key}-{digest}"
        _build(
            tmp, resolved, sources, vocab_size, tokenizer_file, val_fraction, text_field, progress, sft, template, run
        )
        if owners is not None:
            save_source_groups(tmp, sources, [owners[s] for s in resolved])
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).is_file():  # not a concurrent winner: something else is in the way
                message = f"cannot create prepared data directory {final}; is a stale one in the way?"
                raise PhalanxError(message) from None
        if run.staging is not None:
            shutil.rmtree(run.staging, ignore_errors=True)
        return PreparedData.load(final)
    except Exception as e:
        if (final / MANIFEST).is_file():  # a concurrent preparation of the same key won (and took the parts)
            return PreparedData.load(final)
        if isinstance(e, _BadInput) and run.staging is not None:  # fixing the input changes the key
            shutil.rmtree(run.staging, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


class _BadInput(PhalanxError):
    """Bad input met while tokenising: the parts made so far can never be used (fixing the input changes
    the key), unlike those of a preparation stopped by anything else (Ctrl-C, a lost Ray cluster)."""


@dataclass
class _Run:
    """How this preparation runs (none of it changes the result): workers, a Ray cluster, the tokenizer's
    sample bound; for text, the units and their staging directory."""

    workers: int
    ray_address: str | None
    sample_bytes: int
    units: list = field(default_factory=list)
    staging: Path | None = None


def _build(
    dir, resolved, sources, vocab_size, tokenizer_file, val_fraction, text_field, progress, sft, template, run
) -> None:
    """Write tokenizer.json, the shards and, last of all, manifest.json (its presence means complete)."""
    with _progress(progress) as bar:

        def docs(label):  # the tokenizer's training text: the corpus, or a bounded sample of it
            if sft is not None:  # the records as the template renders them
                texts = capped(tokenizer_texts(resolved, sft, template), run.sample_bytes)
                return _counting(texts, bar, label, "records")
            return _counting(sample_documents(resolved, text_field, run.sample_bytes), bar, label)

        staged = None if run.staging is None else run.staging / "tokenizer.json"
        if tokenizer_file is not None:
            tok = load_tokenizer(tokenizer_file)
            tok.save(str(dir / "tokenizer.json"))
        elif staged is not None and staged.is_file():  # trained by the preparation this one resumes
            tok = load_tokenizer(staged)
            shutil.copyfile(staged, dir / "tokenizer.json")
        else:
            tok = train_tokenizer(docs("training tokenizer"), vocab_size)
            tok.save(str(dir / "tokenizer.json"))
            if staged is not None:  # kept for a resumed preparation: training it again would cost minutes
                staged.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(dir / "tokenizer.json", staged.with_suffix(f".{os.getpid()}.tmp"))
                os.replace(staged.with_suffix(f".{os.getpid()}.tmp"), staged)
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
            counts = _tokenise_text(dir, resolved, tok, actual_vocab, val_fraction, text_field, bar, run)
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


def _cache_key(
    resolved, vocab_size, tokenizer_file, val_fraction, text_field, sft=None, template=None, sample=None
) -> str:
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
    if sample is not None and sample != DEFAULT_SAMPLE_BYTES:  # the default keeps the keys made before it
        parts += ["tokenizer_sample_bytes", sample]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def _tokenise_text(dir, resolved, tok, vocab_size, val_fraction, text_field, bar, run) -> dict:
    """Tokenise the units not already in the staging directory, put every part into the shards in unit
    order (while later units are still being tokenised) and return the manifest's counts."""
    store, units, dtype = PartStore(run.staging), run.units, dtype_for_vocab(vocab_size)
    finished = {i: meta for i in range(len(units)) if (meta := store.finished(i)) is not None}
    jobs = [
        UnitJob(i, u, resolved[u.source], text_field, run.staging, dtype.str)
        for i, u in enumerate(units)
        if i not in finished
    ]
    spec = TokenizerSpec(tok.to_str(), special_tokens(tok))
    if run.ray_address is not None:
        results = run_on_ray(jobs, spec, run.ray_address)
    else:
        small = sum(job.unit.size for job in jobs) < POOL_MIN_BYTES
        results = run_local(jobs, spec, 1 if small else run.workers)
    reused_bytes = sum(units[i].size for i in finished)
    progress = UnitProgress(bar, len(units), sum(u.size for u in units), len(finished), reused_bytes)
    if finished and bar is not None:
        bar.console.print(f"resuming: {len(finished)} of {len(units)} units already tokenised in {run.staging}")
    records, nodes = [0] * len(resolved), set()
    with closing(results), ShardMerge(dir, vocab_size, val_fraction, len(resolved)) as merge:
        for i, unit in enumerate(units):
            meta = finished.get(i)
            if meta is None:
                meta = next(results)
                if "error" in meta:
                    raise _BadInput(meta["error"])
                nodes.add(meta.get("node"))
                progress.finished(unit.size, meta["tokens"])
            records[unit.source] += meta.get("records", 0)
            merge.add(unit.source, *store.read(i, dtype))
            _unit_merged(i)
    for index, source in enumerate(resolved):  # a file cut into units is checked for records here, as a whole
        split = any(u.source == index and u.how != "whole" for u in units)
        if split and records[index] == 0:
            raise _BadInput(f"data source {source.path} holds no records")
    if merge.documents == 0:
        names = ", ".join(str(s.path) for s in resolved[:3]) + (", ..." if len(resolved) > 3 else "")
        raise _BadInput(f"corpus is empty: no text in {len(resolved)} source file(s) ({names})")
    ray_nodes = len(nodes - {None})
    workers = None if run.ray_address is not None else run.workers  # on Ray, the cluster's CPUs tokenised
    preparation = {"units": len(units), "reused_units": len(finished), "workers": workers, "ray_nodes": ray_nodes}
    return {**merge.counts(), "preparation": preparation}


def _unit_merged(index: int) -> None:
    """Called as each unit's part enters the shards; tests stop a preparation here as a crash would."""


def _write_examples(examples, dir: Path, vocab_size: int, val_fraction: float, max_length: int) -> dict:
    """Whole examples, in record order, each to train or val: example k (from 0) goes to val while val
    holds fewer than ceil(k * val_fraction), the share falling behind as in ShardMerge.add. So val gets
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
