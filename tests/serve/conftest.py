"""Fixtures for the serving tests: one tiny trained run for the whole package, and the real `phalanx serve`
CLI on it in a subprocess (with an API key). Every server binds 127.0.0.1 on a port the OS picks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from serve_helpers import API_KEY, MODEL, SERVE_RUN, LiveServer, serve_process

from tests.helpers import train_json


@pytest.fixture(scope="module")
def tokenizer(request, corpus):
    """For the engine tests: a tokenizer of the test module's own ARGS.vocab_size, trained on the corpus."""
    from phalanx.data.tokenizer import train_tokenizer

    return train_tokenizer([corpus.read_text()], request.module.ARGS.vocab_size)


@pytest.fixture(scope="module")
def model(request):
    """For the engine tests: a seeded random model of the test module's own ARGS (random weights: every
    context gets its own argmax, so a bit a neighbour changed would show)."""
    import torch

    from phalanx.models.decoder import Transformer

    torch.manual_seed(0)
    return Transformer(request.module.ARGS).eval()


@pytest.fixture(scope="session")
def served_run(corpus, runs_root) -> Path:
    summary = train_json(*SERVE_RUN, f"data.sources=[{corpus}]", f"run.dir={runs_root}", "run.name=serve-tiny")
    return Path(summary["run_dir"])


@pytest.fixture(scope="session")
def server(served_run, tmp_path_factory) -> LiveServer:
    """`phalanx serve` itself: 8 slots (so 16 requests also queue), an API key, any free port; float32, as
    the references these tests compute in process (a CPU with bf16 units would serve bf16 by default)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process(
        [
            sys.executable,
            "-m",
            "phalanx",
            "serve",
            str(served_run),
            "--port",
            "0",
            "--api-key",
            API_KEY,
            "--model-name",
            MODEL,
            "--slots",
            "8",
            "--max-queue",
            "32",
            "--dtype",
            "float32",
            "--log-level",
            "warning",
        ],
        log,
    ) as url:
        yield LiveServer(url, API_KEY)


@pytest.fixture(scope="module")
def oai(server):
    """The official OpenAI client on the shared server."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def oll(server):
    """The official Ollama client on the shared server."""
    import ollama

    return ollama.Client(host=server.url, headers=server.headers)


@pytest.fixture(scope="module")
def http(server):
    """Raw requests (httpx) to the shared server, with its API key."""
    with server.client() as client:
        yield client
