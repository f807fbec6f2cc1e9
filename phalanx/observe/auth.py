"""Who may read the dashboard: anyone on loopback, otherwise only holders of the token.

Beyond 127.0.0.1 the dashboard needs a token (`--token`, 16 characters or more, as `phalanx serve`'s
API key). A client proves it has it with an `Authorization: Bearer TOKEN` header (scripts, Prometheus;
parsed as `phalanx serve` parses it) or with the session cookie the /login form sets (browsers).

A session is a random id the server remembers (in memory, MAX_SESSIONS at most, each for
SESSION_SECONDS): the cookie holds the id, never the token, and /logout forgets it, so a cookie copied
before logging out opens nothing afterwards (nor after a restart). The cookie is HttpOnly (no script
reads it) and SameSite=Strict (no other site's page can send it along). Wrong tokens, by header or by
the form, are rate-limited per client (phalanx/http_auth.py); a stale cookie is not a guess (an id is
256 random bits) and is simply cleared.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from urllib.parse import parse_qs, quote

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from phalanx.errors import PhalanxError
from phalanx.http_auth import MIN_SECRET_CHARS, FailedAuthLimiter, bearer_token, check_secret, secret_matches
from phalanx.http_guard import read_body_within
from phalanx.listen import is_loopback

COOKIE = "phalanx_session"
MIN_TOKEN_CHARS = MIN_SECRET_CHARS
SESSION_SECONDS = 7 * 24 * 3600
MAX_SESSIONS = 1024  # the oldest session goes when a new one would pass this
MAX_LOGIN_BYTES = 4096  # a token and a next page
# The login form needs its stylesheet before the browser holds the cookie; it holds nothing private.
OPEN_PATHS = ("/health", "/login", "/logout", "/static/dashboard.css")
# Answered 401 rather than sent to the login form: machines read these.
MACHINE_PREFIXES = ("/api/", "/metrics", "/static/")


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to serve beyond loopback without a token, or with one short enough to guess."""
    check_secret(token, "--token")
    if not is_loopback(host) and token is None:
        raise PhalanxError(
            f"--host {host} serves the dashboard beyond this machine: set --token "
            "(or PHALANX_DASHBOARD_TOKEN) so only token holders can read it"
        )


def safe_next(target: str | None) -> str:
    """Where to go after logging in: only a path on this site (no open redirect to another host)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def client_host(scope: Scope) -> str:
    return (scope.get("client") or ("",))[0]


class Sessions:
    """Session ids handed out at login, remembered by their SHA-256 (a lookup then reveals nothing about
    how close a guess came). Thread-safe: the dashboard's sync routes run in a thread pool."""

    def __init__(self, lifetime: float = SESSION_SECONDS, limit: int = MAX_SESSIONS, clock=time.time):
        self.lifetime, self.limit, self.clock = lifetime, limit, clock
        self._expiry: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(session: str) -> str:
        return hashlib.sha256(session.encode("utf-8", errors="replace")).hexdigest()

    def open(self) -> str:
        session = secrets.token_urlsafe(32)
        with self._lock:
            self._expiry[self._key(session)] = self.clock() + self.lifetime
            while len(self._expiry) > self.limit:
                self._expiry.popitem(last=False)
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        key = self._key(session)
        with self._lock:
            expires = self._expiry.get(key)
            if expires is not None and expires < self.clock():
                del self._expiry[key]
                expires = None
        return expires is not None

    def close(self, session: str | None) -> None:
        if session:
            with self._lock:
                self._expiry.pop(self._key(session), None)

    def __len__(self) -> int:
        return len(self._expiry)


class DashboardAuth:
    """The token, the sessions opened with it and the limit on wrong tokens: one per app."""

    def __init__(self, token: str, limiter: FailedAuthLimiter | None = None, sessions: Sessions | None = None):
        self.token = token
        self.limiter = limiter or FailedAuthLimiter()
        self.sessions = sessions or Sessions()

    def login(self, response: Response, secure: bool) -> None:
        response.set_cookie(
            COOKIE,
            self.sessions.open(),
            max_age=int(self.sessions.lifetime),
            httponly=True,
            samesite="strict",
            secure=secure,
            path="/",
        )

    def logout(self, request: Request, response: Response) -> None:
        self.sessions.close(request.cookies.get(COOKIE))
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")

    def token_matches(self, offered: str) -> bool:
        return secret_matches(offered.encode(), self.token)


class TokenAuth:
    """ASGI middleware: lets a request through if it carries the token (header) or a live session (cookie),
    or asks for an open path; otherwise 401 for machine paths and a redirect to /login for pages, and 429
    for a client that has sent too many wrong tokens."""

    def __init__(self, app: ASGIApp, auth: DashboardAuth):
        self.app, self.auth = app, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        request, path = Request(scope), scope["path"]
        header = request.headers.get("authorization")
        if header is None:  # a browser: its session cookie, if it has a live one
            if self.auth.sessions.valid(request.cookies.get(COOKIE)):
                await self.app(scope, receive, send)
                return
            response = self.refusal(scope, path)
            if COOKIE in request.cookies:  # logged out, expired or from before a restart: stop sending it
                response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        elif (wait := self.auth.limiter.retry_after(client_host(scope))) is not None:
            response = too_many_attempts(path, wait)
        elif secret_matches(bearer_token(header), self.auth.token):
            await self.app(scope, receive, send)
            return
        else:
            self.auth.limiter.failed(client_host(scope))
            response = self.refusal(scope, path)
        await response(scope, receive, send)

    @staticmethod
    def refusal(scope: Scope, path: str) -> Response:
        if path.startswith(MACHINE_PREFIXES):
            return JSONResponse(
                {"error": "authentication required: send Authorization: Bearer TOKEN"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        query = scope.get("query_string", b"").decode("latin-1")
        target = path + (f"?{query}" if query else "")
        return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)


def too_many_attempts(path: str, wait: int) -> Response:
    message = f"too many wrong tokens from this address; try again in {wait} s"
    headers = {"Retry-After": str(wait)}
    if path.startswith(MACHINE_PREFIXES):
        return JSONResponse({"error": message}, status_code=429, headers=headers)
    return PlainTextResponse(message, status_code=429, headers=headers)


async def read_login_form(request: Request) -> tuple[str, str]:
    """The token and next page from the login form's urlencoded body (no multipart needed). A body over
    MAX_LOGIN_BYTES is BodyTooLarge, refused unread: anyone may post here, before any session."""
    body = (await read_body_within(request, MAX_LOGIN_BYTES)).decode(errors="replace")
    fields = parse_qs(body, keep_blank_values=True)
    return fields.get("token", [""])[0], fields.get("next", ["/"])[0]
