"""OpenAI's request bodies, strictly: /v1/chat/completions and /v1/completions.

Beyond OpenAI's own sampling fields, top_k, min_p, repeat_penalty and repeat_last_n are accepted (as
llama.cpp's and vLLM's servers do; the openai client sends them through `extra_body`). `n`,
log-probabilities, `response_format` (structured output) and tools are honoured. Fields phalanx cannot
honour (logit bias, best_of: several samples of which one is returned, suffix) are accepted only at
their "off" value and refused by name otherwise.
Integers are int64 and numbers finite, temperature 0 to 2 as OpenAI documents it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.http.common import ApiError, Int64, StrictModel, sampling_options
from phalanx.serve.http.tool_calls import openai_call


class StreamOptions(StrictModel):
    include_usage: bool = False


class _OpenAIRequest(StrictModel):
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    user: str | None = None  # an end-user id for the caller's own records; phalanx keeps none
    n: Int64 | None = Field(None, ge=1, le=16)  # independent samples, each its own slot
    logprobs: Any = None  # chat: a bool (top_logprobs says how many alternatives); completions: 0 to 5
    logit_bias: dict[str, Any] | None = None
    # Extensions (llama.cpp / vLLM servers).
    top_k: Int64 | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: Int64 | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"logit_bias": ({},)}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None, template_stops: list[str]) -> SamplingOptions:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.repeat_last_n,
        }
        # OpenAI's defaults: temperature 1, no nucleus cut, no penalties.
        return sampling_options(
            **{
                "temperature": 1.0,
                **{k: v for k, v in given.items() if v is not None},
                "stop": tuple(dict.fromkeys([*template_stops, *stops])),
                "max_tokens": max_tokens,
            }
        )


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = Field(None, ge=1)
    max_completion_tokens: Int64 | None = Field(None, ge=1)
    top_logprobs: Int64 | None = Field(None, ge=0, le=20)  # OpenAI's range
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_OpenAIRequest.UNSUPPORTED, "store": (False,)}

    def messages_for_template(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for the system role; tool_calls.template_messages spells out calls.
        return [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
                "tool_calls": [openai_call(c) for c in m.tool_calls or []],
            }
            for m in self.messages
        ]

    @property
    def top_logprobs_asked(self) -> int | None:
        if self.logprobs not in (None, True, False):
            raise ApiError(400, "logprobs must be true or false", param="logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_OpenAIRequest):
    prompt: Any  # a string, strings, token ids or lists of them: checked by openai/prompts.py, one line per fault
    max_tokens: Int64 | None = Field(16, ge=0)  # OpenAI's default for completions; 0 with echo: score only
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None
    add_special_tokens: bool = True  # vLLM's: false sends every prompt exactly as given, without BOS

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_OpenAIRequest.UNSUPPORTED, "suffix": ("",), "best_of": (1,)}

    @property
    def top_logprobs_asked(self) -> int | None:
        """The legacy form: logprobs is how many alternatives (0 to 5) besides the token taken."""
        if self.logprobs is None:
            return None
        if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 5:
            raise ApiError(400, "logprobs must be an integer from 0 to 5", param="logprobs")
        return self.logprobs
