"""The run's event log: every fault, detection, restart, rollback, failed save and straggler alert.

One JSON object per line in RUN_DIR/events.jsonl with `time` (Unix seconds), `node`, `rank` (null for
the node agent), `kind` and details. The agent and the ranks append to the same file; each event is a
single write() on a file opened with O_APPEND, so lines from several processes never interleave.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from phalanx.train.metrics import json_safe, read_jsonl

EVENTS_FILE = "events.jsonl"


class EventSink(Protocol):
    def emit(self, kind: str, rank: int | None = None, **details: Any) -> dict[str, Any]: ...


class JsonlEventSink:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / EVENTS_FILE
        self.node = socket.gethostname()

    def emit(self, kind: str, rank: int | None = None, **details: Any) -> dict[str, Any]:
        event = json_safe({"time": time.time(), "node": self.node, "rank": rank, "kind": kind, **details})
        line = (json.dumps(event) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return event


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / EVENTS_FILE)
