"""What both HTTP fronts share: errors in each API's own shape, a size-limited JSON body, strict request
models with clear messages, and the engine's refusals turned into statuses.

Whatever a body holds is refused with a 400 naming the problem rather than reaching code that would
fail on it: strings that are not Unicode (a lone surrogate such as "\\ud800", which JSON's escapes can
spell but no tokenizer can encode), nesting deeper than MAX_JSON_DEPTH, integers beyond 64 bits and
non-finite numbers (`1e309` parses to infinity).

Ollama's errors are {"error": "message"}; OpenAI's are {"error": {"message", "type", "param", "code"}}.
Which one a response uses follows from its path: /v1/... (and vLLM's /tokenize, /detokenize and
/tokenizer_info) is OpenAI, everything else Ollama's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, ClassVar, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import ClientDisconnect

from phalanx.http_guard import BodyTooLarge, read_body_within
from phalanx.serve.core.contract import PromptTooLong, QueueFull, RequestStream, ServingEngine
from phalanx.serve.core.options import InvalidOptions, SamplingOptions

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 64  # requests nest a few levels; a 100,000-deep array would exhaust the parser's stack
DISCONNECT_POLL_SECONDS = 0.1

# An integer as Ollama (Go's int) and OpenAI (int64) read it: anything wider is refused, not wrapped.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


# vLLM's tokenizer endpoints (serve/http/tokenizer/), outside /v1/ but answered in OpenAI's shape, as vLLM does.
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in TOKENIZER_PATHS


def error_response(path: str, error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    if error.status == 503:
        headers = {"Retry-After": "1", **(headers or {})}
    if is_openai_path(path):
        body: dict[str, Any] = {
            "error": {
                "message": error.message,
                "type": "server_error" if error.status >= 500 else "invalid_request_error",
                "param": error.param,
                "code": error.code,
            }
        }
    else:
        body = {"error": error.message}
    return JSONResponse(body, status_code=error.status, headers=headers)


def streamed_error(path: str, message: str) -> dict[str, Any]:
    """An error met after a stream began (its status is already sent): one more object in the stream."""
    if is_openai_path(path):
        return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return {"error": message}


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's JSON object, refusing bodies over `limit` bytes before reading them where the
    Content-Length says so, and as soon as they pass it otherwise (chunked uploads)."""
    try:
        body = await read_body_within(request, limit)
    except BodyTooLarge as e:
        raise ApiError(413, str(e), code="request_too_large") from None
    except ClientDisconnect:  # gone, or too slow (phalanx.http_guard answers that one 408 itself)
        raise ApiError(408, "the request body did not arrive in full") from None
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    check_json_tree(data)
    return data


def check_json_tree(data: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings that are not valid Unicode (walked without
    recursion, so the check itself cannot run out of stack)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(value, dict):
                for key in value:
                    _check_text(key)
                stack.extend((v, depth + 1) for v in value.values())
            else:
                stack.extend((v, depth + 1) for v in value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise ApiError(
            400,
            f"the request body holds a lone surrogate (\\u{ord(bad):04x}) in a string: not valid "
            "Unicode text; send each character whole (a surrogate pair, or the character itself)",
        ) from None


class StrictModel(BaseModel):
    """Request bodies: unknown fields and wrong types are errors (no string-to-number coercion)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # Fields the APIs define that phalanx cannot honour, with the "off" values clients may send anyway;
    # any other value is refused by name rather than quietly ignored.
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, off in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value not in off:
                raise ValueError(f"'{name}' is not supported by phalanx serve")
        return self


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, describe_validation_error(e), param=_first_param(e)) from None


def _field_path(loc: tuple) -> str:
    # pydantic puts union members and model names in the location ('stop', 'list[str]'); keep field names.
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int)
        or (
            isinstance(p, str)
            and "[" not in p
            and not p[:1].isupper()
            and p not in ("str", "int", "float", "bool", "dict", "list", "none")
        )
    ]
    return ".".join(parts)


def _first_param(e: ValidationError) -> str | None:
    errors = e.errors()
    return _field_path(errors[0]["loc"]) or None if errors else None


def describe_validation_error(e: ValidationError) -> str:
    """One line naming each bad field once: unknown, missing or of the wrong type."""
    by_field: dict[str, list[str]] = {}
    for err in e.errors(include_url=False):
        path = _field_path(err["loc"])
        if err["type"] == "extra_forbidden":
            text = f"unknown field '{path}'"
        elif err["type"] == "missing":
            text = f"missing field '{path}'"
        else:
            text = err["msg"].removeprefix("Value error, ")
        if text not in by_field.setdefault(path, []):
            by_field[path].append(text)
    parts = []
    for path, texts in by_field.items():
        plain = [t for t in texts if not t.startswith(("unknown field", "missing field"))]
        parts += [t for t in texts if t not in plain]
        if plain:
            parts.append(f"invalid '{path}': {' or '.join(plain)}" if path else " or ".join(plain))
    return "; ".join(parts)


def sampling_options(**kwargs: Any) -> SamplingOptions:
    try:
        return SamplingOptions(**kwargs)
    except InvalidOptions as e:
        raise ApiError(400, str(e)) from None


def submit(
    engine: ServingEngine,
    prompt_ids: list[int],
    options: SamplingOptions,
    request: Request,
    context_limit: int | None = None,
    **extras: Any,
) -> RequestStream:
    """Queue a request on the engine, its refusals as HTTP errors (never a truncated prompt). extras: the
    engine's constraint and top_logprobs."""
    try:
        return engine.submit(
            prompt_ids, options, context_limit=context_limit, loop=asyncio.get_running_loop(), **extras
        )
    except PromptTooLong as e:
        raise ApiError(400, str(e), code="context_length_exceeded", param="messages") from None
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}", code="server_busy") from None


async def collect(request: Request, stream: RequestStream) -> str:
    """The whole reply of a non-streamed request; if the client goes away first, the request is cancelled
    so its slot frees (a streamed reply notices through its response instead)."""
    pieces: list[str] = []

    async def read_all() -> None:
        async for piece in stream.chunks():
            pieces.append(piece)

    reading = asyncio.ensure_future(read_all())
    try:
        while not reading.done():
            await asyncio.wait({reading}, timeout=DISCONNECT_POLL_SECONDS)
            if not reading.done() and await request.is_disconnected():
                stream.cancel()
        reading.result()
    finally:
        stream.cancel()  # no-op once finished; frees the slot if this handler itself was cancelled
        reading.cancel()
    if stream.finish.reason == "error":
        raise ApiError(500, stream.finish.error or "generation failed")
    return "".join(pieces)
