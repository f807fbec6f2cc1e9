"""`phalanx chat`: a terminal conversation, with a model loaded here or with a running server.

Each line read is a user turn; the reply streams out as it is generated and joins the history, so the
model sees the whole conversation every turn. `/bye` or end of input ends it, `/clear` forgets the
history. Locally the engine runs in-process (one slot); against a URL it speaks Ollama's /api/chat.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TextIO

from phalanx.errors import PhalanxError


class ChatBackend(Protocol):
    def reply(self, messages: list[dict[str, str]]) -> Iterator[str]: ...
    def close(self) -> None: ...


class LocalChat:
    def __init__(self, path: Path, options: dict[str, Any], device: str, context: int | None):
        from phalanx.serve.engine import Engine
        from phalanx.serve.options import DEFAULTS, InvalidOptions, SamplingOptions
        from phalanx.serve.served import load_served_model
        from phalanx.serve.server import pick_device

        torch_device, dtype = pick_device(device, "auto")
        self.served = load_served_model(path, torch_device, dtype)
        self.engine = Engine(self.served.loaded.model, self.served.loaded.tokenizer, slots=1, max_queue=0,
                             context=context)
        num_predict = options.pop("num_predict", None)
        try:
            self.options = SamplingOptions(**{**DEFAULTS, **options, "stop": tuple(self.served.chat_stops),
                                              "max_tokens": num_predict})
        except InvalidOptions as e:
            raise PhalanxError(str(e)) from None
        self.engine.start()

    def reply(self, messages: list[dict[str, str]]) -> Iterator[str]:
        from phalanx.serve.engine import PromptTooLong

        try:
            stream = self.engine.submit(self.served.chat_prompt_ids(messages), self.options)
        except PromptTooLong as e:
            raise ConversationError(f"{e}; /clear starts a new conversation") from None
        yield from stream
        if stream.finish.reason == "error":
            raise ConversationError(stream.finish.error or "generation failed")

    def close(self) -> None:
        self.engine.stop()


class RemoteChat:
    def __init__(self, url: str, model: str | None, options: dict[str, Any], api_key: str | None):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(10.0, read=None))
        self.options = options
        self.model = model or self._first_model()

    def _get(self, path: str) -> Any:
        import httpx

        try:
            response = self.client.get(path)
        except httpx.HTTPError as e:
            raise PhalanxError(f"cannot reach {self.url}: {e}") from None
        _raise_for(response, self.url)
        return response.json()

    def _first_model(self) -> str:
        models = self._get("/api/tags").get("models") or []
        if not models:
            raise PhalanxError(f"{self.url} serves no model")
        return models[0]["name"]

    def reply(self, messages: list[dict[str, str]]) -> Iterator[str]:
        import httpx

        body = {"model": self.model, "messages": messages, "stream": True, "options": self.options}
        try:
            with self.client.stream("POST", "/api/chat", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    _raise_for(response, self.url)
                for line in response.iter_lines():
                    if not line:
                        continue
                    part = json.loads(line)
                    if "error" in part:
                        raise ConversationError(part["error"])
                    if text := part.get("message", {}).get("content"):
                        yield text
        except httpx.HTTPError as e:
            raise PhalanxError(f"lost the connection to {self.url}: {e}") from None

    def close(self) -> None:
        self.client.close()


class ConversationError(Exception):
    """This turn failed (too long, the server refused it); the conversation can go on."""


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
        raise ConversationError(message)
    raise PhalanxError(f"{url} answered {response.status_code}: {message}")


def chat_loop(backend: ChatBackend, system: str | None, lines: TextIO = sys.stdin, out: TextIO = sys.stdout,
              err: TextIO = sys.stderr) -> int:
    """Talk until /bye or end of input; returns the number of replies."""
    interactive = lines.isatty()
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    start = len(history)
    replies = 0
    while True:
        if interactive:
            out.write(">>> ")
            out.flush()
        line = lines.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        if text.strip() == "/bye":
            break
        if text.strip() == "/clear":
            del history[start:]
            continue
        if not text.strip():
            continue
        turn = history + [{"role": "user", "content": text}]
        pieces: list[str] = []
        try:
            for piece in backend.reply(turn):
                out.write(piece)
                out.flush()
                pieces.append(piece)
        except ConversationError as e:
            err.write(f"error: {e}\n")
            err.flush()
            continue
        out.write("\n")
        out.flush()
        history = turn + [{"role": "assistant", "content": "".join(pieces)}]
        replies += 1
    return replies


def run_chat(target: str, model: str | None, system: str | None, options: dict[str, Any], api_key: str | None,
             device: str, context: int | None) -> None:
    if target.startswith(("http://", "https://")):
        if context is not None:
            raise PhalanxError("--context applies to a local model; a server's context is set by phalanx serve")
        backend: ChatBackend = RemoteChat(target, model, options, api_key)
    else:
        if model is not None:
            raise PhalanxError("--model picks a model on a server; a local run directory holds one model")
        backend = LocalChat(Path(target), options, device, context)
    try:
        chat_loop(backend, system)
    finally:
        backend.close()
