"""What both HTTP servers (the dashboard, `phalanx serve`) share about credentials: the shortest secret
they accept, how a bearer header is read, and a limit on failed attempts per client.

A secret must be long enough that guessing it is hopeless, and failed attempts are slowed down so a
scanner cannot try many: each client (an IPv4 address, or an IPv6 /64, which one machine usually holds
whole) has a small bucket of failures that refills slowly; once it is empty the client is answered 429
until it refills, even with the right secret, so the answers stop telling it anything.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import threading
import time
from collections import OrderedDict

from phalanx.errors import PhalanxError

MIN_SECRET_CHARS = 16
SECRET_HINT = "e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))'"

# Failed authentications: a client may fail FAILURE_BURST times at once, then one more every
# FAILURE_REFILL_SECONDS; at most TRACKED_CLIENTS clients are remembered (the least recently seen go).
FAILURE_BURST = 10
FAILURE_REFILL_SECONDS = 6.0
TRACKED_CLIENTS = 4096


def check_secret(secret: str | None, option: str) -> None:
    """Refuse a key or token short enough to guess (one line, exit 2)."""
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        raise PhalanxError(f"{option} must be at least {MIN_SECRET_CHARS} characters ({SECRET_HINT})")


def bearer_token(header: str | bytes | None) -> bytes | None:
    """The credential of an `Authorization: Bearer CREDENTIAL` header, as bytes to compare with
    hmac.compare_digest against `secret.encode()`; None when the header is missing, empty or names another
    scheme. The scheme is matched in any case and spaces around the credential are dropped (RFC 9110).
    A str header is taken as ASGI servers decode it (latin-1), so both forms give the same bytes."""
    if isinstance(header, str):
        header = header.encode("latin-1", errors="replace")
    scheme, _, credential = (header or b"").strip().partition(b" ")
    credential = credential.strip()
    if scheme.lower() != b"bearer" or not credential:
        return None
    return credential


def secret_matches(offered: bytes | None, secret: str) -> bool:
    """Constant-time comparison of an offered credential with the secret."""
    return offered is not None and hmac.compare_digest(offered, secret.encode())


def client_key(host: str | None) -> str:
    """Whom a failure counts against: the client's address, IPv6 by its /64."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return host or "unknown"
    if address.version == 6:
        if address.ipv4_mapped is not None:  # ::ffff:1.2.3.4 is the IPv4 client 1.2.3.4
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class FailedAuthLimiter:
    """A token bucket of failures per client, in bounded memory. Thread-safe (the dashboard's sync
    routes run in a thread pool)."""

    def __init__(
        self,
        burst: int = FAILURE_BURST,
        refill_seconds: float = FAILURE_REFILL_SECONDS,
        max_clients: int = TRACKED_CLIENTS,
        clock=time.monotonic,
    ):
        self.burst, self.refill_seconds, self.max_clients, self.clock = burst, refill_seconds, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)
        self._lock = threading.Lock()

    def _tokens(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - at) / self.refill_seconds)

    def retry_after(self, host: str | None) -> int | None:
        """Seconds until this client may try again, or None when it may try now."""
        key, now = client_key(host), self.clock()
        with self._lock:
            if key not in self._buckets:
                return None
            tokens = self._tokens(key, now)
        return None if tokens >= 1 else max(1, math.ceil((1 - tokens) * self.refill_seconds))

    def failed(self, host: str | None) -> None:
        key, now = client_key(host), self.clock()
        with self._lock:
            self._buckets[key] = (max(0.0, self._tokens(key, now) - 1), now)
            self._buckets.move_to_end(key)
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)
