"""Shared fixtures: a small corpus, a tiny model config and a way to run the real CLI in a subprocess."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

# Where the time goes (the slowest tests, seconds per folder) and the --time-limit guard CI sets.
pytest_plugins = ["timing"]

# A shell without job control starts background commands with SIGINT ignored, and every process the tests
# start would inherit that (Python leaves an ignored SIGINT ignored): the Ctrl-C tests need it delivered.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A model and batch small enough for many CPU runs in one test session, still a real Llama.
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.max_seq_len=64",
    "data.vocab_size=384",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=12",
    "train.warmup_steps=2",
    "train.eval_interval=6",
    "train.eval_batches=4",
    "checkpoint.interval=4",
    "checkpoint.keep=5",
    # float32 whatever the CPU: tests compare layouts within 1e-5, which bf16 autocast cannot hold
    # (`auto` picks bf16 on CPUs with bf16 units; tests/test_demo.py trains under `auto`).
    "train.dtype=float32",
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Two plays from the built-in corpus as a plain text file (~270 KB): fast to tokenise."""
    from phalanx.data.corpus import iter_documents, resolve_sources

    sources = [
        s
        for s in resolve_sources(["builtin:shakespeare"], Path.cwd())
        if s.path.stem in ("romeo-and-juliet", "macbeth")
    ]
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text("\n\n".join(iter_documents(sources)))
    return path


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    """One runs root per session, so the prepared-data cache is shared by the tests' runs."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def tiny_args(corpus, runs_root, request) -> list[str]:
    """Overrides for a tiny run with a fresh run name per test."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    return TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}", f"run.name={name}"]
