"""Errors that end a command with one clear line and a distinct exit code (tracebacks only with --debug).

Exit codes: 2 bad input; 3 a crash loop (restarts that never get past the newest checkpoint); 4 the run
failed again after `safe.max_restarts` restarts; 5 the job could not form (rendezvous failed or timed
out); 128 + N stopped by signal N (143 for SIGTERM, 130 for Ctrl-C). A scheduler can requeue on 4, 5
and 143 but should not on 2 or 3.
"""


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


class StoppedBySignal(PhalanxError):
    """The launch was stopped by a signal (a scheduler's SIGTERM, Ctrl-C); exits 128 + the signal."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name}; the ranks were stopped "
                         "(the same command resumes from the newest checkpoint)")
        self.exit_code = 128 + int(signum)
