"""`phalanx chat`: a terminal conversation, with a model loaded here or with a running server.

Each message is a user turn; the reply streams out as it is generated and joins the history, so the model
sees the whole conversation every turn. Slash commands (chat_commands.py) set parameters, show the model
and clear the history; Ctrl-C stops a reply and the chat goes on. Locally the engine runs in-process (one
slot); against a URL it speaks Ollama's /api/chat. The backends are in chat_backends.py, the terminal
and piped input in chat_input.py.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any, TextIO

from phalanx.errors import PhalanxError
from phalanx.serve.cli.chat_backends import (
    ChatBackend,
    ConversationError,
    InvalidParameters,
    LocalChat,
    RemoteChat,
    Reply,
    check_parameters,
)
from phalanx.serve.cli.chat_commands import BYE, COMPLETIONS, Conversation, run_command
from phalanx.serve.cli.chat_input import LineSource, PipedLines, TerminalLines, history_path, read_message, spinner

EXIT_HINT = "Use Ctrl + d or /bye to exit."


class ReplyWriter:
    """Writes a reply as it streams, without the whitespace at either end (the model often opens with a
    newline and ends with a blank line), so every reply is one tidy block."""

    def __init__(self, out: TextIO):
        self.out = out
        self.started = False
        self.held = ""  # whitespace that ends the text so far: written only if more text follows

    def write(self, piece: str) -> None:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return
            self.started = True
        body = piece.rstrip()
        if not body:
            self.held += piece
            return
        self.out.write(self.held + body)
        self.out.flush()
        self.held = piece[len(body) :]

    def end(self) -> None:
        """Close the block: the reply's last line, then one blank line."""
        self.out.write("\n\n" if self.started else "\n")
        self.out.flush()


def take_turn(backend: ChatBackend, conversation: Conversation, text: str, out: TextIO, err: TextIO) -> None:
    """Send one message and stream the reply; it joins the history only if it ended by itself. Ctrl-C
    (KeyboardInterrupt) stops the reply, frees the engine's slot or the server's request, and is raised on."""
    writer, reply, pieces = ReplyWriter(out), None, []
    try:
        with spinner(out):  # until the first token: the prompt's prefill, or the server's queue
            reply = _reply_that_fits(backend, conversation, text, err)
            stream = iter(reply)
            first = next(stream, None)
        for piece in itertools.chain([first] if first is not None else [], stream):
            pieces.append(piece)
            writer.write(piece)
    except ConversationError as e:
        writer.end()
        err.write(f"error: {e}\n")
        err.flush()
        return
    except KeyboardInterrupt:
        writer.end()
        raise
    finally:
        if reply is not None:
            reply.stop()  # nothing once it has ended by itself
    conversation.exchanges.append((text, "".join(pieces)))
    if conversation.verbose and reply.stats is not None:  # /set verbose: the counts, between reply and gap
        out.write("\n" if writer.started else "")
        out.flush()
        err.write(reply.stats.line() + "\n")
        err.flush()
        out.write("\n")
        out.flush()
        return
    writer.end()


def _reply_that_fits(backend: ChatBackend, conversation: Conversation, text: str, err: TextIO) -> Reply:
    """The reply to `text`. When the conversation no longer fits the model's context, its oldest exchanges
    are left out until it does (the system message stays), as Ollama does; said the first time only."""
    dropped = 0
    while True:
        try:
            reply = backend.reply(conversation.messages(text), conversation.params)
            break
        except ConversationError as e:
            if not e.too_long or not conversation.exchanges:
                raise  # the message alone is too long: nothing to leave out
            conversation.exchanges.pop(0)
            dropped += 1
    if dropped and not conversation.told_of_dropping:
        conversation.told_of_dropping = True
        err.write(
            f"note: the conversation outgrew the model's context: left out its oldest {dropped} "
            f"exchange{'' if dropped == 1 else 's'}, as from now on whenever it must (the system message "
            "stays; /clear starts afresh)\n"
        )
        err.flush()
    return reply


def chat_loop(
    backend: ChatBackend,
    conversation: Conversation,
    lines: LineSource,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    interactive: bool = False,
) -> None:
    """Talk until /bye or the end of input (Ctrl-D at a terminal). At a terminal Ctrl-C stops only the
    reply (or drops the line being typed) and the chat goes on; piped in, it ends the chat."""
    while True:
        try:
            text, multiline = read_message(lines)
        except EOFError:
            break
        except KeyboardInterrupt:
            if not interactive:
                raise
            out.write(f"\n{EXIT_HINT}\n\n")  # the line typed so far is dropped, as a shell does
            out.flush()
            continue
        try:
            if not text.strip():
                continue
            if text.lstrip().startswith("/") and not multiline:
                if run_command(text.strip(), conversation, backend, out) == BYE:
                    break
                out.write("\n")
                out.flush()
                continue
            # A reply cut off by Ctrl-C is not kept: the next turn does not build on half a sentence.
            take_turn(backend, conversation, text, out, err)
        except KeyboardInterrupt:
            if not interactive:
                raise


def open_backend(
    target: str, model: str | None, api_key: str | None, device: str, context: int | None, err: TextIO
) -> ChatBackend:
    if target.startswith(("http://", "https://")):
        if context is not None:
            raise PhalanxError("--context applies to a local model; a server's context is set by phalanx serve")
        with spinner(err, f"Connecting to {target}"):
            return RemoteChat(target, model, api_key)
    if model is not None:
        raise PhalanxError("--model picks a model on a server; a local run directory holds one model")
    with spinner(err, f"Loading {target}"):  # importing torch and loading the weights take seconds
        return LocalChat(Path(target), device, context)


def run_chat(
    target: str,
    model: str | None,
    system: str | None,
    params: dict[str, Any],
    api_key: str | None,
    device: str,
    context: int | None,
    verbose: bool = False,
    history: bool = True,
) -> None:
    try:
        check_parameters(params)
    except InvalidParameters as e:
        raise PhalanxError(str(e)) from None
    interactive = sys.stdin.isatty()
    backend = open_backend(target, model, api_key, device, context, sys.stderr)
    conversation = Conversation(system=system, params=params, verbose=verbose)
    if interactive:
        lines: LineSource = TerminalLines(COMPLETIONS, history_path() if history else None)
        print(f"phalanx chat: {backend.name} ({backend.where}). /? for help, /bye or Ctrl-D to leave.", flush=True)
    else:
        lines = PipedLines(sys.stdin, sys.stdout)
    try:
        chat_loop(backend, conversation, lines, interactive=interactive)
    finally:
        lines.close()
        backend.close()
