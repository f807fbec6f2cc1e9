"""phalanx's server on 127.0.0.1, in a thread of this process, for lm-evaluation-harness to talk to.

The harness's `local-completions` model scores prompts over /v1/completions and finds the tokenizer
through /tokenize and /tokenizer_info, so evaluating through the real server runs exactly the code
`phalanx serve` runs (its batched engine, its prompt framing), not a second copy of the model. The port
is any free one, and a random key guards it: another local user cannot use the model meanwhile.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import httpx

from phalanx.errors import PhalanxError

START_TIMEOUT_SECONDS = 60.0


class LocalServer:
    """`with LocalServer(path, slots, device, dtype) as server:` serves the model at server.url until the
    block ends; server.served is the loaded model, server.engine the engine under the routes."""

    def __init__(self, path: Path, slots: int, device: str = "auto", dtype: str = "auto"):
        import uvicorn

        from phalanx.http_server import server_config
        from phalanx.listen import bind
        from phalanx.serve.core.served import load_served_model
        from phalanx.serve.engines.torch_engine import Engine
        from phalanx.serve.http.app import create_app
        from phalanx.serve.http.metrics import ServeMetrics
        from phalanx.serve.server import pick_device

        torch_device, torch_dtype = pick_device(device, dtype)  # float32 on a CPU, as `generate` computes
        self.served = load_served_model(path, torch_device, torch_dtype)
        self.api_key = secrets.token_urlsafe(24)
        metrics = ServeMetrics()
        # The harness sends `batch_size` prompts a request: as many slots, and as many places in the
        # queue, so that no request of the harness is ever refused as too many at once.
        self.engine = Engine(
            self.served.loaded.model, self.served.loaded.tokenizer, slots=slots, max_queue=slots, observer=metrics
        )
        app = create_app(self.served, self.engine, metrics, api_key=self.api_key)
        self._sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._uvicorn = uvicorn.Server(server_config(app, "warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def context(self) -> int:
        return self.engine.context

    def __enter__(self) -> LocalServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise PhalanxError("phalanx's server for the evaluation stopped while starting")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.__exit__()
        raise PhalanxError(f"phalanx's server for the evaluation did not answer within {START_TIMEOUT_SECONDS:.0f} s")

    def __exit__(self, *exc) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(30)
        self._sock.close()
