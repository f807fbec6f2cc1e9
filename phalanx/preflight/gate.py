"""`safe.preflight` in `phalanx train`: keep quarantined and failing nodes out of the job.

Before training every node checks that the run store has not quarantined it, then (quick or full) the
whole job runs the preflight; a failing node is named in one line and quarantined instead of joining.
Before each restart the node agent preflights its own node again, in a separate process while its
ranks are down (a restart after a fault is exactly when a node may have gone bad).
"""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys

from phalanx.config.schema import Config
from phalanx.launch.local import LaunchSpec
from phalanx.preflight.report import PreflightFailedError, PreflightReport
from phalanx.safe.events import JsonlEventSink


def refuse_if_quarantined(config: Config) -> None:
    from phalanx.observe.observer import open_store

    store = open_store(config)
    if store is None:
        return
    try:
        host = socket.gethostname()
        for entry in store.quarantined():
            if entry["node"] == host:
                since = datetime.datetime.fromtimestamp(entry["since"]).strftime("%Y-%m-%d %H:%M")
                raise PreflightFailedError(f"node {host} is quarantined since {since}: {entry['reason']}; "
                                           f"once it is fixed, `phalanx preflight --clear {host}` lets it join")
    finally:
        store.close()


def preflight_before_training(config: Config, spec: LaunchSpec, progress: bool) -> PreflightReport:
    from phalanx.preflight.run import run_preflight
    from phalanx.preflight.thresholds import parse_overrides

    overrides = parse_overrides([f"{k}={v}" for k, v in config.safe.preflight_thresholds.items()])
    report = run_preflight(config, spec, quick=config.safe.preflight == "quick", overrides=overrides,
                           progress=progress)
    events = JsonlEventSink(config.run_dir)
    if not report.passed:
        reason = report.failure_line()
        events.emit("preflight_failed", node=report.node, reason=reason, seconds=report.seconds)
        raise PreflightFailedError(f"preflight failed, the job does not start: {reason}")
    events.emit("preflight_passed", seconds=report.seconds, world_size=report.world_size)
    return report


def node_preflight_before_restart(config: Config, nproc: int):
    """For the node agent: a callable that preflights this node alone (its `nproc` ranks, no peers) in a
    child process and raises PreflightFailedError if it fails (the child has quarantined the node)."""
    def check() -> None:
        events = JsonlEventSink(config.run_dir)
        command = [sys.executable, "-m", "phalanx", "preflight", str(config.run_dir / "config.yaml"),
                   "--nproc", str(nproc), "--json"] + (["--quick"] if config.safe.preflight == "quick" else [])
        command += [f"--threshold={k}={v}" for k, v in config.safe.preflight_thresholds.items()]
        proc = subprocess.run(command, capture_output=True, text=True)
        report = _last_json(proc.stdout)
        if proc.returncode == 0:
            events.emit("preflight_passed", before="restart", seconds=report.get("seconds"))
            return
        reason = "; ".join(f"{n}: {why}" for n, why in report.get("failed_nodes", {}).items()) or \
            (proc.stderr.strip().splitlines() or ["the preflight did not complete"])[-1]
        events.emit("preflight_failed", before="restart", reason=reason)
        raise PreflightFailedError(f"this node failed its preflight before a restart and leaves the job: {reason}")
    return check


def _last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}
