"""`phalanx chat` with piped stdin, on a local run directory and against a running server: each input line
is echoed after the `>>> ` prompt with its reply below it and a blank line after, so every line gives one
block; the history carries over, /set parameter and /set system change what the model is sent, /clear
forgets the history (and says so), a turn too long for the context is refused and the chat goes on, /bye
(or the end of input) ends it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from serve_helpers import InProcessServer

# Seeded sampling: a 4-step model's greedy replies are all newlines, which would hide a lost history.
OPTIONS = ["--temperature", "0.8", "--seed", "7", "--num-predict", "8"]
ASK, ANSWER = "Who is there?", "Nay, answer me."
SYSTEM = "Speak in verse."
TOO_LONG = " ".join(["wherefore"] * 1500)  # well over the 1024-token context


def phalanx_chat(*args: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "chat", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def block(line: str, answer: str) -> str:
    """What one input line shows: the prompt and the line, then the answer (trimmed) and a blank line."""
    return f">>> {line}\n" + (f"{answer.strip()}\n\n" if answer.strip() else "\n")


def test_chat_piped_locally_and_against_a_server(served_run):
    # One slot, like the local chat's own engine: same shapes, same bits, same seeded replies.
    with InProcessServer(served_run, slots=1, max_queue=4, api_key="chat-key") as live, live.client() as http:

        def reply(messages, seed=7):
            body = {
                "model": live.model,
                "messages": messages,
                "stream": False,
                "options": {"temperature": 0.8, "seed": seed, "num_predict": 8},
            }
            return http.post("/api/chat", json=body).json()["message"]["content"]

        def user(text):
            return {"role": "user", "content": text}

        def assistant(text):
            return {"role": "assistant", "content": text}

        r1 = reply([user(ASK)])
        r2 = reply([user(ASK), assistant(r1), user(ANSWER)])
        assert r2 != reply([user(ANSWER)])  # the history changes the reply
        r3 = reply([user(ASK), assistant(r1), user(ASK)], seed=8)
        assert r3 != reply([user(ASK), assistant(r1), user(ASK)])  # the seed changes the reply
        r4 = reply(
            [{"role": "system", "content": SYSTEM}, user(ASK), assistant(r1), user(ASK), assistant(r3), user(ASK)],
            seed=8,
        )
        script = [
            ASK,
            ANSWER,
            "/clear",
            TOO_LONG,
            "",
            ASK,
            "/set parameter seed 8",
            ASK,
            f"/set system {SYSTEM}",
            ASK,
            "/bye",
            "never read",
        ]
        expected = (
            block(ASK, r1)
            + block(ANSWER, r2)
            + block("/clear", "Cleared the conversation: 2 exchanges forgotten.")
            + block(TOO_LONG, "")
            + block(ASK, r1)
            + block("/set parameter seed 8", "Set parameter 'seed' to '8'")
            + block(ASK, r3)
            + block(f"/set system {SYSTEM}", "Set system message.")
            + block(ASK, r4)
            + ">>> /bye\n"
        )

        local = phalanx_chat(str(served_run), *OPTIONS, "--verbose", stdin="\n".join(script) + "\n")
        assert local.returncode == 0, local.stderr
        assert local.stdout == expected
        # The refused turn says why, on stderr; --verbose adds the counts of each of the five replies.
        assert re.search(
            r"^error: the prompt is \d+ tokens but the context holds 1024.*/clear starts a new "
            r"conversation$",
            local.stderr,
            re.M,
        ), local.stderr
        stats = re.findall(r"^(\d+) tokens in [\d.]+ s .*; prompt (\d+) tokens in [\d.]+ s$", local.stderr, re.M)
        assert len(stats) == 5 and all(0 < int(n) <= 8 and int(p) > 0 for n, p in stats), local.stderr

        remote = phalanx_chat(live.url, "--api-key", "chat-key", *OPTIONS, stdin="\n".join(script[:2]))  # EOF ends
        assert remote.returncode == 0, remote.stderr
        assert remote.stdout == block(ASK, r1) + block(ANSWER, r2)

        remote = phalanx_chat(live.url, "--api-key", "chat-key", *OPTIONS, stdin="\n".join(script) + "\n")
        assert remote.returncode == 0, remote.stderr
        assert remote.stdout == expected

        refused = phalanx_chat(live.url, "--api-key", "wrong", stdin="hello\n")
        assert refused.returncode == 2 and "needs an API key" in refused.stderr
        unknown = phalanx_chat(live.url, "--api-key", "chat-key", "--model", "nope", stdin="hello\n")
        assert unknown.returncode == 2 and "model 'nope' not found" in unknown.stderr, unknown.stderr
        assert unknown.stdout == ""  # refused before the first turn


@pytest.mark.slow
def test_ctrl_c_ends_a_piped_chat(served_run):
    """Piped in, there is no one to go on chatting with: Ctrl-C (SIGINT) ends the chat as it ends any
    command, with one line and exit 130, rather than going on to the next line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "chat", str(served_run), "--seed", "7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        proc.stdin.write(f"{ASK}\n{ANSWER}\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == f">>> {ASK}\n"  # the turn has begun
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and len(stderr.strip().splitlines()) == 1 and "interrupted" in stderr, stderr
    assert f">>> {ANSWER}" not in stdout


def test_a_conversation_that_outgrows_the_context_leaves_out_its_oldest_exchanges(served_run):
    """With a 48-token context, each message and its reply fit but two exchanges do not: as Ollama does,
    the oldest exchanges are left out (said once, on stderr) rather than the new message refused."""
    line = "Who is there? Nay, answer me."
    script = "\n".join(["/set parameter num_ctx 48", line, line, line, "/bye"]) + "\n"
    with InProcessServer(served_run, slots=1, max_queue=4, api_key="chat-key") as live:
        for target in (str(served_run), live.url):
            chat = phalanx_chat(target, "--api-key", "chat-key", *OPTIONS, stdin=script)
            assert chat.returncode == 0, chat.stderr
            assert chat.stdout.count(f">>> {line}\n") == 3 and "error" not in chat.stderr, chat.stderr
            assert chat.stderr.count("left out its oldest 1 exchange") == 1, chat.stderr
