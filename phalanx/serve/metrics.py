"""Prometheus metrics of one server, in a registry of its own (two apps in one process never collide)."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from phalanx.serve.engine import Engine

# Time to first token: from a few milliseconds (a tiny model, idle) to a minute (a long queue).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_SECONDS = 10.0


class TokenRate:
    """Tokens per second over the last RATE_WINDOW_SECONDS (fed by the engine thread, read by scrapes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events: deque[tuple[float, int]] = deque()
        self._started = time.monotonic()

    def add(self, count: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), count))

    def per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._events and self._events[0][0] < now - RATE_WINDOW_SECONDS:
                self._events.popleft()
            total = sum(n for _, n in self._events)
        return total / min(RATE_WINDOW_SECONDS, max(now - self._started, 1e-3))


class ServeMetrics:
    """Also the engine's observer: it reports first tokens and generated tokens here."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("phalanx_serve_requests", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge("phalanx_serve_queue_depth", "Requests waiting for a slot.", registry=r)
        self.active_slots = Gauge("phalanx_serve_active_slots", "Slots decoding a request now.", registry=r)
        self.slots = Gauge("phalanx_serve_slots", "Slots: requests decoded together at most.", registry=r)
        self.ttft = Histogram("phalanx_serve_time_to_first_token_seconds",
                              "From a request's arrival at the engine to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.generated = Counter("phalanx_serve_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter("phalanx_serve_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.rate = TokenRate()
        Gauge("phalanx_serve_tokens_per_second", f"Generated tokens per second over the last "
              f"{RATE_WINDOW_SECONDS:g} s.", registry=r).set_function(self.rate.per_second)

    def watch(self, engine: Engine) -> None:
        self.queue_depth.set_function(lambda: engine.waiting)
        self.active_slots.set_function(lambda: engine.active)
        self.slots.set(engine.slots)

    def prompt_prefilled(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens_generated(self, count: int) -> None:
        self.generated.inc(count)
        self.rate.add(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
