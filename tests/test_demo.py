"""The quick start: `phalanx train` with no arguments, then text from the model; `phalanx train chat-demo`
fine-tunes that model to reply, then `phalanx chat runs/chat-demo` talks with it."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import phalanx

SPEECHES = ["Good morrow, sir. What news from the court?", "Who art thou, that comest so late?", "I love thee, Juliet."]


@pytest.mark.slow
def test_demo_learns_shakespeare_then_to_reply(tmp_path):
    summary = json.loads(phalanx("train", "--json", cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert summary["run_dir"] == str(tmp_path / "runs" / "demo") and summary["steps"] == 250
    assert summary["val_loss_final"] <= 0.65 * summary["val_loss_start"]  # at least 35% below
    text = phalanx("generate", "runs/demo", "ROMEO:", "--max-new-tokens", "200", "--seed", "0", cwd=tmp_path).stdout
    speakers = re.findall(r"^[A-Z][A-Za-z' ]+:$", text, flags=re.MULTILINE)
    assert len(speakers) >= 3, text  # it writes a play: speaker lines followed by speeches

    chat = json.loads(phalanx("train", "chat-demo", "--json", cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert chat["run_dir"] == str(tmp_path / "runs" / "chat-demo") and chat["steps"] == 200
    assert chat["val_loss_final"] <= 0.9 * chat["val_loss_start"]  # the replies' loss, at least 10% below
    events = [json.loads(line) for line in (tmp_path / "runs" / "chat-demo" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "sample_reply"][-3:] == [200, 200, 200]

    piped = "\n".join([*SPEECHES, "/bye"]) + "\n"
    result = phalanx_chat(tmp_path, piped)
    replies = re.findall(r"^>>> .*\n((?:.+\n)+)\n", result.stdout, flags=re.MULTILINE)
    counts = [int(n) for n in re.findall(r"^(\d+) tokens in", result.stderr, flags=re.MULTILINE)]
    assert len(replies) == len(counts) == len(SPEECHES), result.stdout + result.stderr
    for reply, count in zip(replies, counts):
        # A reply, not a play: the model stops at the end of its turn (EOS, long before the 100-token
        # limit) rather than writing the next speaker's line.
        assert count < 100 and re.search(r"[A-Za-z]{2,}", reply), result.stdout
        assert not re.search(r"^(USER|ASSISTANT|SYSTEM):", reply, flags=re.MULTILINE), result.stdout


def phalanx_chat(cwd, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "chat", "runs/chat-demo", "--seed", "0", "--verbose", "--num-predict", "100"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        check=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
