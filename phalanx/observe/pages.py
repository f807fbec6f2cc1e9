"""The data behind each dashboard page, read from the store and downsampled on the server."""

from __future__ import annotations

from typing import Any

from phalanx.observe.store import RunStore

MAX_POINTS = 1000  # per curve: enough for any screen, small enough to send every few seconds
MAX_HEATMAP_BINS = 200


def run_page_data(store: RunStore, run_id: int) -> dict[str, Any]:
    """Everything the run page shows: the run, its curves, rank heatmap, events and goodput."""
    return {
        "run": store.run(run_id),
        "series": store.series(run_id, MAX_POINTS),
        "heatmap": store.rank_heatmap(run_id, MAX_HEATMAP_BINS),
        "events": store.events(run_id),
        "goodput": store.goodput(run_id),
    }


def compare_data(store: RunStore, run_ids: list[int]) -> list[dict[str, Any]]:
    """Loss curves of several runs, for overlaying."""
    return [{"run": store.run(run_id), "series": store.series(run_id, MAX_POINTS)} for run_id in run_ids]
