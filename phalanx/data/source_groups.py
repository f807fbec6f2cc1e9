"""Which `data.sources` entry each prepared file belongs to, kept beside the prepared data.

Prepared data is keyed by the files it was made from, not by how the config's entries group them
(`[notes/]` and `[notes/a.txt, notes/b.txt]` share one cache), so the grouping of one list of entries is a
small file of its own, `sources-<hash of the entries>.json`, written once beside the manifest. A mixture
of sources by weight (data/mixture_sources.py) reads it with the manifest's token count of each file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def groups_path(dir: Path, entries: list[str]) -> Path:
    digest = hashlib.sha256(json.dumps([str(e) for e in entries]).encode()).hexdigest()[:16]
    return Path(dir) / f"sources-{digest}.json"


def save_source_groups(dir: Path, entries: list[str], entry_of_file: list[int]) -> None:
    """Record the entry of each of the manifest's files (in its `files` order), unless already recorded.
    A shared cache may be read-only: then a mixed run says so when it needs the file (load_source_groups)."""
    path = groups_path(dir, entries)
    if path.is_file():
        return
    record = {"sources": [str(e) for e in entries], "entry_of_file": entry_of_file}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # two preparations of one cache may race
    try:
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def load_source_groups(dir: Path, entries: list[str]) -> list[int] | None:
    """The entry index of each prepared file, or None where these entries were never prepared here."""
    try:
        record = json.loads(groups_path(dir, entries).read_text())
    except (OSError, ValueError):
        return None
    return record["entry_of_file"] if record.get("sources") == [str(e) for e in entries] else None
