"""Structured output against the real `phalanx serve`: Ollama's `format` ("json" or a JSON schema) and
OpenAI's `response_format` (json_object, json_schema). The tiny model writes garbage; held to the
grammar, sampled at temperature 1 with many seeds, every reply must still parse and validate."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from serve_helpers import MODEL

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
# Bounded strings and numbers, so a model that never chooses to stop still closes within the budget.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "grim"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "tags", "alive"],
    "additionalProperties": False,
}


def test_ollama_schema_format_parses_and_validates(oll):
    for seed in range(4):
        reply = oll.chat(
            model=MODEL,
            messages=MESSAGES,
            format=PERSON,
            options={"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": seed, "num_predict": 120},
        )
        assert reply.done_reason == "stop", reply.message.content
        jsonschema.validate(json.loads(reply.message.content), PERSON)
    generated = oll.generate(
        model=MODEL, prompt="A person:", format=PERSON, options={"temperature": 0, "num_predict": 120}
    )
    jsonschema.validate(json.loads(generated.response), PERSON)
    streamed = "".join(
        c.message.content
        for c in oll.chat(
            model=MODEL, messages=MESSAGES, format=PERSON, stream=True, options={"seed": 9, "num_predict": 120}
        )
    )
    jsonschema.validate(json.loads(streamed), PERSON)


def test_ollama_json_format_is_a_json_object(oll):
    reply = oll.chat(model=MODEL, messages=MESSAGES, format="json", options={"temperature": 0, "num_predict": 60})
    assert isinstance(json.loads(reply.message.content), dict)


def test_openai_json_schema_every_sample_validates(oai):
    response = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=1.0,
        seed=3,
        n=4,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    values = []
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        values.append(json.loads(choice.message.content))
        jsonschema.validate(values[-1], PERSON)
    assert len({json.dumps(v) for v in values}) > 1  # n samples, not one sample n times


def test_openai_json_object_streamed_and_whole(oai):
    whole = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    chunks = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=60,
        stream=True,
        response_format={"type": "json_object"},
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_a_budget_too_small_to_close_the_json_says_length(http):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "format": PERSON,
        "stream": False,
        "options": {"temperature": 0, "num_predict": 5},
    }
    reply = http.post("/api/chat", json=body).json()
    assert reply["done_reason"] == "length" and reply["eval_count"] == 5
    with pytest.raises(ValueError):
        json.loads(reply["message"]["content"])
    oai_body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 5,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    choice = http.post("/v1/chat/completions", json=oai_body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith('{"')


def test_bad_formats_are_400(http):
    chat = {"model": MODEL, "messages": MESSAGES, "stream": False}
    for bad in (5, "yaml", {"type": "nonsense"}):
        response = http.post("/api/chat", json={**chat, "format": bad})
        assert response.status_code == 400 and response.json()["error"], (bad, response.text)
    oai = {"model": MODEL, "messages": MESSAGES}
    for bad in (
        {"type": "xml"},
        {"type": "json_schema", "json_schema": {"schema": 7}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    ):
        response = http.post("/v1/chat/completions", json={**oai, "response_format": bad})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == "response_format"
    assert http.get("/health").status_code == 200


def test_a_format_in_the_batch_leaves_a_greedy_neighbour_unchanged(http):
    plain = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "presence_penalty": 0}
    alone = http.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]["content"]
    formatted = {**plain, "temperature": 1.0, "response_format": {"type": "json_object"}, "max_tokens": 60}

    def post(body):
        return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, {**formatted, "seed": s}) for s in range(5)] + [pool.submit(post, plain)]
        results = [f.result() for f in futures]
    assert results[-1] == alone
    assert all(r.startswith("{") for r in results[:-1])


def test_the_grammar_alone_decides_greedy_json(http):
    """Constrained greedy is the argmax among allowed tokens: the same reply every time."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "stream": False,
        "format": PERSON,
        "options": {"temperature": 0, "num_predict": 120},
    }
    first, second = (http.post("/api/chat", json=body).json()["message"]["content"] for _ in range(2))
    assert first == second
    jsonschema.validate(json.loads(first), PERSON)
    assert httpx.codes.OK == http.get("/health").status_code


# ---- the pieces, without HTTP ----


def test_format_fields_map_to_schemas():
    from phalanx.serve.core.structured_output import (
        ANY_JSON_OBJECT,
        FormatError,
        ollama_format_schema,
        openai_format_schema,
        schema_grammar,
    )

    assert ollama_format_schema("") is None and ollama_format_schema(None) is None
    assert ollama_format_schema("json") == ANY_JSON_OBJECT and ollama_format_schema(PERSON) == PERSON
    assert openai_format_schema({"type": "text"}) is None
    assert openai_format_schema({"type": "json_object"}) == ANY_JSON_OBJECT
    assert openai_format_schema({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}) == PERSON
    for bad in ([PERSON], {"type": "nonsense"}, {"properties": {"a": {"type": "integer", "minimum": "x"}}}):
        with pytest.raises(FormatError):
            schema_grammar(bad)


def test_engine_ends_a_complete_value_without_spending_a_token(served_run):
    """Once the grammar allows only end-of-text the request stops: every token taken is part of the JSON."""
    from phalanx.serve.core.options import SamplingOptions
    from phalanx.serve.core.served import load_served_model
    from phalanx.serve.core.structured_output import schema_grammar
    from phalanx.serve.engines.torch_engine import Engine

    served = load_served_model(served_run)
    engine = Engine(served.loaded.model, served.loaded.tokenizer, slots=2, max_queue=2)
    engine.start()
    try:
        prompt = served.chat_prompt_ids(MESSAGES)
        constraint = engine.vocabulary.constraint(schema_grammar(PERSON))
        stream = engine.submit(
            prompt, SamplingOptions(temperature=1.0, seed=5, max_tokens=120), constraint=constraint, top_logprobs=0
        )
        text = stream.text()
        assert stream.finish.reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
        assert stream.finish.completion_tokens == len(stream.logprobs)  # no end-of-text token was drawn
        assert b"".join(bytes(e["bytes"]) for e in stream.logprobs).decode() == text
    finally:
        engine.stop()
