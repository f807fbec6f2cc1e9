"""The bodies of /tokenize and /detokenize, as vLLM's server takes them (strictly: unknown fields and
wrong types are 400s). Chat messages are not tokenized here: /tokenize takes text."""

from __future__ import annotations

from typing import Any, ClassVar

from phalanx.serve.http.common import Int64, StrictModel


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS first, as a text prompt is framed
    return_token_strs: bool = False
    messages: Any = None  # vLLM's chat form

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"messages": ()}


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Int64]
