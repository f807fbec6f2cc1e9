"""The copy of a run's plain files into the run store, Prometheus and TensorBoard.

The ranks only append JSON lines (step metrics from rank 0, step timings from every rank, and events;
the node agents append their hardware samples; phalanx/run/layout.py names the files), which costs them
microseconds and never waits on a database. A follower reads what is new every `sync_interval_s` and
writes it to the store in one transaction together with how far it read each file, so every line lands
exactly once, across restarts and later launches. The store's follower runs in a process of its own
(store_writer.py), so a database fault (a SIGBUS from a file sqlite maps) cannot take the node agent
down; the agent keeps a store-less follower for /metrics and TensorBoard.

A store that is unreachable only delays the copy: the lines wait in memory and are retried with backoff.
An SQLite file deleted or replaced under the follower (its inode changed, or it is gone) is noticed
before each write: the follower opens the new file, registers the run again and copies the run's whole
history from the files, from the offsets the new store holds (none, for a fresh file).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from phalanx.errors import StoreError
from phalanx.extras import require
from phalanx.observe.eval_reports import is_report, read_scores, report_names
from phalanx.run.layout import EVENTS, METRICS, TELEMETRY, RunDir
from phalanx.run.records import JsonlEventSink
from phalanx.safe.goodput import account

if TYPE_CHECKING:  # a store is handed in: the follower that only feeds /metrics and TensorBoard needs no SQLAlchemy
    from phalanx.observe.store import RunStore

GOODPUT_EVERY_S = 10.0
# What goodput accounting needs of each step record; the follower keeps only these for the launch.
GOODPUT_FIELDS = ("step", "time", "loss", "step_seconds", "eval_seconds", "skipped")
MAX_BACKOFF_S = 30.0  # the longest wait between tries while the store is down
STORE_REBUILT, STORE_REFILLED = "store_rebuilt", "store_refilled"  # event kinds of the run's own events


class RunFollower:
    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        wall_start: float,
        store: RunStore | None = None,
        run_id: int | None = None,
        interval: float = 1.0,
        tensorboard: bool = False,
        connect: Callable[[], tuple[RunStore, int]] | None = None,
        on_rebuilt: Callable[[RunStore], bool] | None = None,
        refill_pending: bool = False,
    ):
        """With `connect` (open the store, register the run, return both) the follower opens the store
        itself, retrying until it answers, and reopens it when its SQLite file is replaced; then
        `on_rebuilt` refills the new store with other runs, called on each pass until it says it is
        complete (a store that fails again mid-refill, or a writer killed, must not lose them).
        `refill_pending`: a rebuild before this follower started left its refill unfinished."""
        self.run_dir, self.run_name, self.wall_start = Path(run_dir), run_name, wall_start
        self.store, self.run_id, self.interval = store, run_id, interval
        self.connect, self.on_rebuilt = connect, on_rebuilt
        self.offsets: dict[str, int] = store.offsets(run_id) if store is not None and run_id is not None else {}
        self._identity = _file_identity(store) if store is not None else None
        self.rebuilds = 0
        self.refill_pending = refill_pending
        self.tensorboard = _tensorboard_writer(self.run_dir) if tensorboard else None
        self.last: dict[str, Any] = {}
        self.ranks: dict[int, dict[str, Any]] = {}
        # The newest checkpoint's benchmark scores: {(task, metric): (step, time, value)}, for /metrics.
        self.eval_scores: dict[tuple[str, str], tuple[int, float, float | None]] = {}
        self.counts: Counter[str] = Counter()
        self.launch_metrics: list[dict] = []
        self.launch_events: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="phalanx-store-follower", daemon=True)
        self._goodput_at = 0.0
        # metrics, rank records, events, telemetry samples, benchmark scores
        self._pending: tuple[list[dict], ...] = ([], [], [], [], [])
        self._warned: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> RunFollower:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any] | None:
        """Copy what is left and write the launch's goodput; returns that goodput report."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sync()
        report = self.goodput()
        if self.tensorboard is not None:
            self.tensorboard.close()
        return report

    def _loop(self) -> None:
        delay = self.interval
        while not self._stop.wait(delay):
            delay = self.interval if self.pass_once() else min(MAX_BACKOFF_S, max(delay, self.interval) * 2)

    def pass_once(self) -> bool:
        """One sync (and the goodput now and then); whether everything read is stored. Never raises:
        observing must not take its process down."""
        try:
            stored = self.sync()
            if stored and time.time() - self._goodput_at >= GOODPUT_EVERY_S:
                self.goodput()
            return stored
        except Exception as exc:
            self._warn(f"run follower: {type(exc).__name__}: {exc}")
            return False

    def drain(self, within_s: float, status: str | None = None, error: str | None = None) -> bool:
        """At the end of a launch: copy what is left, retrying with backoff for up to `within_s` seconds
        while the store is down, then write the goodput and (with `status`) the run's final status.
        Whether all of it landed."""
        deadline, delay = time.monotonic() + within_s, min(self.interval, 1.0)
        while True:
            if self.pass_once() and self._finish(status, error):
                return True
            if time.monotonic() + delay > deadline:
                return False
            time.sleep(delay)
            delay = min(MAX_BACKOFF_S, delay * 2)

    def _finish(self, status: str | None, error: str | None) -> bool:
        if self.store is None:
            return False
        try:
            self.goodput(raise_errors=True)
            if status is not None:
                self.store.finish_run(self.run_id, status, error)
            return True
        except StoreError as exc:
            self._warn(f"{exc}; will retry")
            return False

    # -- one pass ----------------------------------------------------------------------------------
    def sync(self) -> bool:
        """Read every file's new complete lines, update /metrics and TensorBoard, and copy them to the
        store; lines the store could not take yet wait in memory for the next pass. Whether nothing
        is left waiting (always True without a store)."""
        offsets, new = dict(self.offsets), {}
        for rel in self._files():
            try:
                new[rel], offsets[rel] = _read_new_lines(self.run_dir / rel, self.offsets.get(rel, 0))
            except OSError as exc:  # a file system hiccup (NFS): try that file again next pass
                self._warn(f"cannot read {rel}: {exc}")
        for rel in report_names(self.run_dir):  # each benchmark report once: it never changes once there
            if rel not in offsets:
                new[rel], offsets[rel] = read_scores(self.run_dir, rel), 1
        metrics, rank_records, events, telemetry, scores = _by_kind(new)
        storing = self.store is not None or self.connect is not None
        with self._lock:
            self.offsets = offsets
            self._update_state(metrics, rank_records, events, scores)
            if storing:
                for pending, records in zip(self._pending, (metrics, rank_records, events, telemetry, scores)):
                    pending.extend(records)
        if self.tensorboard is not None:
            _write_tensorboard(self.tensorboard, metrics, scores)
        if not storing:
            return True
        if self.store is not None and self.connect is not None and self._file_replaced():
            self._rebuild()
        if self.store is None and not self._attach():
            return False
        if self.refill_pending and not self._refill():
            return False
        if not any(self._pending):
            return True
        try:  # outside the lock: a slow database never holds up a /metrics scrape
            metrics, rank_records, events, telemetry, scores = self._pending
            self.store.ingest(self.run_id, metrics, rank_records, events, offsets, telemetry, scores)
        except StoreError as exc:
            if exc.transient:  # down or locked: keep the lines for the next pass
                self._warn(f"{exc}; will retry")
                return False
            # The database refuses these lines and always will: skip them (the plain files keep them).
            self._warn(f"{exc}; {sum(map(len, self._pending))} records not stored")
        self._pending = ([], [], [], [], [])
        return True

    # -- opening, and reopening a replaced store -----------------------------------------------------
    def _attach(self) -> bool:
        """Open the store and register the run (through `connect`); what it lacks of the lines read so far
        becomes pending: all of them for a fresh store, those past its offsets for one that knows the run."""
        try:
            store, run_id = self.connect()
            stored = store.offsets(run_id)
        except StoreError as exc:
            self._warn(f"{exc}; will retry")
            return False
        new = {}
        for rel, upto in self.offsets.items():
            start = stored.get(rel, 0)
            if start < upto:
                try:
                    new[rel] = (
                        read_scores(self.run_dir, rel)
                        if is_report(rel)
                        else _read_lines_between(self.run_dir / rel, start, upto)
                    )
                except OSError as exc:
                    self._warn(f"cannot read {rel}: {exc}")
        with self._lock:
            self._pending = _by_kind(new)
        self.store, self.run_id, self._identity = store, run_id, _file_identity(store)
        return True

    def _file_replaced(self) -> bool:
        return self._identity is not None and _file_identity(self.store) != self._identity

    def _rebuild(self) -> None:
        """The SQLite file was deleted or replaced: drop the old handle (its connections still write to
        the deleted file) and attach to a new one, copying this run's history again."""
        path = self.store.engine.url.database
        self.store.close()
        self.store, self._identity = None, None
        self.rebuilds += 1
        _print_warning(
            f"the run store {path} was deleted or replaced; rebuilding it from the run directory {self.run_dir}"
        )
        if not self._attach():
            return
        # Said in the run's events (and so in the new store): its figures before now were copied again.
        JsonlEventSink(self.run_dir).emit(STORE_REBUILT, path=str(path))
        self.refill_pending = self.on_rebuilt is not None

    def _refill(self) -> bool:
        """Refill a rebuilt store with the other runs; whether that is done. Once done, said in the run's
        events, so that a writer started after this one does not refill again."""
        try:
            done = self.on_rebuilt(self.store)
        except Exception as exc:  # the other runs are a bonus; this run's copy must go on
            self._warn(f"refilling the rebuilt store with the other runs: {type(exc).__name__}: {exc}")
            done = False
        if done:
            self.refill_pending = False
            JsonlEventSink(self.run_dir).emit(STORE_REFILLED)
        return done

    def _files(self) -> list[str]:
        return [METRICS, EVENTS, TELEMETRY, *RunDir(self.run_dir).rank_timing_names()]

    def _update_state(
        self, metrics: list[dict], rank_records: list[dict], events: list[dict], scores: list[dict] = ()
    ) -> None:
        for row in scores:  # a later checkpoint's score replaces an earlier one's; of one step, the newer report's
            key, seen = (row["task"], row["metric"]), self.eval_scores.get((row["task"], row["metric"]))
            if seen is None or (row["step"], row["time"]) >= seen[:2]:
                self.eval_scores[key] = (row["step"], row["time"], row["value"])
        for m in metrics:
            if "loss" in m:
                self.last.update(
                    {
                        k: m.get(k)
                        for k in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "tokens_seen")
                        + ("moe_imbalance", "moe_imbalance_by_layer")
                    }
                )
                if m.get("peak_mem_gib") is not None:
                    self.last["peak_mem_bytes"] = m["peak_mem_gib"] * 2**30
            if m.get("val_loss") is not None:
                self.last["val_loss"] = m["val_loss"]
            if m.get("time", 0) >= self.wall_start:
                self.launch_metrics.append({k: m[k] for k in GOODPUT_FIELDS if k in m})
        for r in rank_records:
            self.ranks[r["rank"]] = r
        for e in events:
            self.counts[e["kind"]] += 1
            if e.get("time", 0) >= self.wall_start:
                self.launch_events.append(e)

    def goodput(self, raise_errors: bool = False) -> dict[str, Any] | None:
        """This launch's goodput so far (written to the store); None before the first step."""
        with self._lock:
            self._goodput_at = time.time()
            if not self.launch_metrics:
                return None
            report = account(self.launch_events, self.launch_metrics, self.wall_start, time.time())
            self.last["ettr"] = report["ettr"]
        if self.store is not None:
            try:
                self.store.set_goodput(self.run_id, report)
            except StoreError as exc:
                if raise_errors:
                    raise
                self._warn(f"{exc}; goodput not stored")
        return report

    def state(self) -> dict[str, Any]:
        """For the Prometheus collector."""
        with self._lock:
            return {
                "run": self.run_name,
                "last": dict(self.last),
                "ranks": dict(self.ranks),
                "counts": dict(self.counts),
                "eval": {key: (step, value) for key, (step, _, value) in self.eval_scores.items()},
            }

    def _warn(self, message: str) -> None:
        if message not in self._warned:  # once each: an outage must not flood the training console
            _print_warning(message)
            self._warned.add(message)


def refill_unfinished(run_dir: Path) -> bool:
    """Whether the run's events say its store was rebuilt and not yet refilled with the other runs."""
    try:
        lines = (Path(run_dir) / EVENTS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    pending = False
    for line in lines:
        if STORE_REBUILT in line or STORE_REFILLED in line:
            try:
                kind = json.loads(line).get("kind")
            except ValueError:  # a line cut short by a crash
                continue
            pending = {STORE_REBUILT: True, STORE_REFILLED: False}.get(kind, pending)
    return pending


def _print_warning(message: str) -> None:
    # One line however long (a log reader greps for it), and no markup read into paths or URLs.
    Console(stderr=True, soft_wrap=True).print(f"[yellow]warning:[/] {escape(message)}")


def _by_kind(new: dict[str, list[dict]]) -> tuple[list[dict], ...]:
    """Records read per file as (metrics, per-rank timings, events, telemetry, benchmark scores)."""
    new = dict(new)
    metrics, events, telemetry = new.pop(METRICS, []), new.pop(EVENTS, []), new.pop(TELEMETRY, [])
    scores = [row for rel in [r for r in new if is_report(r)] for row in new.pop(rel)]
    return metrics, [r for records in new.values() for r in records], events, telemetry, scores


def _file_identity(store: RunStore) -> tuple[int, int] | None:
    """(device, inode) of an SQLite store's file ((-1, -1) once it is gone, which equals no file that is
    there); None for a server database, which has no file to lose."""
    if store.engine.dialect.name != "sqlite":
        return None
    try:
        st = os.stat(store.engine.url.database)
    except OSError:
        return (-1, -1)
    return st.st_dev, st.st_ino


def _read_lines_between(path: Path, start: int, end: int) -> list[dict]:
    """The JSON records of the complete lines in [start, end) of a file (a span already read once)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    records = []
    for line in data.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _read_new_lines(path: Path, position: int) -> tuple[list[dict], int]:
    """The JSON records of complete lines after `position`, and the position after the last of them.
    A file shorter than `position` was replaced: read it from the start."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() < position:
                position = 0
            f.seek(position)
            data = f.read()
    except FileNotFoundError:
        return [], position
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next pass
    records = []
    for line in data[:end].splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return records, position + end


def _tensorboard_writer(run_dir: Path):
    require("tensorboard", "observe.tensorboard=true")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard))


TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_sec": "perf/tokens_per_sec",
    "mfu": "perf/mfu",
    "peak_mem_gib": "perf/peak_mem_gib",
}


def _write_tensorboard(writer: Any, metrics: list[dict], scores: list[dict] = ()) -> None:
    for m in metrics:
        for key, tag in TENSORBOARD_TAGS.items():
            if m.get(key) is not None:
                writer.add_scalar(tag, m[key], global_step=m["step"], walltime=m.get("time"))
    for row in scores:
        if row["value"] is not None:
            writer.add_scalar(f"eval/{row['task']}/{row['metric']}", row["value"], global_step=row["step"])
    writer.flush()
