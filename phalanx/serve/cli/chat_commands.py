"""`phalanx chat`'s slash commands, named and worded after `ollama run`'s so its users feel at home:
/set, /show, /clear, /bye and /? (or /help). Each prints what it did; none of them is sent to the model.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any, TextIO

from phalanx.serve.cli.chat_backends import ChatBackend, InvalidParameters, check_parameters
from phalanx.serve.core.options import DEFAULTS

# Ollama's option names (those a phalanx server takes), their types, and what they do. `/set parameter`
# accepts exactly these; tests/serve/test_serve_chat_commands.py keeps them in step with the server's.
PARAMETERS: dict[str, tuple[type, str]] = {
    "temperature": (float, "0 picks the likeliest token; higher is more varied"),
    "top_k": (int, "sample among the k likeliest tokens (0: all)"),
    "top_p": (float, "sample among the likeliest tokens holding this much probability"),
    "min_p": (float, "drop tokens less likely than this times the likeliest"),
    "repeat_penalty": (float, "penalise recently seen tokens (1: off)"),
    "repeat_last_n": (int, "how many recent tokens the penalties look at (-1: all, 0: off)"),
    "presence_penalty": (float, "subtract from every recent token's logit"),
    "frequency_penalty": (float, "subtract, times its count, from every recent token's logit"),
    "seed": (int, "fix the sampling for repeatable replies (default: random)"),
    "num_predict": (int, "most tokens per reply (-1: no limit)"),
    "num_ctx": (int, "tokens of context (at most the model's)"),
    "stop": (str, "strings that end a reply, one or more"),
}

HELP = '''Available commands:
  /set            Set session variables (parameters, system message, verbose)
  /show           Show model information
  /clear          Forget the conversation so far
  /bye            Leave the chat (Ctrl-D does too)
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use """ to begin a multi-line message, and """ again to end it.
Ctrl-C stops a reply; the chat goes on without that exchange.'''

SET_HELP = """Available commands:
  /set parameter ...     Set a parameter (/set parameter lists them)
  /set system <string>   Set the system message
  /set verbose           Show token counts and speed after each reply
  /set quiet             Stop showing them"""

SHOW_HELP = """Available commands:
  /show info         Details of this model
  /show parameters   Parameters of this chat and of the model
  /show system       The system message"""

SHORTCUTS = """Available keyboard shortcuts:
  Up / Down          Earlier and later lines of the history (kept between chats)
  Ctrl-R             Search the history
  Ctrl-A / Ctrl-E    Move to the start / end of the line
  Alt-B / Alt-F      Move back / forward a word
  Ctrl-K / Ctrl-U    Delete to the end / start of the line
  Ctrl-W             Delete the word before the cursor
  Ctrl-L             Clear the screen
  Tab                Complete a command
  Ctrl-C             Stop the reply, or drop the line being typed
  Ctrl-D             Leave the chat (on an empty line)"""

# What Tab completes: every command as typed in full.
COMPLETIONS = sorted(
    {
        "/set parameter ",
        "/set system ",
        "/set verbose",
        "/set quiet",
        "/show info",
        "/show parameters",
        "/show system",
        "/clear",
        "/bye",
        "/help",
        "/? shortcuts",
        "/? set",
        "/? show",
        *(f"/set parameter {name} " for name in PARAMETERS),
    }
)


@dataclass
class Conversation:
    """What the next turn is sent with: the system message, the exchanges so far, the parameters."""

    system: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    exchanges: list[tuple[str, str]] = field(default_factory=list)  # (user, assistant)
    verbose: bool = False
    told_of_dropping: bool = False  # said that the oldest exchanges are left out once they do not fit

    def messages(self, user: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for asked, answered in self.exchanges:
            messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
        return messages + [{"role": "user", "content": user}]


BYE = "bye"


def run_command(line: str, conversation: Conversation, backend: ChatBackend, out: TextIO) -> str | None:
    """Carry out one slash command, printing its answer; returns BYE when the chat should end."""
    words = line.split()
    name, args = words[0], words[1:]
    if name == "/bye":
        return BYE
    if name in ("/?", "/help"):
        out.write(_help(args) + "\n")
    elif name == "/clear":
        count = len(conversation.exchanges)
        conversation.exchanges.clear()
        kept = " (the system message stays)" if conversation.system else ""
        out.write(f"Cleared the conversation: {count} exchange{'' if count == 1 else 's'} forgotten{kept}.\n")
    elif name == "/set":
        out.write(_set(line, args, conversation) + "\n")
    elif name == "/show":
        out.write(_show(args, conversation, backend) + "\n")
    else:
        out.write(f"Unknown command '{name}'. Type /? for help\n")
    return None


def _help(args: list[str]) -> str:
    topic = args[0] if args else ""
    return {"shortcuts": SHORTCUTS, "set": SET_HELP, "/set": SET_HELP, "show": SHOW_HELP, "/show": SHOW_HELP}.get(
        topic, HELP
    )


def _set(line: str, args: list[str], conversation: Conversation) -> str:
    if not args:
        return SET_HELP
    what = args[0]
    if what == "parameter":
        return _set_parameter(args[1:], conversation)
    if what == "system":
        # The rest of the line as typed (spaces kept), like a message.
        text = line.split(None, 2)[2].strip() if len(args) > 1 else ""
        if not text:
            return "Usage: /set system <string>"
        conversation.system = text
        return "Set system message."
    if what in ("verbose", "quiet"):
        conversation.verbose = what == "verbose"
        return f"Set '{what}' mode."
    return f"Unknown /set '{what}'.\n{SET_HELP}"


def _parameter_list() -> str:
    rows = []
    for name, (_kind, meaning) in PARAMETERS.items():
        default = DEFAULTS.get(name)
        shown = f" (default {default})" if default is not None else ""
        rows.append(f"  {name:<18} {meaning}{shown}")
    return "Available parameters (/set parameter NAME VALUE):\n" + "\n".join(rows)


def _set_parameter(args: list[str], conversation: Conversation) -> str:
    if not args:
        return _parameter_list()
    name, values = args[0], args[1:]
    if name not in PARAMETERS:
        return f"Unknown parameter '{name}'.\n{_parameter_list()}"
    if not values:
        return f"Usage: /set parameter {name} VALUE"
    kind = PARAMETERS[name][0]
    try:
        value: Any = values if name == "stop" else kind(values[0])
        if len(values) > 1 and name != "stop":
            raise ValueError
    except ValueError:
        return f"Couldn't set parameter: {name} takes one {'integer' if kind is int else 'number'}"
    params = {**conversation.params, name: value}
    try:
        check_parameters(params)
    except InvalidParameters as e:
        return f"Couldn't set parameter: {e}"
    conversation.params = params
    return f"Set parameter '{name}' to '{', '.join(values)}'"


def _show(args: list[str], conversation: Conversation, backend: ChatBackend) -> str:
    what = args[0] if args else ""
    if what == "info":
        return "\n".join(
            f"  {title}\n" + "\n".join(f"    {label:<22}{value}" for label, value in rows) + "\n"
            for title, rows in backend.info()
        ).rstrip("\n")
    if what == "parameters":
        mine = [
            (name, ", ".join(map(str, value)) if isinstance(value, list) else str(value))
            for name, value in conversation.params.items()
        ]
        lines = ["User defined parameters:", *(f"  {k:<18} {v}" for k, v in mine or [("(none)", "")])]
        lines += ["", "Model defined parameters:", *(f"  {k:<18} {v}" for k, v in backend.model_parameters())]
        others = ", ".join(f"{k} {v}" for k, v in DEFAULTS.items() if k not in conversation.params)
        return "\n".join(lines + ["", textwrap.fill(f"The others take Ollama's defaults: {others}.", 78)])
    if what == "system":
        return conversation.system or "No system message was specified."
    if what:
        return f"Unknown /show '{what}'.\n{SHOW_HELP}"
    return SHOW_HELP
