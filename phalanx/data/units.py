"""Work units: the corpus cut into pieces that can be tokenised apart and put back together in order.

A unit is a whole source (a .txt/.md file, a play, a compressed JSON Lines file, a saved or hub dataset),
a byte range of a plain .jsonl file cut at line ends, or one row group of a Parquet file. The cut depends
only on the files and `unit_bytes`, never on how many workers there are, so the documents of the units
read one after another are exactly the documents of the corpus read straight through
(corpus.iter_sourced_documents), and so are the tokens and shards made from them.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from phalanx.data.corpus import Source, _read
from phalanx.data.readers.jsonl import json_line
from phalanx.errors import PhalanxError

UNIT_BYTES = 32 << 20  # a unit's share of a big file: a few seconds of one core's tokenising


@dataclass(frozen=True)
class Unit:
    """`source`: the index of the source in the resolved list. `how`: "whole" (read as the corpus reads
    it), "lines" (bytes start..stop of a .jsonl file, both at line starts) or "rows" (Parquet row group
    `start`, whose first row is row `stop` + 1 of the file). `size`: bytes on disk, for progress."""

    source: int
    how: str
    start: int = 0
    stop: int = 0
    size: int = 0

    def as_json(self) -> dict:
        return asdict(self)


def cut_units(sources: list[Source], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of every source, in corpus order."""
    units: list[Unit] = []
    for index, source in enumerate(sources):
        units += _units_of(index, source, unit_bytes)
    return units


def _units_of(index: int, source: Source, unit_bytes: int) -> list[Unit]:
    size = _disk_size(source)
    if source.kind == "jsonl" and source.path.name.lower().endswith(".jsonl") and size > unit_bytes:
        return [Unit(index, "lines", a, b, b - a) for a, b in _line_cuts(source.path, size, unit_bytes)]
    if source.kind == "parquet":
        groups = _row_groups(source.path)
        if len(groups) > 1:
            return [Unit(index, "rows", g, first, nbytes) for g, (first, nbytes) in enumerate(groups)]
    return [Unit(index, "whole", size=size)]


def _disk_size(source: Source) -> int:
    if source.kind == "hf_hub":
        return 0  # streamed: its size is not known beforehand
    if source.path.is_dir():
        return sum(f.stat().st_size for f in source.path.rglob("*") if f.is_file())
    return source.path.stat().st_size


def _line_cuts(path: Path, size: int, unit_bytes: int) -> list[tuple[int, int]]:
    """(start, stop) byte ranges of about unit_bytes each, every cut just after a newline."""
    cuts = [0]
    with path.open("rb") as f:
        while cuts[-1] + unit_bytes < size:
            f.seek(cuts[-1] + unit_bytes)
            f.readline()  # to the end of the line the nominal cut falls in
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    return list(zip(cuts, cuts[1:] + [size]))


def _row_groups(path: Path) -> list[tuple[int, int]]:
    """(rows before it, compressed bytes) of each row group; none where the file does not open (reading it
    whole then says why, in one line)."""
    import pyarrow
    import pyarrow.parquet

    try:
        meta = pyarrow.parquet.ParquetFile(path).metadata
    except (OSError, pyarrow.ArrowException):
        return []
    groups, first = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        groups.append((first, group.total_byte_size))
        first += group.num_rows
    return groups


def unit_documents(unit: Unit, source: Source, text_field: str, counts: dict) -> Iterator[str]:
    """The non-empty documents of one unit, in order; counts["records"] counts the rows read (a split file
    with none at all is refused when its units are put together)."""
    if unit.how == "whole":
        docs = _read(source, text_field)
    elif unit.how == "lines":
        docs = _texts(_jsonl_range(source.path, unit.start, unit.stop), text_field, counts)
    else:
        docs = _texts(_parquet_group(source.path, unit.start, unit.stop, text_field), text_field, counts)
    return (doc for doc in docs if doc.strip())


def _texts(rows, text_field: str, counts: dict) -> Iterator[str]:
    """The text field of each row, refused as corpus._read_records refuses it (the same words)."""
    for where, record in rows:
        counts["records"] = counts.get("records", 0) + 1
        if not isinstance(record, dict) or text_field not in record:
            raise PhalanxError(f"{where}: no {text_field!r} field (set data.text_field to the text key)")
        value = record[text_field]
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            raise PhalanxError(f"{where}: field {text_field!r} is {kind}, expected a string")
        yield value


def _jsonl_range(path: Path, start: int, stop: int):
    """(file:line, value) of the non-blank lines in bytes start..stop. The range is read whole (a unit is
    a few tens of MB); line numbers are counted from the file's start only when an error needs one."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            chunk = f.read(stop - start)
    except OSError as e:
        raise PhalanxError(f"cannot read data source {path}: {e.strerror}") from None
    for offset, raw in enumerate(io.BytesIO(chunk)):
        if not raw.strip():
            continue
        value = json_line(raw, lambda k=offset: f"{path}:{_line_number(path, start, k)}")
        yield _Where(path, start, offset), value


@dataclass(frozen=True)
class _Where:
    """`file:line` of a line in a range, its number counted (reading the file up to it) only when an error
    message prints it: counting it for every line would read each big file twice."""

    path: Path
    start: int
    offset: int

    def __str__(self) -> str:
        return f"{self.path}:{_line_number(self.path, self.start, self.offset)}"


def _line_number(path: Path, start: int, offset: int) -> int:
    """The 1-based number of the line `offset` lines after byte `start` (which begins a line)."""
    before = 0
    with path.open("rb") as f:
        while f.tell() < start:
            before += f.read(min(1 << 24, start - f.tell())).count(b"\n")
    return before + offset + 1


def _parquet_group(path: Path, group: int, first_row: int, text_field: str):
    """(file:row N, row) of one row group, rows numbered from the file's first as parquet_rows numbers them."""
    import pyarrow
    import pyarrow.parquet

    from phalanx.data.readers.oneline import first_line
    from phalanx.data.readers.parquet import BATCH_ROWS

    try:
        file = pyarrow.parquet.ParquetFile(path)
        names = file.schema_arrow.names
        if text_field not in names:
            raise PhalanxError(
                f"{path}: no {text_field!r} column (it has {', '.join(names) or 'none'}); "
                "set data.text_field to the text column"
            )
        row = first_row
        for batch in file.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[text_field]):
            for value in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", value
    except (OSError, pyarrow.ArrowException) as e:
        raise PhalanxError(f"{path}: not a readable Parquet file ({first_line(e)})") from None
