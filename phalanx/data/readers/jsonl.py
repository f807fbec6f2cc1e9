"""JSON Lines, plain or compressed: `.jsonl`, `.jsonl.gz` (stdlib gzip) and `.jsonl.zst` (the `zstandard`
package, phalanx's data extra). Each is read a line at a time, so a large file never sits in memory whole."""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from phalanx.data.readers.oneline import first_line
from phalanx.data.readers.optional import require_module
from phalanx.errors import PhalanxError

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


def require_compression(path: Path) -> None:
    """Refuse a .zst file up front, in one line, where zstandard is not installed (gzip is the stdlib's)."""
    if path.name.lower().endswith(".zst"):
        require_module("zstandard", f"data source {path}")


def open_lines(path: Path) -> IO[bytes]:
    """The file's decompressed bytes, iterable by line."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        zstandard = require_module("zstandard", f"data source {path}")
        # The decompression reader has no readline; a BufferedReader over it gives line iteration.
        # read_across_frames: pzstd and `zstd -T` write several frames, and the file is all of them.
        reader = zstandard.ZstdDecompressor().stream_reader(path.open("rb"), read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)
    return path.open("rb")


def jsonl_values(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line; a line that is not UTF-8 JSON, or bytes that do
    not decompress, stop it with one line naming the file. Text documents and fine-tuning records
    (data/sft.py) are both read here."""
    try:
        f = open_lines(path)  # bytes, so a bad line's UTF-8 error can name its line number
    except OSError as e:
        raise PhalanxError(f"cannot read data source {path}: {e.strerror}") from None
    lineno = 0
    with f:
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except _decompression_errors(path) as e:
                after = f" after line {lineno}" if lineno else ""
                raise PhalanxError(f"{path}: corrupt or truncated compressed data{after} ({first_line(e)})") from None
            lineno += 1
            if not raw.strip():
                continue
            yield lineno, json_line(raw, lambda n=lineno: f"{path}:{n}")


def json_line(raw: bytes, where: Callable[[], str]) -> Any:
    """One JSON Lines record; bad bytes or JSON are one line naming `where()` (file:line, asked only then)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise PhalanxError(f"{where()}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise PhalanxError(f"{where()}: invalid JSON ({e.msg})") from None


def _decompression_errors(path: Path) -> tuple[type[BaseException], ...]:
    # gzip.BadGzipFile is an OSError, a truncated gzip an EOFError; zstandard raises its own ZstdError.
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    if path.name.lower().endswith(".zst"):
        errors += (require_module("zstandard", f"data source {path}").ZstdError,)
    return errors
