"""Ollama's request bodies (docs.ollama.com/api), strictly: /api/generate, /api/chat and /api/show.

`format` (structured output), `tools` and `logprobs`/`top_logprobs` are honoured (serve/core/structured_output.py,
serve/http/tool_calls.py). Fields phalanx cannot honour (images, thinking, a request's own template) are accepted
only empty, as the official client sends some of them, and refused by name otherwise. keep_alive is
honoured (serve/http/keep_alive.py); options Ollama takes for its own runner or sampler that phalanx has no use for
are accepted and ignored, as Ollama ignores those it does not use (ignored.py).
Integers are 64-bit as Ollama (Go) reads them and numbers finite; the options' ranges are serve/core/options.py's.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from phalanx.serve.core.options import DEFAULTS, SamplingOptions
from phalanx.serve.http.common import ApiError, Int64, StrictModel, sampling_options
from phalanx.serve.http.ollama.ignored import IgnoredOllamaOptions


class OllamaOptions(IgnoredOllamaOptions):
    temperature: float | None = None
    top_k: Int64 | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: list[str] | None = None
    num_predict: Int64 | None = None  # -1: until the context is full (-2 too)
    num_ctx: Int64 | None = Field(None, ge=1)  # narrows the server's context for this request, never widens it


class _OllamaRequest(StrictModel):
    model: str = Field(min_length=1)
    stream: bool = True
    options: OllamaOptions | None = None
    keep_alive: float | int | str | None = None
    format: Any = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = Field(None, ge=0, le=20)  # Ollama's range

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"think": (False,)}

    @property
    def top_logprobs_asked(self) -> int | None:
        """The engine's top_logprobs: None without `logprobs: true`, else how many alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, template_stops: list[str]) -> tuple[SamplingOptions, int | None]:
        """The engine's options (Ollama's defaults filled in) and the request's context limit (num_ctx)."""
        given = self.options.used() if self.options else {}
        num_predict = given.pop("num_predict", -1)
        if num_predict < -2:
            raise ApiError(400, "num_predict must be >= 0, or -1 for no limit")
        num_ctx = given.pop("num_ctx", None)
        # The template's own stops end the assistant's turn whatever else the request adds.
        stops = tuple(dict.fromkeys([*template_stops, *given.pop("stop", [])]))
        options = sampling_options(
            **{**DEFAULTS, **given, "stop": stops, "max_tokens": None if num_predict < 0 else num_predict}
        )
        return options, num_ctx


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[Int64] | None = None
    images: list[str] | None = None
    width: Int64 | None = None
    height: Int64 | None = None
    steps: Int64 | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_OllamaRequest.UNSUPPORTED,
        "suffix": ("",),
        "template": ("",),
        "context": ([],),
        "images": ([],),
        "width": (),
        "height": (),
        "steps": (),
    }


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None  # a tool message's: which tool's result it is

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"images": ([],)}


class ChatRequest(_OllamaRequest):
    messages: list[ChatMessage] = []  # none: Ollama's load (keep_alive 0: unload) request
    tools: list[Any] | None = None


class ShowRequest(StrictModel):
    model: str | None = None
    name: str | None = None  # older clients' spelling of model
    verbose: bool | None = None

    @property
    def requested(self) -> str:
        if not (self.model or self.name):
            raise ApiError(400, "missing field 'model'")
        return self.model or self.name
