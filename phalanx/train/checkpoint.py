"""Checkpoints with torch.distributed.checkpoint (DCP): one directory per save, named by step.

Layout of `RUN_DIR/checkpoints/step_00000200/`:
  DCP files        model and optimizer state, sharded the way they live in memory (DDP or FSDP2)
  rng_rank{R}.pt   each rank's torch RNG states
  trainer.json     step, loader position, model shape and anything else the loop needs to go on
  manifest.json    size and SHA-256 of every other file, written last

A save is written under a hidden temporary name and renamed once every rank has finished, so a partial
save never looks like a checkpoint; only the newest `keep` are kept. A save that fails (disk full, I/O
error) is reported to the caller and leaves nothing behind. Before resuming, the newest checkpoint is
checked against its manifest; a corrupt one is set aside (renamed `corrupt-step_...`) for the previous.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from phalanx.errors import CheckpointLoadError, PhalanxError
from phalanx.parallel.distributed import DistEnv

# DCP warns on every single-process save/load; one process without a group is a normal way to run here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAINER_STATE = "trainer.json"
MANIFEST = "manifest.json"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (their manifest, written last, exists), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


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


def check_model_shape(path: Path, model_args: dict[str, Any]) -> None:
    """Refuse a checkpoint written by a model of another shape, naming the fields that differ."""
    saved = read_trainer_state(path).get("model_args", {})
    diffs = [f"{k} {saved.get(k)} != {v}" for k, v in model_args.items() if saved.get(k) != v]
    if diffs:
        raise PhalanxError(f"checkpoint {path} is from a different model shape ({'; '.join(diffs)}); "
                           "use another run.name or checkpoint.resume=never")


def write_manifest(path: Path) -> None:
    files = {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(path.iterdir()) if f.is_file() and f.name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify_checkpoint(path: Path) -> str | None:
    """Why the checkpoint cannot be trusted, or None when every file matches its manifest."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return "its manifest is missing or unreadable"
    for name, expected in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != expected["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {expected['size']}"
        if _sha256(f) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


def newest_valid_checkpoint(root: Path, on_corrupt) -> Path | None:
    """The newest checkpoint that passes verification; corrupt ones are renamed out of the way and
    reported through `on_corrupt(path, reason)`. Run on one rank only."""
    for path in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(path)
        if reason is None:
            return path
        aside = path.with_name(f"corrupt-{path.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        on_corrupt(path, reason)
    return None


class Checkpointer:
    def __init__(self, root: Path, keep: int, env: DistEnv):
        self.root, self.keep, self.env = root, keep, env

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
             storage_writer=None) -> Path | str:
        """The new checkpoint's path, or why the save failed: the same answer on every rank, whichever
        rank hit the error, so all ranks go on training (or all stop) together."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-step_{step:08d}"
        error = None
        if self.env.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that died half-way
                tmp.mkdir(parents=True)
            except OSError as exc:
                error = f"cannot create {tmp}: {exc.strerror}"
        if (error := _agree(error)) is None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            try:
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, storage_writer=storage_writer)
                torch.save(_rng_state(self.env.device), tmp / f"rng_rank{self.env.rank}.pt")
            except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
                error = _first_line(exc)
            error = _agree(error)
        if error is None and self.env.is_main:
            try:
                (tmp / TRAINER_STATE).write_text(json.dumps({**state, "step": step}, indent=1))
                write_manifest(tmp)
                _publish(tmp, final)
                for old in list_checkpoints(self.root)[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError as exc:
                error = f"cannot publish {final}: {exc.strerror}"
        if (error := _agree(error)) is not None:
            if self.env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            return error
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = read_trainer_state(path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        try:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointLoadError(f"cannot load checkpoint {path}: {_first_line(exc)}") from exc
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        rng_file = path / f"rng_rank{self.env.rank}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved: fresh seeds then
            _set_rng_state(torch.load(rng_file, weights_only=True), self.env.device)
        return state


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Only the model's weights, into a plain single-device model (generate, export, serve)."""
    model_sd = model.state_dict()
    try:
        with warnings.catch_warnings():  # one process reading alone is the intent here, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model_sd}, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:
        raise PhalanxError(f"cannot load checkpoint {path}: {_first_line(exc)}") from exc
    model.load_state_dict(model_sd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _agree(error: str | None) -> str | None:
    """Every rank learns the first error any rank had (collective; only at save time)."""
    if not dist.is_initialized():
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished save into place, flushed first so a crash cannot leave a named but empty save.
    A checkpoint already at that step (a replayed step) is replaced without a moment of having neither."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    aside = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(exc: BaseException) -> str:
    """DCP wraps each rank's (exception, traceback) into its message; the root cause is what a user needs."""
    failures = getattr(exc, "failures", None)
    if failures:
        cause = next(iter(failures.values()))[0]
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
