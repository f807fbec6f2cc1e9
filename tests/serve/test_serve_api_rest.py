"""The small rest of the APIs (issue 14 item 12, the parts not in the engine): HEAD on every GET route,
405 with `Allow`, Ollama options accepted and ignored as Ollama ignores them, `raw` with `system` as
Ollama treats it, and `keep_alive` honoured (weights out after the idle time or at once with 0, back on
the next request). Over loopback with the official `ollama` and `openai` clients and raw httpx, against
the real app in a thread of this process (its own server: unloading must not disturb the shared one)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import httpx
import ollama
import openai
import pytest
from serve_helpers import MODEL, InProcessServer

from phalanx.serve.http.common import ApiError
from phalanx.serve.http.keep_alive import parse_keep_alive

GREEDY = {"temperature": 0, "num_predict": 12, "presence_penalty": 1.0, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def live(served_run):
    server = InProcessServer(served_run, slots=2, max_queue=4)
    with server as live:
        live.inner = server  # the served model and the app, to look inside
        yield live


@pytest.fixture(scope="module")
def http(live):
    with live.client() as client:
        yield client


@pytest.fixture(scope="module")
def oll(live) -> ollama.Client:
    return ollama.Client(host=live.url)


def weights_in(live) -> bool:
    return live.inner.served.loaded.model.tok_embeddings.weight.numel() > 0


def generate(oll: ollama.Client, **extra):
    return oll.generate(model=MODEL, prompt="ROMEO:", raw=True, options=GREEDY, **extra)


# ---- HEAD and 405 ----


@pytest.mark.slow
def test_head_on_every_get_route(live, http):
    paths = sorted(
        {
            route.path.replace("{model_id:path}", MODEL)
            for route in all_routes(live.inner.uvicorn.config.app)
            if "GET" in getattr(route, "methods", ())
        }
    )
    assert {"/api/tags", "/api/ps", "/api/version", "/v1/models", f"/v1/models/{MODEL}", "/health"} <= set(paths)
    for path in paths:
        got, head = http.get(path), http.head(path)
        assert head.status_code == got.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"], path
        if path not in ("/metrics", "/api/ps"):  # the others' bodies do not change between the two calls
            assert head.headers["content-length"] == str(len(got.content)), path
    assert http.head("/nowhere").status_code == 404


def all_routes(app) -> list:
    # FastAPI keeps an included router as one entry holding the router's own routes.
    found, stack = [], list(app.routes)
    while stack:
        route = stack.pop()
        inner = getattr(route, "original_router", None)
        stack.extend(inner.routes) if inner is not None else found.append(route)
    return found


def test_wrong_method_is_405_with_allow(http):
    for method, path, allow in [
        ("POST", "/api/tags", "GET, HEAD"),
        ("GET", "/api/chat", "POST"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("PUT", "/api/embed", "POST"),
    ]:
        response = http.request(method, path)
        assert response.status_code == 405 and response.headers["allow"] == allow, (method, path)
    head = http.head("/api/generate")  # HEAD runs as GET inside; the client is told what it sent
    assert head.status_code == 405 and head.headers["allow"] == "POST"
    message = http.put("/api/generate").json()["error"]
    assert message == "method PUT is not allowed on /api/generate"
    openai_shape = http.get("/v1/chat/completions").json()["error"]
    assert openai_shape["message"] == "method GET is not allowed on /v1/chat/completions"


# ---- options Ollama ignores, raw with system ----


def test_options_ollama_ignores_are_accepted_and_ignored(oll, http):
    plain = generate(oll)
    ignored = {
        "mirostat": 2,
        "mirostat_eta": 0.2,
        "mirostat_tau": 4.0,
        "num_keep": 5,
        "typical_p": 0.7,
        "num_thread": 1,
        "num_gpu": 0,
        "main_gpu": 0,
        "use_mmap": False,
        "numa": False,
        "low_vram": True,
        "num_batch": 64,
        "tfs_z": 1.0,
        "use_mlock": False,
        "penalize_newline": True,
    }
    same = oll.generate(model=MODEL, prompt="ROMEO:", raw=True, options={**GREEDY, **ignored})
    assert same.response == plain.response and same.eval_count == plain.eval_count
    # Still typed as Ollama types them, and a name Ollama does not know is still an error.
    wrong = http.post("/api/generate", json={"model": MODEL, "prompt": "x", "options": {"mirostat": "on"}})
    assert wrong.status_code == 400 and "options.mirostat" in wrong.json()["error"]
    typo = http.post("/api/generate", json={"model": MODEL, "prompt": "x", "options": {"temprature": 0}})
    assert typo.status_code == 400 and typo.json()["error"] == "unknown field 'options.temprature'"


def test_raw_with_system_as_ollama_treats_it(oll, http):
    refused = http.post("/api/generate", json={"model": MODEL, "prompt": "ROMEO:", "raw": True, "system": "Be kind."})
    assert refused.status_code == 400
    assert refused.json()["error"] == "raw mode does not support template, system, or context"
    # raw with an empty system is raw; a system prompt alone (no prompt) only loads, as in Ollama.
    assert generate(oll, system="").response == generate(oll).response
    only_system = oll.generate(model=MODEL, prompt="", system="Be kind.")
    assert only_system.done_reason == "load" and only_system.response == ""


# ---- keep_alive ----


def test_keep_alive_values_as_ollama_reads_them():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("300ms") == pytest.approx(0.3) and parse_keep_alive("1.5s") == 1.5
    assert parse_keep_alive(10) == 10 and parse_keep_alive("10") == 10 and parse_keep_alive(0) == 0
    assert parse_keep_alive("0s") == 0 and parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    for bad in ("soon", "5 minutes", "m", "", "1x", True):
        with pytest.raises(ApiError):
            parse_keep_alive(bad)


def test_keep_alive_zero_unloads_and_the_next_request_loads(live, oll, http):
    before = generate(oll)
    assert before.load_duration == 0 and weights_in(live)
    unloaded = http.post("/api/generate", json={"model": MODEL, "keep_alive": 0}).json()
    assert unloaded["done_reason"] == "unload" and unloaded["done"] is True and unloaded["response"] == ""
    assert not weights_in(live) and http.get("/api/ps").json() == {"models": []}
    assert http.get("/api/tags").json()["models"][0]["size"] > 0  # still the model the server serves

    again = generate(oll)  # loads the same checkpoint again: the same greedy reply
    assert again.response == before.response and again.load_duration > 0 and weights_in(live)
    (entry,) = http.get("/api/ps").json()["models"]
    assert entry["expires_at"].startswith("2318")  # the default keeps it forever

    # keep_alive 0 with a prompt: the reply as ever, the weights out right after it.
    last = generate(oll, keep_alive=0)
    assert last.response == before.response and last.done_reason in ("stop", "length")
    wait_until(lambda: not weights_in(live), 20)

    # Chat's way: no messages loads; no messages with keep_alive 0 unloads.
    loaded = http.post("/api/chat", json={"model": MODEL, "messages": []}).json()
    assert loaded["done_reason"] == "load" and weights_in(live)
    out = http.post("/api/chat", json={"model": MODEL, "messages": [], "keep_alive": "0s"}).json()
    assert out["done_reason"] == "unload" and out["message"] == {"role": "assistant", "content": ""}
    assert not weights_in(live)

    # OpenAI requests and embeddings load it too.
    oai = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    reply = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4, temperature=0)
    assert reply.choices[0].text is not None and weights_in(live)
    http.post("/api/generate", json={"model": MODEL, "keep_alive": 0})
    embedded = http.post("/api/embed", json={"model": MODEL, "input": "KING:"}).json()
    assert embedded["load_duration"] > 0 and len(embedded["embeddings"][0]) == 64

    bad = http.post("/api/generate", json={"model": MODEL, "prompt": "x", "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_keep_alive_unloads_after_the_idle_time(live, oll, http):
    generate(oll, keep_alive="1s")
    done = time.monotonic()
    (entry,) = http.get("/api/ps").json()["models"]
    expires = datetime.fromisoformat(entry["expires_at"].replace("Z", "+00:00"))
    assert 0 <= (expires - datetime.now(UTC)).total_seconds() <= 1.5
    time.sleep(0.3)
    assert weights_in(live)  # not before the idle time has passed
    wait_until(lambda: not weights_in(live), 20)
    assert time.monotonic() - done >= 0.9
    assert generate(oll).load_duration > 0  # and back, now kept (the default) ...
    time.sleep(1.5)
    assert weights_in(live)  # ... past the earlier request's second


def test_a_checkpoint_gone_while_unloaded_is_a_503_then_loads_again(live, oll, http):
    checkpoint = live.inner.served.loaded.checkpoint
    aside = checkpoint.with_name(checkpoint.name + "-aside")
    assert http.post("/api/generate", json={"model": MODEL, "keep_alive": 0}).json()["done_reason"] == "unload"
    checkpoint.rename(aside)
    try:
        gone = http.post("/api/generate", json={"model": MODEL, "prompt": "x", "stream": False})
        assert gone.status_code == 503 and "could not be loaded again" in gone.json()["error"]
        assert gone.headers["retry-after"] == "1" and not weights_in(live)
    finally:
        aside.rename(checkpoint)
    assert generate(oll).load_duration > 0 and weights_in(live)


def wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_unknown_model_still_404_for_load_requests(http):
    assert http.post("/api/chat", json={"model": "nobody", "messages": []}).status_code == 404


def test_head_needs_the_key_as_get_does(server):
    """On the shared keyed `phalanx serve`: HEAD passes the same checks as GET (key, Host)."""
    assert httpx.head(f"{server.url}/api/tags").status_code == 401
    assert httpx.head(f"{server.url}/health").status_code == 200  # open, as its GET is
    keyed = httpx.head(f"{server.url}/api/tags", headers=server.headers)
    assert keyed.status_code == 200 and keyed.content == b""
    foreign = httpx.head(f"{server.url}/api/tags", headers={**server.headers, "Host": "attacker.example"})
    assert foreign.status_code == 403
