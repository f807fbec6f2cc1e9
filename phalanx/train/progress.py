"""What a training run says on stderr while it trains: a live line on a terminal, plain lines elsewhere.

On a terminal, rich redraws one line (step, loss, tok/s, ETA). Where stderr is a file or a pipe (CI
logs, `| tee`, `nohup`) nothing can be redrawn, so a plain line is printed for the first step, then
every PHALANX_PROGRESS_INTERVAL seconds (default 10), and for the last step. stdout stays free for --json.
"""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

INTERVAL_ENV = "PHALANX_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


def plain_interval() -> float:
    """Seconds between plain progress lines (PHALANX_PROGRESS_INTERVAL; a bad value falls back to 10)."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value >= 0 else DEFAULT_INTERVAL_S


class ProgressLine:
    """Rank 0's progress (`enabled`; the other ranks stay quiet), live or as plain lines."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.console = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)
        self._enabled = enabled
        self._live = enabled and self.console.is_terminal
        self._total, self._start_step = total_steps, start_step
        self._started = self._last_line = time.monotonic()
        self._printed_step: int | None = None
        self._interval = plain_interval()
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self._live,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")

    def __enter__(self) -> ProgressLine:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, loss: float, tokens_per_sec: float, val_loss: float | None, last: bool = False) -> None:
        info = f"loss {loss:.4f}  {tokens_per_sec:,.0f} tok/s"
        if val_loss is not None:
            info += f"  val {val_loss:.4f}"
        if self._live:
            self._progress.update(self._task, completed=step, info=info)
            return
        if not self._enabled:
            return
        now = time.monotonic()
        first = self._printed_step is None
        if first or last or now - self._last_line >= self._interval:
            self.console.print(f"step {step}/{self._total}  {info}{self._eta(step, now)}")
            self._last_line, self._printed_step = now, step

    def log(self, message: str) -> None:
        if self._enabled:
            self.console.print(message)

    def _eta(self, step: int, now: float) -> str:
        done = step - self._start_step
        if done <= 0 or step >= self._total:
            return ""
        seconds = int((now - self._started) / done * (self._total - step))
        return f"  eta {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def notice(message: str, enabled: bool = True) -> None:
    """One line of what the run is doing (resuming, evaluating), on stderr, from rank 0."""
    if enabled:
        Console(stderr=True, highlight=False, markup=False, soft_wrap=True).print(message)
