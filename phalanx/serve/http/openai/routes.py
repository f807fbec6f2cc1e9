"""OpenAI's API: /v1/chat/completions, /v1/completions and /v1/models.

Streams are server-sent events: for chat, the first chunk carries the assistant role, content follows in
deltas, the last choice chunk carries finish_reason, then (with stream_options.include_usage) a chunk of
usage with no choices, then `data: [DONE]`. /v1/completions continues each of its prompts as plain text
(BOS where the tokenizer has one, then the text or the token ids: openai/prompts.py), and with echo and
logprobs scores the prompt's tokens in the engine's prefill; chat renders the messages with the chat
template. With n > 1 or several prompts the choices' chunks interleave, each by its index
(serve/http/choices.py); replies.py shapes choices, tool calls and log-probabilities.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

import phalanx
from phalanx.serve.core.contract import Finish, RequestStream, ServingEngine
from phalanx.serve.core.served import ServedModel
from phalanx.serve.core.structured_output import FormatError, openai_format_schema
from phalanx.serve.http.choices import build_constraints, collect_samples, merged, submit_prompts
from phalanx.serve.http.common import ApiError, parse_body, read_json, streamed_error
from phalanx.serve.http.keep_alive import ModelResidency
from phalanx.serve.http.openai.prompts import completion_prompts, model_vocab_size
from phalanx.serve.http.openai.replies import ChatReply, CompletionReply, Reply
from phalanx.serve.http.openai.schema import ChatCompletionRequest, CompletionRequest
from phalanx.serve.http.tool_calls import ToolError, call_schema, forced_tools, read_tools, template_messages

FINGERPRINT = f"phalanx-{phalanx.__version__}"


def _usage(finishes: list[Finish], n: int) -> dict[str, int]:
    # n samples share one prompt: each prompt counts once, as OpenAI counts it.
    prompt = sum(f.prompt_tokens for f in finishes[::n])
    completion = sum(f.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def openai_router(served: ServedModel, engine: ServingEngine, residency: ModelResidency | None = None) -> APIRouter:
    router = APIRouter()
    residency = residency or ModelResidency(served, engine)

    def check_model(name: str) -> None:
        if not served.matches(name):
            raise ApiError(
                404,
                f"the model '{name}' does not exist; this server serves '{served.name}'",
                code="model_not_found",
                param="model",
            )

    def model_object() -> dict[str, Any]:
        return {
            "id": served.name,
            "object": "model",
            "created": int(served.loaded_at.timestamp()),
            "owned_by": "phalanx",
        }

    async def respond(
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        template_stops: list[str],
        kind: str,
        reply: Reply,
        schema: dict[str, Any] | None = None,
        **scoring: Any,
    ):
        """prompts: one (chat) or several (completions), each answered with n choices; scoring: the
        engine's prompt_logprobs and list_stop_token."""
        options, top_logprobs, n = body.sampling(max_tokens, template_stops), body.top_logprobs_asked, body.n or 1
        constraints = await build_constraints(engine, request, schema, n, "response_format")
        await residency.ready()  # loads the weights if keep_alive took them out; no await from here to the submit
        streams = submit_prompts(engine, request, prompts, options, constraints, top_logprobs, **scoring)
        for stream in streams:
            residency.track(stream)
        head = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{secrets.token_hex(12)}",
            "object": kind,
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": FINGERPRINT,
        }
        if not body.stream:
            texts = await collect_samples(request, streams)
            choices = [
                reply.whole(i, text, s.finish.reason, s.logprobs, s.prompt_logprobs)
                for i, (text, s) in enumerate(zip(texts, streams))
            ]
            return JSONResponse({**head, "choices": choices, "usage": _usage([s.finish for s in streams], n)})
        head["object"] = f"{kind}.chunk" if kind == "chat.completion" else kind
        return StreamingResponse(
            _events(request, streams, head, body.include_usage, reply, n), media_type="text/event-stream"
        )

    async def _events(
        request: Request,
        streams: list[RequestStream],
        head: dict[str, Any],
        include_usage: bool,
        reply: Reply,
        n: int,
    ) -> AsyncIterator[str]:
        usage_none = {"usage": None} if include_usage else {}

        def event(choice: dict[str, Any]) -> str:
            return _sse({**head, "choices": [choice], **usage_none})

        opened: set[int] = set()

        def open_choice(i: int) -> list[str]:
            # A choice opens once; where its opening lists the prompt's scores, at its first piece or its
            # end, by when the engine has set them (before it delivered either).
            if i in opened:
                return []
            opened.add(i)
            return [event(opening) for opening in reply.opening(i, streams[i].prompt_logprobs)]

        if not reply.opens_after_prefill:
            for i in range(len(streams)):
                for opening in open_choice(i):
                    yield opening
        async for i, piece in merged(streams):
            if piece is not None or streams[i].finish.reason not in ("error", "cancelled"):
                for opening in open_choice(i):
                    yield opening
            if piece is not None:
                if (delta := reply.delta(i, piece)) is not None:
                    yield event(delta)
                continue
            finish = streams[i].finish
            if finish.reason == "error":
                yield _sse(streamed_error(request.url.path, finish.error or "generation failed"))
                return
            if finish.reason == "cancelled":
                return
            for last in reply.closing(i, finish.reason):
                yield event(last)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage([s.finish for s in streams], n)})
        yield _sse("[DONE]")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatCompletionRequest, await read_json(request))
        check_model(body.model)
        try:
            tools = read_tools(body.tools)
            forced = forced_tools(body.tool_choice, tools)
        except ToolError as e:
            raise ApiError(400, str(e), param="tools") from None
        use_tools = bool(tools) and body.tool_choice != "none"
        try:
            schema = openai_format_schema(body.response_format)
        except FormatError as e:
            raise ApiError(400, str(e), param="response_format") from None
        if forced:
            if schema is not None:
                raise ApiError(
                    400,
                    "response_format and a tool_choice that forces a call cannot both hold the "
                    "output; send one of them",
                    param="tool_choice",
                )
            schema = call_schema(forced)
        try:
            prompt_ids = await asyncio.to_thread(  # off the event loop: see ollama_api._render
                served.chat_prompt_ids, template_messages(body.messages_for_template(), tools if use_tools else [])
            )
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await respond(
            request,
            body,
            [prompt_ids],
            body.new_tokens,
            served.chat_stops,
            "chat.completion",
            ChatReply(tools if use_tools else [], body.top_logprobs_asked is not None),
            schema,
        )

    @router.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await read_json(request))
        check_model(body.model)
        top_logprobs, n = body.top_logprobs_asked, body.n or 1
        scored = body.echo and top_logprobs is not None  # the prompt's tokens listed with their scores
        if scored and not engine.scores_prompts:
            raise ApiError(
                400,
                "echo with logprobs needs the prompt's log-probabilities, which this server's engine cannot "
                "compute; serve with --engine torch (or drop echo or logprobs)",
                param="echo",
            )
        vocab_size = model_vocab_size(served, engine.vocabulary.model_vocab)
        prompts = await asyncio.to_thread(  # off the event loop: a megabyte of text takes a while to encode
            completion_prompts, served, body.prompt, vocab_size, body.add_special_tokens
        )
        if len(prompts) * n > engine.slots + engine.max_queue:  # else it could never be queued, even idle
            raise ApiError(
                400,
                f"this request holds {len(prompts)} prompts x n={n}, more than this server takes at once "
                f"({engine.slots} slots and {engine.max_queue} queue places); send at most "
                f"{engine.slots + engine.max_queue} per request",
                param="prompt",
            )
        return await respond(
            request,
            body,
            [p.ids for p in prompts],
            body.max_tokens,
            [],
            "text_completion",
            CompletionReply(prompts, n, body.echo, top_logprobs is not None, engine.vocabulary),
            prompt_logprobs=top_logprobs if scored else None,
            list_stop_token=top_logprobs is not None,
        )

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_object()

    return router
