"""Reading DCP checkpoints that someone else may have written, without running their code.

torch's FileSystemReader reads a checkpoint's `.metadata` with a bare `pickle.load`, and the default
load planner reads non-tensor items (the optimizer's param_groups) with `torch.load(weights_only=False)`:
a crafted checkpoint directory runs code the moment any command opens it (and the manifest's SHA-256s
do not help, an attacker rewrites them too). Here the metadata goes through an unpickler that knows
only DCP's own metadata classes and a few harmless torch types, and byte items through
`torch.load(weights_only=True)`. Anything else is refused with one line naming what it tried to load.
No library offers this reader, hence this small one.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from phalanx.errors import PhalanxError

_METADATA_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "ChunkStorageMetadata",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
ALLOWED_GLOBALS = frozenset(
    {
        *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout from its name
        ("pathlib", "PosixPath"),  # the checkpoint id recorded at save time
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class UnsafeCheckpointError(PhalanxError):
    """A checkpoint whose metadata asks to load something other than DCP's own classes (exit code 2)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata_file(path: Path) -> Any:
    """The checkpoint's DCP metadata, or UnsafeCheckpointError if it is not plain DCP metadata."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"refusing to load {path}: its DCP metadata asks to load {exc}, which a "
            "checkpoint never needs (a crafted checkpoint can run code this way)"
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError) as exc:
        raise UnsafeCheckpointError(f"checkpoint metadata {path} is unreadable: {exc}") from None


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata goes through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        locate = getattr(self, "_get_metadata_path", None)  # torch >= 2.7; a fixed name before
        path = locate(rank) if locate is not None else Path(self.path) / ".metadata"
        metadata = read_metadata_file(Path(path))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Byte items (non-tensor state such as param_groups) read with weights_only=True. The default planner
    then stores them; it reads its input with weights_only=False, so it is handed a copy re-saved from
    the already checked value, never the checkpoint's own bytes."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            checked = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"refusing a checkpoint item {read_item.dest_index.fqn}: {str(exc).splitlines()[0]}"
            ) from None
        clean = io.BytesIO()
        torch.save(checked, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


METADATA_FILE = ".metadata"  # DCP's name for it


def check_metadata(checkpoint: Path) -> None:
    """Refuse (UnsafeCheckpointError) a checkpoint whose metadata is not plain DCP metadata; for the
    launcher, before any rank starts."""
    read_metadata_file(Path(checkpoint) / METADATA_FILE)


def safe_load(state_dict: dict[str, Any], checkpoint: Path) -> None:
    """dcp.load through the safe reader and planner (in place, as dcp.load). An unsafe checkpoint raises
    UnsafeCheckpointError itself, not wrapped in DCP's CheckpointException."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_metadata(checkpoint)
    try:
        dcp.load(state_dict, storage_reader=SafeReader(checkpoint), planner=SafeLoadPlanner())
    except CheckpointException as exc:
        for failure in getattr(exc, "failures", {}).values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, UnsafeCheckpointError):
                raise cause from None
        raise
