"""16 concurrent streams over both APIs, mixed lengths and sampling, on a server with 8 slots (so half
of them queue and join mid-batch): all complete, each exactly as when served alone.

A 4-step model's plain greedy text is a run of newlines whatever the prompt, which would hide a request
reading another's cache; a presence penalty keeps greedy decoding greedy but makes each reply depend on
its own context."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ollama
import openai


def requests(model: str) -> list[tuple[str, dict]]:
    out = []
    for i in range(16):
        line = "Who is there? " * (i % 4) + f"Speak, {i}."
        n = 12 + 2 * i
        if i % 4 == 0:
            out.append(
                (
                    "openai-chat",
                    {
                        "model": model,
                        "messages": [{"role": "user", "content": line}],
                        "max_tokens": n,
                        "temperature": 0,
                        "presence_penalty": 1.0,
                    },
                )
            )
        elif i % 4 == 1:
            out.append(
                (
                    "openai-completion",
                    {
                        "model": model,
                        "prompt": "ROMEO: " + line,
                        "max_tokens": n,
                        "temperature": 0,
                        "presence_penalty": 1.0,
                    },
                )
            )
        elif i % 4 == 2:  # and Ollama's default repeat penalty
            out.append(
                (
                    "ollama-chat",
                    {
                        "model": model,
                        "messages": [{"role": "user", "content": line}],
                        "options": {"temperature": 0, "presence_penalty": 1.0, "num_predict": n},
                    },
                )
            )
        else:  # seeded sampling is per request too
            out.append(
                (
                    "ollama-generate",
                    {
                        "model": model,
                        "prompt": "JULIET: " + line,
                        "raw": True,
                        "options": {"temperature": 0.9, "seed": i, "num_predict": n},
                    },
                )
            )
    return out


def run(server, kind: str, body: dict) -> tuple[str, str, int]:
    """(text, finish reason, tokens) of one streamed request."""
    if kind.startswith("openai"):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
        create = client.chat.completions.create if kind == "openai-chat" else client.completions.create
        chunks = list(create(**body, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0] for c in chunks if c.choices]
        text = "".join((p.delta.content or "") if kind == "openai-chat" else p.text for p in pieces)
        return text, pieces[-1].finish_reason, chunks[-1].usage.completion_tokens
    client = ollama.Client(host=server.url, headers=server.headers)
    call = client.chat if kind == "ollama-chat" else client.generate
    parts = list(call(**body, stream=True))
    text = "".join(p.message.content if kind == "ollama-chat" else p.response for p in parts)
    return text, parts[-1].done_reason, parts[-1].eval_count


def test_sixteen_concurrent_streams_match_each_served_alone(server):
    reqs = requests(server.model)
    alone = [run(server, kind, body) for kind, body in reqs]
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        together = list(pool.map(lambda r: run(server, *r), reqs))
    assert all(reason in ("stop", "length") for _, reason, _ in together)
    assert together == alone
    assert len({text for text, _, _ in alone}) >= 12  # the replies really differ
