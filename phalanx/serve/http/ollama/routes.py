"""Ollama's API: /api/generate, /api/chat (newline-delimited JSON streams by default, or one object with
`stream: false`), /api/tags, /api/show, /api/ps and /api/version.

/api/generate renders its prompt (and system) through the chat template as Ollama does, unless `raw`;
an empty prompt only answers that the model is loaded. Durations are in nanoseconds. `format` holds the
output to JSON (serve/core/structured_output.py), `tools` are rendered into the prompt and a reply that is only
calls comes back as message.tool_calls (serve/http/tool_calls.py), `logprobs` gives each chunk its tokens'.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

import phalanx
from phalanx.serve.core.contract import Finish, Piece, RequestStream, ServingEngine
from phalanx.serve.core.served import ServedModel
from phalanx.serve.core.structured_output import FormatError, ollama_format_schema
from phalanx.serve.http.choices import build_constraints, submit_samples
from phalanx.serve.http.common import ApiError, collect, parse_body, read_json, streamed_error
from phalanx.serve.http.keep_alive import ModelResidency, unloads_now
from phalanx.serve.http.ollama.schema import ChatRequest, GenerateRequest, ShowRequest
from phalanx.serve.http.tool_calls import Tool, ToolError, ollama_call, parse_calls, read_tools, template_messages

NDJSON = "application/x-ndjson"
FAR_FUTURE = "2318-01-01T00:00:00Z"  # /api/ps expires_at while keep_alive keeps the model forever


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _stats(finish: Finish, arrived: float, load_seconds: float = 0.0) -> dict[str, Any]:
    return {
        "done": True,
        "done_reason": finish.reason,
        "total_duration": _ns(finish.finished_at - arrived),
        "load_duration": _ns(load_seconds),
        "prompt_eval_count": finish.prompt_tokens,
        "prompt_eval_duration": _ns(finish.prompt_seconds),
        "eval_count": finish.completion_tokens,
        "eval_duration": _ns(finish.generation_seconds),
    }


def ollama_router(served: ServedModel, engine: ServingEngine, residency: ModelResidency | None = None) -> APIRouter:
    router = APIRouter()
    residency = residency or ModelResidency(served, engine)

    def check_model(name: str) -> None:
        if not served.matches(name):
            raise ApiError(404, f"model '{name}' not found")

    async def respond(
        request: Request,
        body: GenerateRequest | ChatRequest,
        prompt_ids: list[int],
        template_stops: list[str],
        piece: Callable[[str], dict[str, Any]],
        arrived: float,
        tools: list[Tool] | None = None,
    ):
        options, num_ctx = body.sampling(template_stops)
        try:
            schema = ollama_format_schema(body.format)
        except FormatError as e:
            raise ApiError(400, str(e)) from None
        top_logprobs = body.top_logprobs_asked
        constraints = await build_constraints(engine, request, schema)
        load_seconds = await residency.ready(body.keep_alive)  # no await from here to the submit
        (stream,) = submit_samples(
            engine, request, prompt_ids, options, constraints, top_logprobs=top_logprobs, context_limit=num_ctx
        )
        residency.track(stream)
        head = {"model": body.model}
        if tools or top_logprobs is not None:
            piece = _with_extras(piece, tools or [], top_logprobs is not None)
        if not body.stream:
            text = await collect(request, stream)
            whole = Piece.of(text, stream.logprobs) if top_logprobs is not None else text
            return JSONResponse(
                {**head, "created_at": _now(), **piece(whole), **_stats(stream.finish, arrived, load_seconds)}
            )
        return StreamingResponse(
            _lines(request, stream, head, piece, arrived, bool(tools), load_seconds), media_type=NDJSON
        )

    def _with_extras(
        piece: Callable[[str], dict[str, Any]], tools: list[Tool], logprobs: bool
    ) -> Callable[[str], dict[str, Any]]:
        """A chunk with its log-probabilities, and a chat message whose whole text is tool calls as them."""

        def extended(text: str) -> dict[str, Any]:
            chunk = piece(text)
            if tools and (calls := parse_calls(text, tools)):
                chunk["message"] = {**chunk["message"], "content": "", "tool_calls": [c.ollama() for c in calls]}
            if logprobs:
                chunk["logprobs"] = list(getattr(text, "logprobs", []))
            return chunk

        return extended

    async def _lines(
        request: Request,
        stream: RequestStream,
        head: dict[str, Any],
        piece: Callable[[str], dict[str, Any]],
        arrived: float,
        hold: bool = False,
        load_seconds: float = 0.0,
    ) -> AsyncIterator[str]:
        """hold: with tools, the text goes out in one chunk at the end (a call is recognisable only whole)."""
        try:
            held: list[str] = []
            async for text in stream.chunks():
                if hold:
                    held.append(text)
                    continue
                yield json.dumps({**head, "created_at": _now(), **piece(text), "done": False}) + "\n"
            if held and stream.finish.reason != "error":
                whole = Piece.of("".join(held), [e for t in held for e in getattr(t, "logprobs", [])])
                yield json.dumps({**head, "created_at": _now(), **piece(whole), "done": False}) + "\n"
            finish = stream.finish
            if finish.reason == "error":
                yield json.dumps(streamed_error(request.url.path, finish.error or "generation failed")) + "\n"
            elif finish.reason != "cancelled":
                yield (
                    json.dumps({**head, "created_at": _now(), **piece(""), **_stats(finish, arrived, load_seconds)})
                    + "\n"
                )
        finally:
            stream.cancel()  # the client went away: free the slot

    @router.post("/api/generate")
    async def generate(request: Request):
        arrived = time.perf_counter()
        body = parse_body(GenerateRequest, await read_json(request))
        check_model(body.model)
        if not body.prompt and unloads_now(body.keep_alive):
            return await unload(body.model, {"response": ""})
        if body.raw and body.system:  # as Ollama: raw means the prompt goes in as it is, nothing around it
            raise ApiError(400, "raw mode does not support template, system, or context")
        if not body.prompt:  # Ollama's way to load a model (a system prompt alone generates nothing)
            await residency.ready(body.keep_alive)
            return JSONResponse(
                {"model": body.model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
            )
        if body.raw:
            prompt_ids, stops = await asyncio.to_thread(served.text_prompt_ids, body.prompt), []
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": body.prompt}
            ]
            prompt_ids, stops = await _render(messages), served.chat_stops
        return await respond(request, body, prompt_ids, stops, lambda text: {"response": text}, arrived)

    @router.post("/api/chat")
    async def chat(request: Request):
        arrived = time.perf_counter()
        body = parse_body(ChatRequest, await read_json(request))
        check_model(body.model)
        if not body.messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
            empty = {"message": {"role": "assistant", "content": ""}}
            if unloads_now(body.keep_alive):
                return await unload(body.model, empty)
            await residency.ready(body.keep_alive)
            return JSONResponse(
                {"model": body.model, "created_at": _now(), **empty, "done": True, "done_reason": "load"}
            )
        try:
            tools = read_tools(body.tools)
            messages = [
                {"role": m.role, "content": m.content, "tool_calls": [ollama_call(c) for c in m.tool_calls or []]}
                for m in body.messages
            ]
        except ToolError as e:
            raise ApiError(400, str(e)) from None
        prompt_ids = await _render(template_messages(messages, tools))
        return await respond(
            request,
            body,
            prompt_ids,
            served.chat_stops,
            lambda text: {"message": {"role": "assistant", "content": text}},
            arrived,
            tools,
        )

    async def unload(model: str, empty: dict[str, Any]) -> JSONResponse:
        await residency.unload_now()
        return JSONResponse({"model": model, "created_at": _now(), **empty, "done": True, "done_reason": "unload"})

    async def _render(messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's ids, made in a worker thread: a long prompt's tokenization (or a template's long
        loops) must not hold up /health and the running streams (prompt_tokens.py)."""
        try:
            return await asyncio.to_thread(served.chat_prompt_ids, messages)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def _model_entry() -> dict[str, Any]:
        return {
            "name": served.tagged_name,
            "model": served.tagged_name,
            "modified_at": served.loaded_at.isoformat(),
            "size": served.size_bytes,
            "digest": served.digest,
            "details": served.details(),
        }

    @router.get("/api/tags")
    async def tags():
        return {"models": [_model_entry()]}

    @router.get("/api/ps")
    async def ps():
        if not residency.loaded:  # keep_alive took the weights out: nothing is running, as Ollama lists it
            return {"models": []}
        on_gpu = engine.device.type != "cpu"
        size = served.size_bytes + engine.kv_cache_bytes
        expires = residency.expires_at
        expires_at = FAR_FUTURE if expires is None else expires.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {
            "models": [
                {
                    **_model_entry(),
                    "expires_at": expires_at,
                    "size": size,
                    "size_vram": size if on_gpu else 0,
                    "context_length": engine.context,
                }
            ]
        }

    @router.post("/api/show")
    async def show(request: Request):
        body = parse_body(ShowRequest, await read_json(request))
        check_model(body.requested)
        args = served.loaded.model.args
        stops = "".join(f"stop {json.dumps(s)}\n" for s in served.chat_stops)
        # The source by its directory's name only: a client has no business knowing the server's paths.
        return {
            "modelfile": f"# served by phalanx {phalanx.__version__}\n"
            f"FROM {served.source.name}\nTEMPLATE {json.dumps(served.loaded.chat_template)}\n"
            + "".join(f"PARAMETER {line}\n" for line in stops.splitlines()),
            "parameters": stops,
            "template": served.loaded.chat_template,
            "details": served.details(),
            "model_info": {
                "general.architecture": "llama",
                "general.parameter_count": served.parameters,
                "llama.context_length": engine.context,
                "llama.embedding_length": args.dim,
                "llama.block_count": args.n_layers,
                "llama.feed_forward_length": args.ffn_dim,
                "llama.attention.head_count": args.n_heads,
                "llama.attention.head_count_kv": args.n_kv_heads,
                "llama.attention.layer_norm_rms_epsilon": args.norm_eps,
                "llama.rope.freq_base": args.rope_theta,
                "llama.vocab_size": args.vocab_size,
            },
            "capabilities": ["completion", "tools"],  # tools: serve/http/tool_calls.py
            "modified_at": served.loaded_at.isoformat(),
        }

    @router.get("/api/version")
    async def version():
        return {"version": phalanx.__version__}

    return router
