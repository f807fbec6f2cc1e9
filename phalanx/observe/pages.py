"""The data behind each dashboard page, read from the store and downsampled on the server, and the
JSON answers the pages poll (the page data with its figures built for the page's chart options)."""

from __future__ import annotations

import json
import time
from typing import Any

import yaml

from phalanx.observe.figures import (
    ChartOptions,
    compare_figures,
    compare_hidden,
    hidden_charts,
    mfu_note,
    run_colour,
    run_figures,
)
from phalanx.observe.store import RunStore

MAX_POINTS = 1000  # per curve: enough for any screen, small enough to send every few seconds
MAX_HEATMAP_BINS = 200
MAX_TELEMETRY_POINTS = 300  # per node (and device) and reading: 7 charts of them, every poll


def run_page_data(store: RunStore, run_id: int, by_time: bool = False) -> dict[str, Any]:
    """Everything the run page shows: the run, its curves (on a wall-time axis with each run of a
    restarted step as a point of its own), rank heatmap, a mixture of experts' layer-by-step balance,
    events (each with the step the run was at), goodput, hardware telemetry and benchmark scores."""
    events = store.events(run_id)
    warmup = warmup_steps(events)
    heatmap = store.rank_heatmap(run_id, MAX_HEATMAP_BINS, warmup_steps=warmup)
    heatmap["warmup_steps"] = sorted(warmup)
    return {
        "run": store.run(run_id),
        "series": store.series(run_id, MAX_POINTS, every_run=by_time),
        "heatmap": heatmap,
        "moe_heatmap": store.moe_heatmap(run_id, MAX_HEATMAP_BINS),
        "events": events,
        "event_steps": event_steps(store, run_id, events),
        "goodput": store.goodput(run_id),
        "telemetry": store.telemetry(run_id, MAX_TELEMETRY_POINTS),
        "eval_scores": store.eval_scores(run_id),
    }


def run_answer(store: RunStore, run_id: int, options: ChartOptions) -> dict[str, Any]:
    """GET /api/runs/ID: the page data, the config as YAML, the figures, and which charts are left out."""
    data = run_page_data(store, run_id, by_time=options.x == "time")
    config = data["run"].get("config")
    data["config_yaml"] = yaml.safe_dump(config, sort_keys=False) if config is not None else None
    data["figures"] = run_figures(data, options)
    data["hidden"] = hidden_charts(data)
    data["notes"] = {"mfu": mfu_note(data)}
    data["options"] = {"x": options.x, "smooth": options.smooth, "log": options.log}
    data["now"] = time.time()
    del data["telemetry"]  # the system figures hold it; sent twice it would be half of a long run's answer
    return data


def compare_data(store: RunStore, run_ids: list[int], by_time: bool = False) -> list[dict[str, Any]]:
    """The curves of several runs, for overlaying; on a time axis with their restarts, where the
    curves break."""
    runs = [
        {"run": store.run(run_id), "series": store.series(run_id, MAX_POINTS, every_run=by_time)} for run_id in run_ids
    ]
    if by_time:
        for entry in runs:
            entry["events"] = [e for e in store.events(entry["run"]["id"]) if e["kind"] in ("restart", "regroup")]
    return runs


def compare_answer(store: RunStore, run_ids: list[int], options: ChartOptions) -> dict[str, Any]:
    """GET /api/compare: the runs, where their configs differ, and every training chart overlaid."""
    runs = compare_data(store, run_ids, by_time=options.x == "time")
    answer = {
        "runs": runs,
        "config_diff": config_differences([entry["run"].get("config") for entry in runs]),
        "figures": compare_figures(runs, options),
        "hidden": compare_hidden(runs),
        "now": time.time(),
    }
    for i, entry in enumerate(runs):
        entry["colour"] = run_colour(i)
        entry.pop("events", None)
        entry["run"].pop("config", None)  # the diff is what the page shows of it, and it is the largest part
    return answer


def warmup_steps(events: list[dict[str, Any]]) -> frozenset[int]:
    """The first step of each launch (it compiles kernels and allocates memory): step 1 and the step
    after each place training (re)started."""
    return frozenset(
        {1} | {e["step"] + 1 for e in events if e["kind"] == "training_started" and isinstance(e.get("step"), int)}
    )


def event_steps(store: RunStore, run_id: int, events: list[dict[str, Any]]) -> list[int]:
    """The step each event belongs to: its own `step`, or for events without one (a restart, a crash the
    agent saw) the step the run had last logged when it happened."""
    steps: list[int | None] = [e["step"] if isinstance(e.get("step"), int) else None for e in events]
    missing = [i for i, step in enumerate(steps) if step is None]
    for i, step in zip(missing, store.steps_at(run_id, [events[i]["time"] for i in missing])):
        steps[i] = step
    return steps  # type: ignore[return-value]


def config_differences(configs: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """The config keys (dotted) whose values differ between the runs, with each run's value (None where
    a run's config lacks the key). run.* (name, directory) always differs and is left out, as in
    `phalanx runs compare`."""
    flat = [_flatten(config or {}) for config in configs]
    keys = sorted(
        k
        for k in set().union(*flat)
        if not k.startswith("run.") and len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1
    )
    return [{"key": key, "values": [f.get(key) for f in flat]} for key in keys]


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
