"""A loopback TCP relay in front of the shared PostgreSQL server, to give one test a real outage: the
server itself cannot be stopped (other tests use it), but closing the relay refuses new connections and
cuts the open ones, which is what a client sees of a server that went down."""

from __future__ import annotations

import socket
import threading


class TcpRelay:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.port: int | None = None
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> TcpRelay:
        """Listen (on the same port as before, after a down())."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port or 0))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._open = self._open, []
        if listener is not None:
            listener.close()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
