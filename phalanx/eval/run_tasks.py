"""`phalanx eval --tasks`: check the task names, run the harness, make the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx.errors import PhalanxError
from phalanx.eval.harness import evaluate_tasks
from phalanx.eval.report import harness_report
from phalanx.eval.tasks import split_task_names


def evaluate_tasks_report(
    path: Path, tasks: str, limit: int | None, batch_size: int, include_path: Path | None, device: str
) -> dict[str, Any]:
    if not Path(path).exists():  # before the harness's slow import and task index
        raise PhalanxError(f"{path} does not exist: give a run directory, a checkpoint or an export")
    results, loaded = evaluate_tasks(path, split_task_names(tasks), limit, batch_size, include_path, device)
    return harness_report(loaded.checkpoint, results, limit, batch_size)
