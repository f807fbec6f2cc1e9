"""`phalanx chat` at a terminal: the real command in a pseudo-terminal, typed into as a person would.

A loading spinner until the model is ready, the `/?` help, /set and /show, Tab completion, multi-line
messages, the history (Up recalls a line, also in the next chat), Ctrl-C (stops a reply and the chat goes
on without that exchange; at the prompt it only says how to leave) and Ctrl-D to leave, with exit code 0.
Ctrl-C is typed as the key (byte 3), which the terminal itself turns into SIGINT, as it does for a person.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from pseudo_terminal import CTRL_C, CTRL_D, TAB, UP, PseudoTerminal
from serve_helpers import InProcessServer

pytestmark = pytest.mark.slow  # each test here takes over 5 s (TESTING.md)

ASK = "Who is there?"
EXIT_HINT = "Use Ctrl + d or /bye to exit."
# Seeded and unlimited: a 4-step model rambles on until the context (1024 tokens) is full, long enough to
# be stopped part of the way.
OPTIONS = ["--temperature", "0.8", "--seed", "7"]


def chat_terminal(target: str, state: Path, *args: str) -> PseudoTerminal:
    env = {**os.environ, "TERM": "xterm-256color", "XDG_STATE_HOME": str(state), "INPUTRC": "/dev/null"}
    return PseudoTerminal([sys.executable, "-m", "phalanx", "chat", target, *args], env)


def reply_to(term: PseudoTerminal, line: str) -> str:
    """Type a line and read its reply: the text between the echoed line and the next prompt."""
    term.line(line)
    term.expect(re.escape(line) + "\n")
    return term.expect(r"\n>>> ").strip()


def interrupted_reply(term: PseudoTerminal, full: str) -> tuple[str, int]:
    """Type ASK and press Ctrl-C once its reply has begun; returns what was shown before it stopped, and
    in how many tries. A reply of this tiny model takes well under a second, so a Ctrl-C that came after
    its end (the chat then only says how to leave) is retried from a cleared conversation."""
    for attempt in range(1, 6):
        term.line(ASK)
        term.expect(re.escape(ASK) + "\n")
        term.expect(r"\S")  # the first visible character of the reply
        term.type(CTRL_C)
        shown = term.expect(r"\n>>> ")
        if EXIT_HINT not in shown:
            partial = (full[:1] + shown).replace("^C", "").strip()
            if partial != full:
                return partial, attempt
        assert reply_to(term, "/clear").startswith("Cleared the conversation")
    pytest.fail("every Ctrl-C came after the reply had ended")


def test_chat_at_a_terminal(served_run, tmp_path):
    term = chat_terminal(str(served_run), tmp_path / "state", *OPTIONS)
    try:
        term.expect(f"Loading {re.escape(str(served_run))}")  # the spinner while torch imports and the weights load
        term.expect(r"phalanx chat: serve-tiny \([\d.]+K parameters, cpu\)\. /\? for help")
        term.expect(">>> ")

        help_text = reply_to(term, "/?")
        for command in ("/set", "/show", "/clear", "/bye", "/? shortcuts", '"""'):
            assert command in help_text
        assert "Ctrl-R" in reply_to(term, "/? shortcuts")

        full = reply_to(term, ASK)
        assert len(full) > 200, full  # long enough to stop part of the way
        assert reply_to(term, "/clear") == "Cleared the conversation: 1 exchange forgotten."

        # Ctrl-C stops the reply part of the way: what was shown is the start of the same seeded reply.
        partial, _ = interrupted_reply(term, full)
        assert full.startswith(partial) and len(partial) < len(full)
        # The chat goes on: the engine's one slot is free again, and the cut-off exchange was not kept.
        assert reply_to(term, ASK) == full
        assert reply_to(term, "/clear") == "Cleared the conversation: 1 exchange forgotten."

        # Ctrl-C at the prompt drops the line being typed and says how to leave. It is pressed once readline
        # has shown the line and gone back to waiting, as a person's would be: a SIGINT that lands in the
        # microseconds between readline handling a key and its next select() is only noticed at the next key
        # (CPython's readline checks for signals when select() is interrupted), so typing the text and the
        # Ctrl-C in one burst hung this test in CI.
        term.type("half a thought")
        term.expect("half a thought")
        time.sleep(0.3)
        term.type(CTRL_C)
        assert EXIT_HINT in term.expect(r"\n>>> ")

        # Up recalls the last line; Tab completes a command.
        term.type(UP)
        term.expect("/clear")
        term.line("")
        assert term.expect(r"\n>>> ").strip() == "Cleared the conversation: 0 exchanges forgotten."
        term.type("/show inf" + TAB)
        term.expect("/show info")
        term.line("")
        info = term.expect(r"\n>>> ")
        for label, value in (
            ("name", "serve-tiny"),
            ("context length", "1024"),
            ("layers", "2"),
            ("attention heads", "4 (2 key/value)"),
            ("checkpoint", f"{served_run}/checkpoints/step_00000004"),
        ):
            assert re.search(rf"\n    {label}\s+{re.escape(value)}\n", info), (label, info)

        # Parameters: set, refused with the server's own words, shown.
        assert reply_to(term, "/set parameter num_predict 5") == "Set parameter 'num_predict' to '5'"
        assert reply_to(term, "/set parameter top_p 3") == "Couldn't set parameter: top_p must be between 0 and 1"
        assert reply_to(term, "/set parameter top_k many") == "Couldn't set parameter: top_k takes one integer"
        assert reply_to(term, "/set parameter colour blue").startswith("Unknown parameter 'colour'.")
        shown = reply_to(term, "/show parameters")
        mine, model = shown.split("Model defined parameters:")
        assert re.search(r"num_predict\s+5\n", mine) and re.search(r"seed\s+7\n", mine) and "top_p" not in mine
        assert re.search(r'stop\s+"\\n\\nUSER:"', model), shown
        assert reply_to(term, "/set system Speak in verse.") == "Set system message."
        assert reply_to(term, "/show system") == "Speak in verse."
        assert reply_to(term, "/frobnicate") == "Unknown command '/frobnicate'. Type /? for help"

        # A multi-line message: the continuation prompt, then one reply.
        term.line('"""Who')
        term.expect(r"\.\.\. ")
        term.line('is there?"""')
        term.expect(r'is there\?"""\n')
        term.expect(r"\n>>> ")
        assert reply_to(term, "/show system") == "Speak in verse."

        term.type(CTRL_D)
        assert term.wait() == 0
    finally:
        term.close()

    # The history outlives the chat: the next one recalls the last line typed.
    history = (tmp_path / "state" / "phalanx" / "chat_history").read_text()
    assert ASK in history and "/set parameter top_p 3" in history
    again = chat_terminal(str(served_run), tmp_path / "state", *OPTIONS)
    try:
        again.expect(">>> ")
        again.type(UP)
        again.expect("/show system")
        again.line("")
        assert again.expect(r"\n>>> ").strip() == "No system message was specified."  # a new conversation
        again.line("/bye")
        assert again.wait() == 0
    finally:
        again.close()


def test_chat_at_a_terminal_with_a_server(served_run, tmp_path):
    """Ctrl-C against a server closes the request, which frees the server's only slot for the next turn."""
    server = InProcessServer(served_run, slots=1, max_queue=0)
    metrics = server.engine.observer

    def generated() -> float:
        return metrics.registry.get_sample_value("phalanx_serve_generated_tokens_total") or 0.0

    def until_idle() -> None:
        deadline = time.monotonic() + 30
        while server.engine.active or server.engine.waiting:
            assert time.monotonic() < deadline, "the server never let go of the stopped request"
            time.sleep(0.02)

    with server as live:
        term = chat_terminal(live.url, tmp_path / "state", *OPTIONS, "--no-history")
        try:
            term.expect(f"phalanx chat: tiny-test:latest \\({re.escape(live.url)}\\)")
            term.expect(">>> ")
            full = reply_to(term, ASK)
            until_idle()
            full_tokens = generated()
            assert reply_to(term, "/clear") == "Cleared the conversation: 1 exchange forgotten."
            partial, attempts = interrupted_reply(term, full)
            assert full.startswith(partial) and len(partial) < len(full)
            # Closing the stream cancelled the request on the server: it generated less than the whole reply
            # (the tries whose Ctrl-C came late generated all of theirs), and its only slot is free again.
            until_idle()
            assert generated() - full_tokens < attempts * full_tokens
            assert reply_to(term, ASK) == full
            info = reply_to(term, "/show info")
            assert "context length        1024" in info and f"address               {live.url}" in info
            term.line("/bye")
            assert term.wait() == 0
        finally:
            term.close()
    assert not (tmp_path / "state" / "phalanx" / "chat_history").exists()  # --no-history
