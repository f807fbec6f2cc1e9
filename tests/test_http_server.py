"""uvicorn as phalanx's servers run it (phalanx/http_server.py), over real loopback sockets: a request head
that trickles in is cut off, one client cannot hold every connection, and X-Forwarded-For counts only
from a trusted proxy."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from phalanx.http_server import server_config
from phalanx.listen import bind


async def echo_client(scope, receive, send) -> None:
    """An ASGI app answering with the client address the server settled on."""
    if scope["type"] != "http":
        return
    body = scope["client"][0].encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(**options) -> Iterator[int]:
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(server_config(echo_client, "warning", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


def open_with_partial_head(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and never the rest
    return s


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_trickling_head_is_cut_off_and_the_server_goes_on():
    with serving(head_timeout=1.0) as port:
        slow = [open_with_partial_head(port) for _ in range(20)]
        started = time.monotonic()
        try:
            assert not closed_by_server(slow[0], 0.5)  # held while within its time
            assert all(closed_by_server(s, 5.0) for s in slow)
            assert time.monotonic() - started < 5.0
            # A kept-alive connection that starts a second head and stalls is cut off the same way.
            with socket.create_connection(("127.0.0.1", port)) as kept:
                kept.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                answer = b""
                while not answer.endswith(b"127.0.0.1"):  # the whole response, head and body
                    answer += kept.recv(4096)
                assert answer.startswith(b"HTTP/1.1 200")
                kept.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                assert closed_by_server(kept, 5.0)
            assert httpx.get(f"http://127.0.0.1:{port}/").text == "127.0.0.1"
        finally:
            for s in slow:
                s.close()


def test_one_client_holds_at_most_its_share_of_connections():
    with serving(head_timeout=30.0, per_client=5) as port:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        try:
            closed = [closed_by_server(s, 0.5) for s in held]
            assert closed.count(True) == 3 and closed[:5] == [False] * 5
            held[0].close()  # a place frees: the next connection is served
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port)) as again:
                again.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                assert again.recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize("trusted, seen", [((), "127.0.0.1"), (("127.0.0.1",), "203.0.113.7")])
def test_forwarded_for_counts_only_from_a_trusted_proxy(trusted, seen):
    with serving(trusted_proxies=trusted) as port:
        reply = httpx.get(f"http://127.0.0.1:{port}/", headers={"X-Forwarded-For": "203.0.113.7"})
        assert reply.text == seen


@pytest.mark.parametrize("command", [["serve", "runs/none"], ["dashboard"]])
def test_a_trusted_proxy_must_be_an_address_or_network(command, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "phalanx", *command, "--trusted-proxy", "proxy.example"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: --trusted-proxy takes an IP address or network (such as 10.0.0.5 or 10.0.0.0/8), not 'proxy.example'"
    )
