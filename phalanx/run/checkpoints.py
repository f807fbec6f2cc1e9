"""Checkpoints as readers see them: list, verify, read the trainer state, load model weights alone.

Layout of `RUN_DIR/checkpoints/step_00000200/`:
  DCP files        model and optimizer state, sharded the way they lived in memory (DDP or FSDP2)
  rng_rank{R}.pt   each rank's torch RNG states
  trainer.json     step, loader position, model shape and anything else the loop needs to go on
  manifest.json    size and SHA-256 of every other file, written last

A checkpoint without its manifest is not complete (a save publishes it last). Writing checkpoints is
the trainer's (phalanx/train/checkpoint.py); everything that only reads them comes here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from phalanx.errors import PhalanxError
from phalanx.run.layout import MANIFEST, STEP_DIR, TRAINER_STATE

# DCP warns on every single-process save/load; one process without a group is a normal way to run here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (their manifest, written last, exists), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def incomplete_checkpoints(root: Path) -> list[Path]:
    """Step directories without a manifest: never a finished save (it writes the manifest before its
    rename), so something removed it; they are not checkpoints."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_DIR.match(p.name) and not (p / MANIFEST).is_file())


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / TRAINER_STATE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise PhalanxError(f"{path} is not a phalanx checkpoint (no {TRAINER_STATE})") from None
    except json.JSONDecodeError:
        raise PhalanxError(f"checkpoint {path} is corrupt: {TRAINER_STATE} is not valid JSON") from None


def write_trainer_state(path: Path, state: dict[str, Any]) -> None:
    (path / TRAINER_STATE).write_text(json.dumps(state, indent=1))


def check_model_shape(path: Path, model_args: dict[str, Any]) -> None:
    """Refuse a checkpoint written by a model of another shape, naming the fields that differ. A field
    the checkpoint predates has its default there (ModelArgs gains fields as families are added)."""
    from phalanx.models.decoder import ModelArgs

    defaults = {field.name: field.default for field in dataclasses.fields(ModelArgs)}
    saved = {**defaults, **read_trainer_state(path).get("model_args", {})}
    diffs = [f"{k} {saved.get(k)} != {v}" for k, v in model_args.items() if saved.get(k) != v]
    if diffs:
        raise PhalanxError(
            f"checkpoint {path} is from a different model shape ({'; '.join(diffs)}); "
            "use another run.name or checkpoint.resume=never"
        )


def file_entry(path: Path) -> dict[str, Any]:
    """A file's manifest entry: size and SHA-256."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def write_manifest(path: Path, files: dict[str, dict] | None = None) -> None:
    """The manifest, written last: `files` as hashed already (by every rank in parallel, see
    train/checkpoint.py), else every file in `path` hashed here."""
    if files is None:
        files = {f.name: file_entry(f) for f in sorted(path.iterdir()) if f.is_file() and f.name != MANIFEST}
    files = {name: files[name] for name in sorted(files) if name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify_checkpoint(path: Path, part: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint cannot be trusted, or None when every file matches its manifest. `part`
    (index, count) checks only every count-th file from index: ranks verify a checkpoint in parallel."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return "its manifest is missing or unreadable"
    index, count = part
    for name in sorted(files)[index::count]:
        expected = files[name]
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != expected["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {expected['size']}"
        if _sha256(f) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


def newest_valid_checkpoint(root: Path, on_corrupt, verify=verify_checkpoint) -> Path | None:
    """The newest checkpoint that passes `verify(path)`; corrupt ones are renamed out of the way
    (`corrupt-step_N`) and reported through `on_corrupt(path, reason)`. The renaming is one rank's:
    others pass on_corrupt=None and only take part in a collective `verify`."""
    for path in reversed(list_checkpoints(root)):
        reason = verify(path)
        if reason is None:
            return path
        if on_corrupt is not None:
            aside = path.with_name(f"corrupt-{path.name}")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            on_corrupt(path, reason)
    return None


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Only the model's weights, into a plain single-device model (generate, export, serve). A model with
    LoRA adapters (models/lora.py, the base already in it) takes only its adapters: a LoRA run's
    checkpoints hold nothing else of the model, and every adapter must be there."""
    from torch.distributed.checkpoint.api import CheckpointException

    from phalanx.models.lora import is_adapter
    from phalanx.run.safe_dcp import METADATA_FILE, UnsafeCheckpointError, read_metadata_file, safe_load

    model_sd = model.state_dict()
    adapters = {name: tensor for name, tensor in model_sd.items() if is_adapter(name)}
    if adapters:
        keys = read_metadata_file(path / METADATA_FILE).state_dict_metadata
        saved = {key.removeprefix("model.") for key in keys if key.startswith("model.")}
        missing = sorted(name for name in adapters if name not in saved)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise PhalanxError(
                f"checkpoint {path} lacks the LoRA adapter {missing[0]}{more} that its {TRAINER_STATE}'s lora "
                "settings imply; it was not written by this LoRA run"
            )
        model_sd = adapters
    try:
        with warnings.catch_warnings():  # one process reading alone is the intent here, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_load({"model": model_sd}, path)
    except UnsafeCheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        raise PhalanxError(f"cannot load checkpoint {path}: {dcp_error_line(exc)}") from exc
    model.load_state_dict(model_sd, strict=not adapters)


def dcp_error_line(exc: BaseException) -> str:
    """DCP wraps each rank's (exception, traceback) into its message; the root cause is what a user needs."""
    failures = getattr(exc, "failures", None)
    if failures:
        cause = next(iter(failures.values()))[0]
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
