"""`safe.preflight` in `phalanx train`: keep quarantined and failing nodes out of the job.

Before training every node checks that the run store has not quarantined it, then (quick or full) the
whole job runs the preflight; a failing node is named in one line and quarantined instead of joining.
Before each restart the node agent preflights its own node again, in a separate process while its
ranks are down (a restart after a fault is exactly when a node may have gone bad).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys

from rich.console import Console

from phalanx.config.schema import Config
from phalanx.errors import PreflightFailedError, StoreError
from phalanx.launch.local import LaunchSpec
from phalanx.preflight.report import PreflightReport
from phalanx.run.layout import RunDir
from phalanx.run.records import JsonlEventSink


def refuse_if_quarantined(config: Config) -> None:
    from phalanx.observe.observer import open_store

    host = socket.gethostname()
    try:
        store = open_store(config)
        if store is None:
            return
        try:
            entries = store.quarantined()
        finally:
            store.close()
    except StoreError as exc:
        Console(stderr=True).print(f"[yellow]warning:[/] {exc}; the quarantine list was not checked")
        return
    for entry in entries:
        # Two node agents on one host (drills) are quarantined as host#0, host#1: either keeps it out.
        if entry["node"] == host or entry["node"].startswith(f"{host}#"):
            since = datetime.datetime.fromtimestamp(entry["since"]).strftime("%Y-%m-%d %H:%M")
            raise PreflightFailedError(
                f"node {entry['node']} is quarantined since {since}: {entry['reason']}; "
                f"once it is fixed, `phalanx preflight --clear {entry['node']}` lets it join"
            )


def preflight_before_training(config: Config, spec: LaunchSpec, progress: bool) -> PreflightReport:
    from phalanx.preflight.run import run_preflight
    from phalanx.preflight.thresholds import config_overrides

    overrides = config_overrides(config.safe.preflight_thresholds)
    report = run_preflight(config, spec, quick=config.safe.preflight == "quick", overrides=overrides, progress=progress)
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
        command = [
            sys.executable,
            "-m",
            "phalanx",
            "preflight",
            str(RunDir(config.run_dir).config),
            "--nproc",
            str(nproc),
            "--json",
        ] + (["--quick"] if config.safe.preflight == "quick" else [])
        # Its own process group, so a timeout (a wedged GPU is what it looks for) stops its ranks too.
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = child.communicate(timeout=config.safe.startup_timeout_s)
        except subprocess.TimeoutExpired:
            _stop(child)
            reason = f"the preflight did not finish within safe.startup_timeout_s={config.safe.startup_timeout_s:g} s"
            events.emit("preflight_failed", before="restart", reason=reason)
            raise PreflightFailedError(
                f"this node failed its preflight before a restart and leaves the job: {reason}"
            ) from None
        except BaseException:  # SIGTERM to the agent: leave no orphaned ranks on the devices
            _stop(child)
            raise
        report = _last_json(stdout)
        if child.returncode == 0:
            events.emit("preflight_passed", before="restart", seconds=report.get("seconds"))
            return
        reason = (
            "; ".join(f"{n}: {why}" for n, why in report.get("failed_nodes", {}).items())
            or (stderr.strip().splitlines() or ["the preflight did not complete"])[-1]
        )
        events.emit("preflight_failed", before="restart", reason=reason)
        raise PreflightFailedError(f"this node failed its preflight before a restart and leaves the job: {reason}")

    return check


def _stop(child: subprocess.Popen) -> None:
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}
