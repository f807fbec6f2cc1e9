"""Tools (function calling): the parser on prepared model output, the rendering of definitions, calls and
results into the prompt, and the whole wiring against the real `phalanx serve` with the official clients
and raw requests. The tiny model would never call a tool by itself: `tool_choice` (OpenAI) or a format
of the call (Ollama) force it, which is the same code path a real model's call takes back out."""

from __future__ import annotations

import json

import pytest
from serve_helpers import MODEL

from phalanx.data.chat_template import render_chat
from phalanx.serve.http.tool_calls import (
    Tool,
    ToolCall,
    ToolError,
    call_schema,
    forced_tools,
    parse_calls,
    read_tools,
    template_messages,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = read_tools([WEATHER, CLOCK])
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- the parser and the rendering, on prepared text ----


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
            [ToolCall("get_weather", {"city": "Oslo", "days": 2})],
        ),
        (
            '  <|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}\n',
            [ToolCall("get_time", {"zone": "UTC"})],
        ),
        ('{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}', [ToolCall("get_time", {"zone": "CET"})]),
        (
            '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]',
            [ToolCall("get_time", {}), ToolCall("get_weather", {"city": "Paris"})],
        ),
        (
            '{"name": "get_time", "parameters": {"zone": "UTC"}}\n{"name": "get_time", "parameters": {"zone": "CET"}}',
            [ToolCall("get_time", {"zone": "UTC"}), ToolCall("get_time", {"zone": "CET"})],
        ),
        (
            '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
            [ToolCall("get_time", {}), ToolCall("get_weather", {})],
        ),
    ],
)
def test_parser_reads_calls(text, expected):
    assert parse_calls(text, TOOLS) == expected


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "launch_missiles", "parameters": {}}',
        '{"city": "Paris"}',
        '{"name": "get_time", "parameters": [1]}',
        '{"name": "get_time", "parameters": {}} and then some words',
        '{"name": "get_time", "parameters": {"zone": ',
        "[]",
        '{"name": "get_time", "arguments": "not json"}',
    ],
)
def test_parser_leaves_anything_else_as_text(text):
    assert parse_calls(text, TOOLS) is None


def test_rendering_puts_definitions_calls_and_results_in_the_prompt():
    history = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [ToolCall("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    rendered = template_messages(history, TOOLS)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "ipython"]
    assert rendered[0]["content"].startswith("Be brief.\n\nYou can call the tools below.")
    assert json.loads(rendered[0]["content"].splitlines()[-1])["name"] == "get_time"
    assert json.loads(rendered[2]["content"]) == {"name": "get_weather", "parameters": {"city": "Paris"}}
    text = render_chat(rendered, bos_token="<s>")
    assert "IPYTHON:\nsunny, 21 C" in text and text.endswith("ASSISTANT:\n")
    assert template_messages(MESSAGES, [])[0] == {"role": "user", "content": MESSAGES[0]["content"]}
    assert template_messages(MESSAGES, TOOLS)[0]["role"] == "system"  # one is added when there is none


def test_forcing_and_bad_definitions():
    assert forced_tools("auto", TOOLS) is None and forced_tools("none", TOOLS) is None
    assert forced_tools("required", TOOLS) == TOOLS
    assert forced_tools({"type": "function", "function": {"name": "get_time"}}, TOOLS) == [TOOLS[1]]
    assert call_schema([TOOLS[1]])["properties"]["name"] == {"const": "get_time"}
    assert len(call_schema(TOOLS)["anyOf"]) == 2
    for bad in (
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": ""}}],
        [WEATHER, WEATHER],
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
    ):
        with pytest.raises(ToolError):
            read_tools(bad)
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(ToolError):
            forced_tools(bad, TOOLS)
    assert Tool("f", "", {}).definition() == {"name": "f", "description": "", "parameters": {}}


# ---- over HTTP ----


def _weather_arguments(arguments: str | dict) -> dict:
    parsed = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    assert parsed["city"] in ("Paris", "Oslo") and 1 <= parsed["days"] <= 7
    return parsed


def test_openai_required_and_named_tool_choice(oai):
    required = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=80,
        temperature=1.0,
        seed=1,
        n=3,
    )
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
    assert len({c.message.tool_calls[0].id for c in required.choices}) == 3
    named = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _weather_arguments(call.function.arguments)


def test_openai_streamed_tool_call(oai):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER],
            max_tokens=80,
            stream=True,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].index == 0
    _weather_arguments(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_conversation_with_a_tool_result(oai, http):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    with_result = reply.usage.prompt_tokens
    without = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=1)
    assert with_result > without.usage.prompt_tokens + 10  # the call and the result are in the prompt
    bare = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert without.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # and so are the definitions
    none = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens
    broken = {
        "model": MODEL,
        "messages": [
            *MESSAGES,
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}
                ],
            },
        ],
    }
    response = http.post("/v1/chat/completions", json=broken)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_openai_bad_tool_requests_are_400(http):
    base = {"model": MODEL, "messages": MESSAGES}
    for extra in (
        {"tools": [{"type": "function"}]},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        {"tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
    ):
        response = http.post("/v1/chat/completions", json={**base, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["message"]


def test_ollama_tools_forced_by_a_format(oll, http):
    schema = call_schema(read_tools([WEATHER]))
    reply = oll.chat(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        format=schema,
        options={"temperature": 1.0, "seed": 4, "num_predict": 80},
    )
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and reply.message.content == ""
    _weather_arguments(call.function.arguments)
    streamed = list(
        oll.chat(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER],
            format=schema,
            stream=True,
            options={"temperature": 0, "num_predict": 80},
        )
    )
    calls = [c for chunk in streamed for c in chunk.message.tool_calls or []]
    assert len(calls) == 1 and streamed[-1].done and streamed[-1].done_reason == "stop"
    # The call and its result go back in as history (role "tool"), as the ollama client sends them.
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    again = oll.chat(model=MODEL, messages=history, tools=[WEATHER], options={"num_predict": 4})
    assert again.prompt_eval_count > reply.prompt_eval_count
    body = {"model": MODEL, "messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"function": {}}]}]}
    assert http.post("/api/chat", json=body).status_code == 400
    assert http.post("/api/chat", json={"model": MODEL, "messages": MESSAGES, "tools": [5]}).status_code == 400


def test_ollama_reply_without_calls_stays_text(http):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": [WEATHER],
        "stream": False,
        "options": {"temperature": 0, "num_predict": 6},
    }
    reply = http.post("/api/chat", json=body).json()
    assert "tool_calls" not in reply["message"] and isinstance(reply["message"]["content"], str)
