"""Embeddings over loopback: Ollama's /api/embed and /api/embeddings through the official `ollama` client,
OpenAI's /v1/embeddings through the official `openai` client (which asks for base64 and decodes it),
and raw httpx requests for the shapes and refusals. The vectors are checked against the definition
(final norm's states, mean over the input's tokens without BOS, unit length) computed here from the
same checkpoint."""

from __future__ import annotations

import base64
import sys
import threading

import numpy as np
import pytest
import torch
from serve_helpers import MODEL

TEXTS = ["ROMEO: But soft, what light", "JULIET: O Romeo, Romeo", "KING:"]


@pytest.fixture(scope="module")
def reference(served_run):
    """The definition, computed here on the same checkpoint, one input at a time."""
    from phalanx.serve.core.served import load_served_model

    served = load_served_model(served_run)

    def embed(text: str) -> np.ndarray:
        ids = served.text_prompt_ids(text)
        with torch.no_grad():
            states = served.loaded.model.hidden_states(torch.tensor([ids]))[0]
        mean = states[1:].mean(0) if len(ids) > 1 else states[0]
        return (mean / mean.norm()).numpy()

    return served, embed


def test_hidden_states_are_what_the_output_projection_reads(reference):
    served, _ = reference
    model = served.loaded.model
    tokens = torch.tensor([served.text_prompt_ids(TEXTS[0])])
    with torch.no_grad():
        assert torch.allclose(model.output(model.hidden_states(tokens)), model(tokens), atol=1e-5)
        # Causal: right padding changes no earlier position (what lets inputs share a forward).
        padded = torch.cat([tokens, torch.zeros(1, 7, dtype=torch.long)], dim=1)
        assert torch.allclose(model.hidden_states(padded)[:, : tokens.shape[1]], model.hidden_states(tokens), atol=1e-5)


def test_ollama_embed_matches_the_definition(oll, reference):
    _, embed = reference
    reply = oll.embed(model=MODEL, input=TEXTS)
    vectors = np.array(reply.embeddings)
    assert vectors.shape == (3, 64)  # the tiny model's dim
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    for text, vector in zip(TEXTS, vectors):
        assert np.allclose(vector, embed(text), atol=1e-4)
    assert not np.allclose(vectors[0], vectors[1], atol=1e-3)
    assert reply.model == MODEL and reply.total_duration > 0 and reply.load_duration == 0
    served, _ = reference
    assert reply.prompt_eval_count == sum(len(served.text_prompt_ids(t)) for t in TEXTS)

    single = oll.embed(model=MODEL, input=TEXTS[1])
    assert np.allclose(single.embeddings[0], vectors[1], atol=1e-5)  # alone or in a batch, the same vector
    older = oll.embeddings(model=MODEL, prompt=TEXTS[1])  # /api/embeddings: one unnested vector
    assert np.allclose(older.embedding, vectors[1], atol=1e-5)


def test_ollama_truncate_as_ollama_does(server, reference):
    served, _ = reference
    long = "ROMEO: " + "light " * 1500  # over the 1024-token context
    assert len(served.text_prompt_ids(long)) > 1024
    with server.client() as http:
        cut = http.post("/api/embed", json={"model": MODEL, "input": long}).json()
        assert cut["prompt_eval_count"] == 1024
        narrowed = http.post("/api/embed", json={"model": MODEL, "input": long, "options": {"num_ctx": 100}}).json()
        assert narrowed["prompt_eval_count"] == 100
        refused = http.post("/api/embed", json={"model": MODEL, "input": long, "truncate": False})
        assert refused.status_code == 400 and "the context holds 1024" in refused.json()["error"]
        empty = http.post("/api/embed", json={"model": MODEL, "input": []}).json()
        assert empty["embeddings"] == []
        assert http.post("/api/embeddings", json={"model": MODEL, "prompt": ""}).json() == {"embedding": []}
        assert http.post("/api/embed", json={"model": "nobody", "input": "x"}).status_code == 404
        wrong = http.post("/api/embed", json={"model": MODEL, "input": "x", "dimensions": 8})
        assert wrong.status_code == 400 and "64 dimensions" in wrong.json()["error"]
        assert http.post("/api/embed", json={"model": MODEL, "input": 5}).status_code == 400


def test_openai_client_and_raw_requests(oai, server, reference):
    _, embed = reference
    # The client asks for base64 by default and decodes it to floats.
    reply = oai.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == MODEL
    for text, item in zip(TEXTS, reply.data):
        assert np.allclose(item.embedding, embed(text), atol=1e-4)
    served, _ = reference
    tokens = sum(len(served.text_prompt_ids(t)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    floats = oai.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float", dimensions=64)
    assert np.allclose(floats.data[0].embedding, reply.data[0].embedding, atol=1e-6)

    with server.client() as http:
        raw = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
        assert np.allclose(decoded, embed(TEXTS[0]), atol=1e-4)
        # Token arrays embed as their text does (BOS added when missing).
        ids = served.text_prompt_ids(TEXTS[2])[1:]
        by_ids = http.post("/v1/embeddings", json={"model": MODEL, "input": ids}).json()
        both = http.post("/v1/embeddings", json={"model": MODEL, "input": [ids, ids[:1]]}).json()
        assert np.allclose(by_ids["data"][0]["embedding"], embed(TEXTS[2]), atol=1e-4)
        assert np.allclose(both["data"][0]["embedding"], by_ids["data"][0]["embedding"], atol=1e-5)

        def refused(body: dict) -> dict:
            response = http.post("/v1/embeddings", json={"model": MODEL, **body})
            assert response.status_code == 400, response.text
            return response.json()["error"]

        assert refused({"input": TEXTS, "dimensions": 32})["param"] == "dimensions"
        assert "empty" in refused({"input": []})["message"]
        assert "empty string" in refused({"input": ["a", ""]})["message"]
        assert "outside the vocabulary" in refused({"input": [1, 99999]})["message"]
        assert refused({"input": "x", "encoding_format": "int8"})["param"] == "encoding_format"
        assert refused({"input": "light " * 1500})["code"] == "context_length_exceeded"  # OpenAI never truncates
        missing = http.post("/v1/embeddings", json={"model": "nobody", "input": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_embeddings_leave_concurrent_generation_alone(server, oll):
    """Embedding batches run while a greedy generation decodes: its tokens are the ones it gets alone."""
    body = {
        "model": MODEL,
        "prompt": "JULIET:",
        "raw": True,
        "stream": False,
        "options": {"temperature": 0, "num_predict": 40, "presence_penalty": 1.0, "repeat_penalty": 1.0},
    }
    with server.client() as http:
        alone = http.post("/api/generate", json=body).json()["response"]
        results: list[str] = []

        def generate() -> None:
            with server.client() as own:
                results.append(own.post("/api/generate", json=body).json()["response"])

        thread = threading.Thread(target=generate)
        thread.start()
        for _ in range(3):
            vectors = http.post("/api/embed", json={"model": MODEL, "input": TEXTS * 8}).json()["embeddings"]
            assert len(vectors) == 24
        thread.join(120)
    assert results == [alone]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_the_embedding_thread_yields_the_cpu_to_decoding(reference):
    import os
    import time

    from phalanx.serve.core.embeddings import EMBED_NICENESS, Embedder

    served, _ = reference
    embedder = Embedder(served.loaded.model, 0)
    try:
        wanted = min(19, os.getpriority(os.PRIO_PROCESS, 0) + EMBED_NICENESS)
        deadline = time.monotonic() + 30  # the thread lowers itself first thing
        while os.getpriority(os.PRIO_PROCESS, embedder._thread.native_id) != wanted:
            assert time.monotonic() < deadline, "the embedding thread kept the decode thread's priority"
            time.sleep(0.01)
    finally:
        embedder.close()
