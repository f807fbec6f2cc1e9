"""A program run in a real pseudo-terminal (Python's `pty`), as a person at a terminal would run it: its
stdin, stdout and stderr are the terminal, keys are typed into it (Ctrl-C becomes SIGINT through the
terminal's line discipline, not a signal sent by the test), and the screen is read back as text."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import termios
import time

# Escape sequences (cursor moves, colours, bracketed paste, keypad mode) and rich's spinner frames
# (braille dots): what a screen shows is the text without them.
ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[=>]|[()][0-9A-Za-z])")
SPINNER = re.compile(r"[\u2800-\u28ff]")

UP, TAB, CTRL_C, CTRL_D = "\x1b[A", "\t", "\x03", "\x04"


def screen_text(raw: bytes) -> str:
    text = ESCAPES.sub("", raw.decode("utf-8", "replace")).replace("\r\n", "\n")
    return SPINNER.sub("", text).replace("\r", "").replace("\x07", "")


class PseudoTerminal:
    def __init__(self, argv: list[str], env: dict[str, str], rows: int = 24, cols: int = 80):
        pid, fd = pty.fork()
        if pid == 0:  # the child: the terminal is already its stdin/stdout/stderr and controlling tty
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.raw = b""
        self.seen = 0  # how much of the screen text expect() has consumed
        self.returncode: int | None = None

    @property
    def text(self) -> str:
        return screen_text(self.raw)

    def _read(self, timeout: float) -> bool:
        """Read what the program wrote; False once it has closed the terminal."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: every copy of the terminal's other end is closed
            data = b""
        self.raw += data
        return bool(data)

    def expect(self, pattern: str, timeout: float = 120) -> str:
        """Wait for `pattern` (a regular expression) after the last match; returns the text before it."""
        deadline = time.monotonic() + timeout
        compiled = re.compile(pattern)
        while True:
            text = self.text
            if found := compiled.search(text, self.seen):
                before, self.seen = text[self.seen : found.start()], found.end()
                return before
            if time.monotonic() > deadline or not self._read(0.05):
                raise AssertionError(f"never saw {pattern!r}; the terminal shows:\n{text[-3000:]}")

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def line(self, text: str) -> None:
        self.type(text + "\r")  # Enter sends a carriage return; the terminal turns it into a newline

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout} s; the terminal shows:\n{self.text[-3000:]}")
            self._read(0.05)
        while self._read(0.05):  # whatever it wrote last
            pass
        return self.returncode

    def close(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.returncode = -signal.SIGKILL
        os.close(self.fd)
