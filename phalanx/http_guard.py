"""What keeps web pages from using phalanx's loopback servers (the dashboard, `phalanx serve`) through
the visitor's browser: one ASGI middleware in front of both.

- Host: only loopback names, IP addresses and the names the server was told about are answered. A page
  on attacker.example whose DNS name is rebound to 127.0.0.1 sends `Host: attacker.example` and is
  refused, so it can never read a reply from its "own" origin. (An IP address cannot be rebound.)
- Origin: a browser names the page behind every cross-origin request (and every POST). Only the
  server's own origin (the same host and port as the Host header) and the configured names pass; no
  CORS header is ever granted, so a foreign page cannot read even what it may send.
- Content-Type: a request that a browser could have sent (it carries an Origin or a cookie) must send
  JSON as `application/json` or with no type, so a page cannot post JSON as a `text/plain` or form body
  (the kinds a browser sends without asking first). Others take any type: `curl -d '{...}'` sends
  `application/x-www-form-urlencoded`, and that is how Ollama's own documentation calls every endpoint.
  Browsers since 2019 send Origin on every cross-site POST, and a foreign Origin is refused above.
- Body time: a request whose body has not fully arrived within `body_timeout` seconds (a Content-Length
  larger than what is sent) is answered 408 and its connection closed, rather than held open.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY_TIMEOUT_SECONDS = 30.0
JSON_TYPE = "application/json"
BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}

# refuse(scope, status, message) -> an ASGI app answering it (each server's own error shape).
Refuse = Callable[[Scope, int, str], ASGIApp]


def host_name(authority: str) -> str | None:
    """The name or address of a Host header ("[::1]:8080" -> "::1"), or None if it is malformed."""
    if authority.startswith("["):
        end = authority.find("]")
        name, rest = (authority[1:end], authority[end + 1 :]) if end > 0 else ("", "")
    else:
        name, colon, port = authority.partition(":")
        rest = colon + port
    if not name or (rest and not (rest.startswith(":") and (rest[1:].isdigit() or rest == ":"))):
        return None
    if not all(c.isascii() and (c.isalnum() or c in ".-_:") for c in name):
        return None
    return name.lower().rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def normalise_hosts(names: Iterable[str]) -> frozenset[str]:
    """Configured names, lower case; ".example.org" also allows every name under example.org."""
    return frozenset(n.strip().lower().rstrip(".") for n in names if n.strip())


def _configured(name: str, allowed: frozenset[str]) -> bool:
    return (
        "*" in allowed
        or name in allowed
        or any(a.startswith(".") and (name.endswith(a) or name == a[1:]) for a in allowed)
    )


def host_allowed(name: str, allowed: frozenset[str]) -> bool:
    return name == "localhost" or name.endswith(".localhost") or _is_address(name) or _configured(name, allowed)


def server_hosts(listen_host: str, configured: Iterable[str] = ()) -> tuple[str, ...]:
    """The names a server answers besides loopback names and addresses: the --allowed-host names, the
    --host it listens on when that is a name, and this machine's own name (no page can rebind it)."""
    names = [*configured, socket.gethostname()]
    if not _is_address(listen_host.strip("[]")):
        names.append(listen_host)
    return tuple(dict.fromkeys(n for n in names if n))


def _default_refuse(scope: Scope, status: int, message: str) -> ASGIApp:
    return PlainJSON({"error": message}, status)


class PlainJSON:
    """A small JSON answer (this module depends on no web framework's response classes)."""

    def __init__(self, body: dict, status: int, headers: dict[str, str] | None = None):
        self.body, self.status, self.headers = json.dumps(body).encode(), status, headers or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class HttpGuard:
    """ASGI middleware: refuses foreign Hosts and Origins (403), non-JSON bodies on JSON paths (415), and
    bodies that do not arrive in time (408). `json_paths(path)` says which paths take JSON bodies."""

    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: Iterable[str] = (),
        refuse: Refuse | None = None,
        json_paths: Callable[[str], bool] = lambda path: True,
        body_timeout: float = BODY_TIMEOUT_SECONDS,
    ):
        self.app, self.allowed = app, normalise_hosts(allowed_hosts)
        self.refuse, self.json_paths, self.body_timeout = refuse or _default_refuse, json_paths, body_timeout

    def problem(self, scope: Scope) -> tuple[int, str] | None:
        headers: dict[bytes, bytes] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key, value)
        authority = headers.get(b"host", b"").decode("latin-1")
        if authority:  # HTTP/1.0 may leave it out; no browser does
            name = host_name(authority)
            if name is None or not host_allowed(name, self.allowed):
                return 403, (
                    f"requests for host {authority!r} are not answered here; only loopback names, IP "
                    "addresses and the server's --allowed-host names are"
                )
        origin = headers.get(b"origin")
        # "null" is also what a browser sends for a page's own form under a strict referrer policy; its
        # Sec-Fetch-Site (which no script can set) then says "same-origin".
        same_origin = headers.get(b"sec-fetch-site") == b"same-origin"
        if (
            origin is not None
            and not (origin == b"null" and same_origin)
            and not self.origin_allowed(origin.decode("latin-1"), authority)
        ):
            return 403, (
                f"cross-origin requests (from {origin.decode('latin-1')!r}) are not allowed: this server "
                "answers only its own pages and clients that are not browsers"
            )
        kind = headers.get(b"content-type")
        from_a_browser = origin is not None or b"cookie" in headers
        if kind is not None and from_a_browser and scope["method"] in BODY_METHODS and self.json_paths(scope["path"]):
            media = kind.decode("latin-1").split(";", 1)[0].strip().lower()
            if media != JSON_TYPE:
                return 415, (
                    f"the body must be JSON sent as 'Content-Type: {JSON_TYPE}', not {media or 'empty'!r} "
                    f"(curl: -H 'Content-Type: {JSON_TYPE}')"
                )
        return None

    def origin_allowed(self, origin: str, authority: str) -> bool:
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, files), extensions' own schemes
        if authority and parts.netloc.lower() == authority.lower():
            return True  # the server's own pages
        name = host_name(parts.netloc)
        return name is not None and _configured(name, self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        problem = self.problem(scope)
        if problem is not None:
            return await self.refuse(scope, *problem)(scope, receive, send)
        await self._with_body_deadline(scope, receive, send)

    async def _with_body_deadline(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        state = {"body_done": False, "timed_out": False, "started": False}

        async def receive_in_time() -> Message:
            if state["body_done"]:  # later calls only watch for a disconnect: no deadline
                return await receive()
            if state["timed_out"]:
                return {"type": "http.disconnect"}
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                state["timed_out"] = True
                return {"type": "http.disconnect"}  # the app stops reading; we answer below
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def send_unless_timed_out(message: Message) -> None:
            if state["timed_out"] and not state["started"]:
                return  # the app's answer to the "disconnect" it saw; ours is the 408
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, receive_in_time, send_unless_timed_out)
        except Exception:
            if not state["timed_out"] or state["started"]:
                raise
        if state["timed_out"] and not state["started"]:
            message = f"the request body did not arrive within {self.body_timeout:g} s"
            refusal = self.refuse(scope, 408, message)
            await refusal(scope, receive, _closing(send))


def _closing(send: Send) -> Send:
    """`send` with `Connection: close` on the response: the rest of a late body is never read."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return wrapped


class BodyTooLarge(Exception):
    """A request body over its route's limit (HTTP 413); `size` is what was declared or read so far."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"the request body is larger than the limit of {limit} bytes")
        self.size, self.limit = size, limit


async def read_body_within(request, limit: int) -> bytes:
    """A request's body, refused before any of it is read where its Content-Length is over `limit`, and
    as soon as it passes `limit` otherwise (chunked uploads): a 400 MiB body costs nothing to refuse."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(len(body), limit)
    return bytes(body)
