"""One phalanx node agent inside a Ray actor: what `phalanx train` does on one node, placed by Ray.

The launcher (ray_launcher.py) starts one NodeAgent per placement-group bundle. Each runs the job
function it is handed (phalanx/job/train_job.py's train_job, the very function behind `phalanx train`)
with its node's LaunchSpec, so the torch elastic agent, heartbeats, hang and crash-loop detection,
checkpoint resume and the run store work as on a node started by hand. The methods besides `run` are
the checks a cluster needs before it trains (a shared run directory, the same prepared data).

Errors come back as values (kind, message, exit code) rather than raised through Ray, so the caller
ends with the node's own exit code and one line that names the node.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from phalanx.config.schema import Config
from phalanx.errors import PhalanxError, RendezvousFailedError
from phalanx.launch.cluster.ray_reaper import start_reaper
from phalanx.launch.cluster.shared_storage import (
    data_digest,
    remove_share_probe,
    sees_share_probe,
    store_warning,
    write_share_probe,
)
from phalanx.launch.local import LaunchSpec
from phalanx.run.layout import RunDir
from phalanx.run.records import JsonlEventSink, read_metrics

NODE_ENV = "PHALANX_RAY_NODE"  # the bundle index, in the agent's and so its ranks' environment
Job = Callable[[Config, LaunchSpec, bool], "dict[str, Any] | None"]


def failure(exc: PhalanxError) -> dict[str, Any]:
    return {"error": str(exc), "kind": type(exc).__name__, "exit_code": exc.exit_code}


class NodeAgent:
    def __init__(self, index: int, cwd: str):
        self.index = index
        # The caller's relative paths (run.dir, data sources) mean the same on every node when the
        # caller's working directory is there too, as on a shared filesystem; a node without it stays
        # where Ray put it, and the shared-directory check then says so.
        if os.path.isdir(cwd):
            os.chdir(cwd)
        os.environ[NODE_ENV] = str(index)
        self.reaper = start_reaper(uuid.uuid4().hex)

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it: "(phalanx-node1 pid=...)"
        return f"phalanx-node{self.index}"

    def where(self) -> dict[str, Any]:
        return {"ip": node_ip(), "host": socket.gethostname(), "pid": os.getpid(), "cwd": os.getcwd()}

    def free_endpoint(self) -> str:
        """HOST:PORT for the c10d rendezvous, hosted by this node's agent (node 0)."""
        ip = node_ip()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    # -- checks before training --------------------------------------------------------------------
    def write_probe(self, config: Config, token: str) -> str:
        write_share_probe(config.run_dir, token)
        return str(RunDir(config.run_dir).path.absolute())

    def sees_probe(self, config: Config, token: str) -> bool:
        return sees_share_probe(config.run_dir, token)

    def remove_probe(self, config: Config, token: str) -> None:
        remove_share_probe(config.run_dir, token)

    def store_warning(self, config: Config, machines: int) -> str | None:
        return store_warning(config.observe.store, config.run.dir, machines)

    def prepare(self, config: Config) -> dict[str, Any]:
        """Node 0: tokenise the corpus once (or reuse the cache) under the run lock; the data's digest."""
        from phalanx.run.lock import run_lock
        from phalanx.run.prepare import prepare_run

        try:
            with run_lock(config.run_dir):
                return {"digest": data_digest(prepare_run(config, progress=False))}
        except PhalanxError as exc:
            return failure(exc)

    def check_data(self, config: Config, digest: str) -> dict[str, Any]:
        """Every other node: the data it will train on must be node 0's, by digest."""
        from phalanx.run.prepare import prepare_run

        try:
            data = prepare_run(config, progress=False)  # finds node 0's shards in the shared cache
            mine = data_digest(data)
        except PhalanxError as exc:
            return failure(exc)
        if mine != digest:
            return failure(
                PhalanxError(
                    f"the prepared data in {data.dir} differs from node 0's (digest {mine[:12]} against {digest[:12]}): "
                    "the nodes must read the same data sources and runs root (run.dir on a shared filesystem)"
                )
            )
        return {"digest": mine}

    def record(self, config: Config, kind: str, **details: Any) -> None:
        JsonlEventSink(config.run_dir).emit(kind, **details)

    # -- training ----------------------------------------------------------------------------------
    def run(self, job: Job, config: Config, spec: LaunchSpec, started: float) -> dict[str, Any]:
        """Run the job on this node until it ends. The node hosting global rank 0 returns the summary,
        with the goodput counted from the launch's start (`started`, the caller's clock)."""
        try:
            if spec.node_rank > 0:
                wait_for_endpoint(spec.rdzv_endpoint, config.safe.startup_timeout_s)
            summary = job(config, spec, False)
        except PhalanxError as exc:
            return failure(exc)
        if summary is None:
            return {"summary": None}
        from phalanx.safe.goodput import run_report

        run = RunDir(config.run_dir)
        summary.update(run_report(run.path, read_metrics(run.path), started, time.time()))
        run.summary.write_text(json.dumps(summary, indent=1))
        return {"summary": summary}

    def annotate_summary(self, config: Config, extra: dict[str, Any]) -> dict[str, Any]:
        run = RunDir(config.run_dir)
        summary = {**json.loads(run.summary.read_text()), **extra}
        run.summary.write_text(json.dumps(summary, indent=1))
        return summary


def node_ip() -> str:
    """The address Ray registered this node under (`ray start --node-ip-address`), which the other nodes
    reach it at; guessing from the host's interfaces may pick another one."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == me)


def wait_for_endpoint(endpoint: str, timeout: float) -> None:
    """Until node 0's agent listens at the rendezvous endpoint. On one machine every agent would try to
    host the rendezvous store and the first one up wins; waiting keeps it with node 0, whose loss ends
    the group anyway, so losing any other node never takes the store down with it."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousFailedError(
                    f"node 0's rendezvous at {endpoint} did not come up within safe.startup_timeout_s={timeout:g} s"
                ) from None
            time.sleep(0.2)
