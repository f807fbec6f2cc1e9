"""Progress of the tokenising stage: units done, tokens per second and the time left, on stderr.

Speed and time left count only the units tokenised by this preparation: units a resumed preparation
found finished are done at once and would make the rate look far higher than it is."""

from __future__ import annotations

import time


def progress_line(done: int, units: int, tokens: int, bytes_done: int, bytes_left: int, seconds: float) -> str:
    """`done`/`units` units (all of them), and the rate and time left from `tokens` and `bytes_done` made in
    `seconds` by this preparation, with `bytes_left` of the corpus still to go."""
    line = f"tokenising: {done}/{units} units"
    if seconds <= 0 or bytes_done <= 0:
        return line
    eta = bytes_left * seconds / bytes_done
    return f"{line}, {_si(tokens / seconds)} tokens/s, {bytes_done / seconds / 1e6:.1f} MB/s, ETA {_clock(eta)}"


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class UnitProgress:
    """Counts units as they finish and shows progress_line on a rich progress bar (None: shown nowhere)."""

    def __init__(self, bar, units: int, total_bytes: int, reused: int, reused_bytes: int):
        self.bar, self.units, self.total_bytes = bar, units, total_bytes
        self.done, self.bytes_seen = reused, reused_bytes
        self.tokens = self.bytes_done = 0
        self.start = time.monotonic()
        self.task = None
        if bar is not None:
            self.task = bar.add_task(self.line(), total=max(total_bytes, 1), completed=reused_bytes)

    def line(self) -> str:
        left = max(self.total_bytes - self.bytes_seen, 0)
        seconds = time.monotonic() - self.start
        return progress_line(self.done, self.units, self.tokens, self.bytes_done, left, seconds)

    def finished(self, size: int, tokens: int, reused: bool = False) -> None:
        self.done += 1
        self.bytes_seen += size
        if not reused:
            self.tokens += tokens
            self.bytes_done += size
        if self.task is not None:
            self.bar.update(self.task, description=self.line(), completed=self.bytes_seen)
