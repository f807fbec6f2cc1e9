"""The node agent: torch's elastic agent, plus hang detection, stack capture and crash-loop detection.

torch's LocalElasticAgent already starts the local ranks, notices a rank that exits with an error,
stops the others and restarts the whole group (re-rendezvous included) up to `max_restarts` times.
This subclass adds what it lacks:
  - hangs: on each monitoring tick it reads the ranks' heartbeats; a rank past its timeout gets its
    Python stack dumped (with every other local rank's), then the group is failed and restarted;
  - crash loops: restarts that never get past the newest checkpoint stop the run (exit code 3);
  - a bad-input exit (code 2) of any rank stops the run at once: restarting cannot fix a config;
  - a rank out of memory is named with its step and allocation and retried once; the same step running
    out again on the next attempt stops the run (exit code 10): every restart would;
  - preemption: on SIGTERM the ranks are given `safe.preemption_grace_s` to finish their step and save
    (phalanx/safe/preemption.py) before they are killed; every other stop (a restart, a failed run) kills
    them at once, since a rank takes SIGTERM to mean "save first";
  - a full /dev/shm: warm-started ranks need a few POSIX semaphores there (torch's process context
    makes them), so when it has no room left the attempt's ranks start as fresh interpreters instead;
  - every attempt, failure, hang and restart is an event in RUN_DIR/events.jsonl.

This is the one module that overrides private methods of torch's agent (and wraps its process context);
tests/safe/test_torch_private_api.py lists each override with its reason and fails by name when a torch
upgrade changes what they rely on.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import signal
import threading
import time
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

from phalanx.config.schema import SafeSection
from phalanx.console import say
from phalanx.errors import (
    CrashLoopError,
    DiskFullError,
    PhalanxError,
    PreemptedError,
    RankOutOfMemoryError,
    RunDirLostError,
    StoppedBySignal,
)
from phalanx.run.layout import RunDir
from phalanx.run.records import EventSink
from phalanx.safe.heartbeat import AGENT_STALE_SECONDS, HeartbeatBoard
from phalanx.safe.out_of_memory import allocation_failure, read_error_file
from phalanx.safe.stacks import innermost_frame, take_stacks
from phalanx.safe.watchdog import HangDetector, Stall, culprit

STACK_WAIT_SECONDS = 2.0
NO_OUT_OF_MEMORY = object()  # the previous attempt did not end in an out-of-memory (a step may be None)


class PhalanxAgent(LocalElasticAgent):
    def __init__(
        self,
        spec,
        logs_specs,
        *,
        safe: SafeSection,
        run_dir: Path,
        events: EventSink,
        board: HeartbeatBoard | None,
        newest_checkpoint_step,
        before_restart=None,
        cold_start: tuple[str, tuple[str, ...]] | None = None,
        **kwargs,
    ):
        super().__init__(spec, logs_specs, **kwargs)
        self.before_restart = before_restart  # () -> None, raises to keep this node out (safe.preflight)
        # (executable, args): the same rank as a command line, for when a warm start cannot be made
        self.cold_start = cold_start
        self.safe, self.run_dir, self.events, self.board = safe, run_dir, events, board
        self.detector = HangDetector(safe)
        self.newest_checkpoint_step = newest_checkpoint_step  # () -> int | None, read at each failure
        self.attempt = 0
        self.failed_without_progress = 0
        self.last_failure = "none"
        self._failure_line = ""  # the last failure as the console says it
        self._previous_oom_step = NO_OUT_OF_MEMORY  # the step the previous attempt ran out of memory at
        self._notice: str | None = None  # said when the next attempt starts, once the old ranks are gone
        self.hosts_rank0 = False
        self._failed = False
        self._check_node = False
        self._attempt_start_step = newest_checkpoint_step()
        self._stopped_by: int | None = None  # the signal that stopped the agent (SIGTERM: a preemption)
        self._sigterm_pending = False
        self._stopped_ranks: set[int] = set()  # local ranks the agent killed after a peer failed
        self._home = _identity(RunDir(run_dir))  # what "the run directory" is; see _check_home
        self._last_tick: float | None = None  # the previous monitoring tick (monotonic)
        self._silent_for = 0.0  # how long before this tick the agent did not run (frozen, starved)

    # -- stopping -----------------------------------------------------------------------------------
    def _invoke_run(self, role):
        try:
            return super()._invoke_run(role)
        except SignalException as exc:  # torch then stops the ranks through _shutdown, with this signal
            self._stopped_by = exc.sigval
            raise

    def _start_workers(self, worker_group: WorkerGroup):
        result = self._start_warm_or_cold(worker_group)
        # torch stops the other ranks itself as soon as one fails (PContext.close() with its default,
        # SIGTERM, and up to 30 s for them to exit). A phalanx rank takes SIGTERM to mean "finish the step
        # and save", which the survivors of a failure cannot do: their collectives wait on the dead peer.
        # So a stop torch does not name a signal for is a SIGKILL, as fast as SIGTERM's default once was.
        pcontext = self._pcontext
        self._stopped_ranks = set()
        if pcontext is not None:
            close = pcontext.close

            def close_the_rest(death_sig=None, timeout=30):
                if death_sig is None:  # torch's stop after a failure: who is still running is a consequence
                    self._stopped_ranks |= {r for r, code in rank_exit_codes(pcontext).items() if code is None}
                close(death_sig or signal.SIGKILL, timeout)

            pcontext.close = close_the_rest
            # Ranks forked by the warm server are stopped differently: the moment one fails, torch's
            # process context terminate()s the others (SIGTERM) and waits up to 30 s. Each one's
            # terminate() is made that same SIGKILL, and counted as a consequence.
            for local_rank, process in enumerate(getattr(getattr(pcontext, "_pc", None), "processes", [])):
                process.terminate = functools.partial(self._kill_survivor, local_rank, process)
        # torch's SIGTERM handler (installed as the ranks start) raises its SignalException wherever the
        # main thread is, and a library call of the monitoring loop that catches Exception can swallow it:
        # in drills, one SIGTERM in a handful was lost and the run trained on to its end. With the ranks
        # running, the handler only notes the signal and the next monitoring tick raises it.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._note_sigterm)
        return result

    def _start_warm_or_cold(self, worker_group: WorkerGroup):
        """torch's start of the ranks. Warm-started ranks (forked from the warm server) need torch's
        process context, whose queues and event are POSIX semaphores, which glibc keeps in /dev/shm
        whatever any setting says: on a full /dev/shm making one fails with ENOSPC, and that used to kill
        this agent at the next restart (exit 1, no restart). Ranks started as command lines need no shared
        memory, so that attempt starts them so, a few seconds slower, and resumes as any restart does."""
        try:
            return super()._start_workers(worker_group)
        except OSError as exc:  # a semaphore's ENOSPC names no file (a full log directory's would)
            if (
                exc.errno != errno.ENOSPC
                or exc.filename is not None
                or self.cold_start is None
                or not callable(worker_group.spec.entrypoint)
            ):
                raise
        say(
            "warning: /dev/shm is full (no room for the semaphores of a warm start): this attempt's ranks "
            "start as fresh interpreters, seconds slower; free /dev/shm to get warm restarts back"
        )
        self.events.emit("cold_start", attempt=self.attempt, reason="/dev/shm is full")
        warm = worker_group.spec
        executable, args = self.cold_start
        worker_group.spec = dataclasses.replace(warm, entrypoint=executable, args=args)
        try:
            return super()._start_workers(worker_group)
        finally:
            worker_group.spec = warm  # the next attempt tries a warm start again

    def _kill_survivor(self, local_rank: int, process) -> None:
        self._stopped_ranks.add(local_rank)
        process.kill()

    def _note_sigterm(self, signum, frame) -> None:
        self._sigterm_pending = True

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._stopped_by == signal.SIGTERM and self._pcontext is not None:
            self._stop_preempted()
            return
        if death_sig == signal.SIGTERM:  # a restart or a failed run: a SIGTERM would make the ranks save first
            death_sig = signal.SIGKILL
        super()._shutdown(death_sig, timeout)

    def _stop_preempted(self) -> None:
        """SIGTERM to the ranks, then up to the grace period for them to finish the step and save."""
        grace = self.safe.preemption_grace_s
        # A second SIGTERM (Slurm signals every process of the step, then may repeat) must not cut the
        # wait short: this agent leaving would take its saving ranks down with it (parent-death signal).
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        say(f"SIGTERM: the ranks finish their step and save a checkpoint (grace {grace:g} s)")
        t0 = time.monotonic()
        try:
            super()._shutdown(signal.SIGTERM, timeout=grace)
        finally:
            signal.signal(signal.SIGTERM, previous)
        codes = list(rank_exit_codes(self._pcontext).values())
        if any(code != PreemptedError.exit_code for code in codes):  # killed (or not even reaped yet)
            say(
                f"the ranks did not stop within safe.preemption_grace_s={grace:g} s and were killed; "
                "the run resumes from its newest checkpoint"
            )
        self.events.emit(
            "preemption_stop", attempt=self.attempt, seconds=round(time.monotonic() - t0, 3), exitcodes=codes
        )

    # -- attempts ---------------------------------------------------------------------------------
    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        if self._sigterm_pending:  # noted while the old ranks were stopped: nothing to restart for
            raise SignalException(f"Process {os.getpid()} got signal: SIGTERM", sigval=signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():  # no ranks yet: SIGTERM may raise at once
            signal.signal(signal.SIGTERM, _terminate_process_handler)
        if self._notice:
            say(self._notice)
            self._notice = None
        if self._check_node:  # after a failure, with the old ranks stopped: is this node still sound?
            self._check_node = False
            self.before_restart()
        if self.board is not None:
            self.board.clear()
        self.detector.reset(time.monotonic())
        self._last_tick = None
        self.attempt = self.safe.max_restarts - self._remaining_restarts
        self.events.emit("attempt_started", attempt=self.attempt)
        super()._initialize_workers(worker_group)
        self.hosts_rank0 = any(w.global_rank == 0 for w in worker_group.workers)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch also restarts the group when nodes join an elastic job: a regroup, not a recovery.
        if self._failed:
            self.events.emit("restart", attempt=self.attempt + 1, reason=self.last_failure)
            self._check_node = self.before_restart is not None
            step = self.newest_checkpoint_step()
            # An estimate from the newest files, which the ranks verify as they load them: a torn snapshot
            # or a corrupt checkpoint sends them to an older one (each with its event and a warning line).
            start = f"step {step} if sound" if step is not None else "step 0 (no checkpoint yet)"
            self._notice = (
                f"{self._failure_line}; restarting from {start}, restart {self.attempt + 1} of {self.safe.max_restarts}"
            )
        else:
            self.events.emit("regroup", attempt=self.attempt, reason="nodes are waiting to join")
            self._notice = "nodes are waiting to join: re-forming the job"
        self._failed = False
        super()._restart_workers(worker_group)

    # -- monitoring -------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        now = time.monotonic()
        self._silent_for = now - self._last_tick if self._last_tick is not None else 0.0
        self._last_tick = now
        if self._sigterm_pending:
            self._sigterm_pending = False
            raise SignalException(f"Process {os.getpid()} got signal: SIGTERM", sigval=signal.SIGTERM)
        self._check_home()
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            self._on_crash(self._failed_ranks(result, worker_group))
        elif result.state == WorkerState.HEALTHY and self.board is not None:
            stalls = self.detector.check(self.board.read(), time.monotonic())
            if stalls:
                self._on_hang(worker_group, stalls)
                result = RunResult(state=WorkerState.FAILED)
        if result.state == WorkerState.FAILED:
            self._failed = True
            self._check_crash_loop()
        return result

    def _check_home(self) -> None:
        """Stop when the run directory or its lock is no longer the one this job started in. The ranks
        would write on into deleted files (checkpoints nobody can resume from), and the lock, gone with
        the directory, no longer keeps a second launch of the same run out."""
        if self._home is not None and _identity(RunDir(self.run_dir)) != self._home:
            raise RunDirLostError(
                f"the run directory {self.run_dir} (or its lock) was deleted or replaced while "
                "the job ran: stopped; checkpoints and records there are gone or another "
                "launch's, so restore it or start the run again"
            )

    def _failed_ranks(self, result: RunResult, worker_group: WorkerGroup) -> dict[int, tuple[int, int]]:
        """global rank -> (local rank, exit code) of every rank that exited with an error. torch names only
        the first one it saw for ranks forked by the warm server; the others' codes are read here."""
        failed = {rank: (f.local_rank, f.exitcode) for rank, f in result.failures.items()}
        codes = rank_exit_codes(self._pcontext) if self._pcontext is not None else {}
        for worker in worker_group.workers:
            code = codes.get(worker.local_rank)
            if worker.global_rank not in failed and code not in (None, 0):
                failed[worker.global_rank] = (worker.local_rank, code)
        return failed

    def _on_crash(self, failed: dict[int, tuple[int, int]]) -> None:
        """One event per failure, naming the rank that most likely caused it."""
        for rank, (_, exitcode) in failed.items():
            if exitcode == PhalanxError.exit_code:  # bad input: the rank printed why
                raise PhalanxError(f"rank {rank} stopped on bad input (its message is above)")
            if exitcode == DiskFullError.exit_code:  # no restart can make room: the rank said where
                raise DiskFullError(f"rank {rank} stopped: the run directory's disk is full (its message is above)")
        if any(exitcode == PreemptedError.exit_code for _, exitcode in failed.values()):
            # Ranks sent SIGTERM without this agent (a `kill` of one rank): they agreed to stop and saved.
            # Not a failure to restart from: the job stops as preempted, once the others are done too.
            self._stopped_by = signal.SIGTERM
            raise StoppedBySignal(signal.SIGTERM)
        beats = {b.local_rank: b for b in self.board.read()} if self.board is not None else {}
        now = time.monotonic()
        ranks = []
        for rank, (local_rank, exitcode) in sorted(failed.items()):
            beat = beats.get(local_rank)
            ranks.append(
                {
                    "rank": rank,
                    "exitcode": exitcode,
                    "step": beat.step if beat else None,
                    "phase": beat.phase if beat else None,
                    "stalled_for": now - beat.time if beat and beat.time else None,
                    "stopped": local_rank in self._stopped_ranks,
                }
            )
        # A rank that ran out of memory is the cause: it says so in its exit code, and its peers only fail
        # with it (a broken connection, an abort, the agent's stop), some of them silent as long or longer.
        # Else a rank killed by a signal is the likelier cause; peers then fail on broken connections, and
        # those the agent stopped itself (SIGKILL once a peer failed) are consequences. Then the one
        # silent longest.
        cause = max(
            ranks,
            key=lambda r: (
                r["exitcode"] == RankOutOfMemoryError.exit_code,
                r["exitcode"] < 0 and r["exitcode"] != -signal.SIGTERM and not r["stopped"],
                r["stalled_for"] or 0.0,
            ),
        )
        for r in ranks:
            del r["stopped"]
        if cause["exitcode"] == RankOutOfMemoryError.exit_code:
            self._on_out_of_memory(cause, ranks, failed[cause["rank"]][0])
            return
        self._previous_oom_step = NO_OUT_OF_MEMORY
        reason, why = self._cause_outside_the_ranks()
        self.events.emit(
            "worker_failed",
            rank=cause["rank"],
            attempt=self.attempt,
            exitcode=cause["exitcode"],
            step=cause["step"],
            phase=cause["phase"],
            stalled_for=cause["stalled_for"],
            ranks=ranks,
            **({"reason": reason} if reason else {}),
        )
        self.last_failure = f"rank {cause['rank']} exited with code {cause['exitcode']}" + (
            f" at step {cause['step']} ({cause['phase']})" if cause["step"] is not None else ""
        )
        how = (
            f"({signal.Signals(-cause['exitcode']).name})"
            if _is_signal(cause["exitcode"])
            else f"with code {cause['exitcode']}"
        )
        self._failure_line = f"rank {cause['rank']} exited {how}" + (
            f" at step {cause['step']}" if cause["step"] is not None else ""
        )
        if why:  # what failed first; the ranks' exits follow from it
            self.last_failure = f"{why} ({self.last_failure})"
            self._failure_line = f"{why} ({self._failure_line})"

    def _cause_outside_the_ranks(self) -> tuple[str | None, str | None]:
        """(reason, what happened) when the ranks failed because something around them did: this agent
        was frozen past the ranks' patience with it (they stop rather than train unsupervised:
        rank_guard.py), or the fork server of warm-started ranks died (they die with it). (None, None)
        when the failure is the ranks' own."""
        if self._silent_for >= AGENT_STALE_SECONDS:
            return "agent_frozen", (
                f"this node agent did not run for {self._silent_for:.0f} s (stopped, or starved of CPU), so "
                "its ranks stopped rather than train unsupervised"
            )
        server = _dead_fork_server() if self._start_method == "forkserver" else None
        if server is not None:
            return (
                "fork_server_died",
                f"the fork server that starts this node's ranks (pid {server}) died, and its ranks with it",
            )
        return None, None

    def _on_out_of_memory(self, cause: dict, ranks: list[dict], local_rank: int) -> None:
        """Name the rank, the step and the allocation that failed (the rank recorded the allocator's message
        in torch elastic's error file). An out-of-memory can pass (memory another process held,
        fragmentation), so it is retried once; at the step the previous attempt ran out at too, it is
        the step itself that does not fit, and every restart would fail the same way: the run stops."""
        files = getattr(self._pcontext, "error_files", None) or {}
        failure = allocation_failure(read_error_file(files.get(local_rank)))
        step = cause["step"]
        self.events.emit(
            "worker_failed",
            rank=cause["rank"],
            attempt=self.attempt,
            exitcode=cause["exitcode"],
            step=step,
            phase=cause["phase"],
            stalled_for=cause["stalled_for"],
            ranks=ranks,
            reason="out_of_memory",
            bytes=failure.nbytes,
            device=failure.device,
        )
        where = f"at step {step}" if step is not None else "while starting"
        self.last_failure = f"rank {cause['rank']} ran out of memory {where} ({failure.describe()})"
        if step == self._previous_oom_step:
            raise RankOutOfMemoryError(
                f"{self.last_failure}, as on the previous attempt: every restart would too; make the step need "
                "less memory (train.micro_batch_size, sharding, activation checkpointing) or run where there is more"
            )
        self._previous_oom_step = step
        self._failure_line = f"{self.last_failure}; retried once, as memory another process held may be free now"

    def _on_hang(self, worker_group: WorkerGroup, stalls: list[Stall]) -> None:
        """Dump every local rank's stack, then record who stalled, where and in which phase."""
        self._previous_oom_step = NO_OUT_OF_MEMORY
        pids = self._pcontext.pids() if self._pcontext is not None else {}
        global_rank = {w.local_rank: w.global_rank for w in worker_group.workers}
        files = {s.local_rank: RunDir(self.run_dir).stack_file(self.attempt, global_rank[s.local_rank]) for s in stalls}
        missing = take_stacks(
            {s.local_rank: (pids[s.local_rank], files[s.local_rank]) for s in stalls if s.local_rank in pids},
            STACK_WAIT_SECONDS,
        )
        chosen = culprit(stalls)
        ranks = []
        for s in stalls:
            dump = files[s.local_rank].read_text() if files[s.local_rank].is_file() else ""
            ranks.append(
                {
                    "rank": global_rank[s.local_rank],
                    "step": s.step,
                    "phase": s.phase,
                    "progress": s.progress,
                    "stalled_for": round(s.stalled_for, 3),
                    "limit": round(s.limit, 3),
                    "where": innermost_frame(dump),
                    "stack_file": str(files[s.local_rank]),
                    **({"stack_missing": missing[s.local_rank]} if missing.get(s.local_rank) else {}),
                }
            )
        self.events.emit(
            "hang_detected",
            rank=global_rank[chosen.local_rank],
            attempt=self.attempt,
            stalled_for=chosen.stalled_for,
            limit=chosen.limit,
            ranks=ranks,
        )
        self.last_failure = (
            f"rank {global_rank[chosen.local_rank]} hung at step {chosen.step} "
            f"({chosen.phase}) for {chosen.stalled_for:.1f} s"
        )
        stack = missing.get(chosen.local_rank) or f"its stack is in {files[chosen.local_rank]}"
        self._failure_line = f"{self.last_failure}; {stack}"

    def _check_crash_loop(self) -> None:
        """Count restarted attempts that failed before a newer checkpoint appeared; K in a row stop the run."""
        progress = self.newest_checkpoint_step()
        if progress != self._attempt_start_step:
            self.failed_without_progress = 0
        elif self.attempt > 0:
            self.failed_without_progress += 1
        self._attempt_start_step = progress
        if self.failed_without_progress >= self.safe.crash_loop_restarts:
            restarts = self.failed_without_progress
            where = f"step {progress}" if progress is not None else "no checkpoint yet"
            self.events.emit(
                "crash_loop",
                attempt=self.attempt,
                restarts=restarts,
                checkpoint_step=progress,
                last_failure=self.last_failure,
            )
            raise CrashLoopError(
                f"crash loop: {restarts} restarts in a row without checkpoint progress "
                f"({where}); last failure: {self.last_failure} (see {RunDir(self.run_dir).events})"
            )


def _identity(run: RunDir) -> tuple[tuple[int, int], ...] | None:
    """The run directory's and its lock file's (device, inode): a directory deleted and made again under
    the same name, by a relaunch or by hand, is another directory."""
    try:
        return tuple((s.st_dev, s.st_ino) for s in (run.path.stat(), run.lock.stat()))
    except FileNotFoundError:
        return None


def rank_exit_codes(pcontext) -> dict[int, int | None]:
    """Each local rank's exit code (None while it runs; -N when killed by signal N), from either kind of
    torch process context: ranks started as command lines, or forked by the warm server as functions."""
    if hasattr(pcontext, "subprocess_handlers"):
        return {rank: handler.proc.poll() for rank, handler in pcontext.subprocess_handlers.items()}
    processes = pcontext._pc.processes if pcontext._pc is not None else []  # torch keeps them private
    return {rank: process.exitcode for rank, process in enumerate(processes)}


def _dead_fork_server() -> int | None:
    """The pid of this process's fork server (multiprocessing's, for warm-started ranks) if it has died,
    else None. WNOWAIT leaves it to multiprocessing to reap: its next start of a rank checks the server the
    same way, reaps it and starts a fresh one."""
    import multiprocessing.forkserver

    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if pid is None:
        return None
    try:
        return pid if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None else None
    except ChildProcessError:  # already reaped
        return pid


def _is_signal(exitcode: int) -> bool:
    """torch reports a rank killed by signal N as exit code -N."""
    try:
        return exitcode < 0 and bool(signal.Signals(-exitcode))
    except ValueError:
        return False
