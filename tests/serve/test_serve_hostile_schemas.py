"""Schemas that crash or stall their compiler are refused with 400 and hurt nobody else.

llguidance resolves `$ref`s recursively in native code: a chain of 2,500 of them, or 80 each 20 objects
deep, overflows the stack of the process that compiles it (measured with llguidance 1.9.1; before the
compile moved to a worker process, one such request killed `phalanx serve`). The compiler's own budget
(time, client gone) is tested on it directly, with budgets small enough for a quick test.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from serve_helpers import MODEL

from phalanx.serve.core.schema_compiler import ClientGone, FormatError, SchemaCompiler


def ref_chain(n: int, depth: int = 0, root: str = "#") -> dict:
    """n definitions, each `depth` objects deep around a `$ref` to the next: the resolved schema nests
    n * depth objects and n refs while the document itself nests at most depth + 3 levels. `root`: the
    pointer to where this schema sits in the document the server compiles."""

    def nest(inner: dict) -> dict:
        for _ in range(depth):
            inner = {"type": "object", "properties": {"a": inner}, "required": ["a"]}
        return inner

    defs = {f"d{i}": nest({"$ref": f"{root}/$defs/d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 4}
    return {"$defs": defs, "$ref": f"{root}/$defs/d0"}


HOSTILE = {"2500 refs": (2500, 0), "80 refs 20 deep": (80, 20)}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def routes(schema: dict, tool_schema: dict | None = None) -> dict[str, tuple[str, dict]]:
    """The three ways a request hands the server a schema to compile (a tool's parameters sit inside
    the schema of a call: `tool_schema`, when its pointers differ)."""
    messages = [{"role": "user", "content": "go"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": tool_schema or schema}}
    return {
        "openai response_format": (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": messages,
                "max_tokens": 32,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
        ),
        "ollama format": (
            "/api/chat",
            {"model": MODEL, "messages": messages, "stream": False, "format": schema, "options": {"num_predict": 32}},
        ),
        "openai forced tool call": (
            "/v1/chat/completions",
            {"model": MODEL, "messages": messages, "max_tokens": 32, "tools": [tool], "tool_choice": "required"},
        ),
    }


def assert_serves_at_once(http) -> None:
    """The next ordinary request, with a schema, succeeds within a second."""
    started = time.monotonic()
    path, body = routes(SMALL)["openai response_format"]
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("route", list(routes(SMALL)))
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_schema_that_overflows_the_compilers_stack_is_400_and_the_server_lives(http, name, route):
    n, depth = HOSTILE[name]
    path, body = routes(ref_chain(n, depth), ref_chain(n, depth, "#/properties/parameters"))[route]
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert "ran out of stack or memory" in response.text
    assert_serves_at_once(http)


def test_a_schema_asking_for_a_special_tokens_text_is_400(http):
    """The model writes "<|end_of_text|>" only as the marker, never as text: such a schema cannot be met
    (it ended in a 500 when the grammar reached the marker's text)."""
    for route in ("openai response_format", "ollama format"):
        path, body = routes({"const": "<|end_of_text|>"})[route]
        response = http.post(path, json=body)
        assert response.status_code == 400 and "special-token string" in response.text, response.text
    assert_serves_at_once(http)


# -- the compiler itself: its budgets, with a tokenizer of the shared served run -------------------------
def heavy_schema(n: int = 3000) -> dict:
    """About 0.5-1 s to compile on these machines: over a 0.05 s budget, well under the default."""
    return {
        "type": "object",
        "properties": {f"p{i}": {"anyOf": [{"type": "string"}, {"type": "integer"}]} for i in range(n)},
    }


@pytest.fixture
def compiler(served_run):
    """Each test runs it in one event loop of its own (asyncio.run) and closes it there."""
    from phalanx.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(served_run / "tokenizer.json")
    return SchemaCompiler(tokenizer.to_str(), eos_id=0)


async def never_gone() -> bool:
    return False


def test_the_compiler_refuses_a_compile_over_its_time_and_starts_afresh(compiler):
    async def scenario():
        compiler.time_limit_s = 0.05
        with pytest.raises(FormatError, match="took over 0.05 s"):
            await compiler.grammar(heavy_schema(), never_gone)
        compiler.time_limit_s = 10
        grammar = await compiler.grammar(SMALL, never_gone)
        assert grammar and compiler.workers_started == 2
        assert await compiler.grammar(dict(SMALL), never_gone) == grammar and compiler.compiles == 2  # cached
        await compiler.aclose()

    asyncio.run(scenario())


def test_a_compile_whose_client_left_is_stopped_and_the_queue_moves_on(compiler):
    async def scenario():
        calls = 0

        async def gone_after_a_moment() -> bool:
            nonlocal calls
            calls += 1
            return calls > 1  # present when the compile starts, gone at the first poll

        left = asyncio.ensure_future(compiler.grammar(heavy_schema(), gone_after_a_moment))
        queued = asyncio.ensure_future(compiler.grammar(SMALL, never_gone))
        with pytest.raises(ClientGone):
            await left
        assert await queued
        assert compiler.workers_started == 2  # the abandoned compile's worker was killed, not waited for
        await compiler.aclose()

    asyncio.run(scenario())


def test_the_compiler_refuses_what_is_not_a_schema_before_any_worker(compiler):
    async def scenario():
        with pytest.raises(FormatError, match="must be an object"):
            await compiler.grammar(["not", "a", "schema"], never_gone)
        with pytest.raises(FormatError, match="not supported|could not be read"):
            await compiler.grammar({"type": "no-such-type"}, never_gone)
        await compiler.aclose()

    asyncio.run(scenario())
