"""One HTTP request's generations on the engine: n independent samples (OpenAI's `n`), each with its own
grammar when a format is asked for, and its log-probabilities when asked for.

Each sample is a request of its own on the engine (its own slot, generator and grammar state), so n
samples cost n slots and a sample's tokens do not depend on its siblings. With a seed, sample i is
seeded with seed + i (seed - i at the top of the range): reproducible, and not n copies of one sample.
Greedy samples are identical, as OpenAI's are.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from phalanx.serve.core.contract import RequestStream, ServingEngine
from phalanx.serve.core.options import MAX_SEED, SamplingOptions
from phalanx.serve.core.schema_compiler import ClientGone, FormatError
from phalanx.serve.core.structured_output import TokenConstraint
from phalanx.serve.http.common import ApiError, collect, submit


def sample_options(options: SamplingOptions, index: int) -> SamplingOptions:
    if index == 0 or options.seed is None:
        return options
    seed = options.seed + index if options.seed + index <= MAX_SEED else options.seed - index
    return dataclasses.replace(options, seed=seed)


def _constraints(engine: ServingEngine, grammar: str, n: int, param: str) -> list[TokenConstraint]:
    try:
        return [engine.vocabulary.constraint(grammar) for _ in range(n)]
    except FormatError as e:
        raise ApiError(400, str(e), param=param) from None


async def build_constraints(
    engine: ServingEngine, request: Request, schema: dict[str, Any] | None, n: int = 1, param: str = "format"
) -> list[TokenConstraint | None]:
    """One grammar state per sample. The schema compiles in the vocabulary's worker process (it may
    crash, or take long: see serve/core/schema_compiler.py); the matchers are built in a worker thread, since the
    first one also reads the vocabulary and must not hold up the event loop's other requests."""
    if schema is None:
        return [None] * n
    try:
        grammar = await engine.vocabulary.compiler.grammar(schema, request.is_disconnected)
    except FormatError as e:
        raise ApiError(400, str(e), param=param) from None
    except ClientGone:
        raise ApiError(499, "the client closed the request") from None
    return list(await asyncio.to_thread(_constraints, engine, grammar, n, param))


def submit_samples(
    engine: ServingEngine,
    request: Request,
    prompt_ids: list[int],
    options: SamplingOptions,
    constraints: list[TokenConstraint | None],
    top_logprobs: int | None = None,
    context_limit: int | None = None,
    **scoring: Any,
) -> list[RequestStream]:
    """One engine request per constraint (n samples: n of them, None without a format); all or none (a
    refusal cancels those already queued). Synchronous: nothing else runs between the submits. scoring:
    the engine's prompt_logprobs and list_stop_token, for OpenAI's completions."""
    return submit_prompts(engine, request, [prompt_ids], options, constraints, top_logprobs, context_limit, **scoring)


def submit_prompts(
    engine: ServingEngine,
    request: Request,
    prompts: list[list[int]],
    options: SamplingOptions,
    constraints: list[TokenConstraint | None],
    top_logprobs: int | None = None,
    context_limit: int | None = None,
    **scoring: Any,
) -> list[RequestStream]:
    """submit_samples for several prompts (OpenAI's completions take a list): every prompt's samples, in
    the order prompt 0's, prompt 1's, ..., so stream i is choice i. They are queued one after another
    with no await between, so they join the engine's step boundaries together as its free slots and
    prefill budget allow, and are prefilled in the same batched passes; all or none."""
    if len(prompts) > 1 and any(c is not None for c in constraints):
        raise ValueError("a grammar state follows one request: build constraints per prompt")
    streams: list[RequestStream] = []
    try:
        for prompt_ids in prompts:
            for i, constraint in enumerate(constraints):
                streams.append(
                    submit(
                        engine,
                        prompt_ids,
                        sample_options(options, i),
                        request,
                        context_limit=context_limit,
                        constraint=constraint,
                        top_logprobs=top_logprobs,
                        **scoring,
                    )
                )
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


async def collect_samples(request: Request, streams: list[RequestStream]) -> list[str]:
    """Every sample's whole text (a failed one fails the HTTP request, and cancels its siblings)."""
    try:
        return list(await asyncio.gather(*(collect(request, s) for s in streams)))
    finally:
        for stream in streams:
            stream.cancel()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, str | None]]:
    """The samples' pieces as they come, as (index, piece); (index, None) when that sample has finished
    (its stream's `finish` is then set). Leaving early cancels every sample."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for piece in stream.chunks():
                await queue.put((index, piece))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, piece = await queue.get()
            running -= piece is None
            yield index, piece
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.cancel()
