"""The command-line front of phalanx preflight: register() adds its command to the main typer app."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from phalanx.console import ArgsArg, JsonOpt, split_config_args

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "info": "cyan"}


def register(app: typer.Typer) -> None:
    @app.command()
    def preflight(
        args: Optional[list[str]] = ArgsArg,
        nproc: Optional[int] = typer.Option(
            None, "--nproc", min=1, help="Ranks on this node (default: one per GPU, or 1 on CPU)."
        ),
        nnodes: str = typer.Option("1", "--nnodes", help="Number of nodes, or MIN:MAX, as torchrun takes it."),
        node_rank: int = typer.Option(0, "--node-rank", min=0, help="This node's rank (multi-node)."),
        rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT shared by all nodes."),
        rdzv_conf: str = typer.Option("", "--rdzv-conf", help="Rendezvous options, e.g. last_call_timeout=5."),
        quick: bool = typer.Option(False, "--quick", help="Smaller measurements: under a minute per node."),
        threshold: Optional[list[str]] = typer.Option(
            None,
            "--threshold",
            metavar="CHECK[.warn]=VALUE",
            help="Override a check's failure (or .warn warning) limit; repeatable.",
        ),
        inject_slow_rank: Optional[int] = typer.Option(
            None,
            "--inject-slow-rank",
            min=0,
            metavar="RANK",
            help="Drill: make this rank slow (also PHALANX_PREFLIGHT_SLOW_RANK).",
        ),
        slow_factor: Optional[float] = typer.Option(
            None,
            "--slow-factor",
            help="How many times slower the drill's rank is (default 4, or PHALANX_PREFLIGHT_SLOW_FACTOR)",
        ),
        clear: Optional[str] = typer.Option(
            None, "--clear", metavar="NODE", help="Release NODE from quarantine in the run store; runs no checks."
        ),
        json_out: bool = JsonOpt,
    ) -> None:
        """Check every node and rank before a job: inventory, health, compute, memory, disk, interconnect.

        Each check is graded against per-device limits, and a slow rank is searched
        for. Exits 6 when a check fails (and quarantines the failing node).

        Examples:
        phalanx preflight --quick --nproc 2
        phalanx preflight --nproc 8 --nnodes 4 --node-rank 0 --rdzv-endpoint n0:29500
        phalanx preflight --clear gpu-node-17
        """
        from phalanx.config.loader import load_config

        path, overrides = split_config_args(args)
        config = load_config(path, overrides)
        if clear is not None:
            _clear(config, clear, json_out)
            return
        _preflight(
            config,
            nproc,
            nnodes,
            node_rank,
            rdzv_endpoint,
            rdzv_conf,
            quick,
            threshold or [],
            inject_slow_rank,
            slow_factor,
            json_out,
        )


def _preflight(
    config: Any,
    nproc: int | None,
    nnodes: str,
    node_rank: int,
    rdzv_endpoint: str | None,
    rdzv_conf: str,
    quick: bool,
    threshold: list[str],
    inject_slow_rank: int | None,
    slow_factor: float | None,
    json_out: bool,
) -> None:
    from phalanx.errors import PhalanxError, PreflightFailedError
    from phalanx.launch.local import LaunchSpec
    from phalanx.preflight.run import run_preflight
    from phalanx.preflight.thresholds import config_overrides, parse_overrides
    from phalanx.preflight.timing import DEFAULT_SLOW_FACTOR, SlowRank

    limits = {**config_overrides(config.safe.preflight_thresholds), **parse_overrides(threshold)}
    slow = SlowRank.from_env()
    if inject_slow_rank is not None:
        slow = SlowRank(inject_slow_rank, slow_factor or (slow.factor if slow else DEFAULT_SLOW_FACTOR))
    elif slow_factor is not None:
        if slow is None:
            raise PhalanxError("--slow-factor goes with --inject-slow-rank RANK")
        slow = SlowRank(slow.rank, slow_factor)
    spec = LaunchSpec(nproc or _default_nproc(config.parallel.device), nnodes, node_rank, rdzv_endpoint, rdzv_conf)
    report = run_preflight(config, spec, quick, limits, slow, progress=not json_out)
    if json_out:
        print(json.dumps(report.to_json()))
    else:
        _print_report(report)
    if not report.passed:
        raise PreflightFailedError(f"preflight failed: {report.failure_line()}{_release_hint(report, slow)}")


def _release_hint(report: Any, drill: Any) -> str:
    """How to let a node this preflight quarantined join launches again (a drill's node is not broken)."""
    if not report.quarantined:
        return ""
    clear = " and ".join(f"`phalanx preflight --clear {node}`" for node in report.quarantined)
    if drill is not None:
        return f"; this drill quarantined {', '.join(report.quarantined)}: {clear} releases it"
    return f"; once fixed, {clear} lets it join launches again"


def _default_nproc(device: str) -> int:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return 1
    return torch.cuda.device_count()


def _clear(config: Any, node: str, json_out: bool) -> None:
    from phalanx.errors import PhalanxError
    from phalanx.extras import require
    from phalanx.observe.observer import open_store

    require("observe", "phalanx preflight --clear")  # the quarantine list lives in the run store
    store = open_store(config)
    if store is None:
        raise PhalanxError("observe.store=none: there is no run store to hold a quarantine")
    try:
        reason = next((q["reason"] for q in store.quarantined() if q["node"] == node), None)
        was = store.clear_quarantine(node)
    finally:
        store.close()
    if json_out:
        print(json.dumps({"node": node, "was_quarantined": was, "reason": reason}))
    elif was:
        print(f"{node} released from quarantine (it was quarantined for: {reason})")
    else:
        print(f"{node} was not quarantined")


def _print_report(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    mode = "quick" if report.quick else "full"
    table = Table(
        title=f"preflight ({mode}): {report.world_size} rank(s) on {len(report.nodes)} node(s), "
        f"{report.device_type}, {report.backend}, {report.seconds:.1f} s"
    )
    for column in ("check", "rank/node", "value", "expected", "status", "note"):
        table.add_column(column, overflow="fold")
    for c in report.checks:
        value = "-" if c.value is None else (f"{c.value:,.4g}" if isinstance(c.value, (int, float)) else str(c.value))
        table.add_row(
            c.check,
            c.where,
            f"{value} {c.unit}".strip(),
            c.expected,
            Text(c.status, style=STATUS_STYLE.get(c.status, "")),
            c.message,
        )
    console.print(table)
    if report.slow_ranks.get("ranks"):
        nodes = ", ".join(report.slow_ranks["nodes"])
        console.print(f"slow: rank(s) {report.slow_ranks['ranks']} on {nodes} ({report.slow_ranks['ratio']:.2f}x)")
    for node in report.quarantined:
        console.print(Text(f"quarantined {node}: {report.failed_nodes[node]}", style="red"))
    for note in report.notes:
        console.print(note)
    verdict = "FAILED" if not report.passed else f"passed ({report.warnings} warning(s))"
    console.print(Text(f"preflight {verdict}", style="bold red" if not report.passed else "bold green"))
