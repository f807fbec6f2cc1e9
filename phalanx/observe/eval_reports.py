"""The benchmark reports in a run directory (RUN_DIR/eval/step_N-TIME.json, written by `phalanx eval
--tasks`), read as the run store keeps them: one row per task and metric.

A report is written once, atomically (a temporary file renamed into place), so a file that is there is
complete and never changes: the follower reads each once. What it reads is plain JSON checked field by
field; a file that is not a task report of a checkpoint (bits per byte of a text, an export's report, a
hand edit, something hostile) gives no rows rather than an error, since the store must go on copying the
rest of the run.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from phalanx.run.layout import EVAL

REPORT_NAME = re.compile(r"^step_\d{8}-[0-9T]+(-\d+)?\.json$")  # report.py's names; not its .tmp files
MAX_REPORT_BYTES = 4 * 2**20  # a report of hundreds of tasks is well under this
MAX_NAME_CHARS = 200  # the task and metric columns


def is_report(rel: str) -> bool:
    """Whether a path relative to the run directory (the store's offset key) is a benchmark report."""
    return rel.startswith(f"{EVAL}/")


def report_names(run_dir: Path) -> list[str]:
    """The run's reports, relative to the run directory (eval/step_...json), oldest step first."""
    try:
        names = sorted(p.name for p in (Path(run_dir) / EVAL).iterdir() if REPORT_NAME.match(p.name))
    except OSError:  # no eval/ yet
        return []
    return [f"{EVAL}/{name}" for name in names]


def read_scores(run_dir: Path, rel: str) -> list[dict[str, Any]]:
    """The rows of one report: {step, time, report, task, metric, value, stderr, samples, limit}."""
    path = Path(run_dir) / rel
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_REPORT_BYTES + 1)
        report = json.loads(data) if len(data) <= MAX_REPORT_BYTES else None
    except (OSError, ValueError, RecursionError):
        return []
    return scores_of(report, rel)


def scores_of(report: Any, rel: str) -> list[dict[str, Any]]:
    if not isinstance(report, dict) or report.get("kind") != "tasks" or not isinstance(report.get("tasks"), dict):
        return []
    step = report.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**31:
        return []
    samples = report.get("samples") if isinstance(report.get("samples"), dict) else {}
    rows = []
    for task, metrics in report["tasks"].items():
        if not isinstance(metrics, dict):
            continue
        for metric, score in metrics.items():
            if not isinstance(score, dict):
                continue
            rows.append(
                {
                    "step": step,
                    "time": _time(report.get("created")),
                    "report": rel[:300],
                    "task": str(task)[:MAX_NAME_CHARS],
                    "metric": str(metric)[:MAX_NAME_CHARS],
                    "value": _number(score.get("value")),
                    "stderr": _number(score.get("stderr")),
                    "samples": _count(samples.get(task)),
                    "limit": _count(report.get("limit")),
                }
            )
    return rows


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def _time(created: Any) -> float:
    """The report's `created` (ISO 8601 with its zone) as Unix time; 0 when it is missing or bad."""
    try:
        return datetime.fromisoformat(created).timestamp()
    except (TypeError, ValueError):
        return 0.0
