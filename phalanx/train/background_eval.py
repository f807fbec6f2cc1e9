"""eval.tasks: lm-evaluation-harness tasks scored on the run's checkpoints while it trains.

Rank 0 runs `phalanx eval CHECKPOINT --tasks ... --json` on each chosen checkpoint once it is saved, in a
process of its own at low CPU priority (nice 10), so training goes on meanwhile: the ranks never wait for
the harness, only share the machine with it. The report it saves in RUN_DIR/eval/ is the hand-off: the
run's store writer copies it into the store, from where the dashboard and /metrics show it.

One evaluation runs at a time. A checkpoint chosen while one runs waits; a newer one chosen meanwhile
replaces it (said in an event), so the evaluations never fall ever further behind the run, and the last
checkpoint is always scored: the trainer waits for it at the end of the run.

Its cost is measured: rank 0's step time while an evaluation runs against its step time outside them
(the slowdown, in each `eval_tasks_finished` event and its console line), and how long the end of the run
waited for the last evaluation.

A separate process rather than an import: the harness, its data sets and a second copy of the model stay
out of the trainer's memory, a failing task costs an event rather than the run, and train/ imports
nothing of eval/ (or the command line). `python -m phalanx.train.background_eval` is the small launcher it
starts: it lowers its priority, asks Linux to stop it if the rank dies, and becomes `phalanx eval`.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from phalanx.config.schema import Config, EvalSection

NICENESS = 10  # below the ranks (0): the harness takes the CPU time they leave
RECENT_STEPS = 50  # rank 0's step times outside evaluations, the baseline of the slowdown
WAIT_BEAT_SECONDS = 5.0  # while the run's end waits for the last evaluation: a heartbeat this often
STOP_GRACE_SECONDS = 5.0
# What torch's launcher and the node agent give a rank, which `phalanx eval` must not take as its own:
# it is no rank, joins no process group, and beats no heartbeat.
RANK_ENVIRONMENT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PHALANX_HEARTBEAT_FILE",
    "PHALANX_AGENT_PID",
    "PHALANX_RUN_LOCK",
)
PR_SET_PDEATHSIG = 1


def check_eval_settings(config: Config) -> None:
    """Before a launch: eval.tasks needs the extras `phalanx eval --tasks` needs (a PhalanxError, exit 2,
    naming the one to install), and a local task folder that is there."""
    if not config.eval.tasks:
        return
    from phalanx.errors import PhalanxError
    from phalanx.extras import require

    require("serve", "eval.tasks")  # the harness talks to phalanx's server
    require("eval", "eval.tasks")
    folder = config.eval.include_path
    if folder is not None and not Path(folder).is_dir():
        raise PhalanxError(f"eval.include_path={folder} is not a directory of task files (*.yaml)")


class Running:
    """One `phalanx eval` process, its checkpoint and what it prints."""

    def __init__(self, step: int, checkpoint: Path, command: list[str], env: dict[str, str]):
        self.step, self.checkpoint = step, checkpoint
        self.out: IO[bytes] = tempfile.TemporaryFile()
        self.err: IO[bytes] = tempfile.TemporaryFile()
        self.started = time.monotonic()
        self.step_seconds: list[float] = []  # rank 0's steps while it ran
        self.timed_out = False
        self.proc = subprocess.Popen(command, stdout=self.out, stderr=self.err, stdin=subprocess.DEVNULL, env=env)

    def output(self) -> tuple[str, str]:
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
            f.close()
        return texts[0], texts[1]


class BackgroundEval:
    """Rank 0's evaluations of checkpoints (a no-op elsewhere, and with eval.tasks empty)."""

    def __init__(
        self,
        settings: EvalSection,
        device: str,
        device_index: int | None,
        last_step: int,
        enabled: bool,
        emit: Callable[..., None],
        log: Callable[[str], None],
    ):
        """device: cpu or cuda, the ranks' (index: rank 0's GPU); emit(kind, **details): a run event;
        log(line): a console line above the progress."""
        self.settings, self.last_step = settings, last_step
        self.enabled = enabled and bool(settings.tasks)
        self.emit, self.log = emit, log
        self.device, self.device_index = device, device_index
        # A relative include_path is the launch's, wherever the child starts.
        self.include_path = str(Path(settings.include_path).absolute()) if settings.include_path else None
        self.running: Running | None = None
        self.waiting: tuple[int, Path] | None = None
        self.recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._steps_seen = 0
        self._blocked_since: float | None = None  # when the run's end began waiting for an evaluation

    # -- the trainer's hooks ----------------------------------------------------------------------------
    def checkpoint_saved(self, step: int, path: Path) -> None:
        """A checkpoint is complete on disk (train/saving.py): evaluate it now, or once the one running ends."""
        if not self.enabled or not self._chosen(step):
            return
        if self.waiting is not None:
            self.emit("eval_tasks_skipped", step=self.waiting[0], newer_step=step, reason="a newer checkpoint came")
        self.waiting = (step, Path(path))
        self.poll()

    def step_done(self, step_seconds: float) -> None:
        """After every step: its time, for the cost; an evaluation that ended is reported, the next started."""
        if not self.enabled:
            return
        if self._steps_seen:  # a launch's first step compiles and allocates: no measure of either
            (self.running.step_seconds if self.running is not None else self.recent).append(step_seconds)
        self._steps_seen += 1
        self.poll()

    def poll(self, blocked_seconds: float = 0.0) -> None:
        running = self.running
        if running is not None and running.proc.poll() is None:
            if time.monotonic() - running.started > self.settings.timeout_s:  # hung, or far too slow
                running.timed_out = True
                _end(running.proc)
        if self.running is not None and self.running.proc.poll() is not None:
            self._report(self.running, blocked_seconds)
            self.running = None
        if self.running is None and self.waiting is not None:
            step, path = self.waiting
            self.waiting = None
            self._start(step, path)

    def wait(self, seconds: float = WAIT_BEAT_SECONDS) -> bool:
        """At the end of the run: wait up to `seconds` for the evaluation running, start the one waiting
        (the last checkpoint's) once it ends; whether one still runs or waits. Called again and again by
        the trainer, which beats the heartbeat between; how long the end waited is in the events."""
        if self.running is None and self.waiting is None:
            return False
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
        if self.running is not None:
            left = self.running.started + self.settings.timeout_s - time.monotonic()
            try:
                self.running.proc.wait(timeout=max(0.0, min(seconds, left)))
            except subprocess.TimeoutExpired:
                if left > seconds:
                    return True
        now = time.monotonic()
        self.poll(blocked_seconds=now - self._blocked_since)
        self._blocked_since = now
        return self.running is not None or self.waiting is not None

    def stop(self) -> None:
        """The run stops early (a SIGTERM): the evaluation running is stopped, its checkpoint not scored,
        and no other starts."""
        self.enabled, self.waiting = False, None
        if self.running is None:
            return
        running, self.running = self.running, None
        _end(running.proc)
        running.output()
        self.emit("eval_tasks_stopped", step=running.step, seconds=time.monotonic() - running.started)

    # -- inside ---------------------------------------------------------------------------------------------
    def _chosen(self, step: int) -> bool:
        every = self.settings.interval
        return every is None or step % every == 0 or step == self.last_step

    def _start(self, step: int, checkpoint: Path) -> None:
        if not checkpoint.is_dir():  # removed by checkpoint.keep while it waited
            self.emit("eval_tasks_skipped", step=step, reason="the checkpoint was removed (checkpoint.keep)")
            return
        self.running = Running(step, checkpoint, self._command(checkpoint), self._environment())
        self.emit("eval_tasks_started", step=step, checkpoint=str(checkpoint), tasks=list(self.settings.tasks))

    def _command(self, checkpoint: Path) -> list[str]:
        s = self.settings
        args = ["eval", str(checkpoint), "--tasks", ",".join(s.tasks), "--batch-size", str(s.batch_size)]
        args += ["--device", self.device, "--json"]
        if s.limit is not None:
            args += ["--limit", str(s.limit)]
        if self.include_path is not None:
            args += ["--include-path", self.include_path]
        return [sys.executable, "-m", "phalanx.train.background_eval", str(os.getpid()), "--", *args]

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in RANK_ENVIRONMENT and not k.startswith("TORCHELASTIC")}
        if self.device == "cuda" and self.device_index is not None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else None
            env["CUDA_VISIBLE_DEVICES"] = ids[self.device_index] if ids else str(self.device_index)  # rank 0's GPU
        elif self.device == "cpu":
            # The ranks' threads fill the cores; one thread at low priority takes what they leave without
            # a second team of threads contending with theirs.
            env["OMP_NUM_THREADS"] = "1"
        return env

    def _report(self, running: Running, blocked_seconds: float) -> None:
        seconds = time.monotonic() - running.started
        out, err = running.output()
        code = running.proc.returncode
        report = None
        if code == 0:
            try:
                report = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                report = None
        if not isinstance(report, dict):
            lines = [line for line in err.strip().splitlines() if line.strip()]
            why = lines[-1] if lines else f"exit code {code}"
            if running.timed_out:
                why = f"stopped after eval.timeout_s={self.settings.timeout_s:g} s"
            self.emit("eval_tasks_failed", step=running.step, seconds=seconds, exit_code=code, error=why[-500:])
            self.log(f"step {running.step}: eval.tasks failed ({why[-300:]}); training goes on")
            return
        cost = self._cost(running.step_seconds)
        self.emit(
            "eval_tasks_finished",
            step=running.step,
            seconds=seconds,
            blocked_seconds=blocked_seconds,
            saved=report.get("saved"),
            **cost,
        )
        scores = ", ".join(
            f"{task} {metric} {v['value']:.4f}" + (f" ± {v['stderr']:.4f}" if v.get("stderr") is not None else "")
            for task, metrics in (report.get("tasks") or {}).items()
            for metric, v in metrics.items()
            if isinstance(v, dict) and isinstance(v.get("value"), (int, float))
        )
        slower = f", steps {cost['slowdown'] - 1:+.0%} meanwhile" if cost.get("slowdown") is not None else ""
        waited = f", the end waited {blocked_seconds:.1f} s" if blocked_seconds >= 0.1 else ""
        self.log(f"step {running.step}: {scores or 'no scores'} ({seconds:.1f} s in the background{slower}{waited})")

    def _cost(self, during: list[float]) -> dict[str, Any]:
        """Rank 0's median step time while the evaluation ran against outside evaluations, and their ratio."""
        cost: dict[str, Any] = {"steps_during": len(during)}
        if during and self.recent:
            inside, outside = statistics.median(during), statistics.median(self.recent)
            cost.update(step_seconds_during=inside, step_seconds_outside=outside, slowdown=inside / outside)
        return cost


def _end(proc: subprocess.Popen) -> None:
    """Stop an evaluation: SIGTERM, then SIGKILL after a grace period."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def launch(parent: int, args: list[str]) -> None:
    """The child's first moments: low priority, stopped with the rank that started it, then `phalanx eval`."""
    os.nice(NICENESS)
    try:  # Linux: SIGTERM when the rank dies, however it dies (kept across the exec below)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the rank died before the line above: nothing to evaluate for
        sys.exit(1)
    os.execv(sys.executable, [sys.executable, "-m", "phalanx", *args])


if __name__ == "__main__":
    launch(int(sys.argv[1]), sys.argv[3:])  # PARENT_PID -- EVAL ARGS...
