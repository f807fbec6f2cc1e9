"""Bad requests get the right status and a clear message in the right API's shape, and the server keeps
serving: malformed JSON, wrong types, unknown fields, oversized bodies, API keys, unknown models, prompts
beyond the context, a full queue. And `phalanx serve` refuses to listen beyond loopback without a key."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
from serve_helpers import MODEL, InProcessServer

from tests.helpers import phalanx

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 3}}
OAI_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def ollama_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return body["error"]


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client
    # Whatever was thrown at it, the server still answers.
    with server.client() as client:
        assert client.post("/api/chat", json={**CHAT, "stream": False}).status_code == 200


def test_malformed_json(http):
    assert "not valid JSON" in ollama_error(http.post("/api/chat", content=b'{"model": '), 400)
    assert "not valid JSON" in openai_error(http.post("/v1/chat/completions", content=b"{nope"), 400)["message"]
    assert "JSON object" in ollama_error(http.post("/api/generate", content=b"[1, 2]"), 400)
    assert "empty" in ollama_error(http.post("/api/generate", content=b""), 400)
    assert "NaN" in ollama_error(http.post("/api/chat", content=b'{"model": "x", "options": {"seed": NaN}}'), 400)


def test_wrong_types(http):
    message = ollama_error(http.post("/api/chat", json={**CHAT, "messages": "Hi"}), 400)
    assert message.startswith("invalid 'messages'")
    message = ollama_error(
        http.post("/api/generate", json={"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}}), 400
    )
    assert message == "invalid 'options.temperature': Input should be a valid number"
    error = openai_error(http.post("/v1/chat/completions", json={**OAI_CHAT, "max_tokens": "3"}), 400)
    assert error["param"] == "max_tokens" and "valid integer" in error["message"]
    error = openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": 5}), 400)
    assert error["message"].startswith("invalid 'prompt'")
    assert "role" in ollama_error(http.post("/api/chat", json={**CHAT, "messages": [{"role": "wizard"}]}), 400)
    message = ollama_error(http.post("/api/chat", json={**CHAT, "options": {"top_p": 7}}), 400)
    assert message == "top_p must be between 0 and 1"


def test_unknown_and_unsupported_fields(http):
    assert ollama_error(http.post("/api/chat", json={**CHAT, "temprature": 0}), 400) == "unknown field 'temprature'"
    # mirostat and the other options Ollama ignores are accepted (test_serve_api_rest.py); unknown ones are not.
    message = ollama_error(http.post("/api/chat", json={**CHAT, "options": {"mirostat_v9": 2}}), 400)
    assert message == "unknown field 'options.mirostat_v9'"
    error = openai_error(http.post("/v1/chat/completions", json={**OAI_CHAT, "bogus": True}), 400)
    assert error["message"] == "unknown field 'bogus'" and error["param"] == "bogus"
    message = ollama_error(http.post("/api/generate", json={"model": MODEL, "prompt": "x", "images": ["aGk="]}), 400)
    assert message == "'images' is not supported by phalanx serve"
    error = openai_error(http.post("/v1/chat/completions", json={**OAI_CHAT, "logit_bias": {"5": 1}}), 400)
    assert error["message"] == "'logit_bias' is not supported by phalanx serve"


def test_oversized_bodies(http):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    assert "larger than the limit" in ollama_error(http.post("/api/chat", json=big), 413)
    assert openai_error(http.post("/v1/chat/completions", json=big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny-test", "prompt": "'
        for _ in range(40):
            yield b"y" * 32768
        yield b'"}'

    assert "larger than the limit" in ollama_error(http.post("/api/generate", content=chunks()), 413)


def test_api_key(server):
    with httpx.Client(base_url=server.url) as anonymous:
        assert anonymous.get("/health").status_code == 200  # health checks need no key
        assert ollama_error(anonymous.post("/api/chat", json=CHAT), 401).startswith("missing API key")
        error = openai_error(anonymous.get("/v1/models"), 401)
        assert error["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer not-the-key"}
        assert ollama_error(anonymous.get("/api/tags", headers=wrong), 401).startswith("wrong API key")
        assert openai_error(anonymous.post("/v1/completions", json={}, headers=wrong), 401)["code"] == "invalid_api_key"
        assert anonymous.get("/metrics", headers=wrong).status_code == 401


def test_unknown_model_and_endpoint(http):
    assert ollama_error(http.post("/api/chat", json={**CHAT, "model": "llama9"}), 404) == "model 'llama9' not found"
    assert ollama_error(http.post("/api/show", json={"model": "llama9"}), 404) == "model 'llama9' not found"
    error = openai_error(http.post("/v1/chat/completions", json={**OAI_CHAT, "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    assert http.post("/api/chat", json={**CHAT, "model": f"{MODEL}:latest", "stream": False}).status_code == 200
    assert "no such endpoint" in ollama_error(http.get("/api/nothing"), 404)
    assert "not allowed" in ollama_error(http.get("/api/chat"), 405)


def test_prompt_beyond_the_context_is_refused_not_truncated(http):
    long = "wherefore art thou Romeo " * 800
    message = ollama_error(http.post("/api/generate", json={"model": MODEL, "prompt": long, "raw": True}), 400)
    assert "context holds 1024" in message and "shorten" in message
    error = openai_error(
        http.post("/v1/chat/completions", json={**OAI_CHAT, "messages": [{"role": "user", "content": long}]}), 400
    )
    assert error["code"] == "context_length_exceeded"


def test_generation_is_capped_at_the_context(http, served_run):
    from phalanx.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(served_run / "tokenizer.json")
    words = "But soft what light through yonder window breaks "
    per_copy = len(tokenizer.encode(words).ids)
    prompt = words * (1000 // per_copy)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "raw": True,
        "stream": False,
        "options": {"temperature": 0, "num_predict": 500},
    }
    done = http.post("/api/generate", json=body).json()
    assert done["prompt_eval_count"] > 900
    assert done["done_reason"] == "length" and done["eval_count"] == 1024 - done["prompt_eval_count"]


def test_full_queue_answers_503_and_serving_goes_on(served_run):
    """One slot, no waiting room: a second request while the first runs is refused at once."""
    with InProcessServer(served_run, slots=1, max_queue=0) as live, live.client() as http:
        body = {"model": MODEL, "prompt": "ROMEO:", "raw": True, "options": {"temperature": 0, "num_predict": 1000}}
        with http.stream("POST", "/api/generate", json=body) as running:
            lines = running.iter_lines()
            assert json.loads(next(lines))["done"] is False  # it holds the only slot now
            assert ollama_error(http.post("/api/chat", json=CHAT), 503).startswith("the server is busy")
            error = openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503)
            assert error["type"] == "server_error" and error["code"] == "server_busy"
            assert json.loads(next(lines))["done"] is False  # the first request was running all along
        # Leaving the stream early cancels that request and frees its slot.
        wait_idle(http)
        reply = http.post("/api/chat", json={**CHAT, "stream": False})
        assert reply.status_code == 200 and reply.json()["done"] is True
        # So does a client that gives up waiting for a reply that is not streamed: it stops well before
        # the ~1000 tokens it asked for.
        before = generated_tokens(http)
        with pytest.raises(httpx.ReadTimeout):
            http.post("/api/generate", json={**body, "stream": False}, timeout=0.3)
        wait_idle(http)
        assert 0 < generated_tokens(http) - before < 900
        assert http.post("/api/chat", json={**CHAT, "stream": False}).status_code == 200
        metrics = http.get("/metrics").text
        assert 'phalanx_serve_requests_total{endpoint="/api/chat",status="503"} 1.0' in metrics


def generated_tokens(http: httpx.Client) -> float:
    found = re.search(r"^phalanx_serve_generated_tokens_total (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(found.group(1))


def wait_idle(http: httpx.Client) -> None:
    for _ in range(200):
        if http.get("/health").json()["active"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the cancelled request still holds its slot")


def test_serve_refuses_open_hosts_without_a_key_and_taken_ports(served_run):
    proc = phalanx("serve", str(served_run), "--host", "0.0.0.0", check=False, timeout=120)
    assert proc.returncode == 2 and "without an API key" in proc.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = phalanx("serve", str(served_run), "--port", str(taken.getsockname()[1]), check=False, timeout=120)
    assert proc.returncode == 2 and "cannot listen on 127.0.0.1" in proc.stderr
