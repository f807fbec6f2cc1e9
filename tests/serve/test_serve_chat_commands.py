"""`phalanx chat`'s parts that need no model: the slash commands' parsing and answers, the parameters
(the same names and the same refusals as a server's /api/chat options), multi-line messages, piped lines'
echo, and how a streamed reply is trimmed into one block. The model-facing behaviour is tested with the
real command in test_serve_chat.py (piped) and test_serve_chat_terminal.py (a pseudo-terminal)."""

from __future__ import annotations

import io

import pytest

from phalanx.serve.cli.chat import ReplyWriter
from phalanx.serve.cli.chat_backends import InvalidParameters, check_parameters
from phalanx.serve.cli.chat_commands import BYE, COMPLETIONS, PARAMETERS, Conversation, run_command
from phalanx.serve.cli.chat_input import PipedLines, read_message
from phalanx.serve.http.ollama.ignored import IgnoredOllamaOptions
from phalanx.serve.http.ollama.schema import OllamaOptions


def command(line: str, conversation: Conversation | None = None) -> str:
    out = io.StringIO()
    assert run_command(line, conversation or Conversation(), None, out) is None
    return out.getvalue().rstrip("\n")


def test_parameters_are_the_servers_options():
    # The options a server acts on; those it accepts and ignores as Ollama does are not offered.
    assert set(PARAMETERS) == set(OllamaOptions.model_fields) - set(IgnoredOllamaOptions.model_fields)
    assert all(f"/set parameter {name} " in COMPLETIONS for name in PARAMETERS)


@pytest.mark.parametrize(
    "line, answer, params",
    [
        ("/set parameter temperature 0.5", "Set parameter 'temperature' to '0.5'", {"temperature": 0.5}),
        ("/set parameter seed 42", "Set parameter 'seed' to '42'", {"seed": 42}),
        ("/set parameter num_predict -1", "Set parameter 'num_predict' to '-1'", {"num_predict": -1}),
        ("/set parameter stop END Fin", "Set parameter 'stop' to 'END, Fin'", {"stop": ["END", "Fin"]}),
        ("/set parameter top_p 3", "Couldn't set parameter: top_p must be between 0 and 1", {}),
        ("/set parameter num_predict -5", "Couldn't set parameter: num_predict must be >= 0, or -1 for no limit", {}),
        (
            "/set parameter num_ctx 0",
            "Couldn't set parameter: invalid 'num_ctx': Input should be greater than or equal to 1",
            {},
        ),
        ("/set parameter top_k 2.5", "Couldn't set parameter: top_k takes one integer", {}),
        ("/set parameter temperature warm", "Couldn't set parameter: temperature takes one number", {}),
        ("/set parameter seed 1 2", "Couldn't set parameter: seed takes one integer", {}),
        ("/set parameter seed", "Usage: /set parameter seed VALUE", {}),
    ],
)
def test_set_parameter(line, answer, params):
    conversation = Conversation(params={})
    assert command(line, conversation) == answer
    assert conversation.params == params


def test_set_parameter_keeps_the_others_and_lists_them():
    conversation = Conversation(params={"seed": 7})
    command("/set parameter top_k 5", conversation)
    assert conversation.params == {"seed": 7, "top_k": 5}
    listing = command("/set parameter", conversation)
    assert listing.startswith("Available parameters") and all(name in listing for name in PARAMETERS)
    assert command("/set parameter colour blue").startswith("Unknown parameter 'colour'.\nAvailable parameters")


def test_system_verbose_clear_and_the_messages_sent():
    conversation = Conversation()
    assert command("/show system", conversation) == "No system message was specified."
    assert command("/set system", conversation) == "Usage: /set system <string>"
    assert command("/set system   Speak  in verse.  ", conversation) == "Set system message."
    assert conversation.system == "Speak  in verse."  # the text as typed, inner spaces kept
    conversation.exchanges += [("Who is there?", "Nay."), ("Answer me.", "Stand.")]
    assert conversation.messages("Again?") == [
        {"role": "system", "content": "Speak  in verse."},
        {"role": "user", "content": "Who is there?"},
        {"role": "assistant", "content": "Nay."},
        {"role": "user", "content": "Answer me."},
        {"role": "assistant", "content": "Stand."},
        {"role": "user", "content": "Again?"},
    ]
    assert command("/set verbose", conversation) == "Set 'verbose' mode." and conversation.verbose
    assert command("/set quiet", conversation) == "Set 'quiet' mode." and not conversation.verbose
    assert command("/clear", conversation) == (
        "Cleared the conversation: 2 exchanges forgotten (the system message stays)."
    )
    assert conversation.messages("Hi") == [
        {"role": "system", "content": "Speak  in verse."},
        {"role": "user", "content": "Hi"},
    ]


def test_help_and_unknown_commands():
    assert command("/?").startswith("Available commands:") and command("/help") == command("/?")
    assert "Ctrl-R" in command("/? shortcuts")
    assert "/set parameter" in command("/? set") and command("/set") == command("/? set")
    assert "/show info" in command("/? show") and command("/show") == command("/? show")
    assert command("/frobnicate") == "Unknown command '/frobnicate'. Type /? for help"
    assert command("/set colour").startswith("Unknown /set 'colour'.")
    assert command("/show colour").startswith("Unknown /show 'colour'.")
    assert run_command("/bye", Conversation(), None, io.StringIO()) == BYE


def test_check_parameters_gives_the_engines_options():
    options, num_ctx = check_parameters(
        {"temperature": 0, "num_predict": 3, "num_ctx": 64, "stop": ["X"]}, ["\n\nUSER:"]
    )
    assert (options.temperature, options.max_tokens, num_ctx) == (0, 3, 64)
    assert options.stop == ("\n\nUSER:", "X") and options.top_k == 40  # Ollama's defaults fill the rest
    with pytest.raises(InvalidParameters, match="unknown field 'colour'"):
        check_parameters({"colour": "blue"})


def test_piped_lines_echo_and_multi_line_messages():
    out = io.StringIO()
    lines = PipedLines(io.StringIO('\n  \nWho is there?\n"""First\n\nthird"""\n"""one line"""\n/bye'), out)
    assert read_message(lines) == ("Who is there?", False)  # blank lines are no turn
    assert read_message(lines) == ("First\n\nthird", True)
    assert read_message(lines) == ("one line", True)
    assert read_message(lines) == ("/bye", False)  # the last line may lack its newline
    with pytest.raises(EOFError):
        read_message(lines)
    assert out.getvalue() == ('>>> Who is there?\n>>> """First\n... \n... third"""\n>>> """one line"""\n>>> /bye\n')


@pytest.mark.parametrize(
    "pieces, shown",
    [
        (["\n", " Hello", " ", "\n", "world", "\n\n"], "Hello \nworld\n\n"),
        (["\n\n", "  "], "\n"),  # nothing to show: the block is only its blank line
        (["a", "b\n", "c"], "ab\nc\n\n"),
    ],
)
def test_reply_writer_trims_the_reply_into_one_block(pieces, shown):
    out = io.StringIO()
    writer = ReplyWriter(out)
    for piece in pieces:
        writer.write(piece)
    writer.end()
    assert out.getvalue() == shown
