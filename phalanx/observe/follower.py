"""The node agent's copy of a run's plain files into the run store, Prometheus and TensorBoard.

The ranks only append JSON lines (step metrics from rank 0, step timings from every rank, and events;
the node agents append their hardware samples; phalanx/run/layout.py names the files), which costs them
microseconds and never waits on a database. A thread in the node agent
reads what is new every `sync_interval_s` and writes it to the store in one transaction together with
how far it read each file, so every line lands exactly once, across restarts and later launches. A
store that is briefly unreachable only delays the copy (the lines wait in memory, /metrics and
TensorBoard carry on): nothing is lost, training never notices.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console

from phalanx.errors import StoreError
from phalanx.observe.store import RunStore
from phalanx.run.layout import EVENTS, METRICS, TELEMETRY, RunDir
from phalanx.safe.goodput import account

GOODPUT_EVERY_S = 10.0
# What goodput accounting needs of each step record; the follower keeps only these for the launch.
GOODPUT_FIELDS = ("step", "time", "loss", "step_seconds", "eval_seconds", "skipped")


class RunFollower:
    def __init__(self, run_dir: Path, run_name: str, wall_start: float, store: RunStore | None = None,
                 run_id: int | None = None, interval: float = 1.0, tensorboard: bool = False):
        self.run_dir, self.run_name, self.wall_start = Path(run_dir), run_name, wall_start
        self.store, self.run_id, self.interval = store, run_id, interval
        self.offsets: dict[str, int] = store.offsets(run_id) if store is not None and run_id is not None else {}
        self.tensorboard = _tensorboard_writer(self.run_dir) if tensorboard else None
        self.last: dict[str, Any] = {}
        self.ranks: dict[int, dict[str, Any]] = {}
        self.counts: Counter[str] = Counter()
        self.launch_metrics: list[dict] = []
        self.launch_events: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="phalanx-store-follower", daemon=True)
        self._goodput_at = 0.0
        # metrics, rank records, events, telemetry samples
        self._pending: tuple[list[dict], list[dict], list[dict], list[dict]] = ([], [], [], [])
        self._warned: set[str] = set()

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "RunFollower":
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
        while not self._stop.wait(self.interval):
            try:
                self.sync()
                if time.time() - self._goodput_at >= GOODPUT_EVERY_S:
                    self.goodput()
            except Exception as exc:  # never let observing take the node agent down
                self._warn(f"run follower: {type(exc).__name__}: {exc}")

    # -- one pass ----------------------------------------------------------------------------------
    def sync(self) -> None:
        """Read every file's new complete lines, update /metrics and TensorBoard, and copy them to the
        store; lines the store could not take yet wait in memory for the next pass."""
        offsets, new = dict(self.offsets), {}
        for rel in self._files():
            try:
                new[rel], offsets[rel] = _read_new_lines(self.run_dir / rel, self.offsets.get(rel, 0))
            except OSError as exc:  # a file system hiccup (NFS): try that file again next pass
                self._warn(f"cannot read {rel}: {exc}")
        metrics, events, telemetry = new.pop(METRICS, []), new.pop(EVENTS, []), new.pop(TELEMETRY, [])
        rank_records = [r for records in new.values() for r in records]
        with self._lock:
            self.offsets = offsets
            self._update_state(metrics, rank_records, events)
            for pending, records in zip(self._pending, (metrics, rank_records, events, telemetry)):
                pending.extend(records)
        if self.tensorboard is not None:
            _write_tensorboard(self.tensorboard, metrics)
        if self.store is None or not any(self._pending):
            return
        try:  # outside the lock: a slow database never holds up a /metrics scrape
            metrics, rank_records, events, telemetry = self._pending
            self.store.ingest(self.run_id, metrics, rank_records, events, offsets, telemetry)
        except StoreError as exc:
            if exc.transient:  # down or locked: keep the lines for the next pass
                self._warn(f"{exc}; will retry")
                return
            # The database refuses these lines and always will: skip them (the plain files keep them).
            self._warn(f"{exc}; {sum(map(len, self._pending))} records not stored")
        self._pending = ([], [], [], [])

    def _files(self) -> list[str]:
        return [METRICS, EVENTS, TELEMETRY, *RunDir(self.run_dir).rank_timing_names()]

    def _update_state(self, metrics: list[dict], rank_records: list[dict], events: list[dict]) -> None:
        for m in metrics:
            if "loss" in m:
                self.last.update({k: m.get(k) for k in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu",
                                                        "tokens_seen")})
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

    def goodput(self) -> dict[str, Any] | None:
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
                self._warn(f"{exc}; goodput not stored")
        return report

    def state(self) -> dict[str, Any]:
        """For the Prometheus collector."""
        with self._lock:
            return {"run": self.run_name, "last": dict(self.last), "ranks": dict(self.ranks),
                    "counts": dict(self.counts)}

    def _warn(self, message: str) -> None:
        if message not in self._warned:  # once each: an outage must not flood the training console
            Console(stderr=True).print(f"[yellow]warning:[/] {message}")
            self._warned.add(message)


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
    from phalanx.errors import PhalanxError

    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise PhalanxError("observe.tensorboard=true needs the tensorboard package: "
                           "pip install 'phalanx[tensorboard]'") from None
    return SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard))


TENSORBOARD_TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                    "tokens_per_sec": "perf/tokens_per_sec", "mfu": "perf/mfu", "peak_mem_gib": "perf/peak_mem_gib"}


def _write_tensorboard(writer: Any, metrics: list[dict]) -> None:
    for m in metrics:
        for key, tag in TENSORBOARD_TAGS.items():
            if m.get(key) is not None:
                writer.add_scalar(tag, m[key], global_step=m["step"], walltime=m.get("time"))
    writer.flush()
