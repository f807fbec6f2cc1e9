"""Ollama's API: /api/generate, /api/chat (newline-delimited JSON streams by default, or one object with
`stream: false`), /api/tags, /api/show, /api/ps and /api/version.

/api/generate renders its prompt (and system) through the chat template as Ollama does, unless `raw`;
an empty prompt only answers that the model is loaded. Durations are in nanoseconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

import phalanx
from phalanx.serve.engine import Engine, Finish, RequestStream
from phalanx.serve.http_common import ApiError, collect, parse_body, read_json, streamed_error, submit
from phalanx.serve.ollama_schema import ChatRequest, GenerateRequest, ShowRequest
from phalanx.serve.served import ServedModel

NDJSON = "application/x-ndjson"
FAR_FUTURE = "2318-01-01T00:00:00Z"  # /api/ps expires_at: the model is never unloaded while serving


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _stats(finish: Finish, arrived: float) -> dict[str, Any]:
    return {"done": True, "done_reason": finish.reason, "total_duration": _ns(finish.finished_at - arrived),
            "load_duration": 0, "prompt_eval_count": finish.prompt_tokens,
            "prompt_eval_duration": _ns(finish.prompt_seconds), "eval_count": finish.completion_tokens,
            "eval_duration": _ns(finish.generation_seconds)}


def ollama_router(served: ServedModel, engine: Engine) -> APIRouter:
    router = APIRouter()

    def check_model(name: str) -> None:
        if not served.matches(name):
            raise ApiError(404, f"model '{name}' not found")

    async def respond(request: Request, body: GenerateRequest | ChatRequest, prompt_ids: list[int],
                      template_stops: list[str], piece: Callable[[str], dict[str, Any]], arrived: float):
        options, num_ctx = body.sampling(template_stops)
        stream = submit(engine, prompt_ids, options, request, context_limit=num_ctx)
        head = {"model": body.model}
        if not body.stream:
            text = await collect(request, stream)
            return JSONResponse({**head, "created_at": _now(), **piece(text), **_stats(stream.finish, arrived)})
        return StreamingResponse(_lines(request, stream, head, piece, arrived), media_type=NDJSON)

    async def _lines(request: Request, stream: RequestStream, head: dict[str, Any],
                     piece: Callable[[str], dict[str, Any]], arrived: float) -> AsyncIterator[str]:
        try:
            async for text in stream.chunks():
                yield json.dumps({**head, "created_at": _now(), **piece(text), "done": False}) + "\n"
            finish = stream.finish
            if finish.reason == "error":
                yield json.dumps(streamed_error(request.url.path, finish.error or "generation failed")) + "\n"
            elif finish.reason != "cancelled":
                yield json.dumps({**head, "created_at": _now(), **piece(""), **_stats(finish, arrived)}) + "\n"
        finally:
            stream.cancel()  # the client went away: free the slot

    @router.post("/api/generate")
    async def generate(request: Request):
        arrived = time.perf_counter()
        body = parse_body(GenerateRequest, await read_json(request))
        check_model(body.model)
        if not body.prompt and not body.system:
            return JSONResponse({"model": body.model, "created_at": _now(), "response": "", "done": True,
                                 "done_reason": "load"})
        if body.raw:
            prompt_ids, stops = served.text_prompt_ids(body.prompt), []
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                       [{"role": "user", "content": body.prompt}]
            prompt_ids, stops = _render(messages), served.chat_stops
        return await respond(request, body, prompt_ids, stops, lambda text: {"response": text}, arrived)

    @router.post("/api/chat")
    async def chat(request: Request):
        arrived = time.perf_counter()
        body = parse_body(ChatRequest, await read_json(request))
        check_model(body.model)
        prompt_ids = _render([{"role": m.role, "content": m.content} for m in body.messages])
        return await respond(request, body, prompt_ids, served.chat_stops,
                             lambda text: {"message": {"role": "assistant", "content": text}}, arrived)

    def _render(messages: list[dict[str, Any]]) -> list[int]:
        try:
            return served.chat_prompt_ids(messages)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def _model_entry() -> dict[str, Any]:
        return {"name": served.tagged_name, "model": served.tagged_name,
                "modified_at": served.loaded_at.isoformat(), "size": served.size_bytes, "digest": served.digest,
                "details": served.details()}

    @router.get("/api/tags")
    async def tags():
        return {"models": [_model_entry()]}

    @router.get("/api/ps")
    async def ps():
        on_gpu = engine.device.type != "cpu"
        size = served.size_bytes + engine.kv_cache_bytes
        return {"models": [{**_model_entry(), "expires_at": FAR_FUTURE, "size": size,
                            "size_vram": size if on_gpu else 0, "context_length": engine.context}]}

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
                "general.architecture": "llama", "general.parameter_count": served.parameters,
                "llama.context_length": engine.context, "llama.embedding_length": args.dim,
                "llama.block_count": args.n_layers, "llama.feed_forward_length": args.ffn_dim,
                "llama.attention.head_count": args.n_heads, "llama.attention.head_count_kv": args.n_kv_heads,
                "llama.attention.layer_norm_rms_epsilon": args.norm_eps, "llama.rope.freq_base": args.rope_theta,
                "llama.vocab_size": args.vocab_size,
            },
            "capabilities": ["completion"],
            "modified_at": served.loaded_at.isoformat(),
        }

    @router.get("/api/version")
    async def version():
        return {"version": phalanx.__version__}

    return router
