"""`phalanx runs list | show | compare | import`: the run store from the terminal."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.box import SIMPLE_HEAD
from rich.console import Console
from rich.table import Table

from phalanx.console import JsonOpt, fitted_table, format_value

runs_app = typer.Typer(
    no_args_is_help=True,
    help="List, inspect and compare runs in the run store.",
    epilog="Example: phalanx runs show demo",
)
out = Console()

RunsOpt = typer.Option(Path("runs"), "--runs", help="Runs root whose store file phalanx.db to read.")
StoreOpt = typer.Option(None, "--store", help="A store URL (postgresql://...) or file, instead of --runs.")


def _open(runs: Path, store: str | None, create: bool = False):
    """The store every `runs` command reads, or one line naming the extra that provides it."""
    from phalanx.extras import require

    require("observe", "phalanx runs")
    from phalanx.observe.store import RunStore

    return RunStore.open(store, runs, create=create)


@runs_app.command("list")
def runs_list(runs: Path = RunsOpt, store: Optional[str] = StoreOpt, json_out: bool = JsonOpt) -> None:
    """Every run in the store, newest first (columns that do not fit the terminal are left out; --json has
    every field).

    Examples:
    phalanx runs list
    phalanx runs list --runs /scratch/runs --json
    """
    rows = _open(runs, store).list_runs()
    if json_out:
        print(json.dumps(rows))
        return
    columns = [
        "id",
        "name",
        "status",
        "model",
        "step",
        "loss",
        "val loss",
        "tok/s",
        "MFU",
        "ETTR",
        "restarts",
        "updated",
    ]
    cells = [
        [
            str(r["id"]),
            r["name"],
            r["status"],
            r["model"] or "-",
            f"{r['last_step'] or 0}/{r['max_steps'] or '?'}",
            _num(r["last_loss"]),
            _num(r["last_val_loss"]),
            _num(r["tokens_per_sec"], ",.0f"),
            _pct(r["mfu"]),
            _pct(r["ettr"], ".0%"),
            str(r["restarts"]),
            _when(r["updated_at"], short=True),
        ]
        for r in rows
    ]
    out.print(
        fitted_table(
            f"{len(rows)} runs",
            columns,
            cells,
            right=RIGHT,
            drop_first=("MFU", "restarts", "ETTR", "model", "val loss", "tok/s", "id"),
            console=out,
        )
    )


RIGHT = ("id", "step", "loss", "val loss", "tok/s", "MFU", "ETTR", "restarts")


@runs_app.command("show")
def runs_show(
    name: str = typer.Argument(..., help="Run name (the newest of that name) or id."),
    runs: Path = RunsOpt,
    store: Optional[str] = StoreOpt,
    json_out: bool = JsonOpt,
) -> None:
    """One run: its state, goodput, nodes and events. tokens_per_sec, achieved_tflops and mfu are the
    run's averages over its training time, the figures the training summary and the dashboard show.

    Examples:
    phalanx runs show demo
    phalanx runs show 3 --json
    """
    s = _open(runs, store)
    run = s.find_run(name)
    events, goodput = s.events(run["id"]), s.goodput(run["id"])
    if json_out:
        print(json.dumps({**run, "goodput": goodput, "events": events}))
        return
    table = Table(title=f"run {run['name']} (id {run['id']})", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # a long run directory wraps rather than being cut short
    for key in (
        "status",
        "dir",
        "model",
        "world_size",
        "nodes",
        "last_step",
        "max_steps",
        "last_loss",
        "last_val_loss",
        "tokens_per_sec",
        "achieved_tflops",
        "mfu",
        "restarts",
        "ettr",
        "error",
    ):
        value = run[key]
        table.add_row(
            key,
            ", ".join(value)
            if isinstance(value, list)
            else format_value(value)  # as the training summary prints its figures
            if isinstance(value, float)
            else "-"
            if value is None
            else str(value),
        )
    table.add_row("started", _when(run["started_at"]))
    table.add_row("ended", _when(run["ended_at"]))
    if goodput:
        table.add_row("goodput (s)", ", ".join(f"{k} {v:.1f}" for k, v in goodput["goodput"].items() if v))
        table.add_row("faults", ", ".join(f"{k} {v}" for k, v in goodput["faults"].items()) or "-")
    out.print(table)
    if events:  # every kind, as the dashboard lists them: one view of a run's events
        timeline = Table(
            title="events" if len(events) <= 30 else f"events (the last 30 of {len(events)})",
            box=SIMPLE_HEAD,
            pad_edge=False,
        )
        for column in ("time", "kind", "rank", "details"):
            timeline.add_column(column, overflow="fold")
        for e in events[-30:]:
            details = {k: v for k, v in e.items() if k not in ("time", "node", "rank", "kind")}
            timeline.add_row(
                _when(e["time"], short=True), e["kind"], "-" if e["rank"] is None else str(e["rank"]), _details(details)
            )
        out.print(timeline)


@runs_app.command("compare")
def runs_compare(
    names: list[str] = typer.Argument(..., help="Two or more run names or ids."),
    runs: Path = RunsOpt,
    store: Optional[str] = StoreOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Runs side by side: their results and the config keys in which they differ.

    Example:
    phalanx runs compare demo demo-fsdp
    """
    from phalanx.errors import PhalanxError

    if len(names) < 2:
        raise PhalanxError("compare needs two or more runs")
    s = _open(runs, store)
    found = [s.find_run(n) for n in names]
    flat = [_flatten(r["config"] or {}) for r in found]
    differs = sorted(
        k for k in set().union(*flat) if len({json.dumps(f.get(k)) for f in flat}) > 1 and not k.startswith("run.")
    )
    if json_out:
        print(json.dumps({"runs": found, "config_differences": {k: [f.get(k) for f in flat] for k in differs}}))
        return
    table = Table(title="compare")
    table.add_column("")
    for r in found:
        table.add_column(f"{r['name']} ({r['id']})")
    for key in (
        "status",
        "model",
        "last_step",
        "last_loss",
        "last_val_loss",
        "tokens_per_sec",
        "achieved_tflops",
        "mfu",
        "ettr",
        "restarts",
    ):
        table.add_row(key, *(format_value(r[key]) if isinstance(r[key], float) else str(r[key]) for r in found))
    for key in differs:
        table.add_row(f"[bold]{key}", *(json.dumps(f.get(key)) for f in flat))
    out.print(table)


@runs_app.command("import")
def runs_import(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories to copy into the store."),
    runs: Path = RunsOpt,
    store: Optional[str] = StoreOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Copy run directories trained without a store (or elsewhere) into the store; a run already there is
    brought up to date (the steps and events it lacks, and its status if its launch could not store it).

    Example:
    phalanx runs import runs/old-run --json
    """
    from phalanx.observe.observer import sync_run_dir

    s = _open(runs, store, create=True)
    imported = []
    for run_dir in run_dirs:
        run_id, known = sync_run_dir(s, run_dir)
        imported.append({"run_dir": str(run_dir), "id": run_id, "updated": known})
        if not json_out:
            out.print(
                f"brought run {run_id} ({run_dir}) up to date" if known else f"imported {run_dir} as run {run_id}"
            )
    if json_out:
        print(json.dumps({"imported": imported}))


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _num(value: float | None, fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def _pct(value: float | None, fmt: str = ".1%") -> str:
    return "-" if value is None else format(value, fmt)


def _when(timestamp: float | None, short: bool = False) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%m-%d %H:%M:%S" if short else "%Y-%m-%d %H:%M:%S")


def _details(details: dict[str, Any], limit: int = 160) -> str:
    """An event's details as `key value` pairs (numbers rounded, nested values compact), not escaped JSON."""

    def show(value: Any) -> str:
        if isinstance(value, float):
            return format(value, ".4g")
        if isinstance(value, str) and value[:1] in "{[":
            try:
                value = json.loads(value)  # a field that holds JSON text (a fault's spec)
            except ValueError:
                return value
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k} {show(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + "; ".join(show(v) for v in value) + "]"
        return "-" if value is None else str(value)

    text = ", ".join(f"{k} {show(v)}" for k, v in details.items())
    return text if len(text) <= limit else text[: limit - 1] + "…"
