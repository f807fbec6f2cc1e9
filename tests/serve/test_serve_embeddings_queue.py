"""Embedding requests share one worker fairly, in a bounded line, and are dropped when their client
leaves (serve/core/embeddings.py): a one-word request behind a request of many long inputs waits one
forward, not all of them; a request whose client has gone stops costing forwards; a full line is 503."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from serve_helpers import MODEL

from phalanx.serve.core.embeddings import ClientLeft, Embedder, EmbeddingQueueFull

LONG = "ROMEO: wherefore art thou Romeo, deny thy father and refuse thy name " * 6  # ~90 tokens


@pytest.fixture(scope="module")
def served(served_run):
    from phalanx.serve.core.served import load_served_model

    return load_served_model(served_run)


@pytest.fixture
def embedder(served):
    e = Embedder(served.loaded.model, served.text_prompt_ids("")[0], max_waiting=2, poll_seconds=0.01)
    yield e
    e.close()


def many_long_inputs(served, n: int = 120) -> list[list[int]]:
    return [served.text_prompt_ids(f"{i} {LONG}") for i in range(n)]  # ~225 tokens: 2 per forward


def test_a_small_request_waits_one_forward_of_a_big_one_not_all(served, embedder):
    big_inputs, small_inputs = many_long_inputs(served), [served.text_prompt_ids("KING:")]

    async def both():
        big = asyncio.ensure_future(embedder.embed(big_inputs))
        while embedder.forwards == 0:  # the big one has the worker
            await asyncio.sleep(0.005)
        # Counted where the small one joins the line (embed queues it before its first await): on a
        # loaded machine the loop may wake late, after several of the big one's forwards.
        queued_at = embedder.forwards
        small = await embedder.embed(small_inputs)
        return small, queued_at, embedder.forwards, await big

    small, queued_at, at_small, big = asyncio.run(both())
    assert len(small) == 1 and len(big) == len(big_inputs)
    total = embedder.forwards
    # The small one ran after at most two of the big one's forwards (the one running when it came, and at
    # most one more before its turn; one more where the worker finished one as the count was read), where
    # a first-come worker would have run all 60 first.
    assert at_small - queued_at <= 3 and at_small < total - 1, (queued_at, at_small, total)


def test_a_request_whose_client_left_is_dropped(served, embedder):
    big_inputs = many_long_inputs(served, 1000)  # 500 forwards

    async def leave_after_a_forward() -> bool:
        return embedder.forwards >= 1

    async def run():
        with pytest.raises(ClientLeft):
            await embedder.embed(big_inputs, leave_after_a_forward)
        at_leaving = embedder.forwards
        await asyncio.sleep(0.5)  # time for dozens of forwards, were it still running
        return at_leaving, embedder.forwards, await embedder.embed([served.text_prompt_ids("KING:")])

    at_leaving, after, small = asyncio.run(run())
    # Dropped at its next turn: one forward at most after the client was seen gone.
    assert at_leaving < 500 and after <= at_leaving + 1, (at_leaving, after)
    assert len(small) == 1 and embedder.waiting == 0


def test_a_full_line_is_refused_at_once(served, embedder):
    inputs = many_long_inputs(served, 40)

    async def run():
        waiting = [asyncio.ensure_future(embedder.embed(inputs)) for _ in range(2)]
        await asyncio.sleep(0)  # both in line (max_waiting=2)
        started = time.perf_counter()
        with pytest.raises(EmbeddingQueueFull):
            await embedder.embed(inputs)
        refused_in = time.perf_counter() - started
        return refused_in, [len(v) for v in await asyncio.gather(*waiting)]

    refused_in, lengths = asyncio.run(run())
    assert refused_in < 0.5 and lengths == [40, 40]


def test_abandoned_requests_over_http_do_not_hold_up_the_next(server, served):
    """The issue's case over loopback: big requests whose clients gave up, then a one-word request."""
    body = {"model": MODEL, "input": [f"{i} {LONG}" for i in range(2048)]}  # 1,024 forwards each
    gone = []

    def abandon():
        try:
            with server.client(timeout=1.0) as http:
                http.post("/api/embed", json=body)
        except httpx.TimeoutException:
            gone.append(True)

    threads = [threading.Thread(target=abandon) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(gone) == 3  # each client gave up before its embeddings were done
    with server.client() as http:
        started = time.perf_counter()
        reply = http.post("/api/embed", json={"model": MODEL, "input": "KING:"})
        waited = time.perf_counter() - started
    assert reply.status_code == 200 and len(reply.json()["embeddings"]) == 1
    # 3,072 forwards (12 s or more of work here) were asked for and abandoned; dropped, they cost the next
    # request at most a forward each.
    assert waited < 5, f"the one-word request waited {waited:.1f} s behind abandoned work"
