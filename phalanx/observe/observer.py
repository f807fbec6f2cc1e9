"""What `phalanx train` does to make a run observable: register it in the run store, follow its files
into the store while it trains (in a writer process of its own, store_writer.py), sample the node's
hardware, serve the node's /metrics, and record how the launch ended."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from phalanx.config.schema import Config
from phalanx.errors import PhalanxError, StoppedBySignal, StoreError
from phalanx.observe.availability import store_in_use
from phalanx.observe.follower import RunFollower
from phalanx.observe.store_writer import StoreWriter
from phalanx.run.layout import RunDir
from phalanx.run.records import JsonlEventSink
from phalanx.safe.telemetry import TelemetrySampler

if TYPE_CHECKING:  # store.py imports SQLAlchemy, which only the observe extra installs: imported where used
    from phalanx.observe.store import RunStore


def open_store(config: Config) -> RunStore | None:
    """The run store of `config`, or None: observe.store=none, or the default store on an install without
    the observe extra (availability.py says so once)."""
    if not store_in_use(config):
        return None
    from phalanx.observe.store import RunStore

    return RunStore.open(config.observe.store, config.run.dir)


@contextlib.contextmanager
def observe_run(config: Config, node_rank: int, world_size: int, model: str, started: float) -> Iterator[None]:
    """Around a launch. Node 0 registers the run and follows the run directory into the store (a shared
    file system holds every rank's files there; the store learns the other nodes from their ranks'
    records) from a writer process; every node samples its hardware and may serve its /metrics. The
    store is a convenience: when it cannot be reached the run trains anyway, with a warning, and the
    writer keeps retrying; on an install without the observe extra the default store is skipped, with a
    note (availability.py)."""
    writer = None
    if node_rank == 0 and store_in_use(config):
        from phalanx.observe.store import check_url, store_url

        url = store_url(config.observe.store, config.run.dir)
        check_url(url)  # a URL that can never work is bad input now, not a warning in the writer
        writer = StoreWriter(
            {
                "url": url,
                "run_dir": str(config.run_dir),
                "name": config.run.name,
                "wall_start": started,
                "interval": config.observe.sync_interval_s,
                "retry_s": config.observe.store_retry_s,
                "register": {
                    "config": json.loads(config.model_dump_json()),
                    "model": model,
                    "world_size": world_size,
                    "max_steps": config.train.max_steps,
                    "node": socket.gethostname(),
                },
            }
        )
    follower = telemetry = server = None
    status, error = "finished", None
    try:
        if node_rank == 0 and (config.observe.metrics_port is not None or config.observe.tensorboard):
            # The agent's own follower only feeds /metrics and TensorBoard: the writer has the store.
            follower = RunFollower(
                config.run_dir,
                config.run.name,
                started,
                None,
                None,
                config.observe.sync_interval_s,
                config.observe.tensorboard,
            ).start()
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
        if writer is not None:
            writer.finish(_final_status(config, status), error)


def _warn(message: str) -> None:
    Console(stderr=True).print(f"[yellow]warning:[/] {message}")


def _final_status(config: Config, status: str) -> str:
    """A run halted early on purpose (train.halt_at_step) is stopped, not finished: it will resume."""
    if (
        status == "finished"
        and config.train.halt_at_step is not None
        and config.train.halt_at_step < config.train.max_steps
    ):
        return "stopped"
    return status


def _start_metrics_server(
    config: Config, node_rank: int, follower: RunFollower | None, telemetry: TelemetrySampler | None
) -> Any:
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


def sync_run_dir(store: RunStore, run_dir: Path) -> tuple[int, bool]:
    """Copy a finished (or stopped) run directory's files into the store: runs trained with the store
    off, or elsewhere, or whose store copy is behind (a store that was down at the end). A run already in
    the store is brought up to date: the lines past the offsets the store holds are added, its status
    set from the directory. A run still training is refused. (run id, whether it was there before)."""
    from phalanx.config.loader import load_config
    from phalanx.run.lock import run_lock
    from phalanx.run.resolved import resolved

    run = RunDir(run_dir)
    run_dir = run.path
    if not run.config.is_file():
        raise PhalanxError(f"{run_dir} is not a run directory (it has no {run.config.name})")
    with run_lock(run_dir):  # a run still training is refused: its own node agent is copying it
        known = store.run_id_for_dir(run_dir)
        if known is None:
            config = load_config(str(run.config), [])
            stored = resolved(config, *_trained_with(run_dir, config))  # as `phalanx train` stores it
            run_id = store.start_run(
                run_dir.name,
                run_dir,
                json.loads(stored.model_dump_json()),
                config.model.preset,
                None,
                config.train.max_steps,
                socket.gethostname(),
            )
        else:
            run_id = known  # registered by its launch: its name, config and nodes stay as that stored them
        if not RunFollower(run_dir, run_dir.name, time.time(), store, run_id).sync():  # it said why
            raise StoreError(
                f"the run store did not take all of {run_dir} yet; importing it again adds the rest", transient=True
            )
        summary = json.loads(run.summary.read_text()) if run.summary.is_file() else {}
        if "goodput" in summary:  # `phalanx train` adds the launch's goodput report to the summary
            store.set_goodput(
                run_id, {k: summary.get(k) for k in ("restarts", "faults", "stragglers", "goodput", "ettr")}
            )
        status = (
            "failed"
            if summary.get("final_save_failed")
            else "finished"
            if summary and not summary.get("halted")
            else "stopped"
        )
        # A status its launch stored stays; one the launch could not store (it still says running) is set.
        if known is None or store.run(run_id)["status"] in ("running", "restarting"):
            store.finish_run(run_id, status)
    return run_id, known is not None


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
