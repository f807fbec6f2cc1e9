"""Errors that end a command with one clear line and a distinct exit code (tracebacks only with --debug).

Exit codes: 2 bad input; 3 a crash loop (restarts that never get past the newest checkpoint); 4 the run
failed again after `safe.max_restarts` restarts. A scheduler can requeue on 4 but should not on 2 or 3.
"""


class PhalanxError(Exception):
    """A problem the user can fix (bad config, missing file, incompatible checkpoint)."""

    exit_code = 2


class CrashLoopError(PhalanxError):
    exit_code = 3


class RestartsExhaustedError(PhalanxError):
    exit_code = 4
