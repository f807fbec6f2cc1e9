"""The dashboard's charts as Plotly figure JSON, built on the server from the store's page data.

Figures are plain dicts in Plotly's figure schema (data + layout): the browser only hands them to
Plotly.react. Plain dicts rather than plotly.graph_objects because validating every trace on every
2-second poll costs more than the store query itself; a test checks that each figure passes
graph_objects' validation. Any text that came from a run (names, event details) is HTML-escaped, since
Plotly renders a subset of HTML in hover text, titles and legends.
"""

from __future__ import annotations

import html
import json
from datetime import datetime
from typing import Any

Figure = dict[str, Any]

# Line charts of the run page: (series field, title, y-axis title, y tick format).
LINE_CHARTS = (
    ("lr", "Learning rate", "lr", ".2e"),
    ("grad_norm", "Gradient norm", "norm", ""),
    ("tokens_per_sec", "Throughput", "tokens/s", "~s"),
    ("mfu", "MFU", "model FLOPs utilisation", ".1%"),
    ("peak_mem_gib", "Peak memory", "GiB", ""),
)
# Why a line chart may stay empty for a whole run, where "no data yet" would mislead.
NEVER_REPORTED = {"mfu": "not reported: no known peak FLOP/s for this device",
                  "peak_mem_gib": "not reported on this device"}

# Event kinds by what they mean for the run: one timeline trace (and legend entry, colour) each.
EVENT_GROUPS = (
    ("failure", "#d62728", "x", ("worker_failed", "hang_detected", "save_failed", "checkpoint_corrupt",
                                 "anomaly", "crash_loop")),
    ("recovery", "#ff7f0e", "diamond", ("restart", "regroup", "rollback", "step_skipped", "checkpoint_loaded")),
    ("straggler", "#9467bd", "triangle-up", ("straggler",)),
    ("telemetry", "#8c564b", "star", ("telemetry_alert",)),
    ("checkpoint", "#2ca02c", "circle", ("checkpoint_saved",)),
    ("lifecycle", "#1f77b4", "square", ("attempt_started", "training_started", "fault_injected")),
)
OTHER_EVENTS = ("other", "#7f7f7f", "circle-open")

# Goodput buckets in the order the report lists them; productive first, the losses after it.
GOODPUT_COLOURS = {"productive": "#2ca02c", "redone": "#d62728", "skipped": "#e377c2", "eval": "#17becf",
                   "checkpoint_save": "#1f77b4", "checkpoint_load": "#aec7e8", "startup": "#bcbd22",
                   "detection": "#ff7f0e", "restart": "#ff9896", "other": "#7f7f7f"}

_BASE_LAYOUT: dict[str, Any] = {
    "margin": {"l": 60, "r": 20, "t": 40, "b": 45},
    "height": 300,
    "hovermode": "closest",
    "template": {"layout": {"font": {"size": 12}}},
    "legend": {"orientation": "h", "y": -0.25},
}


def run_figures(data: dict[str, Any]) -> dict[str, Figure]:
    """Every chart of the run page, keyed by the id of the element the page draws it in."""
    series = data["series"]
    figures = {"loss": loss_figure(series)}
    for field, title, y_title, tick_format in LINE_CHARTS:
        empty_text = NEVER_REPORTED.get(field, "no data yet") if series["step"] else "no data yet"
        figures[field] = line_figure(series["step"], series[field], title, y_title, tick_format, empty_text)
    figures["heatmap"] = heatmap_figure(data["heatmap"])
    figures["events"] = events_figure(data["events"])
    figures["goodput"] = goodput_figure(data["goodput"])
    return figures


def loss_figure(series: dict[str, list]) -> Figure:
    traces = [_line(series["step"], series["loss"], "train loss")]
    if series["val_step"]:
        traces.append({**_line(series["val_step"], series["val_loss"], "validation loss"), "mode": "lines+markers"})
    return _figure(traces, "Loss", "step", "loss", empty=not series["step"])


def line_figure(steps: list[int], values: list[float | None], title: str, y_title: str, tick_format: str = "",
                empty_text: str = "no data yet") -> Figure:
    figure = _figure([_line(steps, values, title)], title, "step", y_title,
                     empty=not any(v is not None for v in values), empty_text=empty_text)
    figure["layout"]["showlegend"] = False
    if tick_format:
        figure["layout"]["yaxis"]["tickformat"] = tick_format
    return figure


def heatmap_figure(heatmap: dict[str, Any]) -> Figure:
    """Ranks down, steps (or bins of steps) across, each rank's own compute time as colour: a straggler
    is a bright row (a slow device) or a bright patch (a slow spell)."""
    stride = heatmap.get("stride", 1)
    x_title = "step" if stride == 1 else f"step (mean of sampled steps per bin of {stride})"
    trace = {
        "type": "heatmap",
        "x": heatmap["steps"],
        "y": [f"rank {r}" for r in heatmap["ranks"]],
        "z": heatmap["compute_seconds"],
        "colorscale": "Viridis",
        "colorbar": {"title": {"text": "s"}},
        "hovertemplate": "%{y}, step %{x}<br>compute %{z:.3f} s<extra></extra>",
        "hoverongaps": False,
    }
    figure = _figure([trace], "Compute time per rank and step", x_title, "", empty=not heatmap["ranks"])
    figure["layout"]["yaxis"].update(type="category", autorange="reversed")
    figure["layout"]["height"] = max(300, 90 + 22 * len(heatmap["ranks"]))
    return figure


def events_figure(events: list[dict[str, Any]]) -> Figure:
    """The event log on a time axis: one marker per event, grouped by meaning, details on hover."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        grouped.setdefault(_event_group(event["kind"])[0], []).append(event)
    traces = []
    for name, colour, symbol, _ in (*EVENT_GROUPS, (*OTHER_EVENTS, ())):
        members = grouped.get(name)
        if not members:
            continue
        traces.append({
            "type": "scatter", "mode": "markers", "name": name,
            "x": [_local_time(e["time"]) for e in members],
            "y": [_text(e["kind"]) for e in members],  # tick labels are pseudo-HTML too
            "hovertext": [event_hover(e) for e in members],
            "hoverinfo": "text",
            "marker": {"color": colour, "symbol": symbol, "size": 11, "line": {"width": 1, "color": colour}},
        })
    figure = _figure(traces, "Events", "time (dashboard server's clock)", "", empty=not events)
    figure["layout"]["xaxis"]["type"] = "date"
    figure["layout"]["yaxis"]["type"] = "category"
    kinds = len({e["kind"] for e in events})
    figure["layout"]["height"] = max(260, 120 + 28 * kinds)
    figure["layout"]["margin"]["l"] = 140
    return figure


def goodput_figure(report: dict[str, Any] | None) -> Figure:
    """Where the run's wall time went (seconds per bucket), with ETTR in the title."""
    buckets = (report or {}).get("goodput") or {}
    names = list(buckets)
    trace = {
        "type": "bar", "orientation": "h",
        "x": [buckets[n] for n in names],
        "y": [_text(n) for n in names],
        "marker": {"color": [GOODPUT_COLOURS.get(n, "#7f7f7f") for n in names]},
        "hovertemplate": "%{y}: %{x:.1f} s<extra></extra>",
    }
    ettr = (report or {}).get("ettr")
    title = "Goodput" + (f" (ETTR {ettr:.1%})" if isinstance(ettr, (int, float)) else "")
    figure = _figure([trace], title, "seconds", "", empty=not names)
    figure["layout"]["yaxis"].update(type="category", autorange="reversed")
    figure["layout"]["showlegend"] = False
    figure["layout"]["margin"]["l"] = 120
    return figure


def compare_figures(runs: list[dict[str, Any]]) -> dict[str, Figure]:
    """Train loss (solid) and validation loss (dotted) of several runs overlaid, one colour per run."""
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf")
    train, val = [], []
    for i, entry in enumerate(runs):
        run, series = entry["run"], entry["series"]
        label = _text(f"{run['name']} (#{run['id']})")
        colour = palette[i % len(palette)]
        train.append({**_line(series["step"], series["loss"], label), "line": {"color": colour}})
        if series["val_step"]:
            val.append({**_line(series["val_step"], series["val_loss"], label), "mode": "lines+markers",
                        "line": {"color": colour, "dash": "dot"}})
    figures = {
        "train_loss": _figure(train, "Training loss", "step", "loss", empty=not any(t["x"] for t in train)),
        "val_loss": _figure(val, "Validation loss", "step", "loss", empty=not val),
    }
    for figure in figures.values():
        figure["layout"]["showlegend"] = True  # Plotly hides a lone trace's legend: its run's name
    return figures


def event_hover(event: dict[str, Any]) -> str:
    """An event's hover text: kind, where, when, then its details one per line, all escaped."""
    where = ", ".join(f"{k} {event[k]}" for k in ("rank", "node") if event.get(k) is not None)
    lines = [f"<b>{_text(event['kind'])}</b>" + (f" ({_text(where)})" if where else ""),
             _text(_local_time(event["time"]))]
    for key, value in event_details(event).items():
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > 120:
            text = text[:117] + "..."
        lines.append(f"{_text(key)}: {_text(text)}")
    return "<br>".join(lines)


def event_details(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("time", "node", "rank", "kind")}


def _text(value: str) -> str:
    """Text for Plotly's pseudo-HTML: with < > & escaped no tag can form, and Plotly shows these three
    entities as the characters (it would show &quot; literally, so quotes stay as they are)."""
    return html.escape(value, quote=False)


def _event_group(kind: str) -> tuple[str, str, str]:
    for name, colour, symbol, kinds in EVENT_GROUPS:
        if kind in kinds:
            return name, colour, symbol
    return OTHER_EVENTS


def _local_time(unix_seconds: float) -> str:
    # Plotly reads date strings without a zone as they are; the server's local time is what its logs show.
    return datetime.fromtimestamp(unix_seconds).isoformat(sep=" ", timespec="milliseconds")


def _line(x: list, y: list, name: str) -> dict[str, Any]:
    return {"type": "scatter", "mode": "lines", "name": name, "x": x, "y": y}


def _figure(traces: list[dict[str, Any]], title: str, x_title: str, y_title: str, empty: bool,
            empty_text: str = "no data yet") -> Figure:
    layout = json.loads(json.dumps(_BASE_LAYOUT))  # a fresh copy: callers adjust it
    layout.update(title={"text": _text(title), "x": 0.01}, xaxis={"title": {"text": x_title}, "zeroline": False},
                  yaxis={"title": {"text": y_title}})
    if empty:
        layout["annotations"] = [{"text": _text(empty_text), "showarrow": False, "xref": "paper", "yref": "paper",
                                  "x": 0.5, "y": 0.5, "font": {"size": 16, "color": "#888"}}]
    return {"data": traces, "layout": layout}
