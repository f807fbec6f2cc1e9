"""`phalanx train CONFIG --launcher ray --nnodes N --nproc P`: Ray places phalanx's node agents.

Why actors around phalanx's own agent rather than Ray Train's TorchTrainer: TorchTrainer forms the
process group itself and restarts its workers through FailureConfig, which would replace the torch
elastic agent, and with it what that agent carries here (heartbeats, hang and straggler detection with
stack dumps, the crash-loop guard, the node preflight before a restart, `--nnodes MIN:MAX`). So Ray does
what it is good at, reserving and replacing machines, and each node runs exactly what `phalanx train`
runs on one node (the job function, phalanx/job/train_job.py), in a Ray actor (ray_agent.py):

1. a placement group of one bundle per node (P GPUs, or P CPUs on a CPU cluster), STRICT_SPREAD when
   the cluster has that many nodes that fit a bundle, else SPREAD with a warning (agents share machines);
2. one NodeAgent actor per bundle; Ray sets CUDA/ROCR/HIP_VISIBLE_DEVICES for its GPUs;
3. checks: every node sees the run directory node 0 writes (a shared filesystem), node 0 prepares the
   data once and every node must find the same data by digest; a warning for an SQLite store that
   several machines, or a network filesystem, would share;
4. every agent runs the job with node_rank = its bundle index and the c10d rendezvous at node 0's
   address on a free port, so the agents form one elastic group, as nodes started by hand would;
5. when an actor dies (its process or its node), Ray starts it again (max_restarts) and it rejoins the
   group, which resumes from the newest checkpoint; losing node 0 takes the rendezvous store with it,
   so then every agent starts again at a fresh endpoint. Ray's replacements count against
   `safe.max_restarts`, as the agents' own restarts do;
6. the agents' logs come back through Ray; the node hosting global rank 0 returns the summary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

from phalanx.config.schema import Config
from phalanx.console import DEBUG_ENV, say
from phalanx.errors import (
    CheckpointLoadError,
    CrashLoopError,
    PhalanxError,
    PreflightFailedError,
    RendezvousFailedError,
    RestartsExhaustedError,
    StoppedBySignal,
    StoreError,
)
from phalanx.launch.cluster.ray_agent import Job, NodeAgent
from phalanx.launch.local import LaunchSpec

NAMESPACE = "phalanx"
# The caller's variables the agents see too (never tokens or keys: Ray shows a runtime env to anyone
# with its dashboard): --debug, the progress interval, the preflight's slow-rank drill.
FORWARDED_ENV = (DEBUG_ENV, "PHALANX_PROGRESS_INTERVAL", "PHALANX_PREFLIGHT_SLOW_RANK", "PHALANX_PREFLIGHT_SLOW_FACTOR")
FINISH_GRACE_S = 60.0  # after node 0's agent is done, how long the others may take to end on their own
ERRORS = {
    cls.__name__: cls
    for cls in (
        PhalanxError,
        CheckpointLoadError,
        CrashLoopError,
        RestartsExhaustedError,
        RendezvousFailedError,
        PreflightFailedError,
    )
}


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PhalanxError(
            "--launcher ray needs Ray on this machine and every node: pip install 'phalanx[ray]'"
        ) from None
    return ray


def ray_launch(config: Config, spec: LaunchSpec, job: Job, address: str | None = None) -> dict[str, Any] | None:
    """Train the run on a Ray cluster (`address`, or RAY_ADDRESS as `ray job submit` sets it, or the
    cluster `ray start` left on this machine, or else a new one-machine Ray) and return its summary."""
    started = time.time()
    if spec.node_rank or spec.rdzv_endpoint:
        raise PhalanxError("--launcher ray places the nodes itself: drop --node-rank and --rdzv-endpoint")
    # What the agents will be handed, checked before anything is reserved.
    LaunchSpec(spec.nproc, spec.nnodes, 0, "127.0.0.1:1", spec.rdzv_conf).validate()
    ray = import_ray()
    with _stopped_by_sigterm(), _connected(ray, address):
        return RayJob(ray, config, spec, job, started).run()


class RayJob:
    def __init__(self, ray: Any, config: Config, spec: LaunchSpec, job: Job, started: float):
        self.ray, self.config, self.spec, self.job, self.started = ray, config, spec, job, started
        self.actors: list[Any] = []
        self.places: list[dict[str, Any]] = []
        self.pg = None
        self.replaced = 0

    def run(self) -> dict[str, Any] | None:
        try:
            self._place()
            self._check_shared()
            summary, host = self._train()
            if summary is None:
                raise PhalanxError("the job ended without a summary: no node reported global rank 0")
            extra = {
                "launcher": "ray",
                "nodes": len(self.actors),
                "machines": len({p["ip"] for p in self.places}),
                "nodes_replaced": self.replaced,
            }
            return self.ray.get(self.actors[host].annotate_summary.remote(self.config, extra))
        finally:
            self._release()

    # -- placement ---------------------------------------------------------------------------------
    def _place(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, config, spec = self.ray, self.config, self.spec
        low, high = spec.node_range()
        bundle = self._bundle()
        fit = sum(
            1
            for node in ray.nodes()
            if node["Alive"] and all(node["Resources"].get(k, 0) >= v for k, v in bundle.items())
        )
        shown = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
        if fit >= high:
            count, strategy = high, "STRICT_SPREAD"
        elif fit >= low and fit > 0:
            count, strategy = fit, "STRICT_SPREAD"
            say(
                f"ray: {fit} of the Ray nodes fit a bundle of {shown}: starting with {fit} node agents "
                f"(--nnodes {spec.nnodes})"
            )
        else:
            count, strategy = high, "SPREAD"
            say(
                f"warning: only {fit} Ray node(s) fit a bundle of {shown}; the {high} node agents will share "
                "machines (placement SPREAD, not STRICT_SPREAD)"
            )
        self.pg = placement_group([dict(bundle)] * count, strategy=strategy, name=f"phalanx-{config.run.name}")
        if not self.pg.wait(timeout_seconds=config.safe.startup_timeout_s):
            raise RendezvousFailedError(
                f"the Ray cluster could not reserve {count} bundles of {shown} ({strategy}) within "
                f"safe.startup_timeout_s={config.safe.startup_timeout_s:g} s; it has {ray.cluster_resources()}"
            )
        gpus = bundle.get("GPU", 0)
        remote = ray.remote(NodeAgent)
        # Ray starts actors with the raylet's environment, not the caller's: pass on phalanx's own switches.
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        for index in range(count):
            self.actors.append(
                remote.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=gpus,
                    max_restarts=-1,
                    max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
                    **({"runtime_env": {"env_vars": env}} if env else {}),
                ).remote(index, os.getcwd())
            )
        try:
            self.places = ray.get([a.where.remote() for a in self.actors], timeout=config.safe.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RendezvousFailedError(
                f"the node agents did not start within safe.startup_timeout_s={config.safe.startup_timeout_s:g} s"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise PhalanxError(
                f"a node agent could not start on the Ray cluster (is phalanx installed on every "
                f"node, in the same Python?): {exc}"
            ) from None
        machines = len({p["ip"] for p in self.places})
        say(
            f"ray: {count} node agents ({strategy}, {shown} each) on {machines} machine(s): "
            + ", ".join(f"node {i} {p['host']} ({p['ip']})" for i, p in enumerate(self.places))
        )

    def _bundle(self) -> dict[str, float]:
        """P GPUs (and a CPU for the agent) per node, or P CPUs where the job runs on CPUs."""
        device, nproc = self.config.parallel.device, self.spec.nproc
        gpus = self.ray.cluster_resources().get("GPU", 0)
        if device == "cuda" and gpus < nproc:
            raise PhalanxError(
                f"parallel.device=cuda but the Ray cluster has {gpus:g} GPUs, fewer than --nproc {nproc}"
            )
        if device == "cuda" or (device == "auto" and gpus >= nproc):
            return {"CPU": 1.0, "GPU": float(nproc)}
        return {"CPU": float(nproc)}

    # -- checks ------------------------------------------------------------------------------------
    def _check_shared(self) -> None:
        ray, config, first = self.ray, self.config, self.actors[0]
        token = uuid.uuid4().hex
        path = ray.get(first.write_probe.remote(config, token))
        try:
            seen = ray.get([a.sees_probe.remote(config, token) for a in self.actors[1:]])
        finally:
            ray.get(first.remove_probe.remote(config, token))
        blind = [i for i, ok in enumerate(seen, start=1) if not ok]
        if blind:
            nodes = ", ".join(
                f"node {i} ({self.places[i]['host']}, working directory {self.places[i]['cwd']})" for i in blind
            )
            raise PhalanxError(
                f"{nodes} cannot see the run directory {path} that node 0 ({self.places[0]['host']}) writes: several "
                "machines need run.dir on a filesystem they all mount at the same path (NFS, Lustre, ...), "
                "given as an absolute path"
            )
        machines = len({p["ip"] for p in self.places})
        warning = ray.get(first.store_warning.remote(config, machines))
        if warning:
            say(f"warning: {warning}")
        digest = self._value(0, ray.get(first.prepare.remote(config)))["digest"]
        for index, outcome in enumerate(ray.get([a.check_data.remote(config, digest) for a in self.actors[1:]]), 1):
            self._value(index, outcome)
        say(f"ray: every node sees the run directory {path} and the same prepared data ({digest[:12]})")

    # -- training ----------------------------------------------------------------------------------
    def _train(self) -> tuple[dict[str, Any] | None, int]:
        ray = self.ray
        endpoint = ray.get(self.actors[0].free_endpoint.remote())
        pending = {self._submit(i, endpoint): i for i in range(len(self.actors))}
        summary, host, node0_done = None, 0, None
        orphaned: dict[int, dict[str, Any]] = {}  # nodes whose rendezvous broke while node 0 was still out
        while pending:
            grace = None if node0_done is None else max(0.0, node0_done + FINISH_GRACE_S - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=grace)
            if not done:  # node 0 is done and the rest have not ended: they never joined the last round
                left = sorted(pending.values())
                say(
                    f"ray: node 0 finished; stopping node(s) {', '.join(map(str, left))}, which did not end "
                    f"within {FINISH_GRACE_S:g} s"
                )
                break
            index = pending.pop(done[0])
            try:
                outcome = ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                endpoint = self._replace(index, exc, pending, endpoint)
                if index == 0:
                    orphaned.clear()  # sent back in with everyone else
                continue
            if outcome.get("kind") == "RendezvousFailedError" and index != 0 and 0 in pending.values():
                # Most likely node 0, which hosts the rendezvous store, has just died and Ray has not told
                # us yet: node 0's own outcome decides (its loss re-forms every node).
                orphaned[index] = outcome
                continue
            if index == 0 and orphaned and "error" not in outcome:
                orphaned.clear()  # node 0 finished the job without them
            self._value(index, outcome)
            if outcome["summary"] is not None:
                summary, host = outcome["summary"], index
            if index == 0:
                node0_done = time.monotonic()
        for index, outcome in orphaned.items():
            self._value(index, outcome)
        return summary, host

    def _submit(self, index: int, endpoint: str) -> Any:
        spec = LaunchSpec(self.spec.nproc, self.spec.nnodes, index, endpoint, self.spec.rdzv_conf)
        return self.actors[index].run.remote(self.job, self.config, spec, self.started)

    def _replace(self, index: int, exc: Exception, pending: dict[Any, int], endpoint: str) -> str:
        """Node `index`'s actor died mid-run and Ray is starting it again: send it back into the job (or,
        for node 0, which hosted the rendezvous, start every node again at a new endpoint)."""
        ray, config = self.ray, self.config
        self.replaced += 1
        lost = self.places[index]
        reason = f"node {index} ({lost['host']}) was lost: {_first_line(exc)}"
        if self.replaced > config.safe.max_restarts:
            raise RestartsExhaustedError(
                f"{reason}; Ray has replaced {self.replaced - 1} node(s) already, "
                f"safe.max_restarts={config.safe.max_restarts}"
            )
        say(
            f"ray: {reason}; Ray is starting its agent again ({self.replaced} of safe.max_restarts="
            f"{config.safe.max_restarts})"
        )
        if index != 0:
            self.places[index] = self._when_back(index)
            ray.get(
                self.actors[index].record.remote(
                    config, "node_replaced", node=index, host=self.places[index]["host"], reason=reason
                )
            )
            pending[self._submit(index, endpoint)] = index
            return endpoint
        # Node 0 hosted the rendezvous store: the others cannot re-form without it, so every agent starts
        # again (Ray restarts the ones killed here too) and they meet at a new endpoint.
        for other in list(pending.values()):
            ray.kill(self.actors[other], no_restart=False)
        ray.wait(list(pending), num_returns=len(pending), timeout=config.safe.startup_timeout_s)
        pending.clear()
        for other in range(len(self.actors)):
            self.places[other] = self._when_back(other)
        ray.get(
            self.actors[0].record.remote(config, "node_replaced", node=0, host=self.places[0]["host"], reason=reason)
        )
        # No agent survived to record a restart of its own: this one is the launch's.
        ray.get(self.actors[0].record.remote(config, "restart", attempt=self.replaced, reason=reason))
        endpoint = ray.get(self.actors[0].free_endpoint.remote())
        for other in range(len(self.actors)):
            pending[self._submit(other, endpoint)] = other
        return endpoint

    def _when_back(self, index: int) -> dict[str, Any]:
        """Where node `index`'s agent runs once Ray has started it again (calls fail while it restarts)."""
        ray, timeout = self.ray, self.config.safe.startup_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            try:
                return ray.get(self.actors[index].where.remote(), timeout=timeout)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise RendezvousFailedError(
                        f"Ray did not start node {index}'s agent again within safe.startup_timeout_s={timeout:g} s"
                    ) from None
                time.sleep(0.5)

    def _value(self, index: int, outcome: dict[str, Any]) -> dict[str, Any]:
        """An agent's answer, or its failure raised as the same error (and exit code), naming the node."""
        if "error" not in outcome:
            return outcome
        message = f"node {index} ({self.places[index]['host']}): {outcome['error']}"
        if outcome["kind"] == "StoppedBySignal":
            raise StoppedBySignal(outcome["exit_code"] - 128)
        if outcome["kind"] == "StoreError":
            raise StoreError(message, transient=False)
        error = ERRORS.get(outcome["kind"], PhalanxError)(message)
        error.exit_code = outcome["exit_code"]  # a subclass not listed above keeps its code all the same
        raise error

    def _release(self) -> None:
        ray = self.ray
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextlib.contextmanager
def _connected(ray: Any, address: str | None) -> Iterator[None]:
    if address and address not in ("auto", "local"):
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError):
            raise RendezvousFailedError(
                f"cannot reach the Ray cluster at {address} (--ray-address HOST:PORT, the "
                "head's GCS port, 6379 unless `ray start --port` said otherwise)"
            ) from None
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RendezvousFailedError(
            f"cannot connect to the Ray cluster at {address or 'RAY_ADDRESS'}: {_first_line(exc)}"
        ) from None
    try:
        yield
    finally:
        ray.shutdown()  # a cluster it connected to keeps running; a one-machine Ray it started stops


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """A scheduler's SIGTERM (or `ray job stop`) ends the launch like Ctrl-C: the agents are stopped and
    the command exits 143, so that the same command resumes from the newest checkpoint."""

    def stop(signum: int, frame: Any) -> None:
        raise StoppedBySignal(signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (a caller embedding phalanx): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
