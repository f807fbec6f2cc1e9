"""The choices of OpenAI's replies: whole (one JSON object) or as stream chunks, for chat and completions.

Chat choices carry tool calls when the request has tools and a sample's whole text is calls to them
(finish_reason "tool_calls"); a streamed sample is then held back until it ends, since a call can only be
recognised whole. Log-probabilities are chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, and
the completions API's legacy `{tokens, token_logprobs, top_logprobs, text_offset}`, where echo with
logprobs lists the prompt's scored tokens before the generated ones.
"""

from __future__ import annotations

from typing import Any, Protocol

from phalanx.serve.core.structured_output import TokenVocabulary
from phalanx.serve.http.openai.prompts import CompletionPrompt
from phalanx.serve.http.tool_calls import Tool, parse_calls


def _entries(piece: str) -> list[dict]:
    return list(getattr(piece, "logprobs", []))


class Reply(Protocol):
    # True where the opening chunk needs the prompt's scores, so waits for the prefill (echo + logprobs).
    opens_after_prefill: bool

    def whole(
        self, index: int, text: str, reason: str, logprobs: list[dict], prompt_logprobs: list[dict] | None = None
    ) -> dict[str, Any]: ...
    def opening(self, index: int, prompt_logprobs: list[dict] | None = None) -> list[dict[str, Any]]: ...
    def delta(self, index: int, piece: str) -> dict[str, Any] | None: ...
    def closing(self, index: int, reason: str) -> list[dict[str, Any]]: ...


class ChatReply:
    opens_after_prefill = False

    def __init__(self, tools: list[Tool], logprobs: bool):
        self.tools, self.logprobs = tools, logprobs
        self._held: dict[int, list[str]] = {}

    def _logprobs(self, entries: list[dict]) -> dict[str, Any] | None:
        return {"content": entries, "refusal": None} if self.logprobs else None

    def whole(
        self, index: int, text: str, reason: str, logprobs: list[dict], prompt_logprobs: list[dict] | None = None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = parse_calls(text, self.tools) if self.tools else None
        if calls:
            message = {"role": "assistant", "content": None, "tool_calls": [c.openai() for c in calls]}
            reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": self._logprobs(logprobs), "finish_reason": reason}

    def opening(self, index: int, prompt_logprobs: list[dict] | None = None) -> list[dict[str, Any]]:
        return [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ]

    def delta(self, index: int, piece: str) -> dict[str, Any] | None:
        if self.tools:  # a call is only recognisable whole
            self._held.setdefault(index, []).append(piece)
            return None
        return {
            "index": index,
            "delta": {"content": str(piece)},
            "logprobs": self._logprobs(_entries(piece)),
            "finish_reason": None,
        }

    def closing(self, index: int, reason: str) -> list[dict[str, Any]]:
        chunks = []
        if self.tools:
            held = self._held.pop(index, [])
            text = "".join(held)
            calls = parse_calls(text, self.tools)
            if calls:
                deltas = [{"index": k, **c.openai()} for k, c in enumerate(calls)]
                chunks.append(
                    {"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}
                )
                reason = "tool_calls" if reason == "stop" else reason
            elif text:
                entries = [e for piece in held for e in _entries(piece)]
                chunks.append(
                    {
                        "index": index,
                        "delta": {"content": text},
                        "logprobs": self._logprobs(entries),
                        "finish_reason": None,
                    }
                )
        return chunks + [{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]


class CompletionReply:
    """Choice i is sample i % n of prompt i // n. With echo the prompt's text comes first; with echo and
    logprobs its tokens are listed first too, each with its log-probability given the tokens before it
    (the engine's prompt scores; the first token the model saw has none: null), then the generated ones.
    A BOS phalanx added is neither echoed nor listed (prompts.py)."""

    def __init__(
        self, prompts: list[CompletionPrompt], n: int, echo: bool, logprobs: bool, vocabulary: TokenVocabulary
    ):
        self.prompts, self.n, self.echo, self.logprobs = prompts, n, echo, logprobs
        self.vocabulary = vocabulary  # the token text of a prompt's first token, which has no score entry
        self.opens_after_prefill = echo and logprobs
        self._offsets: dict[int, int] = {}

    def _prompt(self, index: int) -> CompletionPrompt:
        return self.prompts[index // self.n]

    def _prefix(self, index: int) -> str:
        return self._prompt(index).echo if self.echo else ""

    def _legacy(self, index: int, entries: list[dict]) -> dict[str, Any] | None:
        """OpenAI's legacy form; text_offset counts characters from the start of the returned text, and
        each token's alternatives include the token itself, as OpenAI's do."""
        if not self.logprobs:
            return None
        offset = self._offsets.get(index, 0)
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        self._offsets[index] = offset
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                None
                if e["logprob"] is None
                else {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _prompt_entries(self, index: int, scored: list[dict] | None) -> list[dict]:
        """The shown prompt tokens' entries: the first token the engine saw (no score) and the scored rest,
        less the BOS phalanx added."""
        prompt = self._prompt(index)
        first = prompt.ids[0]
        unscored = {"token": self.vocabulary.token_bytes(first).decode("utf-8", errors="replace"), "logprob": None}
        return ([unscored, *(scored or [])])[prompt.added :]

    def _echo_logprobs(self, index: int, prompt_logprobs: list[dict] | None) -> dict[str, Any] | None:
        if not self.opens_after_prefill:
            return None
        self._offsets[index] = 0
        return self._legacy(index, self._prompt_entries(index, prompt_logprobs))

    def _start_offsets(self, index: int) -> None:
        # The generated tokens' offsets start after the echoed text, whatever the prompt tokens' add up to.
        self._offsets[index] = len(self._prefix(index))

    def whole(
        self, index: int, text: str, reason: str, logprobs: list[dict], prompt_logprobs: list[dict] | None = None
    ) -> dict[str, Any]:
        listed = self._echo_logprobs(index, prompt_logprobs)
        self._start_offsets(index)
        generated = self._legacy(index, logprobs)
        if listed is not None and generated is not None:
            generated = {key: listed[key] + generated[key] for key in listed}
        return {"text": self._prefix(index) + text, "index": index, "logprobs": generated, "finish_reason": reason}

    def opening(self, index: int, prompt_logprobs: list[dict] | None = None) -> list[dict[str, Any]]:
        listed = self._echo_logprobs(index, prompt_logprobs)
        self._start_offsets(index)
        prefix = self._prefix(index)
        if not prefix and listed is None:
            return []
        return [{"text": prefix, "index": index, "logprobs": listed, "finish_reason": None}]

    def delta(self, index: int, piece: str) -> dict[str, Any] | None:
        return {
            "text": str(piece),
            "index": index,
            "logprobs": self._legacy(index, _entries(piece)),
            "finish_reason": None,
        }

    def closing(self, index: int, reason: str) -> list[dict[str, Any]]:
        return [{"text": "", "index": index, "logprobs": None, "finish_reason": reason}]
