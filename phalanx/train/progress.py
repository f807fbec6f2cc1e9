"""The live progress line of a training run."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressLine:
    """A live line on stderr (step, loss, tok/s, ETA); stdout stays free for --json output."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._enabled = enabled

    def __enter__(self) -> "ProgressLine":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, loss: float, tokens_per_sec: float, val_loss: float | None) -> None:
        info = f"loss {loss:.4f}  {tokens_per_sec:,.0f} tok/s"
        if val_loss is not None:
            info += f"  val {val_loss:.4f}"
        self._progress.update(self._task, completed=step, info=info)

    def log(self, message: str) -> None:
        if self._enabled:
            self._progress.console.print(message)
