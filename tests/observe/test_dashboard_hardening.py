"""The dashboard against an attacker (issue 14): secrets never shown or stored, no answers to foreign
Hosts or Origins (DNS rebinding, cross-site requests, in a real Chromium too), no slow-body hold, a
logout that really ends a session, rate-limited wrong tokens, and /metrics whose series a client cannot
grow. Over real loopback HTTP on a real SQLite store, and the real `phalanx runs` CLI."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.observe.app import create_app, running
from phalanx.observe.auth import COOKIE
from phalanx.observe.prom import TelemetryCollector, TrainingCollector
from phalanx.observe.redaction import redact, redact_url
from phalanx.observe.store import RunStore
from tests.helpers import phalanx

TOKEN = "hardening-token-0123456789"
PASSWORD = "S3cretPassw0rd"
CONFIG = {
    "run": {"name": "leaky"},
    "observe": {"store": f"postgresql://phalanx:{PASSWORD}@db-host:5432/phalanx"},
    "train": {"max_steps": 10, "lr": 3e-4},
    "data": {"tokenizer": "tok.json", "max_tokens": 3},
    "hub": {"hf_token": "hf_abcdefghijklmnop", "apiKey": "sk-abcdef", "webhook": "https://x.example/?token=t0k3n"},
}
SECRETS = (PASSWORD, "hf_abcdefghijklmnop", "sk-abcdef", "t0k3n")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dash-hardening")
    store = RunStore.open(None, root)
    run_id = store.start_run("leaky", root / "leaky", CONFIG, "tiny", 1, 10, "node-a")
    store.ingest(
        run_id, [{"step": 1, "loss": 5.0, "time": time.time(), "tokens_seen": 256, "tokens_per_sec": 9.0}], [], [], {}
    )
    # A row as an older phalanx stored it, secrets and all: redacted on the way out too.
    old = store.start_run("older", root / "older", {}, "tiny", 1, 10, "node-a")
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE runs SET config = :c WHERE id = :i"), {"c": json.dumps(CONFIG), "i": old})
    store.close()
    return root


@pytest.fixture(scope="module")
def store(root):
    store = RunStore.open(None, root, create=False)
    yield store
    store.close()


@pytest.fixture(scope="module")
def url(store):
    with running(create_app(store)) as url:
        yield url


def leaked(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


# ---- 6. secrets ----------------------------------------------------------------------------------------


def test_one_redaction_rule_for_urls_and_secret_names():
    assert redact_url(f"postgresql://phalanx:{PASSWORD}@db/x") == "postgresql://phalanx:***@db/x"
    assert redact_url("postgresql://u:p@ss@db/x") == "postgresql://u:***@db/x"  # an @ in the password
    assert (
        redact_url("postgresql://phalanx@db/x?sslpassword=abc&sslmode=require")
        == "postgresql://phalanx@db/x?sslpassword=***&sslmode=require"
    )
    assert redact_url("sqlite:////runs/phalanx.db") == "sqlite:////runs/phalanx.db"
    shown = redact(CONFIG)
    assert shown["observe"]["store"] == "postgresql://phalanx:***@db-host:5432/phalanx"
    assert shown["hub"] == {"hf_token": "***", "apiKey": "***", "webhook": "https://x.example/?token=***"}
    assert shown["data"] == CONFIG["data"] and shown["train"] == CONFIG["train"]  # tokenizer, max_tokens: kept


def test_the_store_never_holds_the_secrets(root, store):
    raw = sqlite_config(root, "leaky")
    assert leaked(raw) == [] and "phalanx:***@db-host" in raw


def sqlite_config(root: Path, name: str) -> str:
    engine = sa.create_engine(f"sqlite:///{root / 'phalanx.db'}")
    with engine.connect() as conn:
        text = conn.execute(sa.text("SELECT config FROM runs WHERE name = :n"), {"n": name}).scalar()
    engine.dispose()
    return text


@pytest.mark.parametrize("name", ["leaky", "older"])
def test_the_dashboard_shows_no_secret(url, store, name):
    run_id = store.find_run(name)["id"]
    api = httpx.get(f"{url}/api/runs/{run_id}")
    assert api.status_code == 200 and leaked(api.text) == []
    assert "phalanx:***@db-host" in api.text
    page = httpx.get(f"{url}/runs/{run_id}")
    assert page.status_code == 200 and leaked(page.text) == []
    assert leaked(httpx.get(f"{url}/api/runs").text) == []


@pytest.mark.parametrize("name", ["leaky", "older"])
def test_runs_show_and_compare_show_no_secret(root, name):
    shown = phalanx("runs", "show", name, "--runs", str(root), "--json")
    assert leaked(shown.stdout) == [] and "***" in shown.stdout
    compared = phalanx("runs", "compare", "leaky", "older", "--runs", str(root), "--json")
    assert leaked(compared.stdout) == []


# ---- 5. foreign Hosts and Origins, JSON bodies, slow bodies ---------------------------------------------


def test_foreign_host_names_are_refused(url):
    port = url.rsplit(":", 1)[1]
    for path in ("/", "/api/runs", "/metrics", "/login"):
        response = httpx.get(url + path, headers={"Host": f"attacker.example:{port}"})
        assert response.status_code == 403 and "attacker.example" in response.json()["error"], path
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert httpx.get(f"{url}/api/runs", headers={"Host": host}).status_code == 200


def test_configured_host_names_are_answered(store):
    with running(create_app(store, allowed_hosts=("dash.example",))) as url:
        assert httpx.get(f"{url}/api/runs", headers={"Host": "dash.example"}).status_code == 200
        assert httpx.get(f"{url}/api/runs", headers={"Host": "dash.example.evil"}).status_code == 403
        assert httpx.get(f"{url}/api/runs", headers={"Origin": "https://dash.example"}).status_code == 200


def test_foreign_origins_are_refused_without_cors_grants(url, store):
    run_id = store.find_run("leaky")["id"]
    for origin in ("https://attacker.example", "null", "http://localhost:1"):
        response = httpx.get(f"{url}/api/runs", headers={"Origin": origin})
        assert response.status_code == 403 and "cross-origin" in response.json()["error"]
        assert not any(h.startswith("access-control-") for h in response.headers)
        edit = httpx.patch(f"{url}/api/runs/{run_id}", json={"note": "pwned"}, headers={"Origin": origin})
        assert edit.status_code == 403
    assert httpx.get(f"{url}/api/runs", headers={"Origin": url}).status_code == 200  # its own pages
    # A browser's own-form post under a strict referrer policy: Origin "null", but Sec-Fetch-Site says so.
    own_form = {"Origin": "null", "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(f"{url}/login", data={"token": "x"}, headers=own_form).status_code == 303
    cross = {"Origin": "null", "Sec-Fetch-Site": "cross-site"}
    assert httpx.post(f"{url}/login", data={"token": "x"}, headers=cross).status_code == 403


def test_api_bodies_must_be_json(url, store):
    run_id = store.find_run("leaky")["id"]
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = httpx.patch(
            f"{url}/api/runs/{run_id}", content=json.dumps({"note": "x"}), headers={"Content-Type": kind}
        )
        assert response.status_code == 415 and "application/json" in response.json()["error"], kind


def chunked(total: int, piece: int = 1 << 16):
    """A body of `total` bytes sent chunked: no Content-Length to refuse it by."""
    for _ in range(total // piece):
        yield b"a" * piece


def test_large_bodies_are_refused_before_they_are_read(store):
    """POST /login needs no session: a body over its limit is 413 at once, never read in full (a 400 MiB
    one was, and left the process 400 MB larger). The same for PATCH over its 16 KiB."""
    run_id = store.find_run("leaky")["id"]
    with running(create_app(store, token=TOKEN)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # declares 400 MiB, sends none
            sock.sendall(
                f"POST /login HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                f"application/x-www-form-urlencoded\r\nContent-Length: {400 << 20}\r\n\r\n".encode()
            )
            assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")
        login = httpx.post(
            f"{url}/login", content=chunked(256 << 10), headers={"Content-Type": "application/x-www-form-urlencoded"}
        )
        assert login.status_code == 413
        edit = httpx.patch(
            f"{url}/api/runs/{run_id}",
            content=chunked(256 << 10),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        assert edit.status_code == 413 and "at most 16384" in edit.json()["error"]
        deep = httpx.patch(
            f"{url}/api/runs/{run_id}",
            content=b"[" * 5000 + b"]" * 5000,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        assert deep.status_code == 400 and "not JSON" in deep.json()["error"]
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_body_shorter_than_its_content_length_is_408_and_the_connection_closed(store):
    with running(create_app(store, token=TOKEN, body_timeout=1.0)) as url:
        port = int(url.rsplit(":", 1)[1])
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                f"POST /login HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                f"application/x-www-form-urlencoded\r\nContent-Length: 500\r\n\r\ntoken=abc".encode()
            )
            reply = b""
            try:
                while chunk := sock.recv(65536):
                    reply += chunk
            except TimeoutError:
                raise AssertionError(f"the connection was still held after 10 s: {reply!r}") from None
        assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in reply, reply
        assert time.monotonic() - started < 5


def test_a_rebound_page_in_a_real_browser_reads_nothing(store, tmp_path):
    """Chromium resolves attacker.example to 127.0.0.1 (DNS rebinding): the page it loads from there, and
    a page on another local origin fetching the dashboard, both get nothing."""
    if not Path("/usr/bin/chromium").is_file():
        pytest.skip("no Chromium at /usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    attacker = ThreadingHTTPServer(("127.0.0.1", 0), AttackerPage)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        with running(create_app(store)) as url, sync_api.sync_playwright() as playwright:
            port = url.rsplit(":", 1)[1]
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--host-resolver-rules=MAP attacker.example 127.0.0.1",
                ],
            )
            page = browser.new_page()
            rebound = page.goto(f"http://attacker.example:{port}/api/runs")
            assert rebound.status == 403 and "leaky" not in page.content()
            page.goto(f"http://127.0.0.1:{attacker.server_address[1]}/")
            result = page.evaluate(f"""async () => {{
                const out = {{}};
                try {{ const r = await fetch("http://localhost:{port}/api/runs"); out.read = await r.text(); }}
                catch (e) {{ out.read = "blocked"; }}
                try {{ await fetch("http://localhost:{port}/login", {{method: "POST", mode: "no-cors",
                        headers: {{"Content-Type": "text/plain"}}, body: "token=guess"}}); }}
                catch (e) {{}}
                return out;
            }}""")
            browser.close()
            assert result["read"] == "blocked"
            refused = [
                s
                for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                if f.name == "phalanx_dashboard_requests"
                for s in f.samples
                if s.name.endswith("_total") and s.labels["status"] == "403"
            ]
            assert sum(s.value for s in refused) >= 3  # the rebound page, the fetch, the blind POST
    finally:
        attacker.shutdown()


class AttackerPage(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<!doctype html><title>innocent</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


# ---- 7. sessions, logout, rate limits ------------------------------------------------------------------


def test_logout_ends_the_session_even_for_a_copied_cookie(store):
    with running(create_app(store, token=TOKEN)) as url:
        with httpx.Client(base_url=url) as browser:
            assert browser.post("/login", data={"token": TOKEN, "next": "/"}).status_code == 303
            copied = browser.cookies[COOKIE]
            assert TOKEN not in copied and browser.get("/api/runs").status_code == 200
            page = browser.get("/")
            assert 'action="/logout"' in page.text  # the button is on every page
            out = browser.post("/logout")
            assert out.status_code == 303 and out.headers["location"] == "/login"
            assert COOKIE not in browser.cookies  # the browser is told to drop it
        stolen = httpx.get(f"{url}/api/runs", cookies={COOKIE: copied})
        assert stolen.status_code == 401
        assert (
            "Max-Age=0" in stolen.headers.get("set-cookie", "")
            or "expires" in stolen.headers.get("set-cookie", "").lower()
        )  # a stale cookie is cleared
        with httpx.Client(base_url=url) as again:  # a new login opens a new session
            again.post("/login", data={"token": TOKEN, "next": "/"})
            assert again.cookies[COOKIE] != copied and again.get("/api/runs").status_code == 200


def test_sessions_are_per_app_and_not_derived_from_the_token(store):
    with running(create_app(store, token=TOKEN)) as first, running(create_app(store, token=TOKEN)) as second:
        with httpx.Client(base_url=first) as browser:
            browser.post("/login", data={"token": TOKEN, "next": "/"})
            cookie = browser.cookies[COOKIE]
        assert httpx.get(f"{second}/api/runs", cookies={COOKIE: cookie}).status_code == 401


def test_wrong_tokens_are_rate_limited(store):
    with running(create_app(store, token=TOKEN)) as url:
        wrong = {"Authorization": "Bearer wrong-token-wrong-token"}
        # A new X-Forwarded-For on every try is still the same client (no proxy is trusted by default).
        assert [
            httpx.get(f"{url}/api/runs", headers={**wrong, "X-Forwarded-For": f"198.51.100.{i}"}).status_code
            for i in range(10)
        ] == [401] * 10
        limited = httpx.get(f"{url}/api/runs", headers={**wrong, "X-Forwarded-For": "198.51.100.99"})
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert httpx.get(f"{url}/api/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 429
        assert httpx.post(f"{url}/login", data={"token": TOKEN}).status_code == 429
        assert httpx.get(f"{url}/health").status_code == 200
    with running(create_app(store, token=TOKEN)) as url:  # the login form counts too
        statuses = [httpx.post(f"{url}/login", data={"token": "nope-nope-nope-nope"}).status_code for _ in range(11)]
        assert statuses == [401] * 10 + [429]


def test_the_bearer_scheme_is_read_in_any_case(store):
    with running(create_app(store, token=TOKEN)) as url:
        for header in (f"bearer {TOKEN}", f"BEARER   {TOKEN}"):
            assert httpx.get(f"{url}/api/runs", headers={"Authorization": header}).status_code == 200


def test_dashboard_and_serve_take_the_same_minimum(root):
    proc = phalanx("dashboard", "--runs", str(root), "--token", "fifteen-chars!!", check=False, timeout=60)
    assert proc.returncode == 2 and "at least 16 characters" in proc.stderr


# ---- 8. metrics ----------------------------------------------------------------------------------------


def test_the_method_label_is_bounded_and_there_are_no_created_series(url):
    for method in ("FOOBAR", "PROPFIND", "X" * 40):
        httpx.request(method, f"{url}/api/runs")
    text = httpx.get(f"{url}/metrics").text
    methods = {
        s.labels["method"]
        for f in text_string_to_metric_families(text)
        if f.name == "phalanx_dashboard_requests"
        for s in f.samples
    }
    assert "other" in methods and methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}
    assert "_created" not in text
    # Each run's throughput: a counter of its tokens, not its last tokens-per-second.
    assert 'phalanx_run_tokens_total{id="1",run="leaky"} 256.0' in text
    assert "phalanx_run_tokens_per_second" not in text


def test_ecc_errors_are_a_counter_and_training_throughput_is_a_token_counter():
    registry = CollectorRegistry()
    registry.register(
        TelemetryCollector(
            lambda: {"node": "n", "host": {}, "devices": [{"device": 0, "ecc_uncorrectable": 3, "temperature_c": 50}]}
        )
    )
    registry.register(
        TrainingCollector(
            lambda: {
                "run": "r",
                "last": {
                    "step": 5,
                    "tokens_seen": 1280,
                    "tokens_per_sec": 99.0,
                    "moe_imbalance": 1.75,
                    "moe_imbalance_by_layer": [1.25, 1.75],
                },
                "ranks": {},
                "counts": {},
            }
        )
    )
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["phalanx_device_ecc_uncorrectable_errors"].type == "counter"
    assert 'phalanx_device_ecc_uncorrectable_errors_total{device="0",node="n"} 3.0' in text
    assert families["phalanx_device_temperature_celsius"].type == "gauge"
    assert families["phalanx_train_tokens"].type == "counter"
    assert 'phalanx_train_tokens_total{run="r"} 1280.0' in text
    assert "phalanx_train_tokens_per_second" not in families and "_created" not in text
    # A mixture of experts' routing balance, overall and per MoE layer.
    assert 'phalanx_train_moe_imbalance_ratio{run="r"} 1.75' in text
    assert 'phalanx_train_moe_layer_imbalance_ratio{layer="1",run="r"} 1.75' in text
