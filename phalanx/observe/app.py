"""The dashboard web app: runs list, live run page, run comparison, their JSON API, and /metrics.

Reads a RunStore; the only writes are the /login and /logout forms and a run's tags and note (PATCH /api/runs/ID,
JSON only, behind the token when there is one). Pages are Jinja2 templates with
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

from fastapi import FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phalanx.errors import PhalanxError, StoreError
from phalanx.http_guard import BODY_TIMEOUT_SECONDS, BodyTooLarge, HttpGuard, read_body_within
from phalanx.http_server import server_config
from phalanx.listen import bind
from phalanx.observe import auth
from phalanx.observe.figures import chart_options
from phalanx.observe.pages import compare_answer, run_answer
from phalanx.observe.prom import StoreCollector
from phalanx.observe.store import RunStore
from phalanx.run.jsonl import json_safe

WEB = Path(__file__).parent / "web"
MAX_COMPARE = 20
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
MAX_ANNOTATION_BYTES = 16_384  # 20 tags and a 4,000-character note, JSON-escaped, fit with room to spare
# Plotly injects its own <style> elements, hence 'unsafe-inline' for styles only; scripts are ours.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
    "form-action 'self'; base-uri 'none'; object-src 'none'",
    "x-content-type-options": "nosniff",
    # Nothing to other sites; the dashboard's own form posts keep their Origin (no-referrer makes it "null").
    "referrer-policy": "same-origin",
}


def plotly_js_path() -> Path:
    """plotly.min.js as the installed plotly Python package ships it (what plotly's offline mode embeds)."""
    path = Path(str(files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise PhalanxError(f"the installed plotly package has no {path.name}; reinstall it: pip install plotly")
    return path


def create_app(
    store: RunStore,
    token: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
    body_timeout: float = BODY_TIMEOUT_SECONDS,
) -> ASGIApp:
    """The dashboard over `store`; with a token every route but /health, /login and /logout needs it.
    allowed_hosts: Host names answered besides loopback names and IP addresses (phalanx/http_guard.py)."""
    plotly_js = plotly_js_path()
    templates = Environment(loader=FileSystemLoader(WEB / "templates"), autoescape=True)
    sign_in = auth.DashboardAuth(token) if token is not None else None
    disable_created_metrics()  # prometheus_client's switch is process-wide; phalanx wants them nowhere
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreCollector(store))
    requests = Counter(
        "phalanx_dashboard_requests",
        "HTTP requests the dashboard answered",
        ["method", "route", "status"],
        registry=registry,
    )
    latency = Histogram(
        "phalanx_dashboard_request_seconds",
        "Time to answer a dashboard request",
        ["route"],
        registry=registry,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    )

    app = FastAPI(title="phalanx dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    def page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
        html = templates.get_template(name).render(token_required=sign_in is not None, **context)
        return HTMLResponse(html, status_code=status)

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
    def api_run(
        request: Request, run_id: str, x: str | None = None, smooth: str | None = None, log: str | None = None
    ) -> Response:
        run = find(request, run_id)
        if isinstance(run, Response):
            return run
        try:
            options = chart_options(x, smooth, log)
        except ValueError as exc:
            return error(request, 400, str(exc))
        return SafeJSONResponse(run_answer(store, int(run_id), options))

    @app.patch("/api/runs/{run_id}")
    async def api_annotate(request: Request, run_id: str) -> Response:
        """A run's tags and note. JSON only: a page on another site cannot send that without a CORS
        preflight, which this app never answers, so it cannot edit runs through a visitor's browser."""
        run = find(request, run_id)
        if isinstance(run, Response):
            return run
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return error(request, 415, "send the tags and note as JSON (Content-Type: application/json)")
        try:
            fields = json.loads(await read_body_within(request, MAX_ANNOTATION_BYTES))
        except BodyTooLarge as exc:
            return error(request, 413, f"the request is {exc.size} bytes or more; at most {MAX_ANNOTATION_BYTES}")
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return error(request, 400, "the request body is not JSON")
        if not isinstance(fields, dict) or not fields or set(fields) - {"tags", "note"}:
            return error(request, 400, 'send a JSON object with "tags" (a list of strings) and/or "note" (a string)')
        try:
            return SafeJSONResponse(store.annotate(int(run_id), fields.get("tags"), fields.get("note")))
        except StoreError:
            raise
        except PhalanxError as exc:
            return error(request, 400, str(exc))

    @app.get("/api/compare")
    def api_compare(
        request: Request,
        ids: str | None = None,
        x: str | None = None,
        smooth: str | None = None,
        log: str | None = None,
    ) -> Response:
        run_ids = find_many(request, ids)
        if isinstance(run_ids, Response):
            return run_ids
        try:
            options = chart_options(x, smooth, log)
        except ValueError as exc:
            return error(request, 400, str(exc))
        return SafeJSONResponse(compare_answer(store, run_ids, options))

    # -- machines ------------------------------------------------------------------------------------
    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health() -> Response:
        store.schema_version()  # a StoreError if the store does not answer: 503
        return JSONResponse({"status": "ok"})

    # -- login and logout (forms) --------------------------------------------------------------------
    @app.get("/login", response_class=HTMLResponse)
    def login_form(next: str | None = None) -> Response:
        if token is None:
            return RedirectResponse(auth.safe_next(next), status_code=303)
        return page("login.html", title="log in", next=auth.safe_next(next), failed=False)

    @app.post("/login")
    async def login(request: Request) -> Response:
        if sign_in is None:
            return RedirectResponse("/", status_code=303)
        client = auth.client_host(request.scope)
        wait = sign_in.limiter.retry_after(client)
        if wait is not None:
            return auth.too_many_attempts(request.url.path, wait)
        try:
            offered, target = await auth.read_login_form(request)
        except BodyTooLarge as exc:
            return error(request, 413, str(exc))
        if not sign_in.token_matches(offered):
            sign_in.limiter.failed(client)
            return page("login.html", status=401, title="log in", next=auth.safe_next(target), failed=True)
        response = RedirectResponse(auth.safe_next(target), status_code=303)
        sign_in.login(response, secure=request.url.scheme == "https")
        return response

    @app.post("/logout")
    def logout(request: Request) -> Response:
        """Forget this browser's session: its cookie opens nothing from now on, wherever it was copied."""
        response = RedirectResponse("/login" if sign_in is not None else "/", status_code=303)
        if sign_in is not None:
            sign_in.logout(request, response)
        return response

    # -- static files: ours, and plotly.js from the plotly package -------------------------------------
    @app.get("/static/plotly.min.js")
    def plotly() -> Response:
        return FileResponse(
            plotly_js, media_type="text/javascript", headers={"cache-control": "private, max-age=86400"}
        )

    app.mount("/static", StaticFiles(directory=WEB / "static"), name="static")
    # A long run's page poll is ~800 KB of JSON (1,000-point curves, 8 GPUs' charts), a tenth of that
    # gzipped: it matters beyond loopback. Level 5 costs a few ms where 9 costs several times that for little gain.
    app.add_middleware(GZipMiddleware, minimum_size=4096, compresslevel=5)

    outer: ASGIApp = app
    if sign_in is not None:
        outer = auth.TokenAuth(outer, sign_in)
    # Before the token check: a page on another site is refused whether or not it holds a credential.
    outer = HttpGuard(outer, allowed_hosts, json_paths=lambda path: path.startswith("/api/"), body_timeout=body_timeout)
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
            route = getattr(scope.get("route"), "path", None) or (
                "/static" if scope["path"].startswith("/static/") else "unmatched"
            )
            # Only the methods HTTP defines get their own label: any other word a client sends is "other".
            method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
            self.requests.labels(method, route, str(status[0])).inc()
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


def serve(app: ASGIApp, sock: socket.socket, log_level: str = "warning", trusted_proxies: tuple[str, ...] = ()) -> None:
    """Serve `app` with uvicorn on an already bound socket until Ctrl-C."""
    import uvicorn

    server = uvicorn.Server(server_config(app, log_level, trusted_proxies, access_log=False))
    server.run(sockets=[sock])


@contextlib.contextmanager
def running(app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` from a background thread (in a notebook, a test) and yield its base URL."""
    import uvicorn

    sock = bind(host, port)
    server = uvicorn.Server(server_config(app, "warning", access_log=False))
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
