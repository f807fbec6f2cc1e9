"""How both HTTP servers (the dashboard, `phalanx serve`) run uvicorn: one Config for both, with the
limits uvicorn itself lacks and a client address no client can choose.

- A request's head (its request line and headers) must arrive within HEAD_TIMEOUT_SECONDS of the
  connection opening, or of the previous response on a kept-alive connection; a connection that trickles
  its head (slowloris) is closed then, instead of being held for as long as it likes.
- One client address holds at most CONNECTIONS_PER_CLIENT connections at once; beyond that a new
  connection is closed at once, so one host cannot take every connection the server can hold.
- X-Forwarded-For is believed only from the proxies named with --trusted-proxy. uvicorn believes it from
  127.0.0.1 by default, so a local client that changed the header on every try was a new client each time
  for the failed-key limit. Behind a reverse proxy on another host, name it: every client then counts as
  itself rather than as the proxy.

uvicorn's HTTP/1.1 protocol (h11) is extended through its public protocol-class option; what it relies
on (h11's connection states, the transport and loop uvicorn sets) is checked by tests/test_http_server.py.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from phalanx.errors import PhalanxError

HEAD_TIMEOUT_SECONDS = 10.0
CONNECTIONS_PER_CLIENT = 64


def guarded_protocol(
    head_timeout: float = HEAD_TIMEOUT_SECONDS, per_client: int = CONNECTIONS_PER_CLIENT
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a time limit on request heads and a cap on connections per client."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            if host is not None and sum(1 for c in self.connections if c.client and c.client[0] == host) > per_client:
                transport.close()  # this one is already counted among them
                return
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole head has arrived (or the connection ended)
                self._disarm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(head_timeout, self._head_too_late)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def trusted_proxies(given: list[str]) -> tuple[str, ...]:
    """The --trusted-proxy values, each an address or a network (10.0.0.0/8); anything else is bad input."""
    for value in given:
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise PhalanxError(
                f"--trusted-proxy takes an IP address or network (such as 10.0.0.5 or 10.0.0.0/8), not {value!r}"
            ) from None
    return tuple(given)


def server_config(
    app: Any,
    log_level: str,
    trusted_proxies: tuple[str, ...] = (),
    head_timeout: float = HEAD_TIMEOUT_SECONDS,
    per_client: int = CONNECTIONS_PER_CLIENT,
    **options: Any,
):
    """uvicorn's Config for a phalanx server: the guarded protocol, and proxy headers only from
    `trusted_proxies` (addresses or networks; none: X-Forwarded-For is ignored)."""
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=log_level,
        http=guarded_protocol(head_timeout, per_client),
        proxy_headers=bool(trusted_proxies),
        forwarded_allow_ips=list(trusted_proxies) or None,
        **options,
    )
