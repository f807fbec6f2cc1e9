"""Where phalanx's HTTP servers (the dashboard, `phalanx serve`) listen: loopback checks and the socket."""

from __future__ import annotations

import ipaddress
import socket

from phalanx.errors import PhalanxError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the app starts so a taken port is one clear line rather than
    uvicorn's log."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        addresses = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise PhalanxError(f"--host {host!r} is not an address of this machine: {exc}") from None
    family, kind, proto, _, address = addresses[0]
    # proto must say TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that do, and with it on,
    # every response on a kept-alive connection waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PhalanxError(f"cannot listen on {host}:{port}: {exc.strerror} (pick another with --port)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
