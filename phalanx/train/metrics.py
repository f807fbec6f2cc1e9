"""Where step metrics go: one sink interface, a JSON-lines file today, a run store later."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per record; line-buffered so a crash loses at most the current line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(json_safe({**record, "time": time.time()})) + "\n")

    def close(self) -> None:
        self._file.close()


class NullSink:
    """For ranks other than 0: only one process writes the run's files."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressLine:
    """A live line on stderr (step, loss, tok/s, ETA); stdout stays free for --json output."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._enabled = enabled

    def __enter__(self) -> "ProgressLine":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, loss: float, tokens_per_sec: float, val_loss: float | None) -> None:
        info = f"loss {loss:.4f}  {tokens_per_sec:,.0f} tok/s"
        if val_loss is not None:
            info += f"  val {val_loss:.4f}"
        self._progress.update(self._task, completed=step, info=info)

    def log(self, message: str) -> None:
        if self._enabled:
            self._progress.console.print(message)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none if it is missing), skipping a line a crash cut short."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def json_safe(value: Any) -> Any:
    """NaN and Inf become null: strict JSON readers (jq, JSON.parse) reject Python's bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
