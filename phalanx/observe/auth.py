"""Who may read the dashboard: anyone on loopback, otherwise only holders of the token.

Beyond 127.0.0.1 the dashboard needs a token (`--token`). A client proves it has it with an
`Authorization: Bearer TOKEN` header (scripts, Prometheus) or with the session cookie the /login form
sets (browsers). The cookie holds an HMAC of the token, not the token itself, so a leaked cookie
jar does not leak the token; it is HttpOnly (no script reads it) and SameSite=Strict (no other site's
page can send it along).
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qs, quote

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from phalanx.errors import PhalanxError
from phalanx.listen import is_loopback

COOKIE = "phalanx_session"
MIN_TOKEN_CHARS = 16
# The login form needs its stylesheet before the browser holds the cookie; it holds nothing private.
OPEN_PATHS = ("/health", "/login", "/static/dashboard.css")
# Answered 401 rather than sent to the login form: machines read these.
MACHINE_PREFIXES = ("/api/", "/metrics", "/static/")


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to serve beyond loopback without a token, or with one short enough to guess."""
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise PhalanxError(f"--token must be at least {MIN_TOKEN_CHARS} characters "
                           "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))')")
    if not is_loopback(host) and token is None:
        raise PhalanxError(f"--host {host} serves the dashboard beyond this machine: set --token "
                           "(or PHALANX_DASHBOARD_TOKEN) so only token holders can read it")


def session_value(token: str) -> str:
    """What the login cookie holds: derived from the token, useless for anything but this cookie."""
    return hmac.new(token.encode(), b"phalanx-dashboard-session", hashlib.sha256).hexdigest()


def safe_next(target: str | None) -> str:
    """Where to go after logging in: only a path on this site (no open redirect to another host)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


class TokenAuth:
    """ASGI middleware: lets a request through if it carries the token (header or cookie) or asks for an
    open path; otherwise 401 for machine paths and a redirect to /login for pages."""

    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self.token = token.encode()
        self.session = session_value(token).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.allowed(Request(scope)):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith(MACHINE_PREFIXES):
            response: Response = JSONResponse({"error": "authentication required: send Authorization: Bearer TOKEN"},
                                              status_code=401, headers={"WWW-Authenticate": "Bearer"})
        else:
            query = scope.get("query_string", b"").decode()
            target = path + (f"?{query}" if query else "")
            response = RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)
        await response(scope, receive, send)

    def allowed(self, request: Request) -> bool:
        scheme, _, credential = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), self.token):
            return True
        cookie = request.cookies.get(COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode(), self.session)


async def read_login_form(request: Request) -> tuple[str, str]:
    """The token and next page from the login form's urlencoded body (no multipart needed)."""
    body = (await request.body())[:4096].decode(errors="replace")
    fields = parse_qs(body, keep_blank_values=True)
    return fields.get("token", [""])[0], fields.get("next", ["/"])[0]


def login_ok(token: str | None, offered: str) -> bool:
    return token is not None and hmac.compare_digest(offered.encode(), token.encode())


def set_session_cookie(response: Response, token: str, secure: bool) -> None:
    response.set_cookie(COOKIE, session_value(token), httponly=True, samesite="strict", secure=secure, path="/")
