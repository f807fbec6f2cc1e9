"""JSON schemas compiled in a process of their own, one at a time, under a time and memory budget.

Why a process: llguidance (1.9.1) resolves `$ref`s and nested schemas recursively in native code. A
chain of about 2,500 `$ref`s, or 80 `$ref`s each 20 objects deep, overflows the stack and the process
dies with SIGSEGV: no exception, no thread or bound on the document alone catches it (measured: the
overflow depends on the resolved depth across `$ref`s, not on the document's nesting). Heavy schemas
are the other hazard (reported: an `anyOf` over 3,000 properties cost 16-42 s of CPU and 500 MB). So the
worker does all of a schema's work that can blow up (the schema to a grammar, the grammar's check, a
matcher over the model's vocabulary and its first token mask), and the server only ever builds a
matcher from a grammar the worker finished. A worker that crashes, runs over its memory budget, or over
its time, is replaced, and the request gets HTTP 400.

One compile runs at a time, in arrival order (asyncio's Lock is first come, first served), each within
`time_limit_s`; a request whose client has gone is skipped or, while compiling, killed. Finished grammars
are kept by schema text, so a repeated schema costs nothing.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

COMPILE_OPTIONS = {"whitespace_flexible": False}
TIME_LIMIT_S = 10.0
MEMORY_LIMIT_BYTES = 2 << 30  # the worker's address space: llguidance's own use stays well under
MAX_SCHEMA_BYTES = 1 << 20
DISCONNECT_POLL_S = 0.25
CACHED_GRAMMARS = 64


class FormatError(ValueError):
    """The requested format is not a JSON schema llguidance can hold the output to (HTTP 400)."""


class ClientGone(Exception):
    """The client left while its schema waited or compiled; nobody is there to answer."""


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def compile_in_this_process(schema_text: str, tokenizer: Any = None) -> str:
    """Schema text to a grammar llguidance accepts, or FormatError. With a tokenizer (an LLTokenizer),
    also a matcher over its vocabulary and its first mask, where row and lexer limits show. Can crash
    the process: only the worker calls it on requests' schemas."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_text, defaults=COMPILE_OPTIONS)
    except (ValueError, TypeError) as e:
        raise FormatError(f"the JSON schema could not be read: {first_line(str(e))}") from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise FormatError(f"the JSON schema is not supported: {first_line(messages[0])}")
    if tokenizer is not None:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_logit_bias()
        if matcher.is_error():
            raise FormatError(f"the JSON schema is not supported: {first_line(matcher.get_error())}")
    return grammar


def _worker(memory_limit: int) -> None:
    """The worker process: a line of {"tokenizer", "eos_id"} first, then one schema per line in and one
    JSON line ["ok", grammar] or ["error", message] out, until EOF."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    from llguidance import LLTokenizer

    start = json.loads(sys.stdin.readline())
    tokenizer = LLTokenizer(start["tokenizer"], eos_token=start["eos_id"])  # fails here, not on a request
    print(json.dumps(["ready", ""]), flush=True)
    for line in sys.stdin:
        try:
            reply = ["ok", compile_in_this_process(line, tokenizer)]
        except FormatError as e:
            reply = ["error", str(e)]
        except Exception as e:  # llguidance's own failures (a panic, a limit) are the schema's fault too
            reply = ["error", f"the JSON schema is not supported: {first_line(str(e))}"]
        print(json.dumps(reply), flush=True)


class SchemaCompiler:
    """The server's one schema worker (started on first use) and the queue in front of it."""

    def __init__(
        self,
        tokenizer_json: str,
        eos_id: int,
        time_limit_s: float = TIME_LIMIT_S,
        memory_limit: int = MEMORY_LIMIT_BYTES,
    ):
        self._start_line = json.dumps({"tokenizer": tokenizer_json, "eos_id": eos_id}) + "\n"
        # A model writes its special tokens' strings only as the markers themselves, never as text, so a
        # schema asking for such a string as text ({"const": "<|end_of_text|>"}) cannot be met.
        self._specials = [
            json.dumps(t["content"])[1:-1]
            for t in json.loads(tokenizer_json).get("added_tokens", [])
            if t.get("special")
        ]
        self.time_limit_s, self._memory_limit = time_limit_s, memory_limit
        self._lock = asyncio.Lock()
        self._process: asyncio.subprocess.Process | None = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self.compiles = 0  # schemas sent to a worker (a cached schema sends none)
        self.workers_started = 0

    async def grammar(self, schema: Any, client_gone: Callable[[], Awaitable[bool]]) -> str:
        """The grammar for `schema`. FormatError (HTTP 400) when it is not a schema llguidance can hold
        output to within the budget; ClientGone when the client left first."""
        if not isinstance(schema, dict):
            raise FormatError(f"a JSON schema must be an object, not {type(schema).__name__}")
        try:
            text = json.dumps(schema, sort_keys=True)
        except (ValueError, RecursionError):  # a document nested deeper than Python's own limit
            raise FormatError("the JSON schema is nested too deeply") from None
        if len(text) > MAX_SCHEMA_BYTES:
            raise FormatError(f"the JSON schema is {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are compiled")
        if (special := next((s for s in self._specials if s in text), None)) is not None:
            raise FormatError(
                f"the JSON schema holds the special-token string {special!r}, which the model cannot write as text"
            )
        if (cached := self._cache.get(text)) is not None:
            self._cache.move_to_end(text)
            return cached
        async with self._lock:
            if await client_gone():
                raise ClientGone()
            grammar = await self._compile(text, client_gone)
        self._cache[text] = grammar
        if len(self._cache) > CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return grammar

    async def _compile(self, text: str, client_gone: Callable[[], Awaitable[bool]]) -> str:
        process = await self._ready_worker()
        self.compiles += 1
        process.stdin.write(text.encode() + b"\n")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.time_limit_s
        reading = asyncio.ensure_future(process.stdout.readline())
        try:
            while not reading.done():
                left = deadline - loop.time()
                if left <= 0:
                    await self._stop_worker()
                    raise FormatError(
                        f"compiling the JSON schema took over {self.time_limit_s:g} s; send a smaller schema"
                    )
                await asyncio.wait({reading}, timeout=min(DISCONNECT_POLL_S, left))
                if not reading.done() and await client_gone():
                    await self._stop_worker()
                    raise ClientGone()
            line = reading.result()
        finally:
            reading.cancel()
        if not line:  # the worker died: a stack overflow (SIGSEGV) or its memory budget
            await self._stop_worker()
            raise FormatError(
                "the JSON schema could not be compiled: the compiler ran out of stack or memory "
                "(too deeply nested, too many $refs, or too large)"
            )
        status, payload = json.loads(line)
        if status != "ok":
            raise FormatError(payload)
        return payload

    async def _ready_worker(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        await self._stop_worker()
        # A fresh interpreter that imports only llguidance: not a fork of the server (its threads, its
        # model), and not multiprocessing's spawn, which would import the server's main module again.
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "phalanx.serve.core.schema_compiler",
            str(self._memory_limit),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=64 << 20,
        )
        self._process = process
        self.workers_started += 1
        process.stdin.write(self._start_line.encode())
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), 60)
        except TimeoutError:
            ready = b""
        if not ready:
            await self._stop_worker()
            raise FormatError("the JSON schema compiler did not start")
        return process

    async def _stop_worker(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()

    async def aclose(self) -> None:
        """Stop the worker, within the event loop it was started in."""
        await self._stop_worker()


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
