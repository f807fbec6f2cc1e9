"""Warm rank starts: a node agent's ranks forked from a server that has imported torch and the trainer.

A rank started as a fresh interpreter spends seconds on `import torch` before it can rendezvous; after
a fault every rank pays that again, and it dominates the time from a fault to training again. Python's
multiprocessing forkserver is the standby here: started once per launch (importing the trainer while
the agent forms the rendezvous), it forks each rank of every attempt from its already imported state,
and torch's elastic agent starts a function entrypoint through it (`start_method="forkserver"`). The
server never runs a tensor operation, so no thread pool or device context is forked.

The server is started after the launcher has set the ranks' environment (the heartbeat board, the
agent's pid, the run lock), which the forked ranks inherit from it, and stopped when the launch ends,
so that a later launch in the same process (a Ray actor's next node agent) gets its own.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal

# What the server imports before it forks anyone: its SIGTERM setting (warm_server.py), the rank's entry
# and everything the trainer needs, with what torch imports lazily on the way (building a model on the
# meta device imports dynamo, 0.8 s).
PRELOAD = ["phalanx.launch.warm_server", "phalanx.train.worker", "phalanx.train.trainer", "torch._dynamo"]


def run_entry(module: str, function: str, *args: str) -> None:
    """What a forked rank runs: `module.function(*args)`, named as the command line names `-m module`
    (the launcher knows the trainer only by name). The server has imported the module already."""
    getattr(importlib.import_module(module), function)(*args)


def start_server() -> None:
    """Start the fork server now (it imports PRELOAD in the background), so the first attempt's ranks
    wait less for it too."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def stop_server() -> None:
    """Stop this process's fork server; the next start makes a fresh one. Its ranks are gone by now, but a
    rank stuck where no signal reaches it would keep the server's "alive" pipe open, so the server is
    killed rather than told to go by that pipe alone (it ignores SIGTERM: warm_server.py).
    multiprocessing keeps the server private; `_stop` is what its own tests stop it with (close the
    pipe, reap the process)."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()
