"""Entry point of one rank started by torch's elastic launcher: `python -m phalanx.train.worker CONFIG`.

The launching `phalanx train` has already validated the config, prepared the data and saved the
resolved config in the run directory; each rank only reads it.

The rank guard comes first, before torch is imported (seconds): a rank must die with its node agent and
hold its share of the run lock from its first moment, and a SIGTERM while it starts must stop it at once.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import traceback
import warnings

from phalanx.errors import DiskFullError, PhalanxError, PreemptedError, RankOutOfMemoryError
from phalanx.safe.out_of_memory import is_out_of_memory
from phalanx.safe.rank_guard import guard_rank

# `phalanx --debug` sets this for the whole job; then torch's own warnings and log lines are shown too.
DEBUG_ENV = "PHALANX_DEBUG"


def quiet_torch() -> None:
    """Keep torch's chatter off the run's console unless --debug: DDP's `broadcast_buffers` deprecation
    (phalanx relies on its current meaning) and torch.distributed's log lines, which the node agent
    reports in its own words."""
    if os.environ.get(DEBUG_ENV) == "1":
        return
    warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated", category=FutureWarning)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def main(argv: list[str]) -> int:
    from phalanx.config.loader import load_config  # imported after guard_rank(): these import torch
    from phalanx.train.trainer import attempt_number, train

    (config_path,) = argv
    quiet_torch()
    # Ctrl-C stops the job through the node agent, which passes SIGINT on to its ranks. As Python's
    # KeyboardInterrupt it would print a traceback per rank, and inside a checkpoint save DCP would catch
    # it as that save's failure and train on; ended at once, as by SIGTERM, the rank stops where it is (its
    # newest checkpoint is intact) and the agent says what happened, once.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    config = load_config(config_path)
    try:
        train(config, attempt=attempt_number())
    except PreemptedError as exc:  # rank 0 said where it stopped and how long the save took
        return exc.exit_code
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        # A full disk under the run's records: a restart would fail the same way, so say it and stop (8).
        where = f" writing {exc.filename}" if exc.filename else ""
        print(
            f"error: no space left on device{where} (run directory {config.run_dir}): "
            f"free space and rerun; the same command resumes from the newest saved checkpoint",
            file=sys.stderr,
        )
        return DiskFullError.exit_code
    except PhalanxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        return _out_of_memory(exc)
    return 0


def _out_of_memory(exc: BaseException) -> int:
    """An allocation failed: the node agent names this rank, the step and the size in one line and decides
    whether to restart (the code says which failure it was, torch elastic's error file the message).
    Its traceback is only noise beside that line, so it is shown under --debug only."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(exc)
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exc()
    return RankOutOfMemoryError.exit_code


def run_rank(config_path: str) -> None:
    """The rank's entry when forked from the launch's warm server (phalanx/launch/warm_ranks.py): the
    same as the command line's, with torch already imported. A traceback is printed here, as a fresh
    interpreter would; torch's process wrapper only keeps it in a file."""
    guard_rank()
    try:
        code = main([config_path])
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    guard_rank()
    sys.exit(main(sys.argv[1:]))
