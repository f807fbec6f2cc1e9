"""The dashboard web app: runs list, live run page, run comparison, their JSON API, and /metrics.

Read-only over a RunStore (only GET routes, besides the /login form). Pages are Jinja2 templates with
autoescaping; their scripts fetch the JSON API every few seconds, fill tables with textContent and
hand the server-built figures (figures.py) to Plotly.react. plotly.js itself comes from the installed
`plotly` package, so the dashboard works offline.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from fastapi import FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phalanx.errors import PhalanxError, StoreError
from phalanx.listen import bind
from phalanx.observe import auth
from phalanx.observe.figures import compare_figures, run_figures
from phalanx.observe.pages import compare_data, run_page_data
from phalanx.observe.prom import StoreCollector
from phalanx.observe.store import RunStore
from phalanx.run.jsonl import json_safe

WEB = Path(__file__).parent / "web"
MAX_COMPARE = 20
# Plotly injects its own <style> elements, hence 'unsafe-inline' for styles only; scripts are ours.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
                               "form-action 'self'; base-uri 'none'; object-src 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def plotly_js_path() -> Path:
    """plotly.min.js as the installed plotly Python package ships it (what plotly's offline mode embeds)."""
    path = Path(str(files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise PhalanxError(f"the installed plotly package has no {path.name}; reinstall it: pip install plotly")
    return path


def create_app(store: RunStore, token: str | None = None) -> ASGIApp:
    """The dashboard over `store`; with a token every route but /health and /login needs it."""
    plotly_js = plotly_js_path()
    templates = Environment(loader=FileSystemLoader(WEB / "templates"), autoescape=True)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreCollector(store))
    requests = Counter("phalanx_dashboard_requests", "HTTP requests the dashboard answered",
                       ["method", "route", "status"], registry=registry)
    latency = Histogram("phalanx_dashboard_request_seconds", "Time to answer a dashboard request",
                        ["route"], registry=registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

    app = FastAPI(title="phalanx dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    def page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(templates.get_template(name).render(**context), status_code=status)

    def error(request: Request, status: int, message: str) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message}, status_code=status)
        return page("error.html", status=status, title=str(status), status_code=status, message=message)

    def find(request: Request, run_id: str) -> dict[str, Any] | Response:
        """The run with this id, or the 400/404 answer to send instead."""
        if parse_id(run_id) is None:
            return error(request, 400, f"run id must be a positive integer, not {run_id!r}")
        try:
            return store.run(int(run_id))
        except StoreError:
            raise  # answered 503 by the handler below
        except PhalanxError:
            return error(request, 404, f"no run with id {run_id} in the store")

    def find_many(request: Request, ids: str | None) -> list[int] | Response:
        parsed = [parse_id(p.strip()) for p in (ids or "").split(",") if p.strip()]
        if not parsed or None in parsed:
            return error(request, 400, f"ids must be run ids separated by commas (e.g. ids=1,2), not {ids!r}")
        run_ids = list(dict.fromkeys(parsed))
        if len(run_ids) > MAX_COMPARE:
            return error(request, 400, f"compare at most {MAX_COMPARE} runs at a time, not {len(run_ids)}")
        for run_id in run_ids:
            found = find(request, str(run_id))
            if isinstance(found, Response):
                return found
        return run_ids

    @app.exception_handler(StoreError)
    async def store_unavailable(request: Request, exc: StoreError) -> Response:
        # A database that went away (a PostgreSQL restart) is answered, and the next request retries.
        return error(request, 503, str(exc))

    # -- pages ---------------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse)
    def runs_page() -> Response:
        return page("runs.html", title="runs")

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(request: Request, run_id: str) -> Response:
        run = find(request, run_id)
        if isinstance(run, Response):
            return run
        return page("run.html", title=run["name"], run=run)

    @app.get("/compare", response_class=HTMLResponse)
    def compare_page(request: Request, ids: str | None = None) -> Response:
        run_ids = find_many(request, ids)
        if isinstance(run_ids, Response):
            return run_ids
        return page("compare.html", title="compare", ids=",".join(map(str, run_ids)))

    # -- JSON API ------------------------------------------------------------------------------------
    @app.get("/api/runs")
    def api_runs() -> Response:
        return SafeJSONResponse({"now": time.time(), "runs": store.list_runs()})

    @app.get("/api/runs/{run_id}")
    def api_run(request: Request, run_id: str) -> Response:
        run = find(request, run_id)
        if isinstance(run, Response):
            return run
        data = run_page_data(store, int(run_id))
        config = data["run"].get("config")
        data["config_yaml"] = yaml.safe_dump(config, sort_keys=False) if config is not None else None
        data["figures"] = run_figures(data)
        data["now"] = time.time()
        return SafeJSONResponse(data)

    @app.get("/api/compare")
    def api_compare(request: Request, ids: str | None = None) -> Response:
        run_ids = find_many(request, ids)
        if isinstance(run_ids, Response):
            return run_ids
        runs = compare_data(store, run_ids)
        for entry in runs:
            entry["run"].pop("config", None)  # not shown, and the largest part
        return SafeJSONResponse({"runs": runs, "figures": compare_figures(runs)})

    # -- machines ------------------------------------------------------------------------------------
    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health() -> Response:
        store.schema_version()  # a StoreError if the store does not answer: 503
        return JSONResponse({"status": "ok"})

    # -- login (the only route that is not a GET) ----------------------------------------------------
    @app.get("/login", response_class=HTMLResponse)
    def login_form(next: str | None = None) -> Response:
        if token is None:
            return RedirectResponse(auth.safe_next(next), status_code=303)
        return page("login.html", title="log in", next=auth.safe_next(next), failed=False)

    @app.post("/login")
    async def login(request: Request) -> Response:
        if token is None:
            return RedirectResponse("/", status_code=303)
        offered, target = await auth.read_login_form(request)
        if not auth.login_ok(token, offered):
            return page("login.html", status=401, title="log in", next=auth.safe_next(target), failed=True)
        response = RedirectResponse(auth.safe_next(target), status_code=303)
        auth.set_session_cookie(response, token, secure=request.url.scheme == "https")
        return response

    # -- static files: ours, and plotly.js from the plotly package -------------------------------------
    @app.get("/static/plotly.min.js")
    def plotly() -> Response:
        return FileResponse(plotly_js, media_type="text/javascript",
                            headers={"cache-control": "private, max-age=86400"})

    app.mount("/static", StaticFiles(directory=WEB / "static"), name="static")
    # A long run's page poll is ~300 KB of JSON (1,000-point curves), a third of that gzipped: it matters
    # beyond loopback. Level 5 costs a few ms where 9 costs several times that for little gain.
    app.add_middleware(GZipMiddleware, minimum_size=4096, compresslevel=5)

    outer: ASGIApp = app
    if token is not None:
        outer = auth.TokenAuth(outer, token)
    return ObservedApp(outer, requests, latency)  # outermost: counts refused requests too


class ObservedApp:
    """ASGI middleware: counts and times every request by route (the template, not the raw path, so a
    scan of ids cannot blow up the metric's label set) and adds the security headers."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram):
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = list(message.get("headers", []))
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            route = getattr(scope.get("route"), "path", None) or ("/static" if scope["path"].startswith("/static/")
                                                                   else "unmatched")
            self.requests.labels(scope["method"], route, str(status[0])).inc()
            self.latency.labels(route).observe(time.perf_counter() - started)


def parse_id(text: str) -> int | None:
    """A run id: a positive integer (not "²"); ones beyond the id column's range are simply not found."""
    if not (text.isascii() and text.isdigit()) or len(text) > 18 or int(text) == 0:
        return None
    return int(text)


class SafeJSONResponse(JSONResponse):
    """JSON that a browser can parse: NaN and infinities (JSON has none) become null."""

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()
        except ValueError:
            return json.dumps(json_safe(content), separators=(",", ":")).encode()


def serve(app: ASGIApp, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve `app` with uvicorn on an already bound socket until Ctrl-C."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))
    server.run(sockets=[sock])


@contextlib.contextmanager
def running(app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` from a background thread (in a notebook, a test) and yield its base URL."""
    import uvicorn

    sock = bind(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="phalanx-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the dashboard server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
