"""Embeddings from the served model: the final norm's hidden states, mean-pooled over the input's tokens
and L2-normalised (so a dot product is a cosine similarity).

Each input is framed as in training (BOS, then the text's tokens; no BOS for a tokenizer without one, as
Qwen's). BOS feeds the model but is left out of the mean: at position 0 its state is the same for every
input and would pull all embeddings towards one point; an empty input has nothing else, so its embedding
is BOS's own (without BOS an empty input is refused before it gets here).

The model is shared with the decode engine, whose thread is the only one that runs it in steps. An
embedding request does not join those steps (they are shaped for decoding); it runs on one worker thread
of its own, in inference mode, in forwards of at most MAX_BATCH_TOKENS padded tokens, at a lower CPU
priority than the decode thread. A forward only reads the weights, so the two threads never see each
other's work; they share the CPU.

Requests take turns on that thread, one forward each (round robin), so a request of 2,048 long inputs
delays a one-word request by one forward, not by all of its own. At most MAX_WAITING requests are in
line (beyond: EmbeddingQueueFull, HTTP 503), and a request whose client has gone is dropped at its next
turn, so abandoned work does not hold up the requests behind it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phalanx.models.decoder import Transformer

MAX_BATCH_TOKENS = 512  # padded tokens per forward: bounds memory and how long one turn holds the cores
MAX_INPUTS = 2048  # inputs per request, as OpenAI's embeddings endpoint allows
MAX_WAITING = 32  # embedding requests in line at once (running or waiting for their turn)
EMBED_NICENESS = 10  # how much lower than the decode thread the embedding thread runs
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


class EmbeddingQueueFull(Exception):
    """MAX_WAITING requests are already in line (HTTP 503)."""


class ClientLeft(Exception):
    """The client went away before its embeddings were done; the work was dropped."""


class InputTooLong(ValueError):
    """An input longer than the context when the request did not allow truncating it (HTTP 400)."""


def fit_to_context(ids: list[int], context: int, truncate: bool) -> list[int]:
    """The input's ids, cut to the context's first `context` tokens when truncating is allowed."""
    if len(ids) <= context:
        return ids
    if not truncate:
        raise InputTooLong(
            f"an input is {len(ids)} tokens but the context holds {context}; shorten it (or allow truncating it)"
        )
    return ids[:context]


def plan_batches(inputs: list[list[int]], max_batch_tokens: int = MAX_BATCH_TOKENS) -> list[list[int]]:
    """The inputs' indices in forwards of at most max_batch_tokens padded tokens (one input alone may be
    longer). Sorted by length, so inputs of similar length share a forward and little is padding."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    batches, at = [], 0
    while at < len(order):
        batch = [order[at]]
        # Sorted by length, so the last one added is the longest so far.
        while (
            at + len(batch) < len(order) and (len(batch) + 1) * len(inputs[order[at + len(batch)]]) <= max_batch_tokens
        ):
            batch.append(order[at + len(batch)])
        batches.append(batch)
        at += len(batch)
    return batches


def embed_batch(model: Transformer, inputs: list[list[int]], batch: list[int], bos_id: int | None) -> list[list[float]]:
    """One forward: the unit vectors of inputs[i] for i in batch, right-padded to the longest (causal
    attention: the padding changes no real position's state)."""
    device = model.tok_embeddings.weight.device
    longest = max(len(inputs[i]) for i in batch)
    tokens_BT = torch.zeros(len(batch), longest, dtype=torch.long, device=device)
    mask_BT = torch.zeros(len(batch), longest, dtype=torch.float32, device=device)
    for row, i in enumerate(batch):
        ids = inputs[i]
        tokens_BT[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        first = 1 if bos_id is not None and len(ids) > 1 and ids[0] == bos_id else 0  # BOS is context, not content
        mask_BT[row, first : len(ids)] = 1.0
    with torch.inference_mode():
        hidden_BTD = model.hidden_states(tokens_BT).float()
        mean_BD = (hidden_BTD * mask_BT[..., None]).sum(1) / mask_BT.sum(1, keepdim=True)
        return F.normalize(mean_BD, dim=-1).tolist()


def _yield_to_decoding() -> None:
    """Lower this worker thread's CPU priority (Linux sets it per thread; the threads it starts for its
    ops inherit it), so that where the cores are contended the engine's decode steps go first."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + EMBED_NICENESS))
    except (AttributeError, OSError):  # not Linux, or not allowed: the thread runs at normal priority
        pass


@dataclass
class _Job:
    inputs: list[list[int]]
    batches: deque[list[int]]  # the forwards still to run
    out: list[list[float]]
    done: Future = field(default_factory=Future)
    cancelled: bool = False


class Embedder:
    """Runs the embedding requests on one worker thread of lower priority, a forward of each in turn."""

    def __init__(
        self,
        model: Transformer,
        bos_id: int | None,  # None: the tokenizer has no BOS, every token is content
        max_waiting: int = MAX_WAITING,
        poll_seconds: float = DISCONNECT_POLL_SECONDS,
    ):
        self.model, self.bos_id, self.max_waiting, self.poll_seconds = model, bos_id, max_waiting, poll_seconds
        self.forwards = 0  # forwards run so far (a dropped request's are not run)
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="phalanx-embed", daemon=True)
        self._thread.start()

    @property
    def dimensions(self) -> int:
        return self.model.args.dim

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    async def embed(
        self, inputs: list[list[int]], client_gone: Callable[[], Awaitable[bool]] | None = None
    ) -> list[list[float]]:
        """The inputs' unit vectors, in order. EmbeddingQueueFull at once when the line is full;
        ClientLeft (and the work dropped) when client_gone() says the client has left before the end."""
        if not inputs:
            return []
        job = _Job(inputs, deque(plan_batches(inputs)), [[] for _ in inputs])
        with self._cond:
            if len(self._jobs) >= self.max_waiting:
                raise EmbeddingQueueFull(
                    f"{len(self._jobs)} embedding requests are already waiting (the most "
                    "this server holds); try again later"
                )
            self._jobs.append(job)
            self._cond.notify()
        result = asyncio.wrap_future(job.done)
        try:
            while True:
                finished, _ = await asyncio.wait({result}, timeout=self.poll_seconds)
                if finished:
                    return result.result()
                if client_gone is not None and await client_gone():
                    raise ClientLeft()
        finally:
            job.cancelled = True  # no-op once done; otherwise the worker drops it at its next turn

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _work(self) -> None:
        _yield_to_decoding()
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                job = self._jobs.popleft()
            if job.cancelled:
                continue
            try:
                batch = job.batches.popleft()
                for i, vector in zip(batch, embed_batch(self.model, job.inputs, batch, self.bos_id)):
                    job.out[i] = vector
                self.forwards += 1
            except Exception as e:  # this request's forward: it fails alone, the thread goes on
                _settle(job.done, error=e)
                continue
            if not job.batches:
                _settle(job.done, result=job.out)
                continue
            with self._cond:
                self._jobs.append(job)  # its next forward after every other request's
        with self._cond:
            left = list(self._jobs)
            self._jobs.clear()
        for job in left:
            _settle(job.done, error=RuntimeError("the server is shutting down"))


def _settle(done: Future, result: list[list[float]] | None = None, error: Exception | None = None) -> None:
    """Give a request its result or error, unless its waiter was cancelled meanwhile (nobody listens)."""
    try:
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)
    except InvalidStateError:
        pass
