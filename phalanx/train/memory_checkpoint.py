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
thread as one copy into a slot, a file in shared memory mapped into the rank and reused
(snapshot_slots.py: raw bytes, no pickling), which is all the step waits for; a background thread then
takes the slot's CRC-32 and writes the sidecar step_N.json (the slot, each tensor's place in it, the
JSON parts, the CRC), last, which is what makes a snapshot count. A rank has three slots: the one being
written and the two newest snapshots (a peer that dies mid-step may have finished one step fewer).
Before a slot is overwritten its sidecar is removed, so no sidecar ever names torn bytes. Loading checks
the sidecar's layout, the CRC, keys, shapes and placements, then copies the bytes into the model and
optimizer: nothing in a snapshot is unpickled or run.
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
from phalanx.run.snapshots import (
    complete_steps,
    launch_dir,
    remove_stale,
    sidecar_path,
    write_sidecar,
)
from phalanx.safe.rank_guard import ENV_AGENT_PID
from phalanx.train.checkpoint import STATE_DICT_OPTIONS, rng_state, set_rng_state
from phalanx.train.peer_snapshots import PeerCopies, spans_nodes
from phalanx.train.snapshot_slots import Slot, entries_from_json, plan_layout

SLOTS = 3  # per rank: the two newest snapshots (a peer may have finished one step fewer) and one being written
FORMAT = 2
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
        return [
            list(value.shape),
            str(value.placements),
            list(value.device_mesh.shape),
            list(value.to_local().shape),
            str(value.dtype),
        ]
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


def _trained_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict without frozen parameters, as disk checkpoints leave them out
    (train/checkpoint.py): a LoRA run's base never changes and is read from the pretrained checkpoint on
    every attempt, and QLoRA's 4-bit base could not be copied into a slot anyway."""
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def _copy_into(target: dict[str, Any], saved: dict[str, Any]) -> None:
    """Copy `saved` into the model's state dict `target` in place (a DTensor: its local shard)."""
    for key, current in target.items():
        _local(current).copy_(saved[key])


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

    def __init__(
        self,
        run_dir: Path,
        env: DistEnv,
        layout: dict[str, Any],
        interval: int | str,
        say: Callable[[str], None],
        emit: Callable[..., None] = lambda kind, **details: None,
    ):
        self.env, self.say, self.emit = env, say, emit  # emit(kind, **details): an event of the run
        self.record = {"world_size": env.world_size, "layout": layout}
        self.dir = launch_dir(run_dir, owner_pid()) / f"rank_{env.rank}"
        self.fixed = None if interval == "auto" else int(interval)
        self.interval = self.fixed  # None while `auto` still measures
        self.probes: list[tuple[float, float, float]] = []
        self.waited = 0.0
        self._size: int | None = None  # the bytes one snapshot takes (a slot's size), once the room is checked
        self._slots: dict[int, Slot] = {}  # the slots mapped into this rank, by index
        self._held: dict[int, int] = {}  # slot index -> the step whose sidecar names it
        self.pending: Future | None = None
        self.failed = False
        self._writer = None
        if env.local_rank == 0:  # with snapshots off too: a killed launch's snapshots must not hold memory
            remove_stale(self.dir.parent.parent)
        if self.fixed != 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._held = self._scan()  # a restarted rank's slots hold the previous attempt's snapshots
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="phalanx-snapshot", initializer=_lower_priority)
        # Across nodes, each snapshot is copied to a rank on the next node too (peer_snapshots.py).
        self.peer = (
            PeerCopies(self.dir.parent, env.rank, env.world_size, say)
            if self._writer is not None and spans_nodes(env.world_size)
            else None
        )

    def due(self, step: int) -> bool:
        """The same answer on every rank (a rank whose writes failed still calls take(), which then only
        returns: `auto` agrees on the interval in a collective)."""
        if self._writer is None:
            return False
        return self.interval is None or step % self.interval == 0

    # -- taking -----------------------------------------------------------------------------------
    def take(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> float:
        """Copy this rank's state of `step` into a slot and hand its sealing (CRC, sidecar) to the writer;
        the seconds the training thread stood still for it (a previous seal still running included)."""
        t0 = time.perf_counter()
        self._wait()
        self.waited = time.perf_counter() - t0  # the previous seal still running: the interval is too short
        if self.failed:
            return self.waited
        model_sd = _trained_state(model)
        optim = {key: box[name] for key, box, name in _optim_entries(optimizer)}
        tensors = {
            **{f"model.{k}": _local(v) for k, v in model_sd.items()},
            **{f"optim.{k}": _local(v) for k, v in optim.items() if isinstance(v, torch.Tensor)},
            **{f"rng.{k}": v for k, v in rng_state(self.env.device).items()},
        }
        try:
            entries, size = plan_layout(tensors)
            if size != self._size and not self._prepare(size):
                return time.perf_counter() - t0
            index, slot = self._next_slot()
            with torch.no_grad():
                for entry, value in zip(entries, tensors.values()):
                    slot.view(entry).copy_(value.detach(), non_blocking=value.device.type == "cuda")
            sidecar = {
                "format": FORMAT,
                "step": step,
                "rank": self.env.rank,
                **self.record,
                "slot": index,
                "bytes": size,
                "tensors": [e.as_json() for e in entries],
                "specs": {
                    **{f"model.{k}": _spec(v) for k, v in model_sd.items()},
                    **{f"optim.{k}": _spec(v) for k, v in optim.items()},
                },
                "values": {k: _encode(v) for k, v in optim.items() if not isinstance(v, torch.Tensor)},
                "trainer": json.dumps({**trainer_state, "step": step}),
            }  # exactly what trainer.json holds
        except (OSError, RuntimeError, TypeError, ValueError) as exc:  # /dev/shm full or gone, most likely
            self._stop(exc)
            return time.perf_counter() - t0
        copied = None
        if self.env.device.type == "cuda":  # the copies were queued on the stream: the writer waits for them
            copied = torch.cuda.Event()
            copied.record()
        self._held[index] = step
        self.pending = self._writer.submit(self._seal, slot, sidecar, copied)
        return time.perf_counter() - t0

    def _prepare(self, size: int) -> bool:
        """Before the first snapshot (or when the state's size changes): whether shared memory holds SLOTS
        slots of `size` bytes beside what this rank's slots take already; if so, make and map them all
        now (so that `auto` measures copies, not first mappings), else say so once and stop."""
        taken = sum(p.stat().st_size for p in self.dir.glob("slot_*.bin"))
        free = shutil.disk_usage(self.dir).free + taken
        if free < SLOTS * size:
            self.failed = True
            self.say(
                f"warning: rank {self.env.rank}: no in-memory snapshots: {self.dir.parent.parent} has "
                f"{free / 2**20:,.0f} MiB free, {SLOTS} snapshots of this rank need "
                f"{SLOTS * size / 2**20:,.0f} MiB; restarts resume from disk checkpoints"
            )
            return False
        for index in range(SLOTS):
            path = self.dir / f"slot_{index}.bin"
            if index in self._held and (not path.is_file() or path.stat().st_size != size):
                self._drop(self._held[index])  # a slot made again at another size holds its snapshot no more
            self._slots[index] = Slot(path, size)
            if self.env.device.type == "cuda":
                self._slots[index].pin()
        self._size = size
        return True

    def _next_slot(self) -> tuple[int, Slot]:
        """A free slot, else the one holding the oldest snapshot, whose sidecar goes first: from here on
        no sidecar names the bytes about to be overwritten."""
        free = [i for i in range(SLOTS) if i not in self._held]
        index = free[0] if free else min(self._held, key=self._held.get)
        if index in self._held:
            self._drop(self._held[index])
        return index, self._slots[index]

    def _scan(self) -> dict[int, int]:
        """Slot index -> step, from the sidecars in this rank's directory."""
        held = {}
        for step in self.steps():
            try:
                held[int(json.loads(sidecar_path(self.dir, step).read_text())["slot"])] = step
            except (OSError, ValueError, KeyError, TypeError):
                sidecar_path(self.dir, step).unlink(missing_ok=True)  # names no slot we could reuse
        return held

    def flush(self) -> None:
        """Wait for the snapshot being sealed (for measurements, tests and a rollback)."""
        self._wait()

    def _seal(self, slot: Slot, sidecar: dict[str, Any], copied: Any = None) -> None:
        if copied is not None:
            copied.synchronize()
        sidecar["crc32"] = slot.crc32()
        write_sidecar(self.dir, sidecar["step"], json.dumps(sidecar))  # last: now the snapshot counts
        if self.peer is not None:
            self.peer.offer(sidecar["step"], slot.flat, sidecar)

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:  # /dev/shm full or gone: say it once and train on
            self._stop(exc)

    def _stop(self, exc: BaseException) -> None:
        self.failed = True
        reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        self.say(
            f"warning: rank {self.env.rank}: in-memory snapshots stop: cannot write to {self.dir} "
            f"({reason}); restarts resume from disk checkpoints"
        )

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
        return {
            "interval": interval,
            "snapshot_ms": cost * 1000,
            "step_ms": step * 1000,
            "percent": 100 * cost / step if step else 0.0,
            # of snapshot_ms, waiting for the previous snapshot's write (the writer is behind)
            "write_wait_ms": statistics.median(w for _, _, w in self.probes) * 1000,
        }

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
                side = json.loads(sidecar_path(self.dir, step).read_text())
            except (OSError, ValueError):
                ignored.setdefault("its sidecar is unreadable", []).append(step)
                continue
            mismatch = {k: side.get(k) for k in self.record if side.get(k) != self.record[k]}
            if mismatch:
                ours = {k: self.record[k] for k in mismatch}
                ignored.setdefault(f"taken under {mismatch}, this group has {ours}", []).append(step)
            else:
                good.append(step)
        notes = [
            f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}: {why}" for why, steps in ignored.items()
        ]
        return good, notes

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, newer_than: int, model_args: dict[str, Any]
    ) -> Loaded | None:
        """Load the newest step that every rank has a sound snapshot of, if newer than `newer_than` (the
        disk checkpoint's step); None to resume from disk. Collective; the same answer on every rank."""
        if self._writer is None:
            return None
        t0 = time.perf_counter()
        if self.peer is not None:  # a replacement node's rank: its peer's copy of the newest step
            got = self.peer.fetch(self.steps(), newer_than)
            if got is not None:
                self._install(*got)
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
                    return Loaded(step, state, sidecar_path(self.dir, step), time.perf_counter() - t0)
                if any(e and e.startswith("applying") for e in errors):
                    # Some ranks hold part of it now: drop it so the restart does not try it again.
                    self._drop(step)
                    raise RuntimeError(
                        f"in-memory snapshot of step {step} could not be applied: {next(e for e in errors if e)}"
                    )
            reasons = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            self.emit("snapshot_unusable", step=step, reason=reasons)
            if self.env.is_main:
                self.say(f"warning: in-memory snapshot of step {step} is unusable ({reasons}); trying an older one")
        return None

    def _read(self, step: int) -> dict[str, Any]:
        """The snapshot of `step` as views into its slot, after checking its sidecar and the slot's CRC."""
        side = json.loads(sidecar_path(self.dir, step).read_text())
        if (
            side.get("format") != FORMAT
            or side.get("step") != step
            or side.get("rank") != self.env.rank
            or side.get("slot") not in range(SLOTS)
        ):
            raise ValueError(f"{sidecar_path(self.dir, step).name} is not this rank's snapshot of step {step}")
        slot = Slot(self.dir / f"slot_{side['slot']}.bin", int(side["bytes"]), create=False)
        if slot.crc32() != side.get("crc32"):
            raise ValueError(
                f"slot {side['slot']} does not match the CRC-32 recorded for step {step} (torn or overwritten)"
            )
        views = {e.key: slot.view(e) for e in entries_from_json(side["tensors"], slot.nbytes)}
        part = {
            prefix: {k[len(prefix) + 1 :]: v for k, v in views.items() if k.startswith(prefix + ".")}
            for prefix in ("model", "optim", "rng")
        }
        part["optim"].update({k: _decode(v) for k, v in side["values"].items()})
        part["rng"] = {k: v.clone() for k, v in part["rng"].items()}  # torch's generators take no views
        return {**part, "specs": side["specs"], "trainer": side["trainer"]}

    def _apply(self, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
        """Check every key, shape and placement first (nothing is changed on a mismatch), then copy."""
        if not optimizer.state:  # a fresh optimizer: create its state (zeros) as a disk checkpoint's load does
            get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        model_sd = _trained_state(model)  # detached views of the parameters and buffers: copy_ writes them
        entries = {key: (box, name) for key, box, name in _optim_entries(optimizer)}
        optim_sd = {key: box[name] for key, (box, name) in entries.items()}
        error = _mismatch(model_sd, payload["model"], payload["specs"], "model") or _mismatch(
            optim_sd, payload["optim"], payload["specs"], "optim"
        )
        if error is not None:
            return error
        with torch.no_grad():
            _copy_into(model_sd, payload["model"])
            for key, (box, name) in entries.items():
                current = box[name]
                if isinstance(current, torch.Tensor):
                    _local(current).copy_(payload["optim"][key])
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
            self._drop(newer)

    def _install(self, step: int, data: torch.Tensor, sidecar: dict[str, Any]) -> None:
        """Make a peer's copy of this rank's snapshot of `step` one of this rank's own (a free slot, else
        the oldest snapshot's), checked and loaded from here on as any other."""
        free = [i for i in range(SLOTS) if i not in self._held]
        index = free[0] if free else min(self._held, key=self._held.get)
        if index in self._held:
            self._drop(self._held[index])
        with open(self.dir / f"slot_{index}.bin", "wb") as f:
            f.write(memoryview(data.numpy()))
        write_sidecar(self.dir, step, json.dumps({**sidecar, "slot": index}))
        self._held[index] = step
        self.say(
            f"rank {self.env.rank}: restored its snapshot of step {step} from the peer copy held by "
            f"rank {self.peer.holder(self.env.rank)}"
        )

    def _drop(self, step: int) -> None:
        """Forget the snapshot of `step`: its slot is free for the next one."""
        sidecar_path(self.dir, step).unlink(missing_ok=True)
        self._held = {i: s for i, s in self._held.items() if s != step}

    def close(self) -> None:
        """Let a running write finish (so nothing writes after the directory is removed)."""
        if self.peer is not None:
            self.peer.stop_offers()  # a write waiting to hand its copy over ends now
        if self._writer is not None:
            self._wait()
            self._writer.shutdown(wait=True)
            self._writer = None
        if self.peer is not None:
            self.peer.close()


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


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _encode(value: Any) -> Any:
    """An optimizer hyperparameter as JSON (a tuple, such as AdamW's betas, marked as one)."""
    if isinstance(value, (tuple, list)):
        items = [_encode(v) for v in value]
        return {"tuple": items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a snapshot cannot hold an optimizer value of type {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tuple"}:
        return tuple(_decode(v) for v in value["tuple"])
    return [_decode(v) for v in value] if isinstance(value, list) else value
