"""The dashboard's charts as Plotly figure JSON, built on the server from the store's page data.

Figures are plain dicts in Plotly's figure schema (data + layout): the browser only hands them to
Plotly.react. Plain dicts rather than plotly.graph_objects because validating every trace on every
2-second poll costs more than the store query itself; a test checks that each figure passes
graph_objects' validation. Any text that came from a run (names, event details) is HTML-escaped, since
Plotly renders a subset of HTML in hover text, titles and legends.

The page's controls (x axis by step, tokens or wall time; smoothing; log scale) are query parameters
the server builds the figures for (ChartOptions), so what a chart shows is decided and tested here, and
a link to a page keeps its view.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

Figure = dict[str, Any]

X_AXES = ("step", "tokens", "time")
MAX_SMOOTHING = 0.99
MAX_CHECKPOINT_MARKS = 100  # a save every few steps of a long run would be a solid wall of lines

# Line charts of the run page: (series field, title, y-axis title, y tick format). Throughput and MFU
# are each step's own rates; the run's averages (the tiles, the runs list) are phalanx/run/throughput.py's.
LINE_CHARTS = (
    ("lr", "Learning rate", "lr", ".2e"),
    ("grad_norm", "Gradient norm", "norm", ""),
    ("tokens_per_sec", "Throughput per step", "tokens/s", "~s"),
    ("mfu", "MFU per step", "model FLOPs utilisation", ".1%"),
    ("peak_mem_gib", "Peak memory", "GiB", ""),
    ("step_seconds", "Step time", "seconds", ""),
)
# Noisy step by step: these are the charts smoothing applies to (a learning rate or a memory peak is not).
SMOOTHED = {"loss", "grad_norm", "tokens_per_sec", "mfu", "step_seconds"}
# Charts with restarts, rollbacks and checkpoint saves drawn on them as vertical lines.
MARKED = {"loss", "tokens_per_sec"}
# Why a line chart may stay empty for a whole run: it is hidden, and the page says why.
NEVER_REPORTED = {
    "mfu": "not reported: no known peak FLOP/s for this device",
    "peak_mem_gib": "not reported on this device",
}

# Event kinds drawn as marks on the loss and throughput charts: (kind, mark, colour, line dash).
MARKS = (
    ("restart", "restart", "#ff7f0e", "dash"),
    ("regroup", "restart", "#ff7f0e", "dash"),
    ("rollback", "rollback", "#d62728", "dashdot"),
    ("checkpoint_saved", "checkpoint saved", "#2ca02c", "dot"),
)

# Event kinds by what they mean for the run: one timeline trace (and legend entry, colour) each.
EVENT_GROUPS = (
    (
        "failure",
        "#d62728",
        "x",
        ("worker_failed", "hang_detected", "save_failed", "checkpoint_corrupt", "anomaly", "crash_loop"),
    ),
    ("recovery", "#ff7f0e", "diamond", ("restart", "regroup", "rollback", "step_skipped", "checkpoint_loaded")),
    ("straggler", "#9467bd", "triangle-up", ("straggler",)),
    ("telemetry", "#8c564b", "star", ("telemetry_alert",)),
    ("checkpoint", "#2ca02c", "circle", ("checkpoint_saved",)),
    ("lifecycle", "#1f77b4", "square", ("attempt_started", "training_started", "fault_injected")),
)
OTHER_EVENTS = ("other", "#7f7f7f", "circle-open")

# Goodput buckets in the order the report lists them; productive first, the losses after it.
GOODPUT_COLOURS = {
    "productive": "#2ca02c",
    "redone": "#d62728",
    "skipped": "#e377c2",
    "eval": "#17becf",
    "checkpoint_save": "#1f77b4",
    "checkpoint_load": "#aec7e8",
    "startup": "#bcbd22",
    "detection": "#ff7f0e",
    "restart": "#ff9896",
    "other": "#7f7f7f",
}

# System charts from the node agents' telemetry: (chart, host or devices, field, title, y title, tick
# format, divisor).
SYSTEM_CHARTS = (
    ("sys_cpu", "host", "cpu_ratio", "Host CPU", "utilisation", ".0%", 1),
    ("sys_memory", "host", "memory_used_bytes", "Host memory in use", "GiB", "", 2**30),
    ("sys_disk", "host", "disk_free_bytes", "Free disk at the run directory", "GiB", "", 2**30),
    ("sys_device_util", "devices", "utilization_ratio", "Accelerator utilisation", "busy", ".0%", 1),
    ("sys_device_memory", "devices", "memory_used_bytes", "Accelerator memory in use", "GiB", "", 2**30),
    ("sys_device_temp", "devices", "temperature_c", "Accelerator temperature", "°C", "", 1),
    ("sys_device_power", "devices", "power_w", "Accelerator power", "W", "", 1),
)
NO_TELEMETRY = (
    "no hardware telemetry stored for this run (observe.telemetry_interval_s=0, or it trained "
    "before the store kept telemetry)"
)
NO_DEVICE_TELEMETRY = (
    "no accelerator telemetry: a CPU run, or the node has neither pynvml (NVIDIA, "
    "pip install 'phalanx[nvidia]') nor amdsmi (AMD)"
)

# A mixture of experts' routing balance: the worst MoE layer's curve and the layer-by-step heatmap.
MOE_CHARTS = ("moe_imbalance", "moe_heatmap")
NOT_MOE = "not a mixture of experts: no step reported its experts' routing balance"

# Benchmark scores (eval.tasks while training, or `phalanx eval --tasks` by hand) beside the loss.
NO_EVAL_SCORES = "no benchmark scores stored: train with eval.tasks, or run `phalanx eval RUN_DIR --tasks ...`"

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")

_BASE_LAYOUT: dict[str, Any] = {
    "margin": {"l": 60, "r": 20, "t": 40, "b": 45},
    "height": 300,
    "hovermode": "closest",
    "template": {"layout": {"font": {"size": 12}}},
    "legend": {"orientation": "h", "y": -0.25},
}


@dataclass(frozen=True)
class ChartOptions:
    """What the page's controls ask for: the x axis, the smoothing weight (an exponential moving
    average as TensorBoard's slider, 0 = raw) and a log-scale y axis."""

    x: str = "step"
    smooth: float = 0.0
    log: bool = False


def chart_options(x: str | None = None, smooth: str | None = None, log: str | None = None) -> ChartOptions:
    """ChartOptions from query parameters; a ValueError that says what is allowed for anything else."""
    x = x or "step"
    if x not in X_AXES:
        raise ValueError(f"x must be one of {', '.join(X_AXES)}, not {x!r}")
    try:
        weight = float(smooth) if smooth not in (None, "") else 0.0
    except ValueError:
        weight = math.nan
    if not 0 <= weight <= MAX_SMOOTHING:  # NaN fails this too
        raise ValueError(f"smooth must be a number from 0 to {MAX_SMOOTHING}, not {smooth!r}")
    if log not in (None, "", "0", "1", "true", "false"):
        raise ValueError(f"log must be 0 or 1, not {log!r}")
    return ChartOptions(x, weight, log in ("1", "true"))


class XAxis:
    """Where a step of one run lands on the chosen x axis: itself, the tokens trained by then (as the
    trainer counts them, step x global batch tokens), or its wall time."""

    def __init__(self, series: dict[str, list], kind: str, config: dict[str, Any] | None = None):
        self.kind = kind
        self.per_step = _tokens_per_step(series, config)
        if kind == "tokens" and self.per_step is None:
            self.kind = "step"  # nothing says how many tokens a step is: say so in the axis title
            self.title = "step (tokens per step not recorded)"
        else:
            self.title = {"step": "step", "tokens": "tokens", "time": "time (dashboard server's clock)"}[kind]
        self.step_time = dict(zip(series["step"], series.get("time") or []))

    def steps(self, steps: list[int | None], times: list[float | None] | None = None) -> list:
        """x values of points at these steps (logged at these times)."""
        if self.kind == "tokens":
            return [s * self.per_step if s is not None else None for s in steps]
        if self.kind == "time":
            return [_local_time(t) if t is not None else None for t in (times or [None] * len(steps))]
        return list(steps)

    def event(self, step: int, when: float) -> Any:
        """x of an event that happened at `when`, the run being at `step`."""
        if self.kind == "time":
            return _local_time(when)
        return self.steps([step])[0]

    def layout(self, figure: Figure) -> None:
        figure["layout"]["xaxis"]["title"]["text"] = self.title
        if self.kind == "time":
            figure["layout"]["xaxis"]["type"] = "date"
        elif self.kind == "tokens":
            figure["layout"]["xaxis"]["tickformat"] = "~s"


def run_figures(data: dict[str, Any], options: ChartOptions = ChartOptions()) -> dict[str, Figure]:
    """Every chart of the run page, keyed by the id of the element the page draws it in."""
    series = data["series"]
    axis = XAxis(series, options.x, data["run"].get("config"))
    marks = run_marks(data.get("events", []), data.get("event_steps"), axis) if series["step"] else []
    if axis.kind == "time":  # no line across the time the run was down
        series = break_at_restarts(series, data.get("events", []))
    figures = {"loss": loss_figure(series, axis, options, marks)}
    figures["eval_scores"] = eval_scores_figure(data.get("eval_scores") or [], axis, series)
    for field, title, y_title, tick_format in LINE_CHARTS:
        empty_text = NEVER_REPORTED.get(field, "no data yet") if series["step"] else "no data yet"
        figures[field] = line_figure(
            axis.steps(series["step"], series.get("time")),
            series[field],
            title,
            y_title,
            tick_format,
            empty_text,
            smooth=options.smooth if field in SMOOTHED else 0.0,
            log=options.log and field != "lr",
        )
        axis.layout(figures[field])
        if field in MARKED:
            add_marks(figures[field], marks, legend=False)  # a small chart: its legend would cover the axis
    figures["moe_imbalance"] = moe_imbalance_figure(series, axis, options)
    figures["heatmap"] = heatmap_figure(data["heatmap"])
    figures["moe_heatmap"] = moe_heatmap_figure(data["moe_heatmap"])
    figures["events"] = events_figure(data["events"], data.get("event_steps"), axis)
    figures["goodput"] = goodput_figure(data["goodput"])
    figures.update(system_figures(data.get("telemetry") or {"host": [], "devices": []}))
    return figures


def break_at_restarts(series: dict[str, list], events: list[dict[str, Any]]) -> dict[str, list]:
    """The series (in time order) with a gap (a point of nothing but its time) at each restart between
    two of its points, so a wall-time chart draws no line across the time the run was down; for the
    training curves and the validation curve alike."""
    restarts = sorted(e["time"] for e in events if e["kind"] in ("restart", "regroup"))
    if not restarts:
        return series
    out = dict(series)
    for time_key, keys in (
        ("time", [k for k in series if not k.startswith("val_")]),
        ("val_time", [k for k in series if k.startswith("val_")]),
    ):
        if not series.get(time_key):
            continue
        broken: dict[str, list] = {k: [] for k in keys}
        pending = iter(restarts)
        upcoming = next(pending, None)
        for i, when in enumerate(series[time_key]):
            while upcoming is not None and when is not None and upcoming < when:
                if broken[time_key]:  # a restart before the first point breaks nothing
                    for k in keys:
                        broken[k].append(upcoming if k == time_key else None)
                upcoming = next(pending, None)
            for k in keys:
                broken[k].append(series[k][i])
        out.update(broken)
    return out


def hidden_charts(data: dict[str, Any]) -> dict[str, str]:
    """Charts the run page leaves out, and why: a metric this device never reports (MFU on a CPU), or
    telemetry the run has none of. A chart that only has no data *yet* stays, saying so."""
    series, hidden = data["series"], {}
    if series["step"]:
        for field, reason in NEVER_REPORTED.items():
            if not any(v is not None for v in series[field]):
                hidden[field] = reason
    if not routes_through_experts(data):
        hidden.update(dict.fromkeys(MOE_CHARTS, NOT_MOE))
    if not data.get("eval_scores"):
        hidden["eval_scores"] = NO_EVAL_SCORES
    telemetry = data.get("telemetry") or {"host": [], "devices": []}
    if not telemetry["host"] and not telemetry["devices"]:
        hidden.update({name: NO_TELEMETRY for name, *_ in SYSTEM_CHARTS})
    elif not telemetry["devices"]:
        hidden.update({name: NO_DEVICE_TELEMETRY for name, source, *_ in SYSTEM_CHARTS if source == "devices"})
    return hidden


def routes_through_experts(data: dict[str, Any]) -> bool:
    """Whether the run is a mixture of experts, as its steps tell (the dashboard does not resolve model
    presets or checkpoints): a dense run never reports a routing balance, so its expert charts are left
    out from the start rather than drawn empty; an MoE run's appear with its first step."""
    return bool(data["moe_heatmap"]["layers"]) or any(v is not None for v in data["series"]["moe_imbalance"])


def mfu_note(data: dict[str, Any]) -> str | None:
    """What the MFU tile says when the run never had an MFU: why, and what to set."""
    series = data["series"]
    if not series["step"] or any(v is not None for v in series["mfu"]):
        return None
    config = data["run"].get("config") or {}
    telemetry = data.get("telemetry") or {"host": [], "devices": []}
    on_cpu = (config.get("parallel") or {}).get("device") == "cpu" or (telemetry["host"] and not telemetry["devices"])
    where = "on CPU" if on_cpu else "for this device"
    return f"unknown {where}: no peak FLOP/s to compare with (set train.peak_tflops)"


def loss_figure(
    series: dict[str, list],
    axis: XAxis | None = None,
    options: ChartOptions = ChartOptions(),
    marks: list[dict[str, Any]] | None = None,
) -> Figure:
    axis = axis or XAxis(series, "step")
    traces = _smoothed(
        axis.steps(series["step"], series.get("time")), series["loss"], "train loss", PALETTE[0], options.smooth
    )
    if series["val_step"]:
        traces.append(
            {
                **_line(axis.steps(series["val_step"], series.get("val_time")), series["val_loss"], "validation loss"),
                "mode": "lines+markers",
                "line": {"color": PALETTE[1]},
            }
        )
    figure = _figure(traces, "Loss", "step", "loss", empty=not series["step"])
    axis.layout(figure)
    if options.log:
        figure["layout"]["yaxis"]["type"] = "log"
    add_marks(figure, marks or [])
    return figure


def eval_scores_figure(scores: list[dict[str, Any]], axis: XAxis, series: dict[str, list] | None = None) -> Figure:
    """Each task's metric against the step of the checkpoint it scored, with the benchmark's standard
    error as error bars; a step evaluated twice shows both points. On a step or token axis it spans the
    loss chart's steps (0 to the last), so that the two line up, one above the other."""
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in scores:
        if row["value"] is not None:
            lines.setdefault((row["task"], row["metric"]), []).append(row)
    traces = []
    for i, ((task, metric), rows) in enumerate(sorted(lines.items())):
        trace = {
            **_line(
                axis.steps([r["step"] for r in rows], [r["time"] for r in rows]),
                [r["value"] for r in rows],
                _text(f"{task} {metric}"),
            ),
            "mode": "lines+markers",
            "line": {"color": PALETTE[i % len(PALETTE)]},
        }
        if any(r["stderr"] is not None for r in rows):
            trace["error_y"] = {"type": "data", "array": [r["stderr"] or 0 for r in rows], "visible": True}
        traces.append(trace)
    figure = _figure(traces, "Benchmark scores", "step", "score", empty=not traces)
    axis.layout(figure)
    steps = [s for s in (series or {}).get("step", []) if s is not None] + [r["step"] for r in scores]
    if axis.kind != "time" and steps:
        figure["layout"]["xaxis"]["range"] = axis.steps([0, max(steps)])
    return figure


def line_figure(
    x: list,
    values: list[float | None],
    title: str,
    y_title: str,
    tick_format: str = "",
    empty_text: str = "no data yet",
    smooth: float = 0.0,
    log: bool = False,
) -> Figure:
    figure = _figure(
        _smoothed(x, values, title, PALETTE[0], smooth),
        title,
        "step",
        y_title,
        empty=not any(v is not None for v in values),
        empty_text=empty_text,
    )
    figure["layout"]["showlegend"] = False
    if tick_format:
        figure["layout"]["yaxis"]["tickformat"] = tick_format
    if log:
        figure["layout"]["yaxis"]["type"] = "log"
    return figure


def smooth_values(values: list[float | None], weight: float) -> list[float | None]:
    """Exponential moving average with TensorBoard's debiasing (the first points are not pulled towards
    zero); gaps (None) stay gaps and do not move the average. Each average is a weighted mean of the
    values so far, so it is kept within their range: rounding must not turn a flat line into noise
    that the axis then zooms in on."""
    out: list[float | None] = []
    average, count, low, high = 0.0, 0, math.inf, -math.inf
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(None)
            continue
        average, count = average * weight + (1 - weight) * value, count + 1
        low, high = min(low, value), max(high, value)
        out.append(min(high, max(low, average / (1 - weight**count))) if weight else value)
    return out


def run_marks(events: list[dict[str, Any]], event_steps: list[int] | None, axis: XAxis) -> list[dict[str, Any]]:
    """Restarts, rollbacks and checkpoint saves as marks: where (on the axis), what, and the hover text.
    Checkpoints past MAX_CHECKPOINT_MARKS are thinned evenly (the first and the last stay)."""
    kinds = {kind: (label, colour, dash) for kind, label, colour, dash in MARKS}
    steps = event_steps if event_steps is not None else [e.get("step") or 0 for e in events]
    marks = []
    for event, step in zip(events, steps):
        if event["kind"] in kinds:
            label, colour, dash = kinds[event["kind"]]
            marks.append(
                {
                    "label": label,
                    "colour": colour,
                    "dash": dash,
                    "x": axis.event(step, event["time"]),
                    "hover": f"{event_hover(event)}<br>at step {step}",
                }
            )
    saves = [m for m in marks if m["label"] == "checkpoint saved"]
    if len(saves) > MAX_CHECKPOINT_MARKS:
        keep = {round(i * (len(saves) - 1) / (MAX_CHECKPOINT_MARKS - 1)) for i in range(MAX_CHECKPOINT_MARKS)}
        dropped = {id(m) for i, m in enumerate(saves) if i not in keep}
        marks = [m for m in marks if id(m) not in dropped]
    return marks


def add_marks(figure: Figure, marks: list[dict[str, Any]], legend: bool = True) -> None:
    """A vertical line at each mark, and a hoverable marker on top of it (one legend entry per kind) on
    a hidden second y axis spanning 0-1, so the markers sit at the top whatever the data's scale."""
    if not marks:
        return
    shapes = figure["layout"].setdefault("shapes", [])
    groups: dict[str, list[dict[str, Any]]] = {}
    for mark in marks:
        groups.setdefault(mark["label"], []).append(mark)
        shapes.append(
            {
                "type": "line",
                "xref": "x",
                "yref": "paper",
                "x0": mark["x"],
                "x1": mark["x"],
                "y0": 0,
                "y1": 1,
                "layer": "below",
                "line": {"color": mark["colour"], "width": 1, "dash": mark["dash"]},
            }
        )
    for label, members in groups.items():
        figure["data"].append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": label,
                "yaxis": "y2",
                "x": [m["x"] for m in members],
                "y": [1.0] * len(members),
                "hovertext": [m["hover"] for m in members],
                "hoverinfo": "text",
                "marker": {"color": members[0]["colour"], "symbol": "triangle-down", "size": 9},
            }
        )
    figure["layout"]["yaxis2"] = {"overlaying": "y", "range": [0, 1.05], "visible": False, "fixedrange": True}
    figure["layout"]["showlegend"] = legend


def heatmap_figure(heatmap: dict[str, Any]) -> Figure:
    """Ranks down, steps (or bins of steps) across, each rank's own compute time as colour: a straggler
    is a bright row (a slow device) or a bright patch (a slow spell). The colour scale spans the cells
    without the warm-up steps, which would otherwise make every other cell the same dark colour."""
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
    title = "Compute time per rank and step"
    span = heatmap.get("range")
    if span and span[1] > span[0]:
        trace.update(zauto=False, zmin=span[0], zmax=span[1])
        warmup = [s for s in heatmap.get("warmup_steps", []) if s in set(heatmap["steps"])]
        if warmup:
            listed = ", ".join(map(str, warmup[:5])) + (", ..." if len(warmup) > 5 else "")
            title += f" (colour scale leaves out warm-up step{'s' if len(warmup) > 1 else ''} {listed})"
    figure = _figure([trace], title, _binned_steps_title(heatmap.get("stride", 1)), "", empty=not heatmap["ranks"])
    figure["layout"]["yaxis"].update(type="category", autorange="reversed")
    figure["layout"]["height"] = max(300, 90 + 22 * len(heatmap["ranks"]))
    return figure


def moe_imbalance_figure(series: dict[str, list], axis: XAxis, options: ChartOptions = ChartOptions()) -> Figure:
    """The worst MoE layer's routing balance per step on the chosen axis: the busiest expert's tokens
    over the mean expert's (1 is even; n_experts / top_k, every token sent to the same experts, the worst).
    Noisy step by step, so it is smoothed with the other step curves."""
    figure = line_figure(
        axis.steps(series["step"], series.get("time")),
        series["moe_imbalance"],
        "Expert load imbalance (worst MoE layer; 1 is even)",
        "busiest expert / mean",
        smooth=options.smooth,
        log=options.log,
    )
    axis.layout(figure)
    return figure


def moe_heatmap_figure(heatmap: dict[str, Any]) -> Figure:
    """MoE layers down, steps (or bins of steps) across, each layer's routing imbalance as colour: a
    bright row is a layer whose router favours a few experts (a collapse in the making), a bright patch
    a spell of it. The scale starts at 1, perfectly even, so a balanced layer stays dark however
    balanced the others are."""
    ratios = [v for row in heatmap["imbalance"] for v in row if v is not None]
    trace = {
        "type": "heatmap",
        "x": heatmap["steps"],
        "y": [f"MoE layer {layer}" for layer in heatmap["layers"]],
        "z": heatmap["imbalance"],
        "colorscale": "Viridis",
        "zauto": False,
        "zmin": 1.0,
        "zmax": max([1.0 + 1e-6, *ratios]),  # above zmin even when every layer is perfectly even
        "colorbar": {"title": {"text": "busiest / mean"}},
        "hovertemplate": "%{y}, step %{x}<br>busiest expert %{z:.2f}x the mean<extra></extra>",
        "hoverongaps": False,
    }
    figure = _figure(
        [trace],
        "Expert load imbalance by layer (1 is even)",
        _binned_steps_title(heatmap.get("stride", 1)),
        "",
        empty=not heatmap["layers"],
    )
    # automargin: "MoE layer 12" is wider than the rank heatmap's "rank 1", which the default margin fits.
    figure["layout"]["yaxis"].update(type="category", autorange="reversed", automargin=True)
    figure["layout"]["height"] = max(300, 90 + 22 * len(heatmap["layers"]))
    return figure


def _binned_steps_title(stride: int) -> str:
    """A heatmap's x-axis title: steps, or past its most columns bins of `stride` steps."""
    return "step" if stride == 1 else f"step (mean of sampled steps per bin of {stride})"


def events_figure(
    events: list[dict[str, Any]], event_steps: list[int] | None = None, axis: XAxis | None = None
) -> Figure:
    """The event log on the chosen axis (wall time by default): one marker per event, grouped by meaning,
    details on hover."""
    steps = event_steps if event_steps is not None else [e.get("step") or 0 for e in events]
    by_time = axis is None or axis.kind == "time"
    grouped: dict[str, list[tuple[dict[str, Any], int]]] = {}
    for event, step in zip(events, steps):
        grouped.setdefault(_event_group(event["kind"])[0], []).append((event, step))
    traces = []
    for name, colour, symbol, _ in (*EVENT_GROUPS, (*OTHER_EVENTS, ())):
        members = grouped.get(name)
        if not members:
            continue
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": name,
                "x": [_local_time(e["time"]) if by_time else axis.event(s, e["time"]) for e, s in members],
                "y": [_text(e["kind"]) for e, _ in members],  # tick labels are pseudo-HTML too
                "hovertext": [f"{event_hover(e)}<br>at step {s}" for e, s in members],
                "hoverinfo": "text",
                "marker": {"color": colour, "symbol": symbol, "size": 11, "line": {"width": 1, "color": colour}},
            }
        )
    figure = _figure(traces, "Events", "time (dashboard server's clock)", "", empty=not events)
    if by_time:
        figure["layout"]["xaxis"]["type"] = "date"
    else:
        axis.layout(figure)
    figure["layout"]["yaxis"]["type"] = "category"
    figure["layout"]["yaxis"]["automargin"] = True  # the longest kind's name sets the left margin
    kinds = len({e["kind"] for e in events})
    figure["layout"]["height"] = max(260, 120 + 28 * kinds)
    figure["layout"]["margin"]["l"] = 140
    return figure


def goodput_figure(report: dict[str, Any] | None) -> Figure:
    """Where the run's wall time went (seconds per bucket), with ETTR in the title."""
    buckets = (report or {}).get("goodput") or {}
    names = list(buckets)
    trace = {
        "type": "bar",
        "orientation": "h",
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


def system_figures(telemetry: dict[str, list[dict[str, Any]]]) -> dict[str, Figure]:
    """Host CPU, memory and free disk per node; utilisation, memory, temperature and power per
    accelerator: one line per node (and device), on wall time."""
    figures = {}
    for name, source, field, title, y_title, tick_format, divisor in SYSTEM_CHARTS:
        traces = []
        for i, series in enumerate(telemetry[source]):
            label = series["node"] if source == "host" else f"{series['node']} #{series['device']}"
            if field == "memory_used_bytes":
                total = next((v for v in reversed(series["memory_total_bytes"]) if v), None)
                if total:
                    label += f" (of {total / 2**30:.0f} GiB)"
            values = [v / divisor if v is not None else None for v in series[field]]
            traces.append(
                {
                    **_line([_local_time(t) for t in series["time"]], values, _text(label)),
                    "line": {"color": PALETTE[i % len(PALETTE)]},
                }
            )
        figure = _figure(
            traces,
            title,
            "time (dashboard server's clock)",
            y_title,
            empty=not any(v is not None for trace in traces for v in trace["y"]),
        )
        figure["layout"]["xaxis"]["type"] = "date"
        figure["layout"]["showlegend"] = True
        if tick_format:
            figure["layout"]["yaxis"]["tickformat"] = tick_format
        if tick_format == ".0%":
            figure["layout"]["yaxis"]["range"] = [0, 1.05]
        figures[name] = figure
    return figures


# Charts of the compare page: (key, series field, title, y title, tick format).
COMPARE_CHARTS = (
    ("train_loss", "loss", "Training loss", "loss", ""),
    ("val_loss", "val_loss", "Validation loss", "loss", ""),
    *((field, field, title, y_title, tick_format) for field, title, y_title, tick_format in LINE_CHARTS),
)


def compare_figures(runs: list[dict[str, Any]], options: ChartOptions = ChartOptions()) -> dict[str, Figure]:
    """Every training chart of several runs overlaid, one colour per run (validation loss dotted). On
    the time axis each run starts at 0: runs trained days apart still line up."""
    unit, per_unit = _elapsed_unit(runs)
    figures = {}
    for key, field, title, y_title, tick_format in COMPARE_CHARTS:
        traces, x_title = [], "step"
        for i, entry in enumerate(runs):
            run, series = entry["run"], entry["series"]
            steps_key, time_key = ("val_step", "val_time") if field == "val_loss" else ("step", "time")
            axis = XAxis(series, options.x, run.get("config"))
            if axis.kind == "time":
                series = break_at_restarts(series, entry.get("events", []))
                start = next((t for t in series["time"] if t is not None), None)
                x = [(t - start) / per_unit if t is not None and start is not None else None for t in series[time_key]]
                x_title = f"time since the run's first step ({unit})"
            else:
                x, x_title = axis.steps(series[steps_key]), axis.title
            label = _text(f"{run['name']} (#{run['id']})")
            colour = run_colour(i)
            if field == "val_loss":
                if series["val_step"]:
                    traces.append(
                        {
                            **_line(x, series["val_loss"], label),
                            "mode": "lines+markers",
                            "line": {"color": colour, "dash": "dot"},
                        }
                    )
            else:
                traces += _smoothed(
                    x, series[field], label, colour, options.smooth if field in SMOOTHED or field == "loss" else 0.0
                )
        figure = _figure(
            traces, title, x_title, y_title, empty=not any(v is not None for trace in traces for v in trace["y"])
        )
        if options.x == "tokens" and x_title == "tokens":
            figure["layout"]["xaxis"]["tickformat"] = "~s"
        if tick_format:
            figure["layout"]["yaxis"]["tickformat"] = tick_format
        if options.log and field != "lr":
            figure["layout"]["yaxis"]["type"] = "log"
        # The wide loss charts name the runs (Plotly hides a lone trace's legend: show it); the small
        # ones use the same colours, which the page's runs table shows, as a legend would cover their axis.
        figure["layout"]["showlegend"] = key in ("train_loss", "val_loss")
        figures[key] = figure
    return figures


def run_colour(index: int) -> str:
    """The colour of the index-th run on the compare page, in every chart."""
    return PALETTE[index % len(PALETTE)]


def compare_hidden(runs: list[dict[str, Any]]) -> dict[str, str]:
    """Compare charts none of the runs has data for (MFU of CPU runs), and why."""
    hidden = {}
    for key, field, *_ in COMPARE_CHARTS:
        if (
            key in NEVER_REPORTED
            and any(e["series"]["step"] for e in runs)
            and not any(v is not None for e in runs for v in e["series"][field])
        ):
            hidden[key] = NEVER_REPORTED[key]
    return hidden


def event_hover(event: dict[str, Any]) -> str:
    """An event's hover text: kind, where, when, then its details one per line, all escaped."""
    where = ", ".join(f"{k} {event[k]}" for k in ("rank", "node") if event.get(k) is not None)
    lines = [
        f"<b>{_text(event['kind'])}</b>" + (f" ({_text(where)})" if where else ""),
        _text(_local_time(event["time"])),
    ]
    for key, value in event_details(event).items():
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > 120:
            text = text[:117] + "..."
        lines.append(f"{_text(key)}: {_text(text)}")
    return "<br>".join(lines)


def event_details(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("time", "node", "rank", "kind")}


def _smoothed(x: list, y: list, name: str, colour: str, weight: float) -> list[dict[str, Any]]:
    """One line, or with smoothing the smoothed line over the raw one drawn faint (as TensorBoard does),
    toggled together from the legend."""
    if not weight:
        return [{**_line(x, y, name), "line": {"color": colour}}]
    raw = {
        **_line(x, y, f"{name} (raw)"),
        "line": {"color": colour, "width": 1},
        "opacity": 0.3,
        "legendgroup": name,
        "showlegend": False,
    }
    return [
        raw,
        {**_line(x, smooth_values(y, weight), name), "line": {"color": colour, "width": 2}, "legendgroup": name},
    ]


def _tokens_per_step(series: dict[str, list], config: dict[str, Any] | None) -> float | None:
    """Tokens a step trains: from the newest point that reports tokens seen, else the config's
    global batch x sequence length (what the trainer multiplies)."""
    for step, tokens in zip(reversed(series["step"]), reversed(series.get("tokens_seen") or [])):
        if tokens is not None and step:
            return tokens / step
    train = (config or {}).get("train") or {}
    batch, seq_len = train.get("global_batch_size"), train.get("seq_len")
    if isinstance(batch, int) and isinstance(seq_len, int):
        return float(batch * seq_len)
    return None


def _elapsed_unit(runs: list[dict[str, Any]]) -> tuple[str, float]:
    """Seconds, minutes or hours: whichever keeps the longest run's elapsed time readable."""
    longest = 0.0
    for entry in runs:
        times = [t for t in entry["series"].get("time") or [] if t is not None]
        if times:
            longest = max(longest, times[-1] - times[0])
    if longest > 3 * 3600:
        return "h", 3600.0
    if longest > 180:
        return "min", 60.0
    return "s", 1.0


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


def _figure(
    traces: list[dict[str, Any]], title: str, x_title: str, y_title: str, empty: bool, empty_text: str = "no data yet"
) -> Figure:
    layout = json.loads(json.dumps(_BASE_LAYOUT))  # a fresh copy: callers adjust it
    layout.update(
        title={"text": _text(title), "x": 0.01},
        xaxis={"title": {"text": x_title}, "zeroline": False},
        yaxis={"title": {"text": y_title}},
    )
    if empty:
        layout["annotations"] = [
            {
                "text": _text(empty_text),
                "showarrow": False,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "font": {"size": 16, "color": "#888"},
            }
        ]
    return {"data": traces, "layout": layout}
