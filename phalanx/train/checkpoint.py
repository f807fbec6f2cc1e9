"""Writing and restoring checkpoints with torch.distributed.checkpoint (DCP), one directory per save.

A save is written under a hidden temporary name and renamed once every rank has finished, so a partial
save never looks like a checkpoint; only the newest `keep` are kept. A save that fails (disk full, I/O
error) is reported to the caller and leaves nothing behind; a full disk is said as such, with the size a
checkpoint needs (checkpoint_space.py). The layout of a checkpoint, and everything
that only reads one (listing, verifying against the manifest, model weights alone), is
phalanx/run/checkpoints.py's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from phalanx.errors import CheckpointLoadError
from phalanx.parallel.distributed import DistEnv
from phalanx.parallel.materialize import plain_name
from phalanx.run.checkpoints import (
    dcp_error_line,
    file_entry,
    list_checkpoints,
    read_trainer_state,
    verify_checkpoint,
    write_manifest,
    write_trainer_state,
)
from phalanx.run.layout import TRAINER_STATE, step_dir_name
from phalanx.run.safe_dcp import METADATA_FILE, UnsafeCheckpointError, read_metadata_file, safe_load
from phalanx.train.checkpoint_space import disk_full_line, is_disk_full, needed_bytes, state_dict_bytes

# The optimizer's hyperparameters are stored per parameter name ("param_groups.<fqn>.lr"), not as each
# rank's list of groups: pipeline stages hold different parameters, and DCP keeps one rank's copy of a
# non-tensor item, so per-rank group lists would lose the other stages' parameters on a reshard.
# Frozen parameters are not saved (without_frozen): a LoRA run's checkpoints hold its adapters and their
# optimizer state, and its base comes from the pretrained checkpoint it names (models/lora.py). Loading
# then fills only what was saved (strict=False: DCP itself refuses a checkpoint lacking any of those keys).
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
# Checkpoints written before that kept the groups as a list ("optim.param_groups.0.lr"); they still load,
# in the layout they were written for (no pipeline).
_LISTED_GROUPS = re.compile(r"optim\.param_groups\.\d+\.")


def without_frozen(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """The model state dict without frozen parameters, under any of their names: torch's own
    ignore_frozen_params drops a parameter's first name only, so a tied output head (Llama 3.2's, frozen
    under LoRA) would be saved under its second. Unchanged when nothing is frozen."""
    frozen = {
        plain_name(name).removeprefix("module.")  # DDP's prefix, which the state dict's names lack
        for name, param in model.named_parameters(remove_duplicate=False)
        if not param.requires_grad
    }
    return {k: v for k, v in model_sd.items() if k not in frozen} if frozen else model_sd


def state_dict_options(path: Path) -> StateDictOptions:
    """How the optimizer state in checkpoint `path` is laid out: flattened by name, or the older lists."""
    keys = read_metadata_file(path / METADATA_FILE).state_dict_metadata
    listed = any(_LISTED_GROUPS.match(key) for key in keys)
    return dataclasses.replace(STATE_DICT_OPTIONS, flatten_optimizer_state_dict=not listed)


@dataclass
class SaveOutcome:
    """How one save ended: its path, or why it failed; write_seconds from start to publish, stall_seconds
    the time training stood still for it (all of it for a synchronous save, the staging copy for async)."""

    step: int
    result: Path | str
    write_seconds: float
    stall_seconds: float


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    state: dict[str, Any]
    future: Future | None  # None: written synchronously
    started: float
    stall: float


class Checkpointer:
    """Saves in two halves, start() and finish(): a synchronous save does both at once; an asynchronous
    one (checkpoint.async) stages the state to host memory in start() and writes it in a background
    thread while training goes on, and a later finish() publishes it. Every rank calls both at the same
    points (they are collective)."""

    def __init__(self, root: Path, keep: int, env: DistEnv, asynchronous: bool = False):
        self.root, self.keep, self.env, self.asynchronous = root, keep, env, asynchronous
        self.pending: _Pending | None = None
        self._state_bytes: int | None = None  # of the last state saved: a checkpoint's size before the first
        # DCP plans an async save with collectives from its writer thread: they get a group of their own,
        # so they never interleave with the training's collectives on the default group.
        self._group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None

    def start(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], storage_writer=None
    ) -> str | None:
        """Begin saving step `step`; the reason it could not begin (the same on every rank), else None.
        A save still pending is finished first: call finish() before to learn how it ended."""
        assert self.pending is None, "finish() the previous save first"
        started = time.perf_counter()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        error = None
        if self.env.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that died half-way
                tmp.mkdir(parents=True)
            except OSError as exc:
                error = self._error_line(exc, f"cannot create {tmp}: {exc.strerror}")
        if (error := _agree(error)) is not None:
            return error
        model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        model_sd = without_frozen(model, model_sd)
        self._state_bytes = state_dict_bytes(model_sd, optim_sd)
        future = None
        try:
            torch.save(rng_state(self.env.device), tmp / f"rng_rank{self.env.rank}.pt")
            if self.asynchronous:
                future = dcp.async_save(
                    {"model": model_sd, "optim": optim_sd},
                    checkpoint_id=tmp,
                    storage_writer=storage_writer,
                    process_group=self._group,
                )
            else:
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, storage_writer=storage_writer)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            error = self._error_line(exc, dcp_error_line(exc))
        if (error := _agree(error)) is not None:
            self._discard(tmp)
            return error
        self.pending = _Pending(step, tmp, final, state, future, started, time.perf_counter() - started)
        return None

    def finish(self, wait: bool) -> SaveOutcome | None:
        """Publish the pending save once every rank's part is written (waiting for it if `wait`); None
        while it is still being written, or when nothing is pending. Collective while a save is pending."""
        pending = self.pending
        if pending is None:
            return None
        if pending.future is not None and not wait:
            if not _all_ranks(pending.future.done(), self.env.device):
                return None
        stalled = time.perf_counter()
        error = None
        if pending.future is not None:
            try:
                pending.future.result()
            except (Exception, CheckpointException) as exc:
                error = self._error_line(exc, dcp_error_line(exc))
        self.pending = None
        if (error := _agree(error)) is None:
            error = self._publish(pending)
        stall = pending.stall + (time.perf_counter() - stalled if pending.future is not None and wait else 0.0)
        return SaveOutcome(
            pending.step, pending.final if error is None else error, time.perf_counter() - pending.started, stall
        )

    def _publish(self, pending: _Pending) -> str | None:
        """Manifest (every rank hashes its share of the files), trainer state, atomic rename, rotation."""
        try:
            files = hash_files(pending.tmp, self.env)
        except OSError as exc:
            files, error = {}, self._error_line(exc, f"cannot read back {pending.tmp}: {exc.strerror}")
        else:
            error = None
        error = _agree(error)
        if error is None and self.env.is_main:
            try:
                write_trainer_state(pending.tmp, {**pending.state, "step": pending.step})
                files[TRAINER_STATE] = file_entry(pending.tmp / TRAINER_STATE)
                write_manifest(pending.tmp, files)
                _publish(pending.tmp, pending.final)
                for old in list_checkpoints(self.root)[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError as exc:
                error = self._error_line(exc, f"cannot publish {pending.final}: {exc.strerror}")
        if (error := _agree(error)) is not None:
            self._discard(pending.tmp)
        return error

    def _error_line(self, exc: BaseException, line: str) -> str:
        """`line`, or for a full disk (before the partial save is discarded and frees it) that it is full
        and how much a checkpoint needs."""
        if is_disk_full(exc, self.root):
            return disk_full_line(self.root, needed_bytes(self.root, state_bytes=self._state_bytes))
        return line

    def _discard(self, tmp: Path) -> None:
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], storage_writer=None
    ) -> Path | str:
        """A whole save at once (waiting for the writes even in async mode): its path, or why it failed."""
        error = self.start(step, model, optimizer, state, storage_writer)
        return error if error is not None else self.finish(wait=True).result

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = read_trainer_state(path)
        options = state_dict_options(path)  # also refuses crafted metadata before DCP reads anything
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        model_sd = without_frozen(model, model_sd)
        try:
            safe_load({"model": model_sd, "optim": optim_sd}, path)
        except UnsafeCheckpointError:
            raise  # bad input (exit 2): restarting cannot make it safe
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointLoadError(f"cannot load checkpoint {path}: {dcp_error_line(exc)}") from exc
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        rng_file = path / f"rng_rank{self.env.rank}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved: fresh seeds then
            set_rng_state(torch.load(rng_file, weights_only=True), self.env.device)
        return state


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def hash_files(path: Path, env: DistEnv) -> dict[str, dict]:
    """Manifest entries of every file in `path`, each rank hashing its share (every world_size-th file)
    in parallel, gathered on all ranks: hashing a large checkpoint never waits on one rank."""
    names = sorted(f.name for f in path.iterdir() if f.is_file())
    mine = {name: file_entry(path / name) for name in names[env.rank :: env.world_size]}
    if not dist.is_initialized():
        return mine
    parts: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def verify_in_parallel(path: Path, env: DistEnv) -> str | None:
    """verify_checkpoint with every rank checking its share of the files; the first reason any rank found."""
    return _agree(verify_checkpoint(path, (env.rank, env.world_size)))


def _all_ranks(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank (one tiny all-reduce)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


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
