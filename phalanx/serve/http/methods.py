"""HEAD on every GET route, and the methods a known path allows.

HEAD is answered as the GET would be, status and headers (Content-Length included) without the body
(RFC 9110 9.3.2), so a client or a load balancer can probe any GET endpoint. FastAPI's routes list the
methods they are declared with, so HEAD is turned into GET on the way in, marked in the scope for the
error messages, and the body dropped on the way out.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEAD_MARK = "phalanx.head"


class AnswerHead:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET", HEAD_MARK: True}, receive, without_body)


def asked_method(scope: Scope) -> str:
    """The method the client sent (HEAD runs as GET inside)."""
    return "HEAD" if scope.get(HEAD_MARK) else scope["method"]


def allow_header(allowed: str) -> str:
    """Starlette's Allow value, with HEAD wherever GET is (AnswerHead answers it)."""
    methods = [m.strip() for m in allowed.split(",") if m.strip()]
    if "GET" in methods and "HEAD" not in methods:
        methods.append("HEAD")
    return ", ".join(methods)
