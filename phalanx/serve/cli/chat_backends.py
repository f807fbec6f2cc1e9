"""Where `phalanx chat`'s replies come from: a model loaded in this process, or a running server.

Both take the conversation and the chat's parameters in Ollama's option names and give a Reply: the text
pieces as they stream, stop() to end it early (Ctrl-C), and the counts and timings once it has ended.
Parameters are checked by the same code as a server's /api/chat body, so `/set parameter` refuses exactly
what a server would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from phalanx.errors import PhalanxError

# The sections `/show info` prints: a title, then (label, value) rows.
InfoSections = list[tuple[str, list[tuple[str, str]]]]


class ConversationError(Exception):
    """This turn failed (too long, the server refused it); the conversation can go on. `too_long`: the
    prompt leaves no room for a reply in the context (the chat then leaves out its oldest exchanges)."""

    def __init__(self, message: str, too_long: bool = False):
        super().__init__(message)
        self.too_long = too_long


class InvalidParameters(ValueError):
    """A parameter the model cannot take (out of range, wrong type); the message says which."""


@dataclass(frozen=True)
class ReplyStats:
    prompt_tokens: int
    prompt_seconds: float
    tokens: int
    seconds: float  # from the first token to the last

    def line(self) -> str:
        rate = f" ({self.tokens / self.seconds:,.1f} tokens/s)" if self.seconds > 0 else ""
        return (
            f"{self.tokens} tokens in {self.seconds:.2f} s{rate}; "
            f"prompt {self.prompt_tokens} tokens in {self.prompt_seconds:.2f} s"
        )


class Reply(Protocol):
    stats: ReplyStats | None  # set once the reply has ended by itself

    def __iter__(self) -> Iterator[str]: ...
    def stop(self) -> None: ...  # end it now; nothing once it has ended


class ChatBackend(Protocol):
    name: str
    where: str  # for the opening line: "110.9K parameters, cpu", or the server's address

    def reply(self, messages: list[dict[str, str]], params: dict[str, Any]) -> Reply: ...
    def info(self) -> InfoSections: ...
    def model_parameters(self) -> list[tuple[str, str]]: ...  # what the model itself sets (its stops)
    def close(self) -> None: ...


def check_parameters(params: dict[str, Any], template_stops: list[str] | None = None) -> tuple[Any, int | None]:
    """The engine's SamplingOptions and the context limit (num_ctx) for these parameters, validated as a
    server validates an /api/chat request's `options`; raises InvalidParameters with the server's words."""
    from phalanx.serve.http.common import ApiError, parse_body
    from phalanx.serve.http.ollama.schema import ChatRequest

    try:
        body = parse_body(ChatRequest, {"model": "chat", "messages": [{"role": "user"}], "options": params})
        return body.sampling(template_stops or [])
    except ApiError as e:
        raise InvalidParameters(e.message.replace("options.", "")) from None


class LocalReply:
    def __init__(self, stream: Any):
        self.stream = stream
        self.stats: ReplyStats | None = None

    def __iter__(self) -> Iterator[str]:
        yield from self.stream
        finish = self.stream.finish
        if finish.reason == "error":
            raise ConversationError(finish.error or "generation failed")
        self.stats = ReplyStats(
            finish.prompt_tokens, finish.prompt_seconds, finish.completion_tokens, finish.generation_seconds
        )

    def stop(self) -> None:
        if self.stream.finish is not None:
            return
        # The engine frees the slot at its next step; wait for that, since the chat's engine has one slot
        # and no queue, so the next turn would otherwise be refused. A second Ctrl-C must not skip the wait.
        self.stream.cancel()
        while True:
            try:
                for _ in self.stream:
                    pass
                return
            except KeyboardInterrupt:
                continue


class LocalChat:
    """The serving engine in this process, with one slot: the same decoding as `phalanx serve`."""

    def __init__(self, path: Path, device: str, context: int | None):
        from phalanx.serve.core.served import load_served_model
        from phalanx.serve.server import build_engine, pick_device

        torch_device, dtype = pick_device(device, "auto")
        self.served = load_served_model(path, torch_device, dtype)
        max_seq_len = self.served.loaded.model.args.max_seq_len
        if context is not None and context > max_seq_len:
            raise PhalanxError(f"--context {context} is longer than the model's max_seq_len {max_seq_len}")
        self.engine = build_engine("torch", self.served, slots=1, max_queue=0, context=context, observer=None)
        self.engine.start()
        self.name = self.served.name
        self.where = f"{self.served.details()['parameter_size']} parameters, {torch_device}"

    def reply(self, messages: list[dict[str, str]], params: dict[str, Any]) -> LocalReply:
        from phalanx.serve.core.contract import PromptTooLong, QueueFull

        try:
            options, num_ctx = check_parameters(params, self.served.chat_stops)
            prompt_ids = self.served.chat_prompt_ids(messages)
            return LocalReply(self.engine.submit(prompt_ids, options, context_limit=num_ctx))
        except (InvalidParameters, ValueError, QueueFull) as e:  # PromptTooLong is a ValueError too
            too_long = isinstance(e, PromptTooLong)
            hint = "; /clear starts a new conversation" if too_long else ""
            raise ConversationError(f"{e}{hint}", too_long=too_long) from None

    def info(self) -> InfoSections:
        args = self.served.loaded.model.args
        details = self.served.details()
        model = [
            ("name", self.served.name),
            ("architecture", "llama"),
            ("parameters", f"{details['parameter_size']} ({self.served.parameters:,})"),
            ("context length", str(self.engine.context)),
            ("embedding length", str(args.dim)),
            ("layers", str(args.n_layers)),
            ("attention heads", f"{args.n_heads} ({args.n_kv_heads} key/value)"),
            ("feed-forward length", str(args.ffn_dim)),
            ("vocabulary", str(args.vocab_size)),
            ("precision", details["quantization_level"]),
        ]
        source = [
            ("checkpoint", str(self.served.loaded.checkpoint)),
            ("format", self.served.loaded.format),
            ("device", str(self.engine.device)),
            ("loaded in", f"{self.served.load_seconds:.1f} s"),
        ]
        return [("Model", model), ("Source", source)]

    def model_parameters(self) -> list[tuple[str, str]]:
        return [("stop", json.dumps(s)) for s in self.served.chat_stops]

    def close(self) -> None:
        self.engine.stop()


class RemoteReply:
    def __init__(self, response: Any, url: str):
        self.response, self.url = response, url
        self.stats: ReplyStats | None = None

    def __iter__(self) -> Iterator[str]:
        import httpx

        try:
            for line in self.response.iter_lines():
                if not line:
                    continue
                part = json.loads(line)
                if "error" in part:
                    raise ConversationError(part["error"])
                if text := part.get("message", {}).get("content"):
                    yield text
                if part.get("done"):
                    self.stats = ReplyStats(
                        part.get("prompt_eval_count", 0),
                        part.get("prompt_eval_duration", 0) / 1e9,
                        part.get("eval_count", 0),
                        part.get("eval_duration", 0) / 1e9,
                    )
        except httpx.HTTPError as e:
            raise PhalanxError(f"lost the connection to {self.url}: {e}") from None
        finally:
            self.response.close()

    def stop(self) -> None:
        # Closing the connection is how an Ollama client stops a reply: the server cancels the request.
        self.response.close()


class RemoteChat:
    """A running server (phalanx serve, or Ollama itself), over Ollama's /api/chat."""

    def __init__(self, url: str, model: str | None, api_key: str | None):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(10.0, read=None))
        self.name = model or self._first_model()
        self.where = self.url
        self._shown: dict[str, Any] | None = None
        self._show()  # an unknown --model fails here, before the first turn

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            response = self.client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise PhalanxError(f"cannot reach {self.url}: {e}") from None
        _raise_for(response, self.url)
        return response.json()

    def _first_model(self) -> str:
        models = self._request("GET", "/api/tags").get("models") or []
        if not models:
            raise PhalanxError(f"{self.url} serves no model")
        return models[0]["name"]

    def _show(self) -> dict[str, Any]:
        if self._shown is None:
            self._shown = self._request("POST", "/api/show", {"model": self.name})
        return self._shown

    def reply(self, messages: list[dict[str, str]], params: dict[str, Any]) -> RemoteReply:
        import httpx

        body = {"model": self.name, "messages": messages, "stream": True, "options": params}
        try:
            response = self.client.send(self.client.build_request("POST", "/api/chat", json=body), stream=True)
        except httpx.HTTPError as e:
            raise PhalanxError(f"lost the connection to {self.url}: {e}") from None
        if response.status_code != 200:
            response.read()
            response.close()
            _raise_for(response, self.url)
        return RemoteReply(response, self.url)

    def info(self) -> InfoSections:
        shown = self._show()
        facts, details = shown.get("model_info") or {}, shown.get("details") or {}
        arch = facts.get("general.architecture", details.get("family", "?"))

        def fact(key: str) -> str:
            value = facts.get(f"{arch}.{key}")
            return "?" if value is None else str(value)

        count = facts.get("general.parameter_count")
        parameters = details.get("parameter_size", "?") + (f" ({count:,})" if isinstance(count, int) else "")
        model = [
            ("name", self.name),
            ("architecture", arch),
            ("parameters", parameters),
            ("context length", fact("context_length")),
            ("embedding length", fact("embedding_length")),
            ("layers", fact("block_count")),
            ("attention heads", f"{fact('attention.head_count')} ({fact('attention.head_count_kv')} key/value)"),
            ("feed-forward length", fact("feed_forward_length")),
            ("vocabulary", fact("vocab_size")),
            ("precision", details.get("quantization_level", "?")),
        ]
        return [("Model", model), ("Server", [("address", self.url), ("format", details.get("format", "?"))])]

    def model_parameters(self) -> list[tuple[str, str]]:
        lines = (self._show().get("parameters") or "").splitlines()
        return [tuple(line.split(None, 1)) for line in lines if len(line.split(None, 1)) == 2]

    def close(self) -> None:
        self.client.close()


def _raise_for(response: Any, url: str) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json().get("error")
    except ValueError:
        message = response.text.strip()
    if response.status_code == 401:
        raise PhalanxError(f"{url} needs an API key: pass --api-key KEY or set PHALANX_API_KEY ({message})")
    if response.status_code in (400, 503):
        # phalanx serve's words for a prompt that leaves no room for a reply (Ollama itself truncates)
        raise ConversationError(message, too_long=str(message).startswith("the prompt is "))
    if response.status_code == 404:
        raise PhalanxError(f"{url}: {message}")
    raise PhalanxError(f"{url} answered {response.status_code}: {message}")
