"""What `phalanx train` does to make a run observable: register it in the run store, follow its files
into the store while it trains, sample the node's hardware, serve the node's /metrics, and record how
the launch ended."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from phalanx.config.schema import Config
from phalanx.errors import PhalanxError, StoppedBySignal, StoreError
from phalanx.observe.follower import RunFollower
from phalanx.observe.store import RunStore
from phalanx.run.layout import RunDir
from phalanx.run.records import JsonlEventSink
from phalanx.safe.telemetry import TelemetrySampler


def open_store(config: Config) -> RunStore | None:
    if config.observe.store == "none":
        return None
    return RunStore.open(config.observe.store, config.run.dir)


@contextlib.contextmanager
def observe_run(config: Config, node_rank: int, world_size: int, model: str, started: float) -> Iterator[None]:
    """Around a launch. Node 0 registers the run and follows the run directory into the store (a shared
    file system holds every rank's files there; the store learns the other nodes from their ranks'
    records); every node samples its hardware and may serve its /metrics. The store is a convenience:
    when it cannot be reached the run trains anyway, with a warning."""
    store = run_id = None
    if node_rank == 0:
        try:
            store = open_store(config)
            if store is not None:
                run_id = store.start_run(config.run.name, config.run_dir, json.loads(config.model_dump_json()),
                                         model, world_size, config.train.max_steps, socket.gethostname())
        except StoreError as exc:
            _warn(f"{exc}; training without the run store")
            store = None
    follower = telemetry = server = None
    status, error = "finished", None
    try:
        if node_rank == 0:
            follower = RunFollower(config.run_dir, config.run.name, started, store, run_id,
                                   config.observe.sync_interval_s, config.observe.tensorboard).start()
        if config.observe.telemetry_interval_s > 0:
            telemetry = TelemetrySampler(config.run_dir, config.observe, JsonlEventSink(config.run_dir)).start()
        server = _start_metrics_server(config, node_rank, follower, telemetry)
        yield
    except (StoppedBySignal, KeyboardInterrupt):
        status = "stopped"
        raise
    except BaseException as exc:
        status, error = "failed", str(exc) or type(exc).__name__
        raise
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if telemetry is not None:
            telemetry.stop()
        if follower is not None:
            follower.stop()
        if store is not None:
            try:
                store.finish_run(run_id, _final_status(config, status), error)
            except StoreError as exc:
                _warn(f"{exc}; the run's final status is not stored")
            store.close()


def _warn(message: str) -> None:
    Console(stderr=True).print(f"[yellow]warning:[/] {message}")


def _final_status(config: Config, status: str) -> str:
    """A run halted early on purpose (train.halt_at_step) is stopped, not finished: it will resume."""
    if status == "finished" and config.train.halt_at_step is not None and \
            config.train.halt_at_step < config.train.max_steps:
        return "stopped"
    return status


def _start_metrics_server(config: Config, node_rank: int, follower: RunFollower | None,
                          telemetry: TelemetrySampler | None) -> Any:
    """The node's /metrics: the run's progress (node 0, which follows the run) and this node's hardware."""
    port = config.observe.metrics_port
    if port is None:
        return None
    from prometheus_client import CollectorRegistry, start_http_server

    from phalanx.observe.prom import TelemetryCollector, TrainingCollector

    registry = CollectorRegistry()
    if follower is not None:
        registry.register(TrainingCollector(follower.state))
    if telemetry is not None:
        registry.register(TelemetryCollector(lambda: telemetry.latest))
    try:
        server, _thread = start_http_server(port, addr=config.observe.metrics_host, registry=registry)
    except OSError as exc:
        raise PhalanxError(f"cannot serve /metrics on {config.observe.metrics_host}:{port}: {exc.strerror}") from None
    bound = server.server_address[1]
    # The port the agent bound (observe.metrics_port=0 picks a free one), for people and tests to find;
    # one file per node, as nodes may share the run directory.
    RunDir(config.run_dir).metrics_port_file(None if node_rank == 0 else socket.gethostname()).write_text(f"{bound}\n")
    return server


def sync_run_dir(store: RunStore, run_dir: Path) -> int:
    """Copy a finished (or stopped) run directory's files into the store: runs trained with the store
    off, or elsewhere. A run already in the store is left alone; a run still training is refused."""
    from phalanx.config.loader import load_config
    from phalanx.run.lock import run_lock
    from phalanx.run.resolved import resolved

    run = RunDir(run_dir)
    run_dir = run.path
    if not run.config.is_file():
        raise PhalanxError(f"{run_dir} is not a run directory (it has no {run.config.name})")
    known = store.run_id_for_dir(run_dir)
    if known is not None:
        raise PhalanxError(f"{run_dir} is already in the store as run {known}")
    with run_lock(run_dir):  # a run still training is refused: its own node agent is copying it
        config = load_config(str(run.config), [])
        stored = resolved(config, *_trained_with(run_dir, config))  # as `phalanx train` stores it
        run_id = store.start_run(run_dir.name, run_dir, json.loads(stored.model_dump_json()), config.model.preset,
                                 None, config.train.max_steps, socket.gethostname())
        RunFollower(run_dir, run_dir.name, time.time(), store, run_id).sync()
        summary = json.loads(run.summary.read_text()) if run.summary.is_file() else {}
        if "goodput" in summary:  # `phalanx train` adds the launch's goodput report to the summary
            store.set_goodput(run_id, {k: summary.get(k) for k in ("restarts", "faults", "stragglers", "goodput",
                                                                    "ettr")})
        store.finish_run(run_id, "finished" if summary and not summary.get("halted") else "stopped")
    return run_id


def _trained_with(run_dir: Path, config) -> tuple[int | None, int | None]:
    """(vocabulary, data-parallel ranks) the run trained with, as far as its directory still tells."""
    from phalanx.parallel.mesh import resolve_layout
    from phalanx.run.checkpoints import latest_checkpoint, read_trainer_state
    from phalanx.run.prepare import prepared_data

    try:
        vocab = prepared_data(run_dir).vocab_size
    except PhalanxError:
        vocab = None
    newest = latest_checkpoint(RunDir(run_dir).checkpoints)
    try:
        world = read_trainer_state(newest)["world_size"] if newest is not None else None
        return vocab, resolve_layout(config.parallel, world).dp if world else None
    except (PhalanxError, KeyError):
        return vocab, None
