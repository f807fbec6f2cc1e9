"""Continuous batching over a fixed number of slots, the same for every engine (torch, llama.cpp, vLLM).

An engine holds one SlotScheduler and hands it an EngineSteps: what the engine does on the scheduler's
thread (start the requests joining at a step boundary, run one step, forget a finished slot). The
scheduler owns everything else: the bounded queue and submit's checks, the background thread that joins
waiting requests into free slots at each boundary, cancellation, shut-down, and what happens to each
token an engine picks (take(): counts and timings, the sampler's and the grammar's state,
end-of-text, stop strings, the token budget, log-probabilities, and the text handed out).

A boundary takes requests in the order they came while slots are free and, beyond the first, while their
prompt tokens (EngineSteps.boundary_tokens) fit the engine's prefill_budget; the rest join at the next
boundary, after a step. No request can stop the thread: whatever escapes an engine's step fails the
requests it touched, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from phalanx.serve.core.contract import (
    EngineObserver,
    Finish,
    Piece,
    PromptTooLong,
    QueueFull,
    Request,
    RequestStream,
)
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.core.sampler import RequestSampler
from phalanx.serve.core.structured_output import TokenConstraint, TokenVocabulary
from phalanx.serve.core.text_stream import IncrementalText, StopMatcher

log = logging.getLogger("phalanx.serve")

Pending = deque[tuple[int, Request]]  # (free slot, request) joining at one boundary, in order


class Running(Protocol):
    """A request holding a slot, as each engine keeps it (with its own fields beside these)."""

    request: Request
    slot: int
    sampler: RequestSampler | None  # None where the engine underneath samples (vLLM)
    text: IncrementalText
    stops: StopMatcher
    prefill_started_at: float
    last_token: int
    generated: int
    first_token_at: float | None
    logprobs: list[dict] | None  # entries whose text has not been handed out yet; None: not asked for


class EngineSteps(Protocol):
    """What an engine does for its scheduler. Every method runs on the scheduler's thread, except
    boundary_tokens (under the scheduler's lock, as a boundary is formed)."""

    prefill_budget: float  # prompt tokens one boundary takes beyond its first request's (read at each one)

    def join_all(self, pending: Pending) -> None:
        """Start the requests joining at this boundary, taking each from `pending` as it starts (what is
        left there when this raises has not started): scheduler.occupy(slot, run) for each that runs."""

    def step(self) -> None:
        """One step of every running request: scheduler.take() for each token picked."""

    def release(self, slot: int) -> None:
        """A finished request's slot: what the engine's cache must forget of it."""

    def boundary_tokens(self, request: Request) -> int:
        """What a joining request costs the boundary's prefill_budget."""

    def run_thread(self, loop: Callable[[], None]) -> None:
        """The thread's body: call loop(), inside whatever the engine needs around it."""

    def thread_ends(self) -> None:
        """The thread is ending (or stop() came before it started): release the engine's resources."""

    def logprob_entry(self, token: int, scores: Any, k: int) -> dict:
        """The taken token's log-probability and the k likeliest tokens', from what the engine's step
        passed to take() as `scores`."""


class SlotScheduler:
    def __init__(
        self,
        steps: EngineSteps,
        name: str,
        slots: int,
        max_queue: int,
        context: int,
        stop_ids: Iterable[int],
        vocabulary: TokenVocabulary,
        observer: EngineObserver | None,
    ):
        if slots < 1 or max_queue < 0:
            raise ValueError("an engine needs at least one slot and a queue of at least 0")
        self.steps, self.name = steps, name
        self.slots, self.max_queue, self.context = slots, max_queue, context
        # Every token that ends a reply: EOS, and a checkpoint's others (its end of turn, <|eot_id|> or
        # <|im_end|>, and generation_config.json's eos_token_id list: data/tokenizer.py SpecialTokens).
        self.stop_ids = frozenset(stop_ids)
        self.vocabulary, self.observer = vocabulary, observer
        self.running: dict[int, Running] = {}  # slot -> its request; changed under the lock (occupy, finish)
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the caller's side ----

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self.running)

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
    ) -> RequestStream:
        """Queue a request; raises PromptTooLong or QueueFull at once rather than failing later.
        context_limit (a request's num_ctx) can only narrow the engine's context. constraint: a grammar
        from vocabulary.constraint(), one per request; top_logprobs: None for no log-probabilities, k for
        each token's own and its k likeliest alternatives'; prompt_logprobs: the same for the prompt's
        tokens (engines whose scores_prompts is true); list_stop_token: the end-of-text token that ends
        the reply gets its entry too."""
        if prompt_logprobs is not None and not getattr(self.steps, "scores_prompts", False):
            raise ValueError("this engine cannot score prompts (its scores_prompts is false)")
        context = min(context_limit or self.context, self.context)
        n = len(prompt_ids)
        if n == 0:
            raise PromptTooLong("the prompt is empty")
        # A prompt only scored (max_tokens 0) may fill the context; anything else needs room for a token.
        scored_only = prompt_logprobs is not None and options.max_tokens == 0
        if n > context or (n == context and not scored_only):
            fits = context if scored_only else context - 1
            raise PromptTooLong(
                f"the prompt is {n} tokens but the context holds {context}"
                + ("" if scored_only else ", leaving no room for a reply")
                + f"; shorten it to at most {fits} tokens"
            )
        room = context - n
        limit = room if options.max_tokens is None else min(options.max_tokens, room)
        stream = RequestStream(n, loop)
        request = Request(
            list(prompt_ids),
            options,
            limit,
            stream,
            time.perf_counter(),
            constraint,
            top_logprobs,
            prompt_logprobs,
            list_stop_token,
        )
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # Requests whose clients went away while waiting must not hold queue places for others.
            for gone in [r for r in self._waiting if r.stream.cancelled]:
                self._waiting.remove(gone)
                self.finish_unstarted(gone, "cancelled")
            if len(self.running) + len(self._waiting) >= self.slots + self.max_queue:
                raise QueueFull(
                    f"all {self.slots} slots are busy and {len(self._waiting)} requests are waiting "
                    f"(the most the queue holds); try again later"
                )
            self._waiting.append(request)
            self._cond.notify()
        return stream

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop; requests still running or waiting finish with reason "error"."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is None:
            self.steps.thread_ends()  # what the thread would have released
        else:
            self._thread.join(timeout)

    # ---- the engine's side (its thread) ----

    def occupy(self, slot: int, run: Running) -> None:
        with self._cond:
            self.running[slot] = run

    def holds(self, run: Running) -> bool:
        """Whether `run` still holds its slot (it may have ended on an earlier token of the same step)."""
        return self.running.get(run.slot) is run

    def take(self, run: Running, token: int, scores: Any) -> None:
        """A token the engine picked for `run`; `scores` is what its logprob_entry reads."""
        now = time.perf_counter()
        if run.first_token_at is None:
            run.first_token_at = now
            if self.observer:
                self.observer.first_token(now - run.request.submitted_at)
        run.generated += 1
        if self.observer:
            self.observer.tokens_generated(1)
        if run.sampler is not None:
            run.sampler.accept(token)
        constraint = run.request.constraint
        if constraint is not None:
            constraint.accept(token)
        if token in self.stop_ids and not run.request.options.ignore_eos:
            if run.logprobs is not None and run.request.list_stop_token:
                run.logprobs.append(self.steps.logprob_entry(token, scores, run.request.top_logprobs))
            return self.finish(run, "stop")
        if run.logprobs is not None:
            run.logprobs.append(self.steps.logprob_entry(token, scores, run.request.top_logprobs))
        piece = run.stops.push(run.text.push(token))
        if piece:
            self._deliver(run, piece)
        if run.stops.stopped or (constraint is not None and constraint.complete):
            return self.finish(run, "stop")
        if run.generated >= run.request.limit:
            return self.finish(run, "length")
        run.last_token = token

    def token_logprob(self, token: int, logprob: float) -> dict:
        raw = self.vocabulary.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0), "bytes": list(raw)}

    def logits_logprob_entry(self, token: int, logits_V: torch.Tensor, k: int) -> dict:
        """logprob_entry for engines whose scores are a row's logits: under the model's own distribution."""
        logprobs_V = torch.log_softmax(logits_V.float(), dim=-1)
        entry = self.token_logprob(token, float(logprobs_V[token]))
        top = torch.topk(logprobs_V, min(k, logprobs_V.numel())) if k else None
        entry["top_logprobs"] = (
            []
            if top is None
            else [self.token_logprob(int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
        )
        return entry

    def prompt_entries(self, prompt_ids: list[int], logprobs_TV: torch.Tensor, k: int) -> list[dict]:
        """Scored prompt tokens' entries (as logits_logprob_entry's): row i of logprobs_TV is the model's
        log-softmax after prompt_ids[:i + 1], so it scores prompt_ids[i + 1]."""
        targets = torch.tensor(prompt_ids[1 : len(logprobs_TV) + 1], dtype=torch.long, device=logprobs_TV.device)
        taken = logprobs_TV.gather(1, targets[:, None])[:, 0].tolist()
        top = torch.topk(logprobs_TV, min(k, logprobs_TV.shape[-1])) if k else None
        entries = []
        for i, (token, logprob) in enumerate(zip(targets.tolist(), taken)):
            entry = self.token_logprob(token, logprob)
            entry["top_logprobs"] = (
                []
                if top is None
                else [
                    self.token_logprob(int(t), float(v))
                    for v, t in zip(top.values[i].tolist(), top.indices[i].tolist())
                ]
            )
            entries.append(entry)
        return entries

    def finish(self, run: Running, reason: str, error: str | None = None) -> None:
        stream = run.request.stream
        if reason != "error":
            try:
                tail = run.stops.push(run.text.flush()) + run.stops.flush()
            except Exception as e:  # the last piece would not decode: the request still ends, as an error
                reason, error, tail = "error", f"generation failed: {e}", ""
            if tail or run.logprobs:
                self._deliver(run, tail)
        self.steps.release(run.slot)
        with self._cond:
            self.running.pop(run.slot, None)
        stream._deliver(
            Finish(
                reason,
                len(run.request.prompt_ids),
                run.generated,
                run.request.submitted_at,
                run.prefill_started_at,
                run.first_token_at,
                time.perf_counter(),
                error,
            )
        )

    def ends_before_start(self, request: Request, vocab_size: int | None = None) -> bool:
        """End a joining request that needs no slot: cancelled while it waited, no room for a token, or
        (given the engine's vocab_size, where a bad id would fail a whole batch) a prompt token the model
        does not have."""
        if request.stream.cancelled:
            self.finish_unstarted(request, "cancelled")
        elif request.limit == 0 and request.prompt_logprobs is None:  # a scored prompt still needs its prefill
            self.finish_unstarted(request, "length")
        elif (
            vocab_size is not None
            and (bad := next((t for t in request.prompt_ids if not 0 <= t < vocab_size), None)) is not None
        ):
            self.finish_unstarted(
                request, "error", f"generation failed: token id {bad} is not in the model's vocabulary of {vocab_size}"
            )
        else:
            return False
        return True

    def finish_unstarted(self, request: Request, reason: str, error: str | None = None) -> None:
        now = time.perf_counter()
        request.stream._deliver(Finish(reason, len(request.prompt_ids), 0, request.submitted_at, now, None, now, error))

    def _deliver(self, run: Running, piece: str) -> None:
        """Hand out a piece of text, with the log-probabilities of the tokens up to it when asked for."""
        stream = run.request.stream
        if run.logprobs is None:
            return stream._deliver(piece)
        entries, run.logprobs = run.logprobs, []
        stream.logprobs.extend(entries)
        stream._deliver(Piece.of(piece, entries))

    def _run(self) -> None:
        try:
            self.steps.run_thread(self._loop)
        finally:
            self.steps.thread_ends()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self.running:
                    self._cond.wait()
                if self._stopping:
                    break
                joining, tokens = [], 0
                free = [s for s in range(self.slots) if s not in self.running]
                while self._waiting and len(joining) < len(free):
                    tokens += self.steps.boundary_tokens(self._waiting[0])
                    if joining and tokens > self.steps.prefill_budget:
                        break
                    joining.append(self._waiting.popleft())
            pending = deque(zip(free, joining))
            try:
                self.steps.join_all(pending)
                for run in [r for r in self.running.values() if r.request.stream.cancelled]:
                    self.finish(run, "cancelled")
                if self.running:
                    self.steps.step()
            except Exception as e:  # a bug no request's own guard caught: fail what ran, keep the thread
                log.exception("%s: a step failed", self.name)
                for _, request in pending:
                    self.finish_unstarted(request, "error", f"generation failed: {e}")
                for run in list(self.running.values()):
                    self.finish(run, "error", f"generation failed: {e}")
        with self._cond:
            left = list(self.running.values()), list(self._waiting)
            self._waiting.clear()
        for run in left[0]:
            self.finish(run, "error", "the server is shutting down")
        for request in left[1]:
            self.finish_unstarted(request, "error", "the server is shutting down")


def join_each(pending: Pending, join: Callable[[int, Request], None]) -> None:
    """join_all for an engine that starts its joining requests one by one."""
    while pending:
        join(*pending.popleft())


class ScheduledEngine:
    """The caller's side of an engine (ServingEngine's submit, start, stop and counts), forwarded to the
    SlotScheduler the engine holds as `scheduler`; and EngineSteps' usual answers, which an engine
    overrides where it differs (its join_all and step are always its own)."""

    scheduler: SlotScheduler
    prefill_budget: float = float("inf")
    scores_prompts: bool = False  # an engine that can score prompts (prompt_logprobs) says so

    def run_thread(self, loop: Callable[[], None]) -> None:
        loop()

    def thread_ends(self) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def boundary_tokens(self, request: Request) -> int:
        return len(request.prompt_ids)

    def logprob_entry(self, token: int, logits_V: torch.Tensor, k: int) -> dict:
        """For engines whose step passes a row's logits as `scores`."""
        return self.scheduler.logits_logprob_entry(token, logits_V, k)

    @property
    def alive(self) -> bool:
        return self.scheduler.alive

    @property
    def active(self) -> int:
        return self.scheduler.active

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    def submit(self, *args: Any, **kwargs: Any) -> RequestStream:
        """SlotScheduler.submit (ServingEngine's, serve/core/contract.py)."""
        return self.scheduler.submit(*args, **kwargs)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.scheduler.stop(timeout)
