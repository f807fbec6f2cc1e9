"""What `phalanx eval` reports: one dictionary for --json and the saved file, a table for people, and
where it is kept (RUN_DIR/eval/, when the model came from a run directory).

The report names the checkpoint, and its step, so that results of different steps of a run can be set
side by side; it is written atomically (a temporary file renamed into place), so a reader never sees
half of one.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from phalanx.console import fitted_table, out
from phalanx.run.layout import STEP_DIR, RunDir, run_of_checkpoint


def checkpoint_step(checkpoint: Path) -> int | None:
    """The training step of a run's checkpoint (checkpoints/step_N), None for an export."""
    found = STEP_DIR.match(Path(checkpoint).name)
    return int(found.group(1)) if found else None


def base_report(checkpoint: Path) -> dict[str, Any]:
    run = run_of_checkpoint(checkpoint)
    return {
        "model": str(Path(checkpoint).absolute()),
        "run_dir": str(run.path) if run is not None else None,
        "step": checkpoint_step(checkpoint) if run is not None else None,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def harness_metrics(results: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """lm-eval's results as {task: {metric: {"value", "stderr"}}}: its keys are "metric,filter" (the
    filter "none" dropped) beside "metric_stderr,filter"."""
    metrics: dict[str, dict[str, dict[str, float | None]]] = {}
    for task, values in results["results"].items():
        found = metrics.setdefault(task, {})
        for key, value in values.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue  # alias, sample counts, and the stderrs (read beside their metric)
            metric, filter_name = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            name = metric if filter_name == "none" else f"{metric} ({filter_name})"
            found[name] = {"value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
    return metrics


def harness_report(checkpoint: Path, results: dict[str, Any], limit: int | None, batch_size: int) -> dict[str, Any]:
    import lm_eval

    return {
        **base_report(checkpoint),
        "kind": "tasks",
        "tasks": harness_metrics(results),
        "samples": {task: counts.get("effective") for task, counts in results.get("n-samples", {}).items()},
        "limit": limit,
        "batch_size": batch_size,
        "lm_eval_version": lm_eval.__version__,
    }


def print_tasks_table(report: dict[str, Any]) -> None:
    rows = [
        [task, metric, f"{v['value']:.4f}", "" if v["stderr"] is None else f"{v['stderr']:.4f}"]
        for task, metrics in report["tasks"].items()
        for metric, v in metrics.items()
    ]
    out.print(fitted_table(_title(report), ["task", "metric", "value", "stderr"], rows, right=("value", "stderr")))


def print_text_table(report: dict[str, Any]) -> None:
    text = report["text"]
    rows = [
        ["bits per byte", f"{text['bits_per_byte']:.4f}"],
        ["perplexity (per token)", f"{text['perplexity']:.3f}"],
        ["tokens", f"{text['tokens']:,}"],
        ["bytes", f"{text['bytes']:,}"],
        ["window, stride", f"{text['context']}, {text['stride']}"],
    ]
    out.print(fitted_table(_title(report), ["measure", "value"], rows, right=("value",)))


def _title(report: dict[str, Any]) -> str:
    """Short enough to stay on one line: the run's name and step, or the export's name."""
    if report["run_dir"] is not None:
        return f"{Path(report['run_dir']).name}, step {report['step']}"
    return Path(report["model"]).name


def save_report(report: dict[str, Any]) -> Path | None:
    """RUN_DIR/eval/step_N-TIME.json for a model from a run directory (None for an export)."""
    if report["run_dir"] is None:
        return None
    stamp = re.sub(r"[-:]", "", report["created"].split("+")[0])  # 20260105T101500
    run, n = RunDir(Path(report["run_dir"])), 1
    path = run.eval_result(report["step"], stamp)
    while path.exists():  # two evaluations of one step within a second: keep both
        n += 1
        path = run.eval_result(report["step"], f"{stamp}-{n}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    return path
