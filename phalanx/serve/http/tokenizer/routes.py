"""The model's tokenizer over HTTP, as vLLM's server offers it: POST /tokenize, POST /detokenize and GET
/tokenizer_info. Clients use them to count and build token-id prompts the server reads exactly as they
meant; lm-evaluation-harness's `local-completions` looks for /tokenizer_info and /tokenize and, where
both answer, tokenizes through them (its "remote" tokenizer) rather than needing the model's files.

/tokenize splits text as the model's tokenizer does, as vLLM's and Hugging Face's do: a special token's
string becomes that token (the harness finds the BOS and EOS ids by tokenizing their strings), unlike a
text prompt to /v1/completions, where such strings stay text; plain text gets the same ids either way.
`add_special_tokens` (default true) puts BOS first where the model has one; the harness asks for none,
and /v1/completions adds it to the ids it is sent (openai/prompts.py). /detokenize is the inverse, special
tokens written out. /tokenizer_info is tokenizer_config.json's fields (those an HF export writes), with
the server's context as model_max_length.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from phalanx.data.tokenizer import hf_tokenizer_config
from phalanx.serve.core.contract import ServingEngine
from phalanx.serve.core.served import ServedModel
from phalanx.serve.http.common import ApiError, parse_body, read_json
from phalanx.serve.http.openai.prompts import model_vocab_size, out_of_vocabulary
from phalanx.serve.http.tokenizer.schema import DetokenizeRequest, TokenizeRequest


def tokenizer_router(served: ServedModel, engine: ServingEngine) -> APIRouter:
    router = APIRouter()
    tokenizer, specials = served.loaded.tokenizer, served.loaded.specials

    def check_model(name: str | None) -> None:
        if name is not None and not served.matches(name):
            raise ApiError(
                404,
                f"the model '{name}' does not exist; this server serves '{served.name}'",
                code="model_not_found",
                param="model",
            )

    def tokenize(text: str, add_special_tokens: bool) -> list[int]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids  # phalanx frames BOS itself, below
        return specials.frame(ids) if add_special_tokens else ids

    @router.post("/tokenize")
    async def tokenize_text(request: Request):
        body = parse_body(TokenizeRequest, await read_json(request))
        check_model(body.model)
        ids = await asyncio.to_thread(tokenize, body.prompt, body.add_special_tokens)  # a megabyte takes a while
        return {
            "count": len(ids),
            "max_model_len": engine.context,
            "tokens": ids,
            "token_strs": [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None,
        }

    @router.post("/detokenize")
    async def detokenize(request: Request):
        body = parse_body(DetokenizeRequest, await read_json(request))
        check_model(body.model)
        vocab_size = model_vocab_size(served, engine.vocabulary.model_vocab)
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab_size:
                raise ApiError(400, f"invalid 'tokens[{i}]': {out_of_vocabulary(token, vocab_size)}", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return hf_tokenizer_config(engine.context, specials, served.loaded.chat_template)

    return router
