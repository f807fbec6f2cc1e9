"""Log-probabilities and n > 1 against the real `phalanx serve`, with the official clients and raw
requests: OpenAI chat (`logprobs`, `top_logprobs`), completions (the legacy `logprobs: k`), Ollama
(`logprobs`, `top_logprobs`); n independent samples, indexed, greedy ones identical, seeded ones
reproducible."""

from __future__ import annotations

import math

import pytest
from serve_helpers import MODEL

MESSAGES = [{"role": "user", "content": "Who is there?"}]


def check_entry(token: str, logprob: float, raw: list[int] | None, top: list, k: int) -> None:
    assert logprob <= 0 and math.isfinite(logprob)
    if raw is not None:
        assert bytes(raw).decode("utf-8", errors="replace") == token
    assert len(top) == k
    values = [t.logprob for t in top]
    assert values == sorted(values, reverse=True)


def test_openai_chat_logprobs_greedy(oai):
    response = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert choice.finish_reason == "length"  # (end-of-text is not listed; a stop string's tokens would be)
    assert len(content) == response.usage.completion_tokens == 12  # one entry a token
    # Bytes, not token strings, add up to the text: a token may hold part of a character.
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    for entry in content:
        check_entry(entry.token, entry.logprob, entry.bytes, entry.top_logprobs, 3)
        # Greedy without penalties takes the model's likeliest token: it heads its own alternatives.
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    streamed = list(
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    pieces = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in pieces] == [(e.token, e.logprob) for e in content]
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_sampled_logprobs_are_the_models_not_the_tempered(oai):
    """The same token at the same place has the same log-probability whatever the temperature."""
    cold = (
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True, top_logprobs=20
        )
        .choices[0]
        .logprobs.content[0]
    )
    hot = (
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, temperature=2.0, seed=7, logprobs=True, top_logprobs=20
        )
        .choices[0]
        .logprobs.content[0]
    )
    table = {t.token: t.logprob for t in cold.top_logprobs}
    assert [(t.token, t.logprob) for t in hot.top_logprobs] == [(t.token, t.logprob) for t in cold.top_logprobs]
    if hot.token in table:
        assert hot.logprob == pytest.approx(table[hot.token])


def test_completions_legacy_logprobs(oai):
    """echo with logprobs lists the prompt's tokens first (scored given the tokens before them; the BOS
    phalanx adds is not listed), then the generated ones; text_offset counts from the echoed text's start."""
    response = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8, temperature=0, logprobs=2, echo=True)
    choice = response.choices[0]
    legacy = choice.logprobs
    prompt_tokens = response.usage.prompt_tokens - 1  # less the BOS
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == prompt_tokens + 8
    assert "".join(legacy.tokens[:prompt_tokens]) == "ROMEO:"
    if not any("\ufffd" in t for t in legacy.tokens):  # no token split a character
        assert choice.text == "".join(legacy.tokens)
    assert legacy.text_offset[0] == 0 and legacy.text_offset[prompt_tokens] == len("ROMEO:")
    assert all(b - a == len(t) for a, b, t in zip(legacy.text_offset, legacy.text_offset[1:], legacy.tokens))
    for token, logprob, top in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs):
        # The two likeliest and the token itself (OpenAI's legacy form): a greedy token is among them.
        assert logprob <= 0 and top[token] == logprob and max(top.values()) >= logprob and len(top) <= 3
    generated = zip(legacy.token_logprobs[prompt_tokens:], legacy.top_logprobs[prompt_tokens:])
    assert all(len(top) == 2 and max(top.values()) == logprob for logprob, top in generated)
    plain = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8, temperature=0, logprobs=2)
    assert plain.choices[0].logprobs.tokens == legacy.tokens[prompt_tokens:]
    assert plain.choices[0].logprobs.text_offset[0] == 0


def test_ollama_logprobs(oll, http):
    reply = oll.chat(
        model=MODEL,
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=2,
        options={"temperature": 0, "repeat_penalty": 1.0, "num_predict": 10},
    )
    assert reply.done_reason == "length" and len(reply.logprobs) == reply.eval_count == 10
    for entry in reply.logprobs:
        check_entry(entry.token, entry.logprob, None, entry.top_logprobs, 2)
    raw = http.post(
        "/api/chat",
        json={
            "model": MODEL,
            "messages": MESSAGES,
            "logprobs": True,
            "stream": False,
            "options": {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 10},
        },
    )
    entries = raw.json()["logprobs"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == reply.message.content
    streamed = list(
        oll.generate(
            model=MODEL,
            prompt="Who is there?",
            logprobs=True,
            stream=True,
            options={"temperature": 0, "num_predict": 10},
        )
    )
    entries = [e for chunk in streamed for e in chunk.logprobs or []]
    assert all(e.top_logprobs == [] for e in entries)
    assert len(entries) in (streamed[-1].eval_count, streamed[-1].eval_count - 1)  # end-of-text is not listed
    assert oll.chat(model=MODEL, messages=MESSAGES, options={"num_predict": 2}).logprobs is None


def test_n_samples(oai):
    sampled = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11, n=3)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1
    again = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11, n=3)
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    single = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11)
    assert single.choices[0].message.content == texts[0]  # sample 0 is the request's own seed
    assert sampled.usage.completion_tokens == again.usage.completion_tokens <= 30
    greedy = oai.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=6, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text and greedy.usage.completion_tokens == 12

    streamed = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            temperature=1.0,
            seed=11,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    by_index: dict[int, str] = {}
    finished = set()
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert [by_index[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert streamed[-1].usage.completion_tokens == again.usage.completion_tokens


def test_bad_n_and_logprobs_are_400(http):
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    for extra in ({"n": 0}, {"n": 17}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": 3}):
        response = http.post("/v1/chat/completions", json={**chat, **extra})
        assert response.status_code == 400, (extra, response.text)
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for extra in ({"logprobs": 6}, {"logprobs": True}, {"n": -1}):
        assert http.post("/v1/completions", json={**completion, **extra}).status_code == 400, extra
    ollama_chat = {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}
    assert http.post("/api/chat", json=ollama_chat).status_code == 400
