"""The run store's writer: a process of its own beside the node agent, so that nothing a database does
(a SIGBUS from an SQLite file made immutable under its memory map, a driver that hangs) can take the
agent, and with it the supervision of the ranks, down.

The agent starts it with the run's registration on its stdin (one JSON line) and, when the launch ends,
writes a second line with how it ended. The writer follows the run directory into the store (retrying
with backoff while the store is down, rebuilding an SQLite file that was deleted or replaced), and at
the end retries for up to `observe.store_retry_s` so the final status and every step land. If the agent
dies without a word (its end of the pipe closes), the writer stores what there is and the run as failed.
The agent restarts a writer that dies; a new one continues from the offsets in the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from phalanx.errors import PhalanxError, StoreError

RESTART_LIMIT = 10  # writers the agent starts again in one launch before it gives up on the store
WATCH_EVERY_S = 2.0
EXIT_MARGIN_S = 30.0  # beyond the writer's own retry time: to start, and to finish its last transaction


def _warn(message: str) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[yellow]warning:[/] {escape(message)}")


class StoreWriter:
    """The agent's handle on its writer process."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.restarts = 0
        self._ending = threading.Event()
        self._proc_lock = threading.Lock()
        self.proc = self._spawn()
        self._watch = threading.Thread(target=self._watchdog, name="phalanx-store-watch", daemon=True)
        self._watch.start()

    def _spawn(self) -> subprocess.Popen:
        # A session of its own: a Ctrl-C to the terminal reaches the agent, which then says how the
        # run ended, rather than killing the writer before it could store that.
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx.observe.store_writer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        proc.stdin.write(json.dumps(self.spec) + "\n")
        proc.stdin.flush()
        return proc

    def _watchdog(self) -> None:
        while not self._ending.wait(WATCH_EVERY_S):
            with self._proc_lock:
                code = self.proc.poll()
                if code is None or self._ending.is_set():
                    continue
                if self.restarts >= RESTART_LIMIT:
                    _warn(
                        f"the run store's writer died {self.restarts + 1} times; the rest of this launch is "
                        f"not stored (`phalanx runs import {self.spec['run_dir']}` copies it later)"
                    )
                    return
                self.restarts += 1
                how = f"signal {-code}" if code < 0 else f"code {code}"
                _warn(f"the run store's writer exited ({how}); starting another (training is not affected)")
                self.proc = self._spawn()

    def finish(self, status: str, error: str | None) -> bool:
        """Tell the writer how the launch ended and wait while it stores the rest; whether it did."""
        self._ending.set()
        with self._proc_lock:
            if self.proc.poll() is not None:  # died since the last watch: one more, for the end
                self.proc = self._spawn()
            proc = self.proc
        try:
            proc.stdin.write(json.dumps({"status": status, "error": error}) + "\n")
            proc.stdin.close()
        except OSError:  # it died just now: what it stored stays, `runs import` does the rest
            pass
        try:
            code = proc.wait(timeout=float(self.spec["retry_s"]) + EXIT_MARGIN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        if code != 0:
            _warn(
                f"the run store may lack the end of this launch; `phalanx runs import {self.spec['run_dir']}` "
                "brings it up to date"
            )
        return code == 0


# -- the writer process ------------------------------------------------------------------------------
def main() -> int:
    from phalanx.observe.follower import MAX_BACKOFF_S, RunFollower, refill_unfinished
    from phalanx.observe.store import RunStore

    spec = json.loads(sys.stdin.readline())
    run_dir, register = Path(spec["run_dir"]), spec["register"]
    end: dict[str, Any] = {}
    ended = threading.Event()

    def wait_for_the_end() -> None:
        line = sys.stdin.readline()
        try:
            end.update(json.loads(line))
        except ValueError:  # the pipe closed: the agent is gone
            end.update(status="failed", error="the node agent ended without saying how the run ended")
        ended.set()

    threading.Thread(target=wait_for_the_end, daemon=True).start()

    def connect() -> tuple[RunStore, int]:
        store = RunStore(spec["url"])
        try:
            return store, store.start_run(
                spec["name"],
                run_dir,
                register["config"],
                register["model"],
                register["world_size"],
                register["max_steps"],
                register["node"],
            )
        except StoreError:
            store.close()
            raise

    follower = RunFollower(
        run_dir,
        spec["name"],
        spec["wall_start"],
        interval=spec["interval"],
        connect=connect,
        on_rebuilt=lambda store: import_other_runs(store, run_dir),
        refill_pending=refill_unfinished(run_dir),
    )  # the writer before this one died in it
    delay = spec["interval"]
    while not ended.wait(delay):
        delay = spec["interval"] if follower.pass_once() else min(MAX_BACKOFF_S, delay * 2)
    if follower.drain(float(spec["retry_s"]), end.get("status"), end.get("error")):
        return 0
    _warn(f"the run store could not take the end of the run within observe.store_retry_s={spec['retry_s']}")
    return 1


def import_other_runs(store: Any, run_dir: Path) -> bool:
    """After a rebuild: the other runs of the runs root that are not training (those are copied by
    their own writers) go back into the new store. Whether that is complete: False while the store
    refuses some of them (a later try brings each up to date from the offsets the store holds)."""
    from phalanx.observe.observer import sync_run_dir
    from phalanx.run.layout import RunDir

    imported, complete = [], True
    for other in sorted(Path(run_dir).parent.iterdir()):
        if other == Path(run_dir) or not RunDir(other).config.is_file():
            continue
        try:
            sync_run_dir(store, other)
            imported.append(other.name)
        except StoreError:
            complete = False
        except PhalanxError:  # training (locked), or not a run any more: its own writer, or nobody
            continue
    if imported:
        Console(stderr=True, soft_wrap=True).print(
            f"rebuilt the run store with {len(imported)} other run(s) of {run_dir.parent}: " + ", ".join(imported),
            highlight=False,
        )
    return complete


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except PhalanxError as exc:  # a store URL that can never work
        Console(stderr=True).print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
