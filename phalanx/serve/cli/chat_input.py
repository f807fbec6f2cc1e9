"""Where `phalanx chat` reads its lines, and the spinners it shows while it waits.

At a terminal, lines come through GNU readline (Python's own binding, so no extra dependency): editing,
history kept between chats, Ctrl-R search and Tab completion of the commands. Piped in, each line read is
echoed after the same `>>> ` prompt, so the output reads as the terminal would show it, one block per line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TextIO

HISTORY_LENGTH = 1000
PROMPT, CONTINUED = ">>> ", "... "


class LineSource(Protocol):
    def read(self, prompt: str) -> str: ...  # one line without its newline; EOFError at the end
    def close(self) -> None: ...


def history_path() -> Path:
    """Kept where XDG says state goes (~/.local/state/phalanx/chat_history), like a shell's history."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "phalanx" / "chat_history"


class TerminalLines:
    def __init__(self, completions: list[str], history: Path | None):
        try:
            import readline
        except ImportError:  # Python built without it: plain input() still works
            readline = None
        self.readline, self.history = readline, history
        if readline is None:
            return
        readline.set_history_length(HISTORY_LENGTH)
        if history is not None:
            try:
                readline.read_history_file(history)
            except OSError:  # none yet, or unreadable: start a new one
                pass
        readline.set_completer_delims("")  # complete the whole line: commands have spaces in them
        readline.set_completer(lambda text, i: ([c for c in completions if c.startswith(text)] + [None])[i])
        if "libedit" in (readline.__doc__ or ""):  # macOS's stand-in speaks another binding syntax
            readline.parse_and_bind("bind ^I rl_complete")
        else:
            readline.parse_and_bind("tab: complete")

    def read(self, prompt: str) -> str:
        try:
            return input(prompt)
        except EOFError:  # Ctrl-D: end the prompt's line, so the shell's prompt starts on its own
            print()
            raise

    def close(self) -> None:
        if self.readline is None or self.history is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history)
        except OSError:  # a read-only home must not turn the end of a chat into an error
            pass


class PipedLines:
    def __init__(self, lines: TextIO, out: TextIO):
        self.lines, self.out = lines, out

    def read(self, prompt: str) -> str:
        while True:
            line = self.lines.readline()
            if not line:
                raise EOFError
            text = line.rstrip("\r\n")
            # A blank line is no turn: it gets no block (within a multi-line message it is text, and shown).
            if text.strip() or prompt != PROMPT:
                break
        self.out.write(f"{prompt}{text}\n")
        self.out.flush()
        return text

    def close(self) -> None:
        pass


def read_message(lines: LineSource) -> tuple[str, bool]:
    """One message and whether it was a multi-line one: a line opening with \"\"\" goes on, over as many
    lines as it takes, to the line that ends with \"\"\" (as in `ollama run`)."""
    first = lines.read(PROMPT)
    opened = first.lstrip()
    if not opened.startswith('"""'):
        return first, False
    body = opened[3:]
    if body.endswith('"""'):
        return body[:-3], True
    parts = [body]
    while not (line := lines.read(CONTINUED)).endswith('"""'):
        parts.append(line)
    parts.append(line[:-3])
    return "\n".join(parts), True


@contextmanager
def spinner(stream: TextIO, text: str = "") -> Iterator[None]:
    """rich's spinner while something slow happens, on a terminal only; it leaves nothing behind."""
    if not stream.isatty():
        yield
        return
    from rich.console import Console

    with Console(file=stream).status(text, spinner="dots"):
        yield
