"""Parquet, read a record batch at a time with pyarrow (a core dependency): memory holds one batch of rows,
never the whole file, however large it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx.data.readers.oneline import first_line
from phalanx.errors import PhalanxError

SUFFIXES = (".parquet",)
BATCH_ROWS = 1024  # rows in memory at once


def parquet_rows(path: Path, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, row as a dict) of every row; `columns`: read only these (a text corpus reads
    its text column alone), each refused in one line if the file lacks it."""
    import pyarrow
    import pyarrow.parquet

    try:
        file = pyarrow.parquet.ParquetFile(path)
        if columns is not None:
            names = file.schema_arrow.names
            for column in columns:
                if column not in names:
                    raise PhalanxError(
                        f"{path}: no {column!r} column (it has {', '.join(names) or 'none'}); "
                        "set data.text_field to the text column"
                    )
        row = 0
        for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            for value in batch.to_pylist():
                row += 1
                yield row, value
    except (OSError, pyarrow.ArrowException) as e:
        raise PhalanxError(f"{path}: not a readable Parquet file ({first_line(e)})") from None
