"""The embedding endpoints: Ollama's /api/embed (and the older /api/embeddings) and OpenAI's /v1/embeddings,
over serve/core/embeddings.py (final hidden states, mean-pooled, L2-normalised).

Ollama cuts an input longer than the context to it unless `truncate: false` (then 400, as OpenAI always
does: its endpoint never truncates). `dimensions` is taken only at the model's own width: the model was
not trained to keep meaning in a prefix of its hidden state, so a shorter vector would be a worse one
presented as a choice.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from phalanx.serve.core.contract import ServingEngine
from phalanx.serve.core.embeddings import (
    MAX_INPUTS,
    ClientLeft,
    Embedder,
    EmbeddingQueueFull,
    InputTooLong,
    fit_to_context,
)
from phalanx.serve.core.served import ServedModel
from phalanx.serve.http.common import ApiError, parse_body, read_json
from phalanx.serve.http.embeddings.schema import OllamaEmbeddingsRequest, OllamaEmbedRequest, OpenAIEmbeddingRequest
from phalanx.serve.http.keep_alive import ModelResidency


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def embeddings_router(served: ServedModel, engine: ServingEngine, residency: ModelResidency) -> APIRouter:
    router = APIRouter()
    embedder = Embedder(served.loaded.model, served.loaded.specials.bos_id)
    context = engine.context

    def check_dimensions(dimensions: int | None, param: str | None) -> None:
        if dimensions is not None and dimensions != embedder.dimensions:
            raise ApiError(
                400,
                f"'dimensions' {dimensions} is not supported: this model's embeddings have "
                f"{embedder.dimensions} dimensions (leave it out, or ask for {embedder.dimensions})",
                param=param,
            )

    def text_inputs(texts: list[str], truncate: bool, num_ctx: int | None = None) -> list[list[int]]:
        """num_ctx (Ollama's option) narrows the context inputs are cut to or refused at, never widens it."""
        limit = min(num_ctx or context, context)
        if len(texts) > MAX_INPUTS:
            raise ApiError(400, f"at most {MAX_INPUTS} inputs per request (got {len(texts)})", param="input")
        ids = [served.text_prompt_ids(t) for t in texts]
        if any(not i for i in ids):  # an empty text, and no BOS to stand for it (a Qwen tokenizer)
            raise ApiError(400, "'input' holds an empty string, which this model cannot embed", param="input")
        try:
            return [fit_to_context(i, limit, truncate) for i in ids]
        except InputTooLong as e:
            raise ApiError(400, str(e), code="context_length_exceeded", param="input") from None

    async def embed(request: Request, inputs: list[list[int]], keep_alive: Any) -> tuple[list[list[float]], float]:
        async with residency.embedding(keep_alive) as load_seconds:
            try:
                return await embedder.embed(inputs, request.is_disconnected), load_seconds
            except EmbeddingQueueFull as e:
                raise ApiError(503, f"the server is busy: {e}", code="server_busy") from None
            except ClientLeft:
                raise ApiError(499, "the client closed the request") from None

    def check_ollama_model(name: str) -> None:
        if not served.matches(name):
            raise ApiError(404, f"model '{name}' not found")

    @router.post("/api/embed")
    async def ollama_embed(request: Request):
        arrived = time.perf_counter()
        body = parse_body(OllamaEmbedRequest, await read_json(request))
        check_ollama_model(body.model)
        check_dimensions(body.dimensions, None)
        inputs = await asyncio.to_thread(
            text_inputs,
            body.inputs,
            body.truncate,  # tokenizing: off the loop
            body.options.num_ctx if body.options else None,
        )
        vectors, load_seconds = await embed(request, inputs, body.keep_alive)
        return {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": _ns(time.perf_counter() - arrived),
            "load_duration": _ns(load_seconds),
            "prompt_eval_count": sum(len(ids) for ids in inputs),
        }

    @router.post("/api/embeddings")
    async def ollama_embeddings(request: Request):
        body = parse_body(OllamaEmbeddingsRequest, await read_json(request))
        check_ollama_model(body.model)
        if not body.prompt:  # as Ollama answers an empty prompt
            await residency.ready(body.keep_alive)
            return {"embedding": []}
        vectors, _ = await embed(request, await asyncio.to_thread(text_inputs, [body.prompt], True), body.keep_alive)
        return {"embedding": vectors[0]}

    @router.post("/v1/embeddings")
    async def openai_embeddings(request: Request):
        body = parse_body(OpenAIEmbeddingRequest, await read_json(request))
        if not served.matches(body.model):
            raise ApiError(
                404,
                f"the model '{body.model}' does not exist; this server serves '{served.name}'",
                code="model_not_found",
                param="model",
            )
        check_dimensions(body.dimensions, "dimensions")
        inputs = await asyncio.to_thread(openai_inputs, body.input)
        vectors, _ = await embed(request, inputs, None)
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(ids) for ids in inputs)
        return {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def openai_inputs(given: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(given, str):
            given = [given]
        if not given:
            raise ApiError(400, "'input' is empty: give a string, a list of strings or token arrays", param="input")
        if all(isinstance(x, str) for x in given):
            if any(not x for x in given):
                raise ApiError(400, "'input' holds an empty string", param="input")
            return text_inputs(given, truncate=False)
        arrays = [given] if all(isinstance(x, int) for x in given) else given
        if len(arrays) > MAX_INPUTS:
            raise ApiError(400, f"at most {MAX_INPUTS} inputs per request (got {len(arrays)})", param="input")
        vocab, bos = served.loaded.model.args.vocab_size, served.loaded.specials.bos_id
        out = []
        for ids in arrays:
            if not ids:
                raise ApiError(400, "'input' holds an empty token array", param="input")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is outside the vocabulary (0 to {vocab - 1})", param="input")
            # Framed as text is (BOS first, where there is one), so a text and its token ids embed alike.
            framed = ids if bos is None or ids[0] == bos else [bos, *ids]
            try:
                out.append(fit_to_context(framed, context, truncate=False))
            except InputTooLong as e:
                raise ApiError(400, str(e), code="context_length_exceeded", param="input") from None
        return out

    return router


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32 bytes, as OpenAI's clients decode them
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
