"""The choices of OpenAI's replies: whole (one JSON object) or as stream chunks, for chat and completions.

Chat choices carry tool calls when the request has tools and a sample's whole text is calls to them
(finish_reason "tool_calls"); a streamed sample is then held back until it ends, since a call can only be
recognised whole. Log-probabilities are chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, and
the completions API's legacy `{tokens, token_logprobs, top_logprobs, text_offset}`.
"""

from __future__ import annotations

from typing import Any, Protocol

from phalanx.serve.http.tool_calls import Tool, parse_calls


def _entries(piece: str) -> list[dict]:
    return list(getattr(piece, "logprobs", []))


class Reply(Protocol):
    def whole(self, index: int, text: str, reason: str, logprobs: list[dict]) -> dict[str, Any]: ...
    def opening(self, index: int) -> list[dict[str, Any]]: ...
    def delta(self, index: int, piece: str) -> dict[str, Any] | None: ...
    def closing(self, index: int, reason: str) -> list[dict[str, Any]]: ...


class ChatReply:
    def __init__(self, tools: list[Tool], logprobs: bool):
        self.tools, self.logprobs = tools, logprobs
        self._held: dict[int, list[str]] = {}

    def _logprobs(self, entries: list[dict]) -> dict[str, Any] | None:
        return {"content": entries, "refusal": None} if self.logprobs else None

    def whole(self, index: int, text: str, reason: str, logprobs: list[dict]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = parse_calls(text, self.tools) if self.tools else None
        if calls:
            message = {"role": "assistant", "content": None, "tool_calls": [c.openai() for c in calls]}
            reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": self._logprobs(logprobs), "finish_reason": reason}

    def opening(self, index: int) -> list[dict[str, Any]]:
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
    def __init__(self, prefix: str, logprobs: bool):
        self.prefix, self.logprobs = prefix, logprobs
        self._offsets: dict[int, int] = {}

    def _legacy(self, index: int, entries: list[dict]) -> dict[str, Any] | None:
        """OpenAI's legacy form; text_offset counts characters from the start of the returned text."""
        if not self.logprobs:
            return None
        offset = self._offsets.get(index, len(self.prefix))
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        self._offsets[index] = offset
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    def whole(self, index: int, text: str, reason: str, logprobs: list[dict]) -> dict[str, Any]:
        return {
            "text": self.prefix + text,
            "index": index,
            "logprobs": self._legacy(index, logprobs),
            "finish_reason": reason,
        }

    def opening(self, index: int) -> list[dict[str, Any]]:
        if not self.prefix:
            return []
        return [{"text": self.prefix, "index": index, "logprobs": None, "finish_reason": None}]

    def delta(self, index: int, piece: str) -> dict[str, Any] | None:
        return {
            "text": str(piece),
            "index": index,
            "logprobs": self._legacy(index, _entries(piece)),
            "finish_reason": None,
        }

    def closing(self, index: int, reason: str) -> list[dict[str, Any]]:
        return [{"text": "", "index": index, "logprobs": None, "finish_reason": reason}]
