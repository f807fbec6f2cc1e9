"""Errors that end a command with one clear line and a distinct exit code (tracebacks only with --debug).

EXIT_CODES is the one table of what every exit code means and whether a scheduler should requeue the
job; the README's table is rendered from it (tests/test_errors.py checks they match). Each error type
below takes its code from there.
"""

from __future__ import annotations

from typing import NamedTuple


class ExitCode(NamedTuple):
    code: str  # a number, or "128 + N"
    meaning: str
    requeue: bool  # whether a scheduler should run the job again on this exit


EXIT_CODES = (
    ExitCode("0", "done", False),
    ExitCode(
        "1",
        "a rank's own failure (a crash, a checkpoint that would not load), which the node agent "
        "restarts; from a command, an unexpected error: rerun with --debug and report it",
        False,
    ),
    ExitCode(
        "2",
        "bad input: fix the command or config (or install the extra it names: `pip install 'phalanx[serve]'`)",
        False,
    ),
    ExitCode(
        "3", "crash loop: `safe.crash_loop_restarts` restarts in a row never got past the newest checkpoint", False
    ),
    ExitCode("4", "the run failed again after `safe.max_restarts` restarts", True),
    ExitCode("5", "the job could not form: the rendezvous failed or timed out", True),
    ExitCode("6", "preflight failed, or this node is quarantined (`phalanx preflight --clear NODE` once fixed)", False),
    ExitCode(
        "7",
        "the run store cannot be reached or refused the request (`phalanx runs`, `dashboard`; training "
        "itself goes on without the store, with a warning)",
        True,
    ),
    ExitCode(
        "8",
        "the run directory's disk is full: the final checkpoint, or the run's own records, could not be "
        "written (the message says how much a checkpoint needs); free space and rerun: the same command "
        "resumes from the newest saved checkpoint",
        False,
    ),
    ExitCode(
        "9",
        "the run directory was deleted or replaced while the job ran: it stopped rather than write "
        "checkpoints and records where nobody reads them, and beside a new launch of the same run",
        False,
    ),
    ExitCode(
        "10",
        "a rank ran out of memory at the same step on two attempts in a row (the message names the rank, "
        "the step and the allocation): every restart would too; make the step need less memory "
        "(`train.micro_batch_size`, sharding, activation checkpointing) or run where there is more",
        False,
    ),
    ExitCode(
        "143",
        "preempted (SIGTERM): checkpoint saved. Every rank finished its step and the job saved a "
        "checkpoint there within `safe.preemption_grace_s`; the same command resumes from that step",
        True,
    ),
    ExitCode("128 + N", "stopped by signal N (130: Ctrl-C); the same command resumes from the newest checkpoint", True),
)


def exit_code_table() -> str:
    """The Markdown table of EXIT_CODES, as the README shows it."""
    rows = ["| exit code | meaning | requeue |", "|---|---|---|"]
    rows += [f"| {e.code} | {e.meaning} | {'yes' if e.requeue else 'no'} |" for e in EXIT_CODES]
    return "\n".join(rows)


class PhalanxError(Exception):
    """A problem the user can fix (bad config, missing file, incompatible checkpoint)."""

    exit_code = 2


class CheckpointLoadError(PhalanxError):
    """A checkpoint that passed its manifest check but would not load, in a rank: the node agent
    restarts (I/O may recover) and its crash-loop guard stops it if it never does."""

    exit_code = 1


class CrashLoopError(PhalanxError):
    exit_code = 3


class RestartsExhaustedError(PhalanxError):
    exit_code = 4


class RendezvousFailedError(PhalanxError):
    exit_code = 5


class PreflightFailedError(PhalanxError):
    """A preflight check failed (or the preflight itself could not run). A scheduler should not start the
    job on these nodes; a quarantined node stays out until `phalanx preflight --clear NODE`."""

    exit_code = 6


class StoreError(PhalanxError):
    """The run store could not be reached or refused a write. `transient` errors (a lost connection, a
    locked or restarting database) may succeed if retried; the others will not."""

    exit_code = 7

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


class FinalSaveFailedError(PhalanxError):
    """Training reached its last step but could not save it (a full disk): the steps since the newest
    saved checkpoint would be lost on a resume, so the run must not look finished."""

    exit_code = 8


class DiskFullError(PhalanxError):
    """A rank could not write the run's records (metrics, events) for want of space: restarting cannot
    help, so the job stops (exit 8) rather than crash-loop."""

    exit_code = 8


class RunDirLostError(PhalanxError):
    """The run directory, or its lock, is no longer the one the job took at its start (deleted, moved,
    replaced): another launch may hold the name now, so the job stops (safe/agent.py)."""

    exit_code = 9


class RankOutOfMemoryError(PhalanxError):
    """A rank's allocation failed. The rank exits with this code (phalanx/train/worker.py), and its node
    agent restarts once: memory another process held, or fragmentation, may be gone by then. The same
    step running out again stops the job with it (phalanx/safe/agent.py)."""

    exit_code = 10


class AgentGoneError(PhalanxError):
    """A rank whose node agent is gone (killed, frozen) stops rather than train on unsupervised; to an
    agent that still sees it, it is the rank's own failure."""

    exit_code = 1


class PreemptedError(PhalanxError):
    """A rank asked to stop by SIGTERM finished its step and saved a checkpoint there (the trainer)."""

    exit_code = 143


class StoppedBySignal(PhalanxError):
    """The launch was stopped by a signal (a scheduler's SIGTERM, Ctrl-C); exits 128 + the signal."""

    def __init__(
        self, signum: int, then: str = "the ranks were stopped (the same command resumes from the newest checkpoint)"
    ):
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name}; {then}")
        self.exit_code = 128 + int(signum)
