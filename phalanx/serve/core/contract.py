"""The contract between phalanx serve's engines and their callers (the HTTP routes, `phalanx chat` and
`phalanx generate`): a caller submits prompt token ids with sampling options and gets a RequestStream of
text pieces that ends in one Finish; cancel() on the stream frees the request's slot at the next step.
QueueFull and PromptTooLong refuse a request at submit, before it holds anything. Every engine (torch,
llama.cpp, vLLM in serve/engines/) implements ServingEngine; the callers depend on that alone.

A request may also ask for its prompt to be scored (prompt_logprobs, where the engine's scores_prompts
says it can): the log-probability of each prompt token after the first given the tokens before it, as
the prefill computes them, handed over on the stream before its first piece. With max_tokens 0 such a
request is scored and ends ("length") without generating.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.core.structured_output import TokenConstraint, TokenVocabulary


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full (HTTP 503)."""


class PromptTooLong(ValueError):
    """The prompt leaves no room in the context for a reply (HTTP 400); never truncated silently."""


@dataclass
class Finish:
    reason: str  # "stop" (end of text or a stop string), "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int
    submitted_at: float  # time.perf_counter() stamps
    prefill_started_at: float
    first_token_at: float | None
    finished_at: float
    error: str | None = None

    @property
    def prompt_seconds(self) -> float:
        """Prefill up to the first token (Ollama's prompt_eval_duration)."""
        return (self.first_token_at or self.finished_at) - self.prefill_started_at

    @property
    def generation_seconds(self) -> float:
        """From the first token to the last (Ollama's eval_duration)."""
        return self.finished_at - (self.first_token_at or self.finished_at)

    @property
    def total_seconds(self) -> float:
        return self.finished_at - self.submitted_at


class Piece(str):
    """A piece of text, with the log-probabilities of the tokens it completes (when the request asked)."""

    logprobs: list[dict]  # set by of(); a str subclass cannot have __slots__

    @classmethod
    def of(cls, text: str, logprobs: list[dict]) -> Piece:
        piece = cls(text)
        piece.logprobs = logprobs
        return piece


class RequestStream:
    """One request's output. Iterate it (a thread) or `async for` over chunks() (an event loop, given at
    submit): text pieces, then it ends and `finish` is set. cancel() frees the slot at the next step."""

    def __init__(self, prompt_tokens: int, loop: asyncio.AbstractEventLoop | None):
        self.prompt_tokens = prompt_tokens
        self.finish: Finish | None = None
        self.cancelled = False
        self.logprobs: list[dict] = []  # every piece's, in order (for replies that are not streamed)
        # Scored prompts only: one entry per prompt token after the first (the first has nothing before it
        # to be conditioned on), set by the engine before it delivers the first piece or the finish.
        self.prompt_logprobs: list[dict] | None = None
        self._loop = loop
        self._queue: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if loop else queue.SimpleQueue()

    def cancel(self) -> None:
        self.cancelled = True

    def _deliver(self, item: str | Finish) -> None:
        if self._loop is None:
            self._queue.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True

    def __iter__(self) -> Iterator[str]:
        while not isinstance(item := self._queue.get(), Finish):
            yield item
        self.finish = item

    async def chunks(self) -> AsyncIterator[str]:
        while not isinstance(item := await self._queue.get(), Finish):
            yield item
        self.finish = item

    def text(self) -> str:
        """Everything, waiting for the end (threads only)."""
        return "".join(self)


class EngineObserver(Protocol):
    def prompt_prefilled(self, tokens: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def tokens_generated(self, count: int) -> None: ...


@dataclass
class Request:
    prompt_ids: list[int]
    options: SamplingOptions
    limit: int  # most new tokens: max_tokens capped by the context left
    stream: RequestStream
    submitted_at: float
    constraint: TokenConstraint | None = None  # structured output: the grammar the tokens must follow
    top_logprobs: int | None = None  # None: no log-probabilities; k: each token's and its k likeliest
    prompt_logprobs: int | None = None  # None: the prompt is not scored; k: as top_logprobs, for its tokens
    # The token that ends the reply (end of text) gets a log-probability entry too: OpenAI's legacy
    # completions list it, and a client that drops the last entry as the generated one relies on that.
    list_stop_token: bool = False


class ServingEngine(Protocol):
    """What a caller may use of an engine. Capacity: `slots` requests run at once, `max_queue` more wait,
    each within `context` tokens (prompt and reply); `active` and `waiting` say how many there are now.
    scores_prompts: whether submit takes prompt_logprobs."""

    slots: int
    max_queue: int
    context: int
    vocabulary: TokenVocabulary  # token bytes, and grammars for structured output
    device: torch.device
    observer: EngineObserver | None
    scores_prompts: bool

    @property
    def kv_cache_bytes(self) -> int: ...
    @property
    def alive(self) -> bool: ...
    @property
    def active(self) -> int: ...
    @property
    def waiting(self) -> int: ...

    def submit(
        self,
        prompt_ids: list[int],
        options: SamplingOptions,
        context_limit: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        constraint: TokenConstraint | None = None,
        top_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        list_stop_token: bool = False,
    ) -> RequestStream: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 10.0) -> None: ...
