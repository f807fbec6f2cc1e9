"""JSON-lines files of a run: the sinks that append them and the reader every consumer uses."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per record, stamped with `time`; line-buffered so a crash loses at most
    the current line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(json_safe({**record, "time": time.time()})) + "\n")
        except OSError as exc:  # a full disk above all: the error then names the file
            exc.filename = exc.filename or str(self.path)
            raise

    def close(self) -> None:
        self._file.close()


class NullSink:
    """For ranks other than 0: only one process writes the run's shared files."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def append_line(path: Path, line: str) -> None:
    """One write() on a file opened with O_APPEND: lines from several processes (or the agents of several
    nodes on a shared file system) never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none if it is missing), skipping a line a crash cut short."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def json_safe(value: Any) -> Any:
    """NaN and Inf become null: strict JSON readers (jq, JSON.parse) reject Python's bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
