"""Tools (function calling): definitions and results rendered into the prompt, calls read back out.

Llama 3.1's convention, spelt in phalanx's plain chat template: the tool definitions go into the system
turn (one JSON object per line, with how to call them), a tool's result is a turn of the `ipython` role,
and the assistant calls a tool by replying with nothing but a JSON object {"name": ..., "parameters":
{...}} (several calls: one object per line). Earlier calls in the conversation are rendered that same
way, so the model sees its own format. The rendering happens before the chat template, as plain
messages, so any template (an export's own too) gets the same text.

A reply is read as tool calls only when the whole of it is such calls to tools the request defined;
anything else stays text. A tiny model will not call tools by itself: `tool_choice` "required" or a
named function (OpenAI), or a `format` (Ollama), hold its output to call_schema() and so force one.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

TOOL_RESULT_ROLE = "ipython"  # Llama 3.1's role for what a tool returned
CALL_INSTRUCTIONS = (
    "You can call the tools below. To call one, reply with only a JSON object "
    '{"name": the tool\'s name, "parameters": an object of its arguments}.'
)
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a call with it


class ToolError(ValueError):
    """A tool definition, tool choice or tool call in a request that cannot be used (HTTP 400)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        return {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }

    def ollama(self) -> dict[str, Any]:
        return {"function": {"name": self.name, "arguments": self.arguments}}


def read_tools(raw: list[Any] | None) -> list[Tool]:
    """Both APIs' tool lists: [{"type": "function", "function": {"name", "description", "parameters"}}]."""
    tools = []
    for i, item in enumerate(raw or []):
        if (
            not isinstance(item, dict)
            or item.get("type", "function") != "function"
            or not isinstance(item.get("function"), dict)
        ):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        function = item["function"]
        name, parameters = function.get("name"), function.get("parameters") or {"type": "object"}
        if not isinstance(name, str) or not name:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        tools.append(Tool(name, str(function.get("description") or ""), parameters))
    if len({t.name for t in tools}) != len(tools):
        raise ToolError("tools must have distinct names")
    return tools


def call_text(calls: list[ToolCall]) -> str:
    """How an assistant's calls read in the prompt (and how the model is asked to write them)."""
    return "\n".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls)


def template_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    """Messages with tool definitions, calls and results spelt out as plain {role, content} turns.
    Each message: role, content, and optionally `tool_calls` (a list of ToolCall)."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            role = TOOL_RESULT_ROLE
        calls = m.get("tool_calls") or []
        if calls:
            content = (content + "\n" if content else "") + call_text(calls)
        out.append({"role": role, "content": content})
    if tools:
        listing = CALL_INSTRUCTIONS + "\n" + "\n".join(json.dumps(t.definition(), ensure_ascii=False) for t in tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def call_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON schema of one call to any of `tools`: what forcing a call holds the output to."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "parameters": t.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_calls(text: str, tools: list[Tool]) -> list[ToolCall] | None:
    """The calls a reply makes, or None when it is not (only) tool calls to these tools."""
    names = {t.name for t in tools}
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    if not names or not text.startswith(("{", "[")):
        return None
    try:
        values = json.loads(text)
        values = values if isinstance(values, list) else [values]
    except ValueError:  # several calls, one object a line (or ';'-separated, as Llama 3.1 may write)
        try:
            values = [json.loads(part) for line in text.splitlines() for part in line.split(";") if part.strip()]
        except ValueError:
            return None
    calls = [_call(v, names) for v in values]
    return calls if calls and all(calls) else None


def _call(value: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("parameters", value.get("arguments", {}))
    if isinstance(arguments, str):  # OpenAI's shape: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def ollama_call(raw: Any) -> ToolCall:
    """An assistant message's earlier call as Ollama sends it: {"function": {"name", "arguments": {}}}."""
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError('a tool call must be {"function": {"name": ..., "arguments": {...}}}')
    arguments = function.get("arguments") or {}
    if not isinstance(arguments, dict):
        raise ToolError("a tool call's arguments must be an object")
    return ToolCall(function["name"], arguments)


def openai_call(raw: Any) -> ToolCall:
    """An assistant message's earlier call as OpenAI sends it: arguments as a JSON string."""
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError('a tool call must be {"type": "function", "function": {"name": ..., "arguments": "..."}}')
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ToolError(f"the arguments of the call to {function['name']} are not valid JSON") from None
    if not isinstance(parsed, dict):
        raise ToolError("a tool call's arguments must be a JSON object")
    return ToolCall(function["name"], parsed)


def forced_tools(tool_choice: Any, tools: list[Tool]) -> list[Tool] | None:
    """OpenAI's tool_choice: the tools a call must be made to (None: no call is forced)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise ToolError("tool_choice needs tools")
    if tool_choice == "required":
        return tools
    if (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
    ):
        name = tool_choice["function"].get("name")
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise ToolError(f"tool_choice names the function '{name}', which is not among the tools")
        return chosen
    raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
