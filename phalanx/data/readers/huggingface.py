"""Hugging Face datasets, through the `datasets` library (phalanx's data extra):
  - saved with `save_to_disk`: a directory with state.json, dataset_info.json and Arrow files, which
    `load_from_disk` memory-maps, so rows are paged in from disk as they are read;
  - on the hub: `hf:NAME`, `hf:NAME:SPLIT` or `hf:NAME:CONFIG:SPLIT` (split "train" when none is given),
    streamed with `load_dataset(..., streaming=True)`: nothing is downloaded whole.
A saved DatasetDict (dataset_dict.json, one directory per split) is refused: name the split's directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.data.readers.oneline import first_line
from phalanx.data.readers.optional import require_module
from phalanx.errors import PhalanxError

HUB_PREFIX = "hf:"
DEFAULT_SPLIT = "train"
BATCH_ROWS = 1024  # rows converted to Python at once
# A hub id: NAME or ORG/NAME, of letters, digits, "-", "_" and "."
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_PART = re.compile(r"^[\w.-]+$")


@dataclass(frozen=True)
class HubName:
    name: str
    config: str | None
    split: str


def parse_hub_name(entry: str) -> HubName:
    """`hf:NAME[:SPLIT]` or `hf:NAME:CONFIG:SPLIT`, refused in one line showing the forms it can take."""
    parts = entry[len(HUB_PREFIX) :].split(":")
    usage = f"write hf:ORG/NAME, hf:ORG/NAME:SPLIT or hf:ORG/NAME:CONFIG:SPLIT, not {entry!r}"
    if not 1 <= len(parts) <= 3 or not _HUB_NAME.match(parts[0]) or not all(_PART.match(p) for p in parts[1:]):
        raise PhalanxError(f"data source {entry!r} is not a hub dataset name: {usage}")
    if len(parts) == 3:
        return HubName(parts[0], parts[1], parts[2])
    return HubName(parts[0], None, parts[1] if len(parts) == 2 else DEFAULT_SPLIT)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by Dataset.save_to_disk (or a DatasetDict's, refused when read)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file() or is_saved_dataset_dict(path)


def is_saved_dataset_dict(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def saved_dataset_files(path: Path) -> list[Path]:
    """The files of a saved dataset, for the cache key: rewriting it changes their sizes and mtimes."""
    return sorted(f for f in path.rglob("*") if f.is_file())


def check_saved_dataset(path: Path) -> None:
    """Refuse what cannot be read before anything is prepared: the datasets package missing, a DatasetDict."""
    require_module("datasets", f"data source {path} (a saved Hugging Face dataset)")
    if is_saved_dataset_dict(path):
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        example = path / (splits[0] if splits else DEFAULT_SPLIT)
        raise PhalanxError(
            f"data source {path} is a saved DatasetDict (splits: {', '.join(splits) or 'unknown'}); "
            f"name one split's directory, e.g. {example}"
        )


def saved_dataset_rows(path: Path, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, row) of a dataset saved with save_to_disk."""
    datasets = _quiet_datasets(f"data source {path} (a saved Hugging Face dataset)")
    if _data_files(path) == []:  # a dataset of no rows is saved without Arrow files, and load_from_disk fails
        return
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, pyarrow errors, ...
        raise PhalanxError(f"{path}: not a readable saved dataset ({first_line(e)})") from None
    if not isinstance(dataset, datasets.Dataset):
        raise PhalanxError(f"data source {path} is a saved DatasetDict; name one split's directory")
    if columns is not None:
        _check_columns(str(path), dataset.column_names, columns)
        dataset = dataset.select_columns(columns)
    try:
        row = 0
        for batch in dataset.iter(batch_size=BATCH_ROWS):
            for values in zip(*batch.values()):
                row += 1
                yield row, dict(zip(batch, values))
    except Exception as e:  # a truncated or damaged Arrow file
        raise PhalanxError(f"{path}: not a readable saved dataset ({first_line(e)})") from None


def _data_files(path: Path) -> list | None:
    """The Arrow files state.json lists (None where it cannot be read: load_from_disk then says why)."""
    try:
        return json.loads((path / "state.json").read_text()).get("_data_files")
    except (OSError, ValueError, AttributeError):
        return None


def check_hub(entry: str) -> None:
    parse_hub_name(entry)
    require_module("datasets", f"data source {entry!r}")


def hub_rows(entry: str, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, row) of a hub dataset's split, streamed. With no network (or HF_HUB_OFFLINE set)
    this is one line saying so, not the library's traceback."""
    hub = parse_hub_name(entry)
    datasets = _quiet_datasets(f"data source {entry!r}")
    try:
        dataset = datasets.load_dataset(hub.name, hub.config, split=hub.split, streaming=True)
        rows = iter(dataset)
        row = 0
        for value in rows:
            row += 1
            if columns is not None and row == 1:
                _check_columns(entry, list(value), columns)
            yield row, value if columns is None else {c: value[c] for c in columns}
    except PhalanxError:
        raise
    except Exception as e:  # no network, no such dataset, config or split, a dropped connection
        raise PhalanxError(
            f"{entry}: cannot stream it from the Hugging Face hub ({first_line(e)}); where the hub is out of "
            "reach, save the dataset with save_to_disk elsewhere and name its directory"
        ) from None


def _check_columns(where: str, names: list[str], columns: list[str]) -> None:
    for column in columns:
        if column not in names:
            raise PhalanxError(
                f"{where}: no {column!r} column (it has {', '.join(names) or 'none'}); "
                "set data.text_field to the text column"
            )


def _quiet_datasets(what: str):
    datasets = require_module("datasets", what)
    # Progress bars and info logs on stderr would bury the one line an error gives; phalanx shows its own.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets
