"""Live servers for the serving tests: the `phalanx serve` subprocess's address, and the same app run in a
thread of the test process for settings the shared server does not have."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key-0123456789"  # 16+ characters, as `phalanx serve` requires
MODEL = "tiny-test"
# The tiny shape of tests/conftest.py's TINY, with a longer context so a request can run for a while
# (the queue tests) and a prompt can overflow it; 4 steps of training are plenty to serve.
SERVE_RUN = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.max_seq_len=1024",
    "data.vocab_size=384",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=4",
    "train.warmup_steps=2",
    "train.eval_interval=4",
    "train.eval_batches=2",
    "checkpoint.interval=4",
    "checkpoint.keep=1",
    "train.dtype=float32",  # the served weights the same on any CPU (`auto` is bf16 on some)
]


@dataclass
class LiveServer:
    url: str
    api_key: str | None
    model: str = MODEL

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, log: Path | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"phalanx serve exited {proc.returncode}:\n{log.read_text() if log else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server at {url} never became healthy")


@contextlib.contextmanager
def serve_process(command: list[str], log: Path, start_timeout: float = 120, env: dict | None = None):
    """`phalanx serve` (`command`) in a subprocess logging to `log`: its URL once it listens and answers
    /health; terminated (killed if it lingers) afterwards."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + start_timeout
        while not (found := re.search(r"listening on (http://\S+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"phalanx serve did not start:\n{log.read_text()}")
            time.sleep(0.1)
        wait_healthy(found.group(1), proc, log, start_timeout)
        yield found.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


class InProcessServer:
    """The same app in a thread of the test process, for settings the shared server does not have."""

    def __init__(
        self,
        path: Path,
        slots: int,
        max_queue: int,
        api_key: str | None = None,
        name: str | None = MODEL,
        **app_options,
    ):
        import uvicorn

        from phalanx.http_server import server_config
        from phalanx.serve.core.served import load_served_model
        from phalanx.serve.engines.torch_engine import Engine
        from phalanx.serve.http.app import create_app
        from phalanx.serve.http.metrics import ServeMetrics
        from phalanx.serve.server import bind

        self.served = load_served_model(path, name=name)
        metrics = ServeMetrics()
        self.engine = Engine(
            self.served.loaded.model, self.served.loaded.tokenizer, slots=slots, max_queue=max_queue, observer=metrics
        )
        app = create_app(self.served, self.engine, metrics, api_key=api_key, **app_options)
        self.sock = bind("127.0.0.1", 0)
        self.live = LiveServer(f"http://127.0.0.1:{self.sock.getsockname()[1]}", api_key)
        self.uvicorn = uvicorn.Server(server_config(app, "warning"))  # as `phalanx serve` runs it
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_healthy(self.live.url)
        return self.live

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)
