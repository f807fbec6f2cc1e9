"""Prometheus metrics of one server, in a registry of its own (two apps in one process never collide).

Throughput is counters (phalanx_serve_generated_tokens_total, ..._prompt_tokens_total): Prometheus's
rate() over them is tokens per second over any window, which no precomputed gauge can offer. No
`_created` series: they double every counter's series for a timestamp nobody graphs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from phalanx.serve.core.contract import ServingEngine

# Time to first token: from a few milliseconds (a tiny model, idle) to a minute (a long queue).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """Also the engine's observer: it reports first tokens and generated tokens here."""

    def __init__(self):
        disable_created_metrics()  # prometheus_client's switch is process-wide; phalanx wants them nowhere
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "phalanx_serve_requests",
            "HTTP requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.queue_depth = Gauge("phalanx_serve_queue_depth", "Requests waiting for a slot.", registry=r)
        self.active_slots = Gauge("phalanx_serve_active_slots", "Slots decoding a request now.", registry=r)
        self.slots = Gauge("phalanx_serve_slots", "Slots: requests decoded together at most.", registry=r)
        self.ttft = Histogram(
            "phalanx_serve_time_to_first_token_seconds",
            "From a request's arrival at the engine to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.generated = Counter("phalanx_serve_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter("phalanx_serve_prompt_tokens", "Prompt tokens prefilled.", registry=r)

    def watch(self, engine: ServingEngine) -> None:
        self.queue_depth.set_function(lambda: engine.waiting)
        self.active_slots.set_function(lambda: engine.active)
        self.slots.set(engine.slots)

    def prompt_prefilled(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens_generated(self, count: int) -> None:
        self.generated.inc(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
