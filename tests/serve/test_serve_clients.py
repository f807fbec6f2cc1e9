"""The official `openai` and `ollama` clients against the real `phalanx serve`: chat and completions,
streamed and not, and the model endpoints."""

from __future__ import annotations

import json

from serve_helpers import MODEL

# Greedy, with a presence penalty so that a 4-step model says more than newlines; Ollama's default
# repeat_penalty (1.1) off, to match OpenAI's defaults.
GREEDY = {"temperature": 0, "presence_penalty": 1.0, "repeat_penalty": 1.0}
MESSAGES = [{"role": "system", "content": "Speak as in a play."}, {"role": "user", "content": "Who is there?"}]


def test_openai_chat_plain_and_streamed(oai):
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert plain.model == MODEL and plain.object == "chat.completion"
    assert 0 < plain.usage.completion_tokens <= 12 and plain.usage.prompt_tokens > 5
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices][:-1] == [None] * (len(with_choices) - 1)
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == choice.message.content


def test_openai_completions_plain_and_streamed(oai):
    plain = oai.completions.create(model=MODEL, prompt="ROMEO: But soft,", max_tokens=10, temperature=0)
    assert plain.object == "text_completion" and plain.usage.completion_tokens <= 10
    streamed = list(
        oai.completions.create(model=MODEL, prompt="ROMEO: But soft,", max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    echoed = oai.completions.create(model=MODEL, prompt="ROMEO: But soft,", max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == "ROMEO: But soft," + plain.choices[0].text
    assert [m.id for m in oai.models.list()] == [MODEL]


def test_ollama_chat_plain_and_streamed(oll):
    plain = oll.chat(model=MODEL, messages=MESSAGES, options={**GREEDY, "num_predict": 12})
    assert plain.done and plain.done_reason in ("stop", "length") and plain.message.role == "assistant"
    assert 0 < plain.eval_count <= 12 and plain.prompt_eval_count > 5
    assert plain.total_duration >= plain.eval_duration > 0 and plain.prompt_eval_duration > 0
    parts = list(oll.chat(model=MODEL, messages=MESSAGES, options={**GREEDY, "num_predict": 12}, stream=True))
    assert not any(p.done for p in parts[:-1]) and parts[-1].done
    assert parts[-1].eval_count == plain.eval_count and parts[-1].done_reason == plain.done_reason
    assert "".join(p.message.content for p in parts) == plain.message.content


def test_ollama_generate_templated_raw_and_streamed(oll):
    templated = oll.generate(
        model=MODEL, prompt="Who is there?", system="Speak as in a play.", options={**GREEDY, "num_predict": 12}
    )
    chat = oll.chat(model=MODEL, messages=MESSAGES, options={**GREEDY, "num_predict": 12})
    assert templated.response == chat.message.content  # the same prompt through the chat template
    raw = oll.generate(model=MODEL, prompt="ROMEO: But soft,", raw=True, options={**GREEDY, "num_predict": 10})
    parts = list(
        oll.generate(
            model=MODEL, prompt="ROMEO: But soft,", raw=True, options={**GREEDY, "num_predict": 10}, stream=True
        )
    )
    assert "".join(p.response for p in parts) == raw.response and parts[-1].done
    loaded = oll.generate(model=MODEL, prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_both_apis_give_the_same_greedy_reply(oai, oll):
    a = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, presence_penalty=1.0)
    b = oll.chat(model=MODEL, messages=MESSAGES, options={**GREEDY, "num_predict": 16})
    assert a.choices[0].message.content == b.message.content and b.message.content.strip()
    c = oai.completions.create(model=MODEL, prompt="KING:", max_tokens=16, temperature=0, presence_penalty=1.0)
    d = oll.generate(model=MODEL, prompt="KING:", raw=True, options={**GREEDY, "num_predict": 16})
    assert c.choices[0].text == d.response and d.response.strip()
    # The extensions llama.cpp's server takes too, through the openai client's extra_body.
    e = oai.completions.create(
        model=MODEL,
        prompt="KING:",
        max_tokens=16,
        temperature=0,
        presence_penalty=1.0,
        extra_body={"repeat_penalty": 1.1, "repeat_last_n": 64},
    )
    f = oll.generate(
        model=MODEL, prompt="KING:", raw=True, options={**GREEDY, "repeat_penalty": 1.1, "num_predict": 16}
    )
    assert e.choices[0].text == f.response


def test_ollama_model_endpoints(oll, server):
    listed = oll.list().models
    assert [m.model for m in listed] == [f"{MODEL}:latest"] and listed[0].details.family == "llama"
    shown = oll.show(MODEL)
    assert shown.modelinfo["llama.context_length"] == 1024 and shown.modelinfo["llama.embedding_length"] == 64
    assert "ASSISTANT:" in shown.template and shown.capabilities == ["completion", "tools"]
    running = oll.ps().models
    assert running[0].name == f"{MODEL}:latest" and running[0].context_length == 1024
    with server.client() as http:
        assert http.get("/api/version").json()["version"]


def test_wire_formats(server):
    """NDJSON lines for Ollama, server-sent events ending in [DONE] for OpenAI."""
    with server.client() as http:
        with http.stream(
            "POST", "/api/chat", json={"model": MODEL, "messages": MESSAGES, "options": {"num_predict": 3}}
        ) as r:
            assert r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])
        with http.stream(
            "POST", "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
