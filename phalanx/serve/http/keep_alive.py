"""Ollama's `keep_alive`: how long the model's weights stay in memory once the server is idle.

Each Ollama request may set it (a number of seconds, or a Go duration such as "5m", "1h30m", "300ms";
a negative value: forever; 0: unload as soon as the request is done). As in Ollama each request sets
it anew, and one that does not say (OpenAI's requests among them) gets the server's default, which is
forever: a server is started to serve one model.

Unloading frees the parameters' memory (each parameter's storage is swapped for an empty one, in place,
so the engine's reference to the model stays valid); the next request loads the same checkpoint again
through the one model loader and reports the time in `load_duration`. The KV cache is the engine's and
stays allocated. The model is unloaded only while nothing uses it: no request running or waiting in the
engine, no stream submitted and not yet finished, no embedding in progress.
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import torch

from phalanx.run.model_loader import load_model
from phalanx.serve.core.contract import RequestStream, ServingEngine
from phalanx.serve.core.served import ServedModel
from phalanx.serve.http.common import ApiError

POLL_SECONDS = 0.1
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(value: Any) -> float | None:
    """Seconds, or None for forever, from what Ollama accepts (as its API reads it: a number is seconds,
    a string a Go duration or a bare number of seconds)."""
    if isinstance(value, bool):
        raise ApiError(400, "invalid 'keep_alive': give a duration such as \"5m\" or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _GO_DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ApiError(
                    400,
                    f'invalid \'keep_alive\' {text!r}: give a duration such as "5m", "1h30m", '
                    '"10s", or a number of seconds (negative: keep loaded)',
                ) from None
            seconds = sign * sum(float(n) * _GO_UNITS[u] for n, u in parts)
    return None if seconds < 0 else seconds


def unloads_now(value: Any) -> bool:
    """keep_alive 0 (or "0s"...): the weights go as soon as nothing uses them."""
    return value is not None and parse_keep_alive(value) == 0


class ModelResidency:
    """Whether the served model's weights are in memory, and when they leave."""

    def __init__(self, served: ServedModel, engine: ServingEngine, default: float | None = None):
        self.served, self.engine, self.default = served, engine, default
        served.parameters, served.size_bytes  # noqa: B018 -- computed (and kept) while the weights are in
        params = list(served.loaded.model.parameters())
        self.dtype, self.device = params[0].dtype, params[0].device
        self.idle_limit = default  # seconds idle before unloading; None: never
        self._idle_since: float | None = time.monotonic()
        self._streams: list[RequestStream] = []
        self._embedding = 0
        self._lock: asyncio.Lock | None = None
        self._watcher: asyncio.Task | None = None
        self.loaded = True

    # ---- what the routes call ----

    async def ready(self, keep_alive: Any = None) -> float:
        """Load the weights if they are out (returns the seconds it took, else 0) and take the request's
        keep_alive (None: the default); call it right before submitting, with no await between, so nothing
        unloads in between."""
        self.idle_limit = self.default if keep_alive is None else parse_keep_alive(keep_alive)
        self._idle_since = None
        seconds = 0.0
        if not self.loaded:
            async with self._the_lock():
                if not self.loaded:
                    started = time.perf_counter()
                    try:
                        await asyncio.to_thread(self._load)
                    except Exception as e:  # the checkpoint went away or broke since the server started
                        raise ApiError(
                            503, f"the model's weights could not be loaded again: {e}", code="model_unavailable"
                        ) from None
                    seconds = time.perf_counter() - started
        self._idle_since = None
        self._start_watching()
        return seconds

    def track(self, stream: RequestStream) -> None:
        """A submitted request: the model stays in while it has not finished."""
        self._streams.append(stream)

    @asynccontextmanager
    async def embedding(self, keep_alive: Any = None):
        """Around an embedding request: loads the weights if needed, keeps them in until it is done;
        yields the load time in seconds."""
        self._embedding += 1
        try:
            yield await self.ready(keep_alive)
        finally:
            self._embedding -= 1

    async def unload_now(self) -> None:
        """keep_alive 0 with nothing to generate: out at once if idle, else as soon as it is."""
        self.idle_limit = 0.0
        if self.loaded and not self.busy:
            self._unload()
        else:
            self._start_watching()

    @property
    def expires_at(self) -> datetime | None:
        """When the weights leave if nothing else arrives (None: never)."""
        if self.idle_limit is None:
            return None
        idle_for = 0.0 if self._idle_since is None else time.monotonic() - self._idle_since
        return datetime.now(UTC) + timedelta(seconds=max(0.0, self.idle_limit - idle_for))

    @property
    def busy(self) -> bool:
        self._streams = [s for s in self._streams if s.finish is None and not s.cancelled]
        return bool(self._streams or self._embedding or self.engine.active or self.engine.waiting)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    # ---- inside ----

    def _the_lock(self) -> asyncio.Lock:
        if self._lock is None:  # made in the running loop, not at import or construction time
            self._lock = asyncio.Lock()
        return self._lock

    def _start_watching(self) -> None:
        if self.idle_limit is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self.loaded and self.idle_limit is not None:
            await asyncio.sleep(POLL_SECONDS)
            if self.busy:
                self._idle_since = None
                continue
            now = time.monotonic()
            if self._idle_since is None:
                self._idle_since = now
            if (
                self.idle_limit is not None
                and now - self._idle_since >= self.idle_limit
                and not (self._lock and self._lock.locked())
            ):
                self._unload()

    def _unload(self) -> None:
        for p in self.served.loaded.model.parameters():  # a tied weight is one parameter: emptied once
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.loaded = False
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _load(self) -> None:
        # The very checkpoint served before, not whatever is newest in the run now.
        fresh = dict(load_model(self.served.loaded.checkpoint, self.device).model.named_parameters())
        for name, p in self.served.loaded.model.named_parameters():
            p.data = fresh[name].data.to(self.dtype)
        self.loaded = True
        self._idle_since = None
