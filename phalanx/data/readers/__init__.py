"""Readers of record files: the rows of JSON Lines (plain, gzip or zstd), Parquet and Hugging Face datasets
(saved to disk or streamed from the hub), each row a dict, each with where it came from (`file:line`, or
`file:row N`, rows counted from 1 as lines are). A text corpus takes one field of each row as a document
(data/corpus.py); fine-tuning takes the rows as records (data/sft.py).

Sources are named by a path and a kind: "jsonl" (.jsonl, .jsonl.gz, .jsonl.zst), "parquet", "hf_disk"
(a directory written by save_to_disk) or "hf_hub" (the path is the `hf:...` entry as written).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx.data.readers.huggingface import HUB_PREFIX, hub_rows, saved_dataset_rows
from phalanx.data.readers.jsonl import SUFFIXES as JSONL_SUFFIXES
from phalanx.data.readers.jsonl import jsonl_values
from phalanx.data.readers.parquet import SUFFIXES as PARQUET_SUFFIXES
from phalanx.data.readers.parquet import parquet_rows
from phalanx.errors import PhalanxError

RECORD_KINDS = ("jsonl", "parquet", "hf_disk", "hf_hub")
# File suffix -> kind, for the files a directory or glob names.
RECORD_SUFFIXES = {**dict.fromkeys(JSONL_SUFFIXES, "jsonl"), **dict.fromkeys(PARQUET_SUFFIXES, "parquet")}


def iter_rows(path: Path, kind: str, columns: list[str] | None = None) -> Iterator[tuple[str, Any]]:
    """(where, value) of every row of one source, in order; `columns`: read only these where the format
    allows (Parquet and datasets are columnar; a JSON line is parsed whole). A source with no rows at all
    is refused: an empty Parquet file or dataset is almost always an export that went wrong."""
    if kind == "jsonl":
        rows = ((f"{path}:{n}", value) for n, value in jsonl_values(path))
    elif kind == "parquet":
        rows = ((f"{path}:row {n}", value) for n, value in parquet_rows(path, columns))
    elif kind == "hf_disk":
        rows = ((f"{path}:row {n}", value) for n, value in saved_dataset_rows(path, columns))
    elif kind == "hf_hub":
        rows = ((f"{path}:row {n}", value) for n, value in hub_rows(str(path), columns))
    else:
        raise ValueError(f"not a record source kind: {kind!r}")
    empty = True
    for row in rows:
        empty = False
        yield row
    if empty:
        raise PhalanxError(f"data source {path} holds no records")


__all__ = ["HUB_PREFIX", "RECORD_KINDS", "RECORD_SUFFIXES", "iter_rows"]
