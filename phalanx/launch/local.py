"""Start a node's ranks under the phalanx node agent (torch's elastic agent, see phalanx/safe/agent.py).

This is what `torchrun` does, with our agent in place of torch's: c10d rendezvous (a free local port
for one node; `--rdzv-endpoint` shared by every node otherwise), one process per local rank running
`python -m phalanx.train.worker`, restarts up to `safe.max_restarts`. The same launcher also runs
one-shot jobs on every rank (the cluster preflight): see OneShot.

The ranks must not outlive this process (phalanx/safe/rank_guard.py): they get its pid, its heartbeat
board (where it beats too) and, on the node that owns the run directory, the run lock to hold shared.
Boards left in /dev/shm by agents that were killed are removed here, at the next launch.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phalanx.config.schema import Config
from phalanx.console import debug_enabled
from phalanx.errors import PhalanxError, RendezvousFailedError, RestartsExhaustedError, StoppedBySignal
from phalanx.launch.warm_ranks import run_entry, start_server, stop_server
from phalanx.run.checkpoints import checkpoint_step, latest_checkpoint
from phalanx.run.layout import RunDir
from phalanx.run.records import JsonlEventSink
from phalanx.run.snapshots import launch_dir, newest_common_step
from phalanx.safe.heartbeat import ENV_FILE, open_board
from phalanx.safe.rank_guard import ENV_AGENT_PID, ENV_RUN_LOCK

# The c10d rendezvous options a user may set (seconds), as torchrun's --rdzv-conf takes them.
RDZV_OPTIONS = ("join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval", "keep_alive_max_attempt")


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int = 1
    nnodes: str = "1"  # "N" or "MIN:MAX", as torchrun takes it
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_conf: str = ""  # "key=value,..." passed to the rendezvous, as torchrun's --rdzv-conf

    def world_sizes(self) -> list[int]:
        """Every number of ranks the job may run with (one for a fixed node count)."""
        low, high = self.node_range()
        return [n * self.nproc for n in range(low, high + 1)]

    def validate(self) -> None:
        """Check the launch options before anything starts, with one clear line for each mistake."""
        low, high = self.node_range()
        if high > 1 and not self.rdzv_endpoint:
            raise PhalanxError("several nodes need --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise PhalanxError(f"--rdzv-endpoint must be HOST:PORT, not {self.rdzv_endpoint!r}")
        for key, value in self.rdzv_options().items():
            if key not in RDZV_OPTIONS:
                raise PhalanxError(f"--rdzv-conf: unknown option {key!r} (valid: {', '.join(RDZV_OPTIONS)})")
            if not value.isdigit():
                raise PhalanxError(f"--rdzv-conf: {key} takes whole seconds, not {value!r}")

    def rdzv_options(self) -> dict[str, str]:
        options = {}
        for item in filter(None, self.rdzv_conf.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise PhalanxError(f"--rdzv-conf takes key=value pairs separated by commas, not {item!r}")
            options[key.strip()] = value.strip()
        return options

    def node_range(self) -> tuple[int, int]:
        low, _, high = self.nnodes.partition(":")
        try:
            low, high = int(low), int(high or low)
        except ValueError:
            low = high = 0
        if not 1 <= low <= high:
            raise PhalanxError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, not {self.nnodes!r}")
        return low, high


@dataclass(frozen=True)
class OneShot:
    """A job other than training, started on every rank like the trainer: `python ARGS` once, with no
    restarts and no heartbeats (it has no steps), its events and any stack dumps in `work_dir` rather
    than the run directory, and its own rendezvous id so it never meets a training job's."""

    role: str  # e.g. "preflight"
    args: tuple[str, ...]  # e.g. ("-m", "phalanx.preflight.worker", PARAMS_FILE)
    work_dir: Path


def launch(
    spec: LaunchSpec, config: Config, one_shot: OneShot | None = None, before_restart: Callable[[], None] | None = None
) -> bool:
    """Run the training (or `one_shot`) on this node's ranks until it succeeds, or raise why it could not.
    Returns whether this node ran global rank 0 (the rank that writes the run's summary).
    The caller has validated `spec` and, for training, prepared the run directory. `before_restart`
    runs in the node agent after a failure, before the ranks restart, and raises to keep this node
    out (the job passes the node preflight of `safe.preflight` here)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from phalanx.safe.agent import PhalanxAgent

    min_nodes, max_nodes = spec.node_range()
    entrypoint, start_method = sys.executable, "spawn"  # torch's agent: a command line per rank
    cold_start = None
    if one_shot is None:
        role, work_dir, rdzv_id = "trainer", config.run_dir, config.run.name
        args = ("-m", "phalanx.train.worker", str(RunDir(config.run_dir).config))
        max_restarts, heartbeats = config.safe.max_restarts, config.safe.heartbeats
        if config.safe.warm_restarts:  # the worker's function, forked from the warm server instead
            cold_start = (entrypoint, args)  # what the agent starts when /dev/shm is too full for a warm start
            entrypoint, start_method = run_entry, "forkserver"
            args = ("phalanx.train.worker", "run_rank", *args[2:])
    else:
        role, work_dir, rdzv_id = one_shot.role, one_shot.work_dir, f"{config.run.name}-{one_shot.role}"
        args, max_restarts, heartbeats = one_shot.args, 0, False
    if spec.rdzv_endpoint:
        endpoint, run_id = spec.rdzv_endpoint, rdzv_id  # every node derives the same id
    else:
        endpoint, run_id = "localhost:0", uuid.uuid4().hex  # a free port: parallel runs never collide
    rdzv = RendezvousParameters(
        backend="c10d",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        **spec.rdzv_options(),
    )
    if spec.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks must not fight over the cores
    # The agent's shared TCPStore keeps the previous attempt's keys, so restarted ranks can read a dead
    # peer's address and fail to connect (pytorch/pytorch#135712); a fresh store per attempt avoids it.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        handler = rdzv_registry.get_rendezvous_handler(rdzv)
    except (RendezvousError, ValueError, OSError) as exc:
        raise RendezvousFailedError(f"cannot start the rendezvous at {endpoint}: {exc}") from None
    worker_spec = WorkerSpec(
        role=role,
        local_world_size=spec.nproc,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=handler,
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    board = None
    if heartbeats:
        board = open_board(spec.nproc)
        os.environ[ENV_FILE] = str(board.path)
    os.environ[ENV_AGENT_PID] = str(os.getpid())  # the ranks check it is still their parent
    lock = RunDir(config.run_dir).lock
    if one_shot is None and spec.node_rank == 0 and lock.is_file():  # node 0's train_job holds the run lock
        os.environ[ENV_RUN_LOCK] = str(lock)
    root = RunDir(config.run_dir).checkpoints

    def newest_step() -> int | None:
        """The agent's estimate of where a restart resumes (the restart notice, and the progress the
        crash-loop guard counts): train/resume.py's order on the same files, without verifying them (the
        ranks do, and their checkpoint_loaded event says what they chose)."""
        if one_shot is not None:
            return None  # a one-shot job makes no checkpoints
        newest = latest_checkpoint(root)
        steps = [checkpoint_step(newest) if newest else None, newest_common_step(config.run_dir, os.getpid())]
        return max((s for s in steps if s is not None), default=None)

    if start_method == "forkserver":  # after the ranks' environment is set: they inherit the server's
        start_server()
    agent = PhalanxAgent(
        worker_spec,
        DefaultLogsSpecs(),
        safe=config.safe,
        run_dir=work_dir,
        events=JsonlEventSink(work_dir),
        board=board,
        newest_checkpoint_step=newest_step,
        before_restart=before_restart,
        cold_start=cold_start,
        start_method=start_method,
    )
    # torch's elastic agent logs every stop and failure in its own format ("W1201 12:00:00.0 ... Sending
    # process 123 closing signal SIGTERM"); the agent says them in phalanx's words, so torch's are only
    # shown under --debug.
    # The same for torch's process context of warm-started ranks ("Terminating process 123 via signal").
    torch_logs = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    silence = logging.NullHandler()
    propagates = [log.propagate for log in torch_logs]
    if not debug_enabled():  # a handler of its own, so logging's last resort does not print them either
        for log in torch_logs:
            log.propagate = False
            log.addHandler(silence)
    # torch turns SIGTERM into SignalException once the ranks are started; from here on already, so that a
    # SIGTERM during the rendezvous also ends in StoppedBySignal (exit 143) rather than in a bare kill.
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous_sigterm = signal.signal(signal.SIGTERM, _terminate_process_handler) if in_main_thread else None
    try:
        result = agent.run()
    except RendezvousError as exc:
        raise RendezvousFailedError(f"the job could not form: {exc}") from None
    except SignalException as exc:  # torch turns SIGTERM/SIGINT/SIGHUP into this after stopping the ranks
        raise StoppedBySignal(exc.sigval) from None
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)
        for log, propagate in zip(torch_logs, propagates):
            log.propagate = propagate
            log.removeHandler(silence)
        for name in (ENV_FILE, ENV_AGENT_PID, ENV_RUN_LOCK):
            os.environ.pop(name, None)
        if board is not None:
            board.close()
        if start_method == "forkserver":
            stop_server()
        if one_shot is None:  # this launch's in-memory snapshots: the ranks are gone, so are they
            shutil.rmtree(launch_dir(config.run_dir, os.getpid()), ignore_errors=True)
        handler.shutdown()
    if result is None:  # torch: this node was not needed once the rendezvous closed
        return False
    if result.is_failed():
        if one_shot is not None:
            raise RestartsExhaustedError(f"the {role} failed: {agent.last_failure}")
        raise RestartsExhaustedError(
            f"the run failed again after {config.safe.max_restarts} restarts; last failure: {agent.last_failure}"
        )
    return agent.hosts_rank0
