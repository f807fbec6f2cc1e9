"""Writing and restoring checkpoints with torch.distributed.checkpoint (DCP), one directory per save.

A save is written under a hidden temporary name and renamed once every rank has finished, so a partial
save never looks like a checkpoint; only the newest `keep` are kept. A save that fails (disk full, I/O
error) is reported to the caller and leaves nothing behind. The layout of a checkpoint, and everything
that only reads one (listing, verifying against the manifest, model weights alone), is
phalanx/run/checkpoints.py's.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from phalanx.errors import CheckpointLoadError
from phalanx.parallel.distributed import DistEnv
from phalanx.run.checkpoints import (
    dcp_error_line,
    list_checkpoints,
    read_trainer_state,
    write_manifest,
    write_trainer_state,
)
from phalanx.run.layout import step_dir_name
from phalanx.run.safe_dcp import UnsafeCheckpointError, safe_load


class Checkpointer:
    def __init__(self, root: Path, keep: int, env: DistEnv):
        self.root, self.keep, self.env = root, keep, env

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
             storage_writer=None) -> Path | str:
        """The new checkpoint's path, or why the save failed: the same answer on every rank, whichever
        rank hit the error, so all ranks go on training (or all stop) together."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
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
                error = dcp_error_line(exc)
            error = _agree(error)
        if error is None and self.env.is_main:
            try:
                write_trainer_state(tmp, {**state, "step": step})
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
            safe_load({"model": model_sd, "optim": optim_sd}, path)
        except UnsafeCheckpointError:
            raise  # bad input (exit 2): restarting cannot make it safe
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointLoadError(f"cannot load checkpoint {path}: {dcp_error_line(exc)}") from exc
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        rng_file = path / f"rng_rank{self.env.rank}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved: fresh seeds then
            _set_rng_state(torch.load(rng_file, weights_only=True), self.env.device)
        return state


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
