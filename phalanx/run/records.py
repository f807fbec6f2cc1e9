"""The run's records as their writers and readers see them: the event log (any process) and the step
metrics (rank 0).

The event log holds every fault, detection, restart, rollback, failed save and straggler alert: one
JSON object per line in RUN_DIR/events.jsonl with `time` (Unix seconds), `node`, `rank` (null for the
node agent), `kind` and details. The agent and the ranks append to the same file, one line per
write() (see jsonl.append_line), so lines from several processes never interleave.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from phalanx.run.jsonl import append_line, json_safe, read_jsonl
from phalanx.run.layout import RunDir


class EventSink(Protocol):
    def emit(self, kind: str, rank: int | None = None, **details: Any) -> dict[str, Any]: ...


class JsonlEventSink:
    def __init__(self, run_dir: Path):
        self.path = RunDir(run_dir).events
        self.node = socket.gethostname()

    def emit(self, kind: str, rank: int | None = None, **details: Any) -> dict[str, Any]:
        event = json_safe({"time": time.time(), "node": self.node, "rank": rank, "kind": kind, **details})
        append_line(self.path, json.dumps(event))
        return event


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(RunDir(run_dir).events)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(RunDir(run_dir).metrics)
