"""The inference engine: continuous batching over a preallocated KV cache.

One background thread owns the model. The cache holds `slots` rows of `context` positions, allocated
once. A request waits in a bounded queue until a slot is free; at the next step boundary it joins: the
prompts joining at one boundary are prefilled together, in one forward pass over all their tokens with
each prompt attending only to its own (prefill.py), each into its own cache row, and their first tokens
come out together; then every step decodes one token for all running requests in a single batched
forward, each row at its own position. Finished rows free their slot at once. One boundary takes at most
MAX_PREFILL_TOKENS prompt tokens (a longer prompt is chunked, below), so a burst joins over several
boundaries with a decode step between each: first tokens come out pass by pass, and running rows are
never stalled for a whole burst's prefill. A prompt longer than prefill_chunk tokens is prefilled chunk by
chunk, one chunk per boundary, into a one-row cache of its own (so decode steps never touch its half-made
rows), beside that boundary's short prompts and with a decode step of the running requests between its
chunks; after its last chunk its keys and values move into a packed row and its first token comes out.
Long prompts take turns, one chunking at a time, in the order they joined.

A decode step is sized to what runs, not to the server (on CPU, where it can be proven row-invariant):
running requests keep the low rows of the cache packed (a leaving request's row is refilled by moving
the last one down, one copy per departure rather than a gather per step), the step runs over the first
`width` rows, width the running count rounded up to a power of two (capped at slots), and attends over
the first `span` positions, span the longest live row rounded up by at most 25% (step_span). So
one request on a 16-slot server decodes one row over its own length, and the few shapes there are keep
any shape cache (oneDNN's primitives, a compiled graph) small.

Greedy decoding gives a request the same tokens alone as in a busy batch because each row's math never
sees its neighbours or the step's width: the linear layers run through oneDNN on packed weights
(row_invariant.py), whose rows are the same bits at any batch size, where MKL's are not; a prompt's
attention in a batched prefill is the very call its prefill alone makes; the attention of batched
decoding is spelt out row by row (Attention.attend_rows), and positions beyond a row's length weigh
exactly 0 whatever the span. Where that cannot be had (a GPU, another dtype) every step keeps today's
full shape, (slots, 1) over the whole context, idle rows padded; and where tall products are not
row-invariant (bf16 on this CPU: batched_prefill) each prompt is prefilled alone through the model's own
forward. Chunking holds everywhere: a prompt's chunks are cut from its length alone (prefill.chunk_plan)
and each chunk pass holds that prompt only, so its passes have the same shapes and inputs, hence the same
bits, alone and in company, on any device and dtype. Sampling is per row, with the request's own generator.

Callers hold a RequestStream: text pieces as they are decoded (whole characters, never part of a stop
string), then one Finish with the reason and the counts and timings.

A request may bring a TokenConstraint (structured output: only tokens its grammar allows are sampled in
its row, and it ends with "stop" once the grammar is complete) and ask for log-probabilities: each taken
token's log-softmax under the model's raw logits (before penalties, temperature, filters or the grammar's
mask, as OpenAI reports them) with the k likeliest alternatives, carried by the piece its text ends up in.
Neither changes which token a row takes: greedy rows without a grammar still take the batch's argmax.

No single request can stop the thread: a failure in one request's set-up, sampling or text decoding
fails that request alone (reason "error"), and only a failed batched forward fails the requests of that
step. Anything else that escapes a step fails what was running and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from tokenizers import Tokenizer

from phalanx.data.tokenizer import special_ids
from phalanx.models.llama import KVCache, Transformer, decode_attention_dtype
from phalanx.serve.options import SamplingOptions
from phalanx.serve.prefill import (
    MAX_PREFILL_TOKENS,
    PREFILL_CHUNK_TOKENS,
    chunk_plan,
    prefill_chunk,
    prefill_rows_agree,
    prefill_together,
)
from phalanx.serve.row_invariant import make_rows_invariant
from phalanx.serve.sampler import RequestSampler
from phalanx.serve.structured_output import TokenConstraint, TokenVocabulary
from phalanx.serve.text_stream import IncrementalText, StopMatcher

log = logging.getLogger("phalanx.serve")


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
class _Request:
    prompt_ids: list[int]
    options: SamplingOptions
    limit: int  # most new tokens: max_tokens capped by the context left
    stream: RequestStream
    submitted_at: float
    constraint: TokenConstraint | None = None  # structured output: the grammar the tokens must follow
    top_logprobs: int | None = None  # None: no log-probabilities; k: each token's and its k likeliest


@dataclass
class _Running:
    request: _Request
    slot: int
    position: int  # where the next fed token goes in the cache
    sampler: RequestSampler
    text: IncrementalText
    stops: StopMatcher
    prefill_started_at: float
    last_token: int = 0
    generated: int = 0
    first_token_at: float | None = None
    logprobs: list[dict] | None = None  # entries whose text has not been handed out yet


class _SlotCache:
    """One row of the shared cache, shaped like a batch-of-one KVCache (views: writes land in it)."""

    def __init__(self, cache: KVCache, row: int):
        self.max_len = cache.max_len
        self._layers = [(k[row:row + 1], v[row:row + 1]) for k, v in zip(cache.k, cache.v)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]


class _StepCache:
    """The first `width` rows and `span` positions of the shared cache: what one decode step reads (views:
    the step's writes, at positions below span, land in the cache)."""

    def __init__(self, cache: KVCache, width: int, span: int):
        self.max_len = span
        self._layers = [(k[:width, :, :span], v[:width, :, :span]) for k, v in zip(cache.k, cache.v)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]


def step_width(running: int, slots: int) -> int:
    """Rows a decode step runs over: the running count rounded up to a power of two, at most slots."""
    return min(1 << (running - 1).bit_length(), slots)


def step_span(longest: int, context: int) -> int:
    """Positions a decode step attends over: the longest live row rounded up to a multiple of a quarter
    of the power of two below it (at most 25% beyond it, four shapes per doubling), at least 32."""
    if longest <= 32:
        return min(32, context)
    quarter = 1 << max((longest - 1).bit_length() - 3, 0)
    return min(-(-longest // quarter) * quarter, context)


class TokenOutput:
    """What happens to each token an engine picks, the same for every engine (this one,
    llamacpp_engine.py and vllm_engine.py): counts and timings, the sampler's and the grammar's state,
    end-of-text, stop strings, the token budget, log-probabilities and the text handed out. A running
    request (`run`) has request, sampler, stops, text, logprobs, generated, first_token_at and last_token;
    the engine has observer, eos_id, vocabulary and its own _finish(run, reason). `scores` is what the
    engine's _logprob_entry reads: the row's logits here and in llama.cpp, vLLM's logprobs there."""

    def _take(self, run, token: int, scores) -> None:
        now = time.perf_counter()
        if run.first_token_at is None:
            run.first_token_at = now
            if self.observer:
                self.observer.first_token(now - run.request.submitted_at)
        run.generated += 1
        if self.observer:
            self.observer.tokens_generated(1)
        if run.sampler is not None:  # None where the engine underneath samples (vLLM)
            run.sampler.accept(token)
        constraint = run.request.constraint
        if constraint is not None:
            constraint.accept(token)
        if token == self.eos_id and not run.request.options.ignore_eos:
            return self._finish(run, "stop")
        if run.logprobs is not None:
            run.logprobs.append(self._logprob_entry(token, scores, run.request.top_logprobs))
        piece = run.stops.push(run.text.push(token))
        if piece:
            self._deliver(run, piece)
        if run.stops.stopped or (constraint is not None and constraint.complete):
            return self._finish(run, "stop")
        if run.generated >= run.request.limit:
            return self._finish(run, "length")
        run.last_token = token

    def _logprob_entry(self, token: int, logits_V: torch.Tensor, k: int) -> dict:
        """The token's log-probability under the model's own distribution, and the k likeliest tokens'."""
        logprobs_V = torch.log_softmax(logits_V.float(), dim=-1)
        entry = self._token_logprob(token, float(logprobs_V[token]))
        top = torch.topk(logprobs_V, min(k, logprobs_V.numel())) if k else None
        entry["top_logprobs"] = [] if top is None else [
            self._token_logprob(int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
        return entry

    def _token_logprob(self, token: int, logprob: float) -> dict:
        raw = self.vocabulary.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0),
                "bytes": list(raw)}

    def _deliver(self, run, piece: str) -> None:
        """Hand out a piece of text, with the log-probabilities of the tokens up to it when asked for."""
        stream = run.request.stream
        if run.logprobs is None:
            return stream._deliver(piece)
        entries, run.logprobs = run.logprobs, []
        stream.logprobs.extend(entries)
        stream._deliver(Piece.of(piece, entries))


class SlotScheduler(TokenOutput):
    """Continuous batching over `slots`, the same for every engine: the bounded queue, submit's checks,
    the background thread joining waiting requests into free slots at each step boundary, cancellation,
    shut-down and how a request ends. An engine sets slots, max_queue, context and thread_name, calls
    _init_queue(), and supplies _join(slot, request) (or _join_all(pending), the requests joining at one
    boundary) and _step(); _release(slot), _run() (the thread's body, which an engine may wrap) and
    _thread_ends() are its hooks for its own cache and resources. prefill_budget: prompt tokens joining at
    one boundary (beyond the first request's, each counted by _boundary_tokens); the rest join at the
    next, after a decode step."""

    thread_name = "phalanx-engine"
    prefill_budget: float = float("inf")

    def _init_queue(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._active: dict = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    def _thread_ends(self) -> None:
        pass

    def _join_all(self, pending: deque) -> None:
        """Start the requests joining at this boundary, taking each from `pending` as it starts (what is
        left there when this raises has not started)."""
        while pending:
            self._join(*pending.popleft())

    def _release(self, slot: int) -> None:
        """A finished request's slot: what the engine's cache must forget of it."""

    def _boundary_tokens(self, request: _Request) -> int:
        """What a joining request costs the boundary's prefill_budget."""
        return len(request.prompt_ids)

    # ---- the caller's side ----

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    def submit(self, prompt_ids: list[int], options: SamplingOptions, context_limit: int | None = None,
               loop: asyncio.AbstractEventLoop | None = None, constraint: TokenConstraint | None = None,
               top_logprobs: int | None = None) -> RequestStream:
        """Queue a request; raises PromptTooLong or QueueFull at once rather than failing later.
        context_limit (a request's num_ctx) can only narrow the engine's context. constraint: a grammar
        from self.vocabulary.constraint(), one per request; top_logprobs: see the module's docstring."""
        context = min(context_limit or self.context, self.context)
        n = len(prompt_ids)
        if n == 0:
            raise PromptTooLong("the prompt is empty")
        if n >= context:
            raise PromptTooLong(f"the prompt is {n} tokens but the context holds {context}, leaving no room "
                                f"for a reply; shorten it to at most {context - 1} tokens")
        room = context - n
        limit = room if options.max_tokens is None else min(options.max_tokens, room)
        stream = RequestStream(n, loop)
        request = _Request(list(prompt_ids), options, limit, stream, time.perf_counter(), constraint,
                           top_logprobs)
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # Requests whose clients went away while waiting must not hold queue places for others.
            for gone in [r for r in self._waiting if r.stream.cancelled]:
                self._waiting.remove(gone)
                self._finish_unstarted(gone, "cancelled")
            if len(self._active) + len(self._waiting) >= self.slots + self.max_queue:
                raise QueueFull(f"all {self.slots} slots are busy and {len(self._waiting)} requests are waiting "
                                f"(the most the queue holds); try again later")
            self._waiting.append(request)
            self._cond.notify()
        return stream

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop; requests still running or waiting finish with reason "error"."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is None:
            self._thread_ends()  # what the thread would have released
        else:
            self._thread.join(timeout)

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._thread_ends()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
                joining, tokens = [], 0
                free = [s for s in range(self.slots) if s not in self._active]
                while self._waiting and len(joining) < len(free):
                    tokens += self._boundary_tokens(self._waiting[0])
                    if joining and tokens > self.prefill_budget:
                        break
                    joining.append(self._waiting.popleft())
            pending = deque(zip(free, joining))
            try:
                self._join_all(pending)
                for run in [r for r in self._active.values() if r.request.stream.cancelled]:
                    self._finish(run, "cancelled")
                if self._active:
                    self._step()
            except Exception as e:  # a bug no request's own guard caught: fail what ran, keep the thread
                log.exception("%s: a step failed", self.thread_name)
                for _, request in pending:
                    self._finish_unstarted(request, "error", f"generation failed: {e}")
                for run in list(self._active.values()):
                    self._finish(run, "error", f"generation failed: {e}")
        with self._cond:
            left = list(self._active.values()), list(self._waiting)
            self._waiting.clear()
        for run in left[0]:
            self._finish(run, "error", "the server is shutting down")
        for request in left[1]:
            self._finish_unstarted(request, "error", "the server is shutting down")

    def _finish(self, run, reason: str, error: str | None = None) -> None:
        stream = run.request.stream
        if reason != "error":
            try:
                tail = run.stops.push(run.text.flush()) + run.stops.flush()
            except Exception as e:  # the last piece would not decode: the request still ends, as an error
                reason, error, tail = "error", f"generation failed: {e}", ""
            if tail or run.logprobs:
                self._deliver(run, tail)
        self._release(run.slot)
        with self._cond:
            self._active.pop(run.slot, None)
        stream._deliver(Finish(reason, len(run.request.prompt_ids), run.generated, run.request.submitted_at,
                               run.prefill_started_at, run.first_token_at, time.perf_counter(), error))

    def _ends_before_start(self, request: _Request, vocab_size: int | None = None) -> bool:
        """End a joining request that needs no slot: cancelled while it waited, no room for a token, or
        (given the engine's vocab_size, where a bad id would fail a whole batch) a prompt token the model
        does not have."""
        if request.stream.cancelled:
            self._finish_unstarted(request, "cancelled")
        elif request.limit == 0:
            self._finish_unstarted(request, "length")
        elif vocab_size is not None and (bad := next((t for t in request.prompt_ids if not 0 <= t < vocab_size),
                                                      None)) is not None:
            self._finish_unstarted(request, "error", f"generation failed: token id {bad} is not in the model's "
                                                     f"vocabulary of {vocab_size}")
        else:
            return False
        return True

    def _finish_unstarted(self, request: _Request, reason: str, error: str | None = None) -> None:
        now = time.perf_counter()
        request.stream._deliver(Finish(reason, len(request.prompt_ids), 0, request.submitted_at, now, None, now,
                                       error))


class Engine(SlotScheduler):
    thread_name = "phalanx-engine"

    def _run(self) -> None:
        # This thread only ever does inference. Inference mode rather than no_grad: tensors made here carry
        # no version counters or autograd state, which took 8-10% off a one-row decode step's work outside
        # the matrix products (measured, 125m shape, bf16 and float32).
        with torch.inference_mode():
            super()._run()

    def __init__(self, model: Transformer, tokenizer: Tokenizer, slots: int = 8, max_queue: int = 64,
                 context: int | None = None, observer: EngineObserver | None = None):
        args = model.args
        if slots < 1 or max_queue < 0:
            raise ValueError("an engine needs at least one slot and a queue of at least 0")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.bos_id, self.eos_id = special_ids(tokenizer)
        self.slots, self.max_queue = slots, max_queue
        self.context = min(context or args.max_seq_len, args.max_seq_len)
        weight = model.tok_embeddings.weight
        self.device = weight.device
        # The dtype decode attends in (float32 on CPU, whatever the model's): no cast of the cache per step,
        # for twice a bf16 model's cache memory.
        cache_dtype = decode_attention_dtype(self.device, weight.dtype)
        self.cache = KVCache(args, slots, self.context, dtype=cache_dtype, device=self.device)
        # Steps sized to the running requests only where each row is then provably the same bits; prompts
        # prefilled together only where tall products keep them so too (prefill.py).
        self.sized_steps = make_rows_invariant(self.model)
        self.batched_prefill = self.sized_steps and prefill_rows_agree(self.model)
        # A burst of long prompts joins over several boundaries, a decode step between each (prefill.py).
        self.prefill_budget = MAX_PREFILL_TOKENS if self.batched_prefill else float("inf")
        # Longer prompts are prefilled a chunk per boundary (None: each in one pass), into a one-row cache
        # of their own: decode steps write their idle rows' position 0, which must not land in a prompt
        # half prefilled, and the running rows stay packed. One prompt chunks at a time, the rest queue.
        self.prefill_chunk: int | None = PREFILL_CHUNK_TOKENS
        self._chunk_cache = KVCache(args, 1, self.context, dtype=cache_dtype, device=self.device)
        self._chunking: deque[_Running] = deque()  # joined, prompt not yet prefilled; the first is chunking
        self._chunked_to = 0  # where the first one's next chunk starts
        self._rows: dict[int, int] = {}  # slot -> its cache row; running requests hold rows 0..n-1
        self.observer = observer
        self._init_queue()
        self.vocabulary = TokenVocabulary(tokenizer, self.eos_id, args.vocab_size)

    # ---- the caller's side ----

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.cache.k, *self.cache.v, *self._chunk_cache.k, *self._chunk_cache.v))

    # ---- the engine thread ----

    def _chunked(self, request: _Request) -> bool:
        return self.prefill_chunk is not None and len(request.prompt_ids) > self.prefill_chunk

    def _boundary_tokens(self, request: _Request) -> int:
        # A chunked prompt is not in the boundary's batched pass: its chunks have passes of their own.
        return 0 if self._chunked(request) else len(request.prompt_ids)

    def _release(self, slot: int) -> None:
        """Keep the running rows packed: the last row moves into the freed one (its live positions only)."""
        for i, run in enumerate(self._chunking):  # cancelled or failed before its prompt was prefilled
            if run.slot == slot:
                del self._chunking[i]
                if i == 0:
                    self._chunked_to = 0  # the next one starts from its first chunk
                return
        row = self._rows.pop(slot, None)
        if row is None or row == len(self._rows):
            return
        last_slot = next(s for s, r in self._rows.items() if r == len(self._rows))
        moved = self._active.get(last_slot)
        live = self.cache.max_len if moved is None else min(moved.position + 1, self.cache.max_len)
        for k, v in zip(self.cache.k, self.cache.v):
            k[row, :, :live] = k[len(self._rows), :, :live]
            v[row, :, :live] = v[len(self._rows), :, :live]
        self._rows[last_slot] = row

    def _join_all(self, pending: deque) -> None:
        """Start the requests joining at this boundary and take their first tokens: their prompts prefilled
        together in one pass where that is each prompt's own bits (batched_prefill), else one at a time;
        then one chunk of the long prompt whose turn it is."""
        runs = [run for run in (self._start(*pending.popleft()) for _ in range(len(pending))) if run]
        self._chunking.extend(run for run in runs if self._chunked(run.request))
        runs = [run for run in runs if not self._chunked(run.request)]
        for group in [runs] if self.batched_prefill else [[run] for run in runs]:
            if not group:
                continue
            started = time.perf_counter()
            for run in group:
                run.prefill_started_at = started
            try:
                logits_NV = self._prefill(group)
            except Exception as e:  # the prefill itself: fail the requests in it, keep serving
                log.exception("prefill failed")
                for run in group:
                    self._finish(run, "error", f"generation failed: {e}")
                continue
            for run, logits_V in zip(group, logits_NV):  # each on its own: a bad sample fails that request alone
                try:
                    if self.observer:
                        self.observer.prompt_prefilled(len(run.request.prompt_ids))
                    self._take(run, run.sampler.pick(logits_V, run.request.constraint), logits_V)
                except Exception as e:
                    log.exception("first token failed")
                    self._finish(run, "error", f"generation failed: {e}")
        if self._chunking:
            self._prefill_next_chunk()

    def _prefill_next_chunk(self) -> None:
        """One chunk of the first chunking prompt; after its last, the prompt joins the decoding rows and
        its first token comes out."""
        run = self._chunking[0]
        if run.request.stream.cancelled:  # not another chunk for a client that has gone
            return self._finish(run, "cancelled")
        prompt = run.request.prompt_ids
        start = self._chunked_to
        end = dict(chunk_plan(len(prompt), self.prefill_chunk))[start]
        if start == 0:
            run.prefill_started_at = time.perf_counter()
        try:
            logits_V = prefill_chunk(self.model, prompt[start:end], self._chunk_cache, start)
        except Exception as e:  # this prompt's pass alone: fail it, keep serving the others
            log.exception("prefill failed")
            return self._finish(run, "error", f"generation failed: {e}")
        self._chunked_to = end
        if end < len(prompt):
            return
        self._chunking.popleft()
        self._chunked_to = 0
        # Into the next packed row; it decodes from the next step on.
        row = self._rows[run.slot] = len(self._rows)
        for k, v, chunk_k, chunk_v in zip(self.cache.k, self.cache.v, self._chunk_cache.k, self._chunk_cache.v):
            k[row, :, :end] = chunk_k[0, :, :end]
            v[row, :, :end] = chunk_v[0, :, :end]
        try:
            if self.observer:
                self.observer.prompt_prefilled(len(prompt))
            self._take(run, run.sampler.pick(logits_V, run.request.constraint), logits_V)
        except Exception as e:
            log.exception("first token failed")
            self._finish(run, "error", f"generation failed: {e}")

    def _prefill(self, group: list[_Running]) -> torch.Tensor:
        """Each run's prompt into its cache row; the logits (n, V) of each prompt's last token."""
        if self.batched_prefill:
            return prefill_together(self.model, [run.request.prompt_ids for run in group], self.cache,
                                    [self._rows[run.slot] for run in group])
        (run,) = group  # one at a time, through the model's own forward
        prompt_1T = torch.tensor([run.request.prompt_ids], dtype=torch.long, device=self.device)
        return self.model(prompt_1T, _SlotCache(self.cache, self._rows[run.slot]), start_pos=0)[:, -1]

    def _start(self, slot: int, request: _Request) -> _Running | None:
        """A joining request's running state in the next free cache row; None if it ends before a prefill."""
        if self._ends_before_start(request):
            return None
        try:
            run = _Running(request, slot, len(request.prompt_ids),
                           RequestSampler(request.options, request.prompt_ids, self.context, self.device),
                           IncrementalText(self.tokenizer), StopMatcher(request.options.stop), time.perf_counter(),
                           logprobs=None if request.top_logprobs is None else [])
        except Exception as e:  # options no validation caught (a seed torch cannot take, say)
            log.exception("request set-up failed")
            return self._finish_unstarted(request, "error", f"generation failed: {e}")
        with self._cond:
            self._active[slot] = run
        if not self._chunked(request):  # a chunked prompt takes its row after its last chunk
            self._rows[slot] = len(self._rows)
        return run

    def _step(self) -> None:
        runs = [run for run in self._active.values() if run.slot in self._rows]  # not the prompts chunking
        if not runs:
            return
        rows = [self._rows[run.slot] for run in runs]  # fixed for this step: a release moves rows for the next
        if self.sized_steps:
            width = step_width(len(runs), self.slots)
            span = step_span(max(run.position for run in runs) + 1, self.cache.max_len)
        else:
            width, span = self.slots, self.cache.max_len
        tokens, positions = [0] * width, [0] * width  # idle rows: token 0 at position 0, ignored
        for run, row in zip(runs, rows):
            tokens[row], positions[row] = run.last_token, run.position
        try:
            tokens_N1 = torch.tensor(tokens, dtype=torch.long, device=self.device).view(width, 1)
            positions_N = torch.tensor(positions, dtype=torch.long, device=self.device)
            cache = _StepCache(self.cache, width, span)
            logits_NV = self.model(tokens_N1, cache, positions_B=positions_N)[:, 0].float()
            greedy = logits_NV.argmax(dim=-1).tolist()
        except Exception as e:  # the batched forward itself: fail this step's requests, keep serving
            log.exception("decode step failed")
            for run in runs:
                self._finish(run, "error", f"generation failed: {e}")
            return
        for run, row in zip(runs, rows):  # each row on its own: one request's bad sample fails it alone
            try:
                constraint = run.request.constraint
                if run.sampler.greedy_without_penalties and constraint is None:
                    token = greedy[row]
                else:
                    token = run.sampler.pick(logits_NV[row], constraint)
                run.position += 1
                self._take(run, token, logits_NV[row])
            except Exception as e:
                log.warning("request in slot %d failed: %s", run.slot, e)
                if self._active.get(run.slot) is run:
                    self._finish(run, "error", f"generation failed: {e}")
