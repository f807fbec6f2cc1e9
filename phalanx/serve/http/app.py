"""The FastAPI app of `phalanx serve`: Ollama's and OpenAI's APIs over one engine (generation and
embeddings), vLLM's tokenizer endpoints, /health, /metrics; HEAD on every GET route
(serve/http/methods.py), 405s with `Allow`, and keep_alive's loading and unloading of the weights
(serve/http/keep_alive.py).

Middleware, outermost first: request counting (sees every answer, refusals included), the guard against
web pages (phalanx/http_guard.py: Host, Origin, JSON bodies, body time), then the API key check (every
path but /health; failed keys are rate-limited per client), then HEAD answered as GET without the body.
All plain ASGI, so streamed responses pass through untouched.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phalanx.http_auth import FailedAuthLimiter, bearer_token, secret_matches
from phalanx.http_guard import BODY_TIMEOUT_SECONDS, HttpGuard
from phalanx.serve.core.contract import ServingEngine
from phalanx.serve.core.served import ServedModel
from phalanx.serve.http.common import ApiError, error_response
from phalanx.serve.http.embeddings.routes import embeddings_router
from phalanx.serve.http.keep_alive import ModelResidency
from phalanx.serve.http.methods import AnswerHead, allow_header, asked_method
from phalanx.serve.http.metrics import ServeMetrics
from phalanx.serve.http.ollama.routes import ollama_router
from phalanx.serve.http.openai.routes import openai_router
from phalanx.serve.http.tokenizer.routes import tokenizer_router

log = logging.getLogger("phalanx.serve")

OPEN_PATHS = {"/health"}


class CountRequests:
    def __init__(self, app: ASGIApp, metrics: ServeMetrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # Unknown paths share one label, so scanners cannot grow the metric without bound.
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


class RequireApiKey:
    def __init__(self, app: ASGIApp, api_key: str, limiter: FailedAuthLimiter | None = None):
        self.app, self.api_key = app, api_key
        self.limiter = limiter or FailedAuthLimiter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("",))[0]
        wait = self.limiter.retry_after(client)
        if wait is not None:  # refused before the key is even looked at: the answer tells a guesser nothing
            error = ApiError(
                429, f"too many failed API keys from this address; try again in {wait} s", code="rate_limit_exceeded"
            )
            return await error_response(scope["path"], error, headers={"Retry-After": str(wait)})(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization")
        if not secret_matches(bearer_token(header), self.api_key):
            if header is not None:  # a key was tried; a client that sent none has guessed nothing
                self.limiter.failed(client)
            problem = "wrong API key" if header is not None else "missing API key"
            error = ApiError(401, f"{problem}: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
            response = error_response(scope["path"], error, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _guard_refusal(scope: Scope, status: int, message: str) -> Response:
    codes = {403: "forbidden", 408: "request_timeout", 415: "unsupported_media_type"}
    return error_response(scope["path"], ApiError(status, message, code=codes.get(status)))


def create_app(
    served: ServedModel,
    engine: ServingEngine,
    metrics: ServeMetrics,
    api_key: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
    body_timeout: float = BODY_TIMEOUT_SECONDS,
) -> FastAPI:
    """The app; it starts the engine's thread when it starts and stops it when it stops. allowed_hosts:
    Host names answered besides loopback names and IP addresses (phalanx/http_guard.py)."""

    residency = ModelResidency(served, engine)  # keep_alive: whether the weights are in memory

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        residency.close()
        engine.stop()

    app = FastAPI(title="phalanx serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    routers = [
        ollama_router(served, engine, residency),
        openai_router(served, engine, residency),
        embeddings_router(served, engine, residency),
        tokenizer_router(served, engine),
    ]
    for router in routers:
        app.include_router(router)
    metrics.watch(engine)

    @app.get("/health")
    async def health():
        state = {"model": served.name, "slots": engine.slots, "active": engine.active, "waiting": engine.waiting}
        if not engine.alive:
            return JSONResponse({"status": "engine stopped", **state}, status_code=503)
        return {"status": "ok", **state}

    @app.get("/")
    async def root():
        return Response("phalanx serve is running", media_type="text/plain")

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        method = asked_method(request.scope)
        message = {
            404: f"no such endpoint: {method} {request.url.path}",
            405: f"method {method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        headers = dict(exc.headers or {})
        if "Allow" in headers:  # a known path: say which methods it takes (RFC 9110 15.5.6)
            headers["Allow"] = allow_header(headers["Allow"])
        return error_response(request.url.path, ApiError(exc.status_code, message), headers=headers or None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}"))

    endpoints = {
        route.path
        for routes in (app.routes, *(r.routes for r in routers))
        for route in routes
        if isinstance(getattr(route, "path", None), str) and "{" not in route.path
    }
    app.add_middleware(AnswerHead)  # innermost: every check above sees the HEAD as sent
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(HttpGuard, allowed_hosts=allowed_hosts, refuse=_guard_refusal, body_timeout=body_timeout)
    app.add_middleware(CountRequests, metrics=metrics, endpoints=endpoints)  # added last: outermost
    return app
