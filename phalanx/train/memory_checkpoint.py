"""In-memory checkpoints: each rank's snapshot of its training state in host shared memory.

The node agent restarts every rank of the group after any failure, so a copy that is to survive a crash
cannot live in a rank: it lives in /dev/shm (tmpfs; tempfile.gettempdir() where /dev/shm is not
writable), which outlives the processes but not the node. A restart resumes from the newest step that
every rank has a sound snapshot of when that is newer than the newest disk checkpoint, so a crash redoes
a step or two rather than up to `checkpoint.interval`.

Where they live is phalanx/run/snapshots.py's (one directory per run and launch, so a new launch never
sees an older launch's snapshots and `checkpoint.resume=never|PATH` cannot be undone by them). Each
rank removes its own directory when the run ends on it (finished, stopped, or failed on its last
attempt); the node agent removes its launch's when the launch ends.

What a snapshot holds is what a disk checkpoint holds, collected by the same code (Trainer's trainer
state, checkpoint.py's model/optimizer state dicts and RNG states): this rank's local tensors (a DTensor
as its local shard, with its global shape and placements to check on load), the trainer state as the
JSON text a disk checkpoint's trainer.json holds, the layout and world size. It is taken on the training
thread as a copy into host memory (the only part the step waits for) and written by a background thread:
torch.save to a temporary name, os.replace, then a small JSON sidecar with the file's size and CRC-32,
written last, which is what makes a snapshot count. The newest two are kept per rank. Loading verifies size and CRC
and reads with torch.load(weights_only=True): a snapshot file never runs code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from phalanx.parallel.distributed import DistEnv
from phalanx.run.snapshots import complete_steps, launch_dir, remove_stale
from phalanx.safe.rank_guard import ENV_AGENT_PID
from phalanx.train.checkpoint import STATE_DICT_OPTIONS, rng_state, set_rng_state

KEEP = 2  # per rank: the newest may be half-written on one rank when a peer dies
FORMAT = 1
BUDGET = 0.02  # `auto`: a snapshot may cost this share of a step's time
PROBES = 3  # `auto`: snapshots measured (every step) before the interval is chosen


def owner_pid() -> int:
    """The launch the snapshots belong to: the node agent's pid (a rank outside a launch: its own)."""
    return int(os.environ.get(ENV_AGENT_PID) or os.getpid())


def remove_rank(run_dir: Path, rank: int) -> None:
    """This rank's snapshots of this launch, and the launch directory once no rank has any left."""
    top = launch_dir(run_dir, owner_pid())
    shutil.rmtree(top / f"rank_{rank}", ignore_errors=True)
    try:
        top.rmdir()
    except OSError:
        pass  # another rank's are still there (it removes the directory) or it is gone already


def choose_interval(snapshot_seconds: float, step_seconds: float, budget: float = BUDGET) -> int:
    """Every step when a snapshot costs at most `budget` of a step, else the smallest interval that does."""
    if step_seconds <= 0:
        return 1
    return max(1, math.ceil(snapshot_seconds / (budget * step_seconds) - 1e-9))


def _spec(value: Any) -> list | None:
    """What must match between a saved tensor and the one it is loaded into."""
    if isinstance(value, DTensor):
        return [list(value.shape), str(value.placements), list(value.device_mesh.shape),
                list(value.to_local().shape), str(value.dtype)]
    if isinstance(value, torch.Tensor):
        return [list(value.shape), None, None, list(value.shape), str(value.dtype)]
    return None


def _mismatch(target: dict[str, Any], saved: dict[str, Any], specs: dict[str, Any], prefix: str) -> str | None:
    """Why the saved state dict does not fit the current one `target` (keys, shapes, placements), or None."""
    if set(target) != set(saved):
        missing, extra = sorted(set(target) - set(saved)), sorted(set(saved) - set(target))
        return f"its {prefix} keys differ (missing {missing[:2]}, unexpected {extra[:2]})"
    for key, current in target.items():
        spec = _spec(current)
        if spec != specs.get(f"{prefix}.{key}"):
            return f"{prefix}.{key} was saved as {specs.get(f'{prefix}.{key}')}, this rank holds {spec}"
    return None


def _copy_into(target: dict[str, Any], saved: dict[str, Any]) -> None:
    """Copy `saved` into the model's state dict `target` in place (a DTensor: its local shard)."""
    for key, current in target.items():
        (current.to_local() if isinstance(current, DTensor) else current).copy_(saved[key])


def _optim_entries(optimizer: torch.optim.Optimizer):
    """(key, container, name) of every piece of the optimizer's state, read and written where it lives:
    each group's hyperparameters and each parameter's state (exp_avg, exp_avg_sq, step), in the
    optimizer's own parameter order (the same on every attempt of one layout)."""
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        for name in sorted(k for k in group if k != "params"):
            yield f"group.{g}.{name}", group, name
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for name in sorted(state):
                yield f"state.{index}.{name}", state, name
            index += 1


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@dataclasses.dataclass
class Loaded:
    step: int
    state: dict[str, Any]  # the trainer state, as a disk checkpoint's trainer.json gives it
    path: Path
    seconds: float


class MemorySnapshots:
    """One rank's in-memory checkpoints. `due`/`take` in the training loop, `resume` at start, `close`
    at the end. `interval` is an int (0: off) or "auto"."""

    def __init__(self, run_dir: Path, env: DistEnv, layout: dict[str, Any], interval: int | str,
                 say: Callable[[str], None]):
        self.env, self.say = env, say
        self.record = {"world_size": env.world_size, "layout": layout}
        self.dir = launch_dir(run_dir, owner_pid()) / f"rank_{env.rank}"
        self.fixed = None if interval == "auto" else int(interval)
        self.interval = self.fixed  # None while `auto` still measures
        self.probes: list[tuple[float, float, float]] = []
        self.waited = 0.0
        self._buffers: dict[str, torch.Tensor] = {}
        self._sized = False  # whether the room for snapshots was checked (at the first one)
        self.pending: Future | None = None
        self.failed = False
        self._writer = None
        if env.local_rank == 0:  # with snapshots off too: a killed launch's snapshots must not hold memory
            remove_stale(self.dir.parent.parent)
        if self.fixed != 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="phalanx-snapshot", initializer=_lower_priority)

    def due(self, step: int) -> bool:
        """The same answer on every rank (a rank whose writes failed still calls take(), which then only
        returns: `auto` agrees on the interval in a collective)."""
        if self._writer is None:
            return False
        return self.interval is None or step % self.interval == 0

    # -- taking -----------------------------------------------------------------------------------
    def take(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any],
             ) -> float:
        """Copy this rank's state of `step` into host memory and hand it to the writer; the seconds the
        training thread stood still for it (a previous write still running included)."""
        t0 = time.perf_counter()
        self._wait()
        self.waited = time.perf_counter() - t0  # the previous write still running: the interval is too short
        if self.failed:
            return self.waited
        model_sd, optim_sd = model.state_dict(), {key: box[name] for key, box, name in _optim_entries(optimizer)}
        with torch.no_grad():
            payload = {
                "format": FORMAT, "step": step, "rank": self.env.rank, **self.record,
                "specs": {**{f"model.{k}": _spec(v) for k, v in model_sd.items()},
                          **{f"optim.{k}": _spec(v) for k, v in optim_sd.items()}},
                "model": {k: self._host_copy(f"model.{k}", v) for k, v in model_sd.items()},
                "optim": {k: self._host_copy(f"optim.{k}", v) for k, v in optim_sd.items()},
                "trainer": json.dumps({**trainer_state, "step": step}),  # exactly what trainer.json holds
                "rng": rng_state(self.env.device),
            }
        if not self._sized and not self._room_for(payload):
            return time.perf_counter() - t0
        copied = None
        if self.env.device.type == "cuda":  # the copies were queued on the stream: the writer waits for them
            copied = torch.cuda.Event()
            copied.record()
        self.pending = self._writer.submit(self._write, step, payload, copied)
        return time.perf_counter() - t0

    def _room_for(self, payload: dict[str, Any]) -> bool:
        """Before the first write: whether the directory's file system holds KEEP + 1 snapshots of this
        size (the newest kept two and one being written); if not, say so once and stop snapshots."""
        size = sum(t.nbytes for part in ("model", "optim") for t in payload[part].values()
                   if isinstance(t, torch.Tensor))
        self._sized = True
        free = shutil.disk_usage(self.dir.parent.parent).free
        if free >= (KEEP + 1) * size:
            return True
        self.failed = True
        need = (KEEP + 1) * size / 2**20
        self.say(f"warning: rank {self.env.rank}: no in-memory snapshots: {self.dir.parent.parent} has "
                 f"{free / 2**20:,.0f} MiB free, {KEEP + 1} snapshots of this rank need {need:,.0f} MiB; "
                 "restarts resume from disk checkpoints")
        return False

    def _host_copy(self, key: str, value: Any) -> Any:
        """`value` (a DTensor: its local shard) copied into this rank's host buffer for `key`. The buffers
        are reused from snapshot to snapshot (the previous write has finished: take() waited for it), so
        a snapshot costs a memory copy, not fresh pages; pinned under CUDA, so the copy does not block."""
        if isinstance(value, DTensor):
            value = value.to_local()
        if not isinstance(value, torch.Tensor):
            return value
        value = value.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.device.type == "cuda")
            self._buffers[key] = buffer
        buffer.copy_(value, non_blocking=value.device.type == "cuda")
        return buffer

    def flush(self) -> None:
        """Wait for the snapshot being written (for measurements and tests)."""
        self._wait()

    def _write(self, step: int, payload: dict[str, Any], copied: Any = None) -> None:
        if copied is not None:
            copied.synchronize()
        final = self.dir / f"step_{step:08d}.pt"
        tmp = self.dir / f".tmp-{final.name}"
        try:
            torch.save(payload, tmp)
            digest = _crc32(tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a half-written file would only hold shared memory
            raise
        os.replace(tmp, final)
        side = final.with_suffix(".json")
        tmp_side = self.dir / f".tmp-{side.name}"
        tmp_side.write_text(json.dumps({"step": step, "crc32": digest, "bytes": final.stat().st_size,
                                        **self.record}))
        os.replace(tmp_side, side)  # last: now the snapshot counts
        for old in self.steps()[:-KEEP]:
            for path in (self.dir / f"step_{old:08d}.json", self.dir / f"step_{old:08d}.pt"):
                path.unlink(missing_ok=True)

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:  # /dev/shm full, most likely (torch's writer raises RuntimeError for it):
            self.failed = True  # say it once and train on without snapshots
            reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
            self.say(f"warning: rank {self.env.rank}: in-memory snapshots stop: cannot write to {self.dir} "
                     f"({reason}); restarts resume from disk checkpoints")

    def measured(self, blocked: float, step_seconds: float, warm: bool) -> dict[str, float] | None:
        """`auto`: record one snapshot's cost against its step's time (warm: not the first step after a
        start); after PROBES of them, every rank takes the largest interval any rank needs. The choice
        (collective, at the same step on every rank), or None while measuring or fixed."""
        if self.interval is not None:
            return None
        if warm:
            self.probes.append((blocked, step_seconds, self.waited))
        if len(self.probes) < PROBES:
            return None
        cost = statistics.median(b for b, _, _ in self.probes)
        step = statistics.median(s for _, s, _ in self.probes)
        interval = choose_interval(cost, step)
        if dist.is_initialized():
            t = torch.tensor([interval], dtype=torch.int64, device=self.env.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            interval = int(t.item())
        self.interval = interval
        return {"interval": interval, "snapshot_ms": cost * 1000, "step_ms": step * 1000,
                "percent": 100 * cost / step if step else 0.0,
                # of snapshot_ms, waiting for the previous snapshot's write (the writer is behind)
                "write_wait_ms": statistics.median(w for _, _, w in self.probes) * 1000}

    # -- resuming ---------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """This rank's complete snapshots (their sidecar written), oldest first."""
        return complete_steps(self.dir)

    def _candidates(self) -> tuple[list[int], list[str]]:
        """This rank's snapshots taken under this group's layout and world size; and why others are not
        (one note per distinct reason, naming its steps)."""
        good, ignored = [], {}
        for step in self.steps():
            try:
                side = json.loads((self.dir / f"step_{step:08d}.json").read_text())
            except (OSError, ValueError):
                ignored.setdefault("its sidecar is unreadable", []).append(step)
                continue
            mismatch = {k: side.get(k) for k in self.record if side.get(k) != self.record[k]}
            if mismatch:
                ours = {k: self.record[k] for k in mismatch}
                ignored.setdefault(f"taken under {mismatch}, this group has {ours}", []).append(step)
            else:
                good.append(step)
        notes = [f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}: {why}"
                 for why, steps in ignored.items()]
        return good, notes

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, newer_than: int,
               model_args: dict[str, Any]) -> Loaded | None:
        """Load the newest step that every rank has a sound snapshot of, if newer than `newer_than` (the
        disk checkpoint's step); None to resume from disk. Collective; the same answer on every rank."""
        if self._writer is None:
            return None
        t0 = time.perf_counter()
        mine, notes = self._candidates()
        gathered = _gather((mine, notes))
        common = set(gathered[0][0]).intersection(*(set(g[0]) for g in gathered[1:]))
        if self.env.is_main:
            for line in dict.fromkeys(n for _, ns in gathered for n in ns):
                self.say(f"warning: in-memory snapshots ignored ({line})")
        for step in sorted((s for s in common if s > newer_than), reverse=True):
            loaded, error = None, None
            try:
                loaded = self._read(step)
                error = _trainer_mismatch(loaded, model_args)
            except Exception as exc:  # a torn, truncated or foreign file: never a traceback, the next one
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not any(errors := _gather(error)):
                try:
                    error = self._apply(loaded, model, optimizer)
                except Exception as exc:  # after the checks above: not expected, but never half-silent
                    error = f"applying it failed: {type(exc).__name__}: {exc}"
                if not any(errors := _gather(error)):
                    state = json.loads(loaded["trainer"])
                    set_rng_state(loaded["rng"], self.env.device)
                    return Loaded(step, state, self.dir / f"step_{step:08d}.pt", time.perf_counter() - t0)
                if any(e and e.startswith("applying") for e in errors):
                    # Some ranks hold part of it now: drop it so the restart does not try it again.
                    for path in (self.dir / f"step_{step:08d}.json", self.dir / f"step_{step:08d}.pt"):
                        path.unlink(missing_ok=True)
                    raise RuntimeError(f"in-memory snapshot of step {step} could not be applied: "
                                       f"{next(e for e in errors if e)}")
            if self.env.is_main:
                reasons = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
                self.say(f"warning: in-memory snapshot of step {step} is unusable ({reasons}); trying an "
                         f"older one")
        return None

    def _read(self, step: int) -> dict[str, Any]:
        path = self.dir / f"step_{step:08d}.pt"
        side = json.loads(path.with_suffix(".json").read_text())
        if path.stat().st_size != side.get("bytes") or _crc32(path) != side.get("crc32"):
            raise ValueError(f"{path.name} does not match its recorded size and CRC-32 (torn or overwritten)")
        payload = torch.load(path, weights_only=True, map_location="cpu")
        if payload.get("format") != FORMAT or payload.get("step") != step or payload.get("rank") != self.env.rank:
            raise ValueError(f"{path.name} is not this rank's snapshot of step {step}")
        return payload

    def _apply(self, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
        """Check every key, shape and placement first (nothing is changed on a mismatch), then copy."""
        if not optimizer.state:  # a fresh optimizer: create its state (zeros) as a disk checkpoint's load does
            get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        model_sd = model.state_dict()  # detached views of the parameters and buffers: copy_ writes them
        entries = {key: (box, name) for key, box, name in _optim_entries(optimizer)}
        optim_sd = {key: box[name] for key, (box, name) in entries.items()}
        error = _mismatch(model_sd, payload["model"], payload["specs"], "model") or \
            _mismatch(optim_sd, payload["optim"], payload["specs"], "optim")
        if error is not None:
            return error
        with torch.no_grad():
            _copy_into(model_sd, payload["model"])
            for key, (box, name) in entries.items():
                current = box[name]
                if isinstance(current, torch.Tensor):
                    (current.to_local() if isinstance(current, DTensor) else current).copy_(payload["optim"][key])
                else:
                    box[name] = payload["optim"][key]
        return None

    def discard_after(self, step: int) -> None:
        """Drop this rank's snapshots of steps after `step`, the step training goes on from: they belong to
        a line of steps that was not continued (a resume from older state, a numerics rollback)."""
        if self._writer is None:
            return
        self._wait()
        for newer in (s for s in self.steps() if s > step):
            for path in (self.dir / f"step_{newer:08d}.json", self.dir / f"step_{newer:08d}.pt"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Let a running write finish (so nothing writes after the directory is removed)."""
        if self._writer is not None:
            self._wait()
            self._writer.shutdown(wait=True)
            self._writer = None


def _trainer_mismatch(payload: dict[str, Any], model_args: dict[str, Any]) -> str | None:
    saved = json.loads(payload["trainer"]).get("model_args", {})
    diffs = [f"{k} {saved.get(k)} != {v}" for k, v in model_args.items() if saved.get(k) != v]
    return f"written by a model of another shape ({', '.join(diffs)})" if diffs else None


def _lower_priority() -> None:
    """The writer thread yields the cores to training (Linux nice values are per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _crc32(path: Path) -> int:
    """A torn or bit-flipped file's check; CRC-32 rather than SHA-256 for speed (2.4x here: the writer
    shares the cores with training). Safety against a crafted file is weights_only=True's job, not this."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc
