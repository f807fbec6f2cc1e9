"""OpenAI's API: /v1/chat/completions, /v1/completions and /v1/models.

Streams are server-sent events: for chat, the first chunk carries the assistant role, content follows in
deltas, the last choice chunk carries finish_reason, then (with stream_options.include_usage) a chunk of
usage with no choices, then `data: [DONE]`. /v1/completions continues the prompt as plain text (BOS,
then the text); chat renders the messages with the chat template.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

import phalanx
from phalanx.serve.engine import Engine, Finish, RequestStream
from phalanx.serve.http_common import ApiError, collect, parse_body, read_json, streamed_error, submit
from phalanx.serve.openai_schema import ChatCompletionRequest, CompletionRequest
from phalanx.serve.served import ServedModel

FINGERPRINT = f"phalanx-{phalanx.__version__}"


def _usage(finish: Finish) -> dict[str, int]:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def openai_router(served: ServedModel, engine: Engine) -> APIRouter:
    router = APIRouter()

    def check_model(name: str) -> None:
        if not served.matches(name):
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{served.name}'",
                           code="model_not_found", param="model")

    def model_object() -> dict[str, Any]:
        return {"id": served.name, "object": "model", "created": int(served.loaded_at.timestamp()),
                "owned_by": "phalanx"}

    async def respond(request: Request, body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
                      max_tokens: int | None, template_stops: list[str], kind: str,
                      choice: Callable[[str, str | None], dict[str, Any]], prefix: str = ""):
        stream = submit(engine, prompt_ids, body.sampling(max_tokens, template_stops), request)
        head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{secrets.token_hex(12)}",
                "object": kind, "created": int(time.time()), "model": body.model, "system_fingerprint": FINGERPRINT}
        if not body.stream:
            text = await collect(request, stream)
            return JSONResponse({**head, "choices": [choice(prefix + text, stream.finish.reason)],
                                 "usage": _usage(stream.finish)})
        head["object"] = f"{kind}.chunk" if kind == "chat.completion" else kind
        return StreamingResponse(_events(request, stream, head, body.include_usage, choice, kind, prefix),
                                 media_type="text/event-stream")

    async def _events(request: Request, stream: RequestStream, head: dict[str, Any], include_usage: bool,
                      choice: Callable[[str, str | None], dict[str, Any]], kind: str,
                      prefix: str) -> AsyncIterator[str]:
        usage_none = {"usage": None} if include_usage else {}
        try:
            if kind == "chat.completion":
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield _sse({**head, "choices": [first], **usage_none})
            if prefix:
                yield _sse({**head, "choices": [choice(prefix, None)], **usage_none})
            async for text in stream.chunks():
                yield _sse({**head, "choices": [choice(text, None)], **usage_none})
            finish = stream.finish
            if finish.reason == "error":
                yield _sse(streamed_error(request.url.path, finish.error or "generation failed"))
                return
            if finish.reason == "cancelled":
                return
            last = choice("", finish.reason)
            if kind == "chat.completion":
                last["delta"] = {}
            yield _sse({**head, "choices": [last], **usage_none})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finish)})
            yield _sse("[DONE]")
        finally:
            stream.cancel()  # the client went away: free the slot

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatCompletionRequest, await read_json(request))
        check_model(body.model)
        try:
            prompt_ids = served.chat_prompt_ids(body.messages_for_template())
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None

        def choice(text: str, reason: str | None) -> dict[str, Any]:
            if body.stream:
                return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason}

        return await respond(request, body, prompt_ids, body.new_tokens, served.chat_stops, "chat.completion",
                             choice)

    @router.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await read_json(request))
        check_model(body.model)
        text = body.prompt_text
        prompt_ids = served.text_prompt_ids(text)

        def choice(piece: str, reason: str | None) -> dict[str, Any]:
            return {"text": piece, "index": 0, "logprobs": None, "finish_reason": reason}

        return await respond(request, body, prompt_ids, body.max_tokens, [], "text_completion", choice,
                             prefix=text if body.echo else "")

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_object()

    return router
