"""/metrics: Prometheus text that the official parser reads, counting requests by endpoint and status."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL


def scrape(http) -> dict[tuple[str, tuple], float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def requests_count(samples, endpoint: str, status: str) -> float:
    return samples.get(("phalanx_serve_requests_total", (("endpoint", endpoint), ("status", status))), 0.0)


def test_metrics_parse_and_count(server):
    with server.client() as http:
        before = scrape(http)
        chat = http.post(
            "/api/chat",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": False,
                "options": {"num_predict": 5},
            },
        ).json()
        completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}).json()
        assert http.post("/api/chat", json={"model": "nobody", "messages": 5}).status_code == 400
        assert http.post("/api/chat", json={"model": "nobody", "messages": [{"role": "user"}]}).status_code == 404
        after = scrape(http)

    assert requests_count(after, "/api/chat", "200") - requests_count(before, "/api/chat", "200") == 1
    assert requests_count(after, "/v1/completions", "200") - requests_count(before, "/v1/completions", "200") == 1
    assert requests_count(after, "/api/chat", "400") - requests_count(before, "/api/chat", "400") == 1
    assert requests_count(after, "/api/chat", "404") - requests_count(before, "/api/chat", "404") == 1
    assert requests_count(after, "/metrics", "200") >= 1

    generated = ("phalanx_serve_generated_tokens_total", ())
    assert after[generated] - before[generated] == chat["eval_count"] + completion["usage"]["completion_tokens"]
    prompt = ("phalanx_serve_prompt_tokens_total", ())
    assert after[prompt] - before[prompt] == chat["prompt_eval_count"] + completion["usage"]["prompt_tokens"]
    ttft = ("phalanx_serve_time_to_first_token_seconds_count", ())
    assert after[ttft] - before[ttft] == 2
    assert after[("phalanx_serve_slots", ())] == 8
    assert after[("phalanx_serve_queue_depth", ())] == 0 and after[("phalanx_serve_active_slots", ())] == 0


def test_throughput_is_counters_and_no_created_series(server):
    """Tokens per second is rate() over the token counters, not a precomputed gauge; and no `_created`
    series (a timestamp per counter that only doubles the series count)."""
    with server.client() as http:
        text = http.get("/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["phalanx_serve_generated_tokens"] == "counter"
    assert families["phalanx_serve_prompt_tokens"] == "counter"
    assert "phalanx_serve_tokens_per_second" not in families
    assert "_created" not in text
