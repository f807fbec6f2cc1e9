"""`phalanx chat` with piped stdin, on a local run directory and against a running server: replies
stream out, the history carries over, /clear forgets it, /bye (or end of input) ends the chat."""

from __future__ import annotations

import os
import subprocess
import sys

from serve_helpers import InProcessServer

# Seeded sampling: a 4-step model's greedy replies are all newlines, which would hide a lost history.
OPTIONS = ["--temperature", "0.8", "--seed", "7", "--num-predict", "8"]
LINES = ["Who is there?", "Nay, answer me.", "/clear", "Who is there?", "/bye", "never read"]


def phalanx_chat(*args: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_chat_locally_and_against_a_server(served_run):
    # One slot, like the local chat's own engine: same shapes, same bits, same greedy replies.
    with InProcessServer(served_run, slots=1, max_queue=4, api_key="chat-key") as live, live.client() as http:
        def reply(messages):
            body = {"model": live.model, "messages": messages, "stream": False,
                    "options": {"temperature": 0.8, "seed": 7, "num_predict": 8}}
            return http.post("/api/chat", json=body).json()["message"]["content"]

        first = [{"role": "user", "content": LINES[0]}]
        r1 = reply(first)
        r2 = reply(first + [{"role": "assistant", "content": r1}, {"role": "user", "content": LINES[1]}])
        assert r2 != reply([{"role": "user", "content": LINES[1]}])  # the history changes the reply
        expected = f"{r1}\n{r2}\n{r1}\n"

        local = phalanx_chat(str(served_run), *OPTIONS, stdin="\n".join(LINES) + "\n")
        assert local.returncode == 0, local.stderr
        assert local.stdout == expected

        remote = phalanx_chat(live.url, "--api-key", "chat-key", *OPTIONS, stdin="\n".join(LINES[:2]))  # EOF ends it
        assert remote.returncode == 0, remote.stderr
        assert remote.stdout == f"{r1}\n{r2}\n"

        refused = phalanx_chat(live.url, "--api-key", "wrong", stdin="hello\n")
        assert refused.returncode == 2 and "needs an API key" in refused.stderr
