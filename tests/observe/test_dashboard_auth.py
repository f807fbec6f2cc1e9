"""Who may read the dashboard: loopback by default, a token beyond it, over real HTTP and the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from urllib.parse import quote

import httpx
import pytest

from phalanx.observe.app import create_app, running
from phalanx.observe.auth import COOKIE
from phalanx.observe.store import RunStore
from tests.helpers import phalanx

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dash-auth")
    store = RunStore.open(None, root)
    run_id = store.start_run("guarded", root / "guarded", {}, "tiny", 1, 10, "node-a")
    store.ingest(run_id, [{"step": 1, "loss": 5.0, "time": time.time()}], [], [], {})
    store.close()
    return root


@pytest.fixture(scope="module")
def url(runs_dir):
    store = RunStore.open(None, runs_dir, create=False)
    with running(create_app(store, token=TOKEN)) as url:
        yield url
    store.close()


def test_serving_beyond_loopback_without_a_token_is_refused(runs_dir):
    proc = phalanx("dashboard", "--runs", str(runs_dir), "--host", "0.0.0.0", check=False, timeout=60)
    assert proc.returncode == 2
    assert "--token" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--token", "short"], "at least 16 characters"),
        (["--store", "x.db"], "not both"),
        (["--port", "99999"], "65535"),
    ],
)
def test_bad_options_are_one_line_errors(runs_dir, args, message):
    proc = phalanx("dashboard", "--runs", str(runs_dir), *args, check=False, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_store_is_a_one_line_error(tmp_path):
    proc = phalanx("dashboard", "--runs", str(tmp_path / "nothing"), check=False, timeout=60)
    assert proc.returncode == 2 and "no run store" in proc.stderr
    assert not (tmp_path / "nothing").exists()  # nothing created by a mistyped path


def test_the_command_serves_and_takes_its_token_from_the_environment(runs_dir):
    env = {**os.environ, "PHALANX_DASHBOARD_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "dashboard", "--runs", str(runs_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert "token required" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        base = line.split(" at ", 1)[1].split()[0].rstrip("/")
        assert base.startswith("http://127.0.0.1:")
        deadline = time.time() + 30
        while True:  # the socket is bound before the line is printed; uvicorn starts just after
            try:
                assert httpx.get(f"{base}/health").status_code == 200
                break
            except httpx.ConnectError:
                assert time.time() < deadline
                time.sleep(0.1)
        assert httpx.get(f"{base}/api/runs").status_code == 401
        runs = httpx.get(f"{base}/api/runs", headers={"Authorization": f"Bearer {TOKEN}"}).json()["runs"]
        assert [r["name"] for r in runs] == ["guarded"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_taken_port_is_a_one_line_error(runs_dir, url):
    port = url.rsplit(":", 1)[1]
    proc = phalanx("dashboard", "--runs", str(runs_dir), "--port", port, check=False, timeout=60)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr


@pytest.mark.parametrize(
    "path", ["/api/runs", "/api/runs/1", "/api/compare?ids=1", "/metrics", "/static/plotly.min.js", "/static/run.js"]
)
def test_machine_paths_need_the_token(url, path):
    response = httpx.get(url + path)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(url + path, headers={"Authorization": "Bearer " + TOKEN[:-1] + "x"})
    assert wrong.status_code == 401
    right = httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert right.status_code == 200


@pytest.mark.parametrize("path", ["/", "/runs/1", "/compare?ids=1"])
def test_pages_send_a_browser_to_the_login_form(url, path):
    response = httpx.get(url + path)
    assert response.status_code == 303
    assert response.headers["location"] == "/login?next=" + quote(path, safe="")


def test_health_the_login_form_and_its_stylesheet_are_open(url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/static/dashboard.css").status_code == 200
    form = httpx.get(f"{url}/login?next=/runs/1")
    assert form.status_code == 200 and 'name="token"' in form.text and 'value="/runs/1"' in form.text


def test_login_sets_an_http_only_strict_cookie_that_opens_everything(url):
    with httpx.Client(base_url=url) as browser:
        bad = browser.post("/login", data={"token": "wrong-token-wrong-token", "next": "/runs/1"})
        assert bad.status_code == 401 and "not right" in bad.text and COOKIE not in browser.cookies

        good = browser.post("/login", data={"token": TOKEN, "next": "/runs/1"})
        assert good.status_code == 303 and good.headers["location"] == "/runs/1"
        set_cookie = good.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie.replace("Strict", "strict")
        assert TOKEN not in set_cookie  # the cookie holds a value derived from the token, not the token
        assert browser.get("/runs/1").status_code == 200
        assert browser.get("/api/runs").json()["runs"][0]["name"] == "guarded"
        assert browser.get("/metrics").status_code == 200

    forged = httpx.get(f"{url}/api/runs", cookies={COOKIE: "0" * 64})
    assert forged.status_code == 401


@pytest.mark.parametrize("target", ["//evil.example/", "https://evil.example/", "\\\\evil.example", "runs/1"])
def test_login_never_redirects_off_site(url, target):
    response = httpx.post(f"{url}/login", data={"token": TOKEN, "next": target})
    assert response.status_code == 303 and response.headers["location"] == "/"


def test_without_a_token_the_login_form_just_goes_home(runs_dir):
    store = RunStore.open(None, runs_dir, create=False)
    with running(create_app(store)) as url:
        assert httpx.get(f"{url}/api/runs").status_code == 200
        response = httpx.get(f"{url}/login?next=/runs/1")
        assert response.status_code == 303 and response.headers["location"] == "/runs/1"
    store.close()
