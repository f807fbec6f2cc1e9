"""The llama.cpp engine without HTTP: the built-in engine's interface over llama-cpp-python's batched
low-level API, on GGUF exports of the serving tests' tiny run.

Two models of that run's shape and tokenizer: the trained run itself (4 steps: it mostly repeats itself,
which is what a barely trained model does) and the same shape with seeded random, untied weights, whose
argmax differs at every context, so any bit a neighbour changed in a row would show in its tokens.
Tokens are compared by their bytes, read from the log-probability entries the engine hands out.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from phalanx.export.gguf_export import write_gguf
from phalanx.models.decoder import Transformer
from phalanx.run.model_loader import LoadedModel, load_model
from phalanx.serve.core.contract import PromptTooLong, QueueFull
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.llamacpp_engine import LlamaCppEngine
from phalanx.serve.engines.torch_engine import Engine

pytestmark = pytest.mark.slow  # needs llama-cpp-python (the whole suite's install)

llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = ["ROMEO: wherefore art thou", "JULIET:\nO Romeo, Romeo!", "What light", "MACBETH: Is this a dagger"]


@dataclasses.dataclass
class Model:
    transformer: Transformer
    gguf: Path


@pytest.fixture(scope="module")
def tokenizer(served_run):
    return load_model(served_run).tokenizer


@pytest.fixture(scope="module")
def models(served_run, tmp_path_factory) -> dict[str, Model]:
    """'trained': the run's own weights; 'random': its shape untied, seeded random weights. Both f32."""
    loaded = load_model(served_run)
    root = tmp_path_factory.mktemp("llamacpp")
    torch.manual_seed(0)
    random = Transformer(dataclasses.replace(loaded.model.args, tie_embeddings=False)).eval()
    out = {}
    for name, transformer in (("trained", loaded.model.eval()), ("random", random)):
        write_gguf(LoadedModel(transformer, loaded.tokenizer, served_run), root / f"{name}.gguf", name)
        out[name] = Model(transformer, root / f"{name}.gguf")
    return out


def ids(tokenizer, text: str) -> list[int]:
    return [0] + tokenizer.encode(text).ids


def started(path: Path, tokenizer, **kwargs) -> LlamaCppEngine:
    kwargs = {"slots": 4, "max_queue": 8, "context": 256, "threads": 1, "kv_dtype": "f32", **kwargs}
    engine = LlamaCppEngine(path, tokenizer, **kwargs)
    engine.start()
    return engine


def greedy(n: int, **kwargs) -> SamplingOptions:
    return SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


def run(engine, prompt: list[int], options: SamplingOptions):
    """(text, the taken tokens' bytes, finish) of one request, waiting for its end."""
    stream = engine.submit(prompt, options, top_logprobs=0)
    text = stream.text()
    return text, [bytes(entry["bytes"]) for entry in stream.logprobs], stream.finish


def llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """llama-cpp-python's own high-level Llama, greedy, on the same ids (f32 KV cache, plain buffers)."""
    default = llama_cpp.llama_model_default_params

    def plain_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama.llama_cpp.llama_model_default_params = plain_buffers
    try:
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=256,
            n_threads=1,
            verbose=False,
            type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32,
        )
    finally:
        llama_cpp.llama.llama_cpp.llama_model_default_params = default
    try:
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == n:
                return tokens
    finally:
        llm.close()
    return tokens


@pytest.mark.parametrize("name", ["trained", "random"])
def test_greedy_tokens_are_llama_cpps_own(models, tokenizer, name):
    engine = started(models[name].gguf, tokenizer)
    try:
        for text in PROMPTS[:2]:
            prompt = ids(tokenizer, text)
            _, taken, finish = run(engine, prompt, greedy(24))
            theirs = [engine.vocabulary.token_bytes(t) for t in llama_cpp_greedy(models[name].gguf, prompt, 24)]
            assert finish.reason == "length" and finish.completion_tokens == 24
            assert taken == theirs, text
    finally:
        engine.stop()
    if name == "random":
        assert len(set(taken)) > 5  # the random model says something different at every step


SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "repeat_penalty": 1.2, "repeat_last_n": 32, "seed": 11}


@pytest.mark.parametrize("name", ["trained", "random"])
def test_tokens_match_the_torch_engine(models, tokenizer, name):
    """The same f32 weights in both engines, greedy and seeded sampling (phalanx's sampler on llama.cpp's
    logits): with an f32 cache (and so no flash attention) llama.cpp's logits differ from torch's by ~5e-6,
    so the paths may part only where two candidates are that close. With llama.cpp's CPU flash attention
    (~2e-3 off) the seeded draws on the 4-step run's near-uniform logits agreed for only 135 of 192."""
    n = 48
    model = models[name]
    ours = started(model.gguf, tokenizer)
    torch_engine = Engine(model.transformer, tokenizer, slots=4, max_queue=8, context=256)
    torch_engine.start()
    agree = {"greedy": 0, "sampled": 0}
    differs = False  # sampling really sampled: some prompt's draws are not its greedy tokens
    try:
        for text in PROMPTS:
            prompt = ids(tokenizer, text)
            taken = {}
            for kind, options in (
                ("greedy", greedy(n)),
                ("sampled", SamplingOptions(**SAMPLED, max_tokens=n, ignore_eos=True)),
            ):
                _, theirs, _ = run(torch_engine, prompt, options)
                _, taken[kind], _ = run(ours, prompt, options)
                agree[kind] += next((i for i, (a, b) in enumerate(zip(taken[kind], theirs)) if a != b), n)
            differs = differs or taken["sampled"] != taken["greedy"]
        # End of text ends a request in both at the same token (this prompt's greedy reply is 2 tokens long).
        plague = ids(tokenizer, "A plague o' both your houses")
        ended = [run(e, plague, SamplingOptions(temperature=0, max_tokens=40)) for e in (ours, torch_engine)]
    finally:
        ours.stop()
        torch_engine.stop()
    total = n * len(PROMPTS)
    print(
        f"llama.cpp engine vs torch engine, {name} f32, {len(PROMPTS)} prompts x {n} tokens, tokens that agree up "
        f"to the first difference: greedy {agree['greedy']} of {total}, seeded sampling {agree['sampled']} of "
        f"{total}"
    )
    assert agree["greedy"] >= 0.9 * total and agree["sampled"] >= 0.9 * total and differs
    (text, taken, finish), (torch_text, torch_taken, torch_finish) = ended
    assert (text, taken, finish.reason, finish.completion_tokens) == (
        torch_text,
        torch_taken,
        torch_finish.reason,
        torch_finish.completion_tokens,
    )
    if name == "random":
        assert finish.reason == "stop" and finish.completion_tokens < 40


def mixed(tokenizer) -> list[tuple[list[int], SamplingOptions]]:
    """Greedy, greedy with penalties and seeded samples, one prompt long enough to be fed in chunks."""
    long_prompt = ids(tokenizer, "ROMEO: " + "wherefore art thou Romeo, " * 12)
    return [
        (ids(tokenizer, PROMPTS[0]), greedy(40)),
        (
            ids(tokenizer, PROMPTS[1]),
            SamplingOptions(temperature=0.9, top_k=40, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True),
        ),
        (long_prompt, greedy(20)),
        (
            ids(tokenizer, PROMPTS[3]),
            SamplingOptions(temperature=0, repeat_penalty=1.3, repeat_last_n=16, max_tokens=36, ignore_eos=True),
        ),
        (ids(tokenizer, PROMPTS[2]), greedy(12)),
    ]


@pytest.mark.parametrize("unified_kv", [False, True])
def test_tokens_are_the_same_alone_and_with_others(models, tokenizer, unified_kv):
    """Four slots, five requests submitted at once: four join the first step, where the long prompt is fed
    in chunks (a batch of 24 tokens) beside the others' prompts and then their decode tokens; the fifth
    waits and joins a batch already decoding when the first slot frees."""
    requests = mixed(tokenizer)
    assert len(requests[2][0]) > 3 * 24
    engine = started(models["random"].gguf, tokenizer, batch_tokens=24, unified_kv=unified_kv)
    try:
        alone = [run(engine, prompt, options) for prompt, options in requests]
        streams = [engine.submit(prompt, options, top_logprobs=0) for prompt, options in requests]
        assert (engine.active + engine.waiting) == len(requests)
        together: list = [None] * len(requests)

        def collect(i):
            text = streams[i].text()
            together[i] = (text, [bytes(e["bytes"]) for e in streams[i].logprobs], streams[i].finish)

        threads = [threading.Thread(target=collect, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.stop()
    assert len({text for text, _, _ in alone}) == len(requests)
    assert [(text, taken, f.reason) for text, taken, f in together] == [
        (text, taken, f.reason) for text, taken, f in alone
    ]
    assert [f.completion_tokens for _, _, f in alone] == [o.max_tokens for _, o in requests]
    # The fifth request really waited for a slot (so it joined mid-batch).
    assert together[4][2].prefill_started_at > min(f.first_token_at for _, _, f in together[:4])


def test_stop_strings_and_max_tokens(models, tokenizer):
    engine = started(models["random"].gguf, tokenizer)
    try:
        prompt = ids(tokenizer, PROMPTS[0])
        text, _, finish = run(engine, prompt, greedy(30))
        assert finish.reason == "length" and finish.completion_tokens == 30
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut, _, finish = run(engine, prompt, greedy(30, stop=(stop,)))
        assert finish.reason == "stop" and cut == text[: text.index(stop)] and stop not in cut
        assert finish.completion_tokens < 30
        two, _, finish = run(engine, prompt, greedy(30, stop=(stop, text[:2])))  # the earliest stop string wins
        assert two == "" and finish.reason == "stop"
    finally:
        engine.stop()


def test_cancel_frees_the_slot(models, tokenizer):
    engine = started(models["random"].gguf, tokenizer, slots=1, max_queue=1)
    try:
        stream = engine.submit(ids(tokenizer, PROMPTS[0]), greedy(200))
        pieces = iter(stream)
        next(pieces)
        stream.cancel()
        list(pieces)
        assert stream.finish.reason == "cancelled" and stream.finish.completion_tokens < 200
        deadline = time.monotonic() + 10
        while engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.active == 0
        _, _, finish = run(engine, ids(tokenizer, PROMPTS[1]), greedy(5))
        assert finish.reason == "length"
    finally:
        engine.stop()


def test_queue_full_and_prompt_too_long(models, tokenizer):
    engine = started(models["random"].gguf, tokenizer, slots=1, max_queue=1, context=64)
    try:
        with pytest.raises(PromptTooLong, match="at most 63 tokens"):
            engine.submit(list(range(64)), greedy(1))
        with pytest.raises(PromptTooLong, match="empty"):
            engine.submit([], greedy(1))
        with pytest.raises(PromptTooLong, match="context holds 8"):
            engine.submit(ids(tokenizer, PROMPTS[0]), greedy(1), context_limit=8)
        busy = [engine.submit(ids(tokenizer, p), greedy(60)) for p in PROMPTS[:2]]  # one runs, one waits
        with pytest.raises(QueueFull, match="1 slots are busy"):
            engine.submit(ids(tokenizer, PROMPTS[2]), greedy(1))
        for stream in busy:
            stream.text()
            assert stream.finish.reason == "length"
            # The context caps max_tokens: 60 new tokens after a prompt of ~10 in a context of 64.
            assert stream.finish.completion_tokens == min(60, 64 - stream.prompt_tokens)
    finally:
        engine.stop()


class BrokenGrammar:
    """A request whose structured-output constraint fails when asked for its mask."""

    complete = False

    def apply(self, logits_V):
        raise RuntimeError("this grammar is broken")

    def accept(self, token):
        pass


def test_a_failing_request_does_not_stop_the_thread(models, tokenizer):
    engine = started(models["random"].gguf, tokenizer)
    try:
        prompt = ids(tokenizer, PROMPTS[0])
        expected = run(engine, prompt, greedy(40))[:2]
        good = engine.submit(prompt, greedy(40), top_logprobs=0)
        unknown_token = engine.submit([0, 5, 10**6], greedy(5))
        broken = engine.submit(ids(tokenizer, PROMPTS[1]), greedy(5), constraint=BrokenGrammar())
        for stream, message in (
            (unknown_token, "token id 1000000 is not in the model's vocabulary of 384"),
            (broken, "this grammar is broken"),
        ):
            assert stream.text() == ""
            assert stream.finish.reason == "error" and message in stream.finish.error
        assert (good.text(), [bytes(e["bytes"]) for e in good.logprobs]) == expected
        assert good.finish.reason == "length" and engine.alive
        assert run(engine, prompt, greedy(40))[:2] == expected
    finally:
        engine.stop()
    assert not engine.alive


class Counting:
    def __init__(self):
        self.prefilled, self.first, self.generated = [], [], 0

    def prompt_prefilled(self, tokens):
        self.prefilled.append(tokens)

    def first_token(self, seconds):
        self.first.append(seconds)

    def tokens_generated(self, count):
        self.generated += count


def test_observer_kv_cache_and_shutdown(models, tokenizer):
    observer = Counting()
    args = models["random"].transformer.args
    engine = started(models["random"].gguf, tokenizer, slots=2, max_queue=4, observer=observer)
    assert engine.context == 256 and engine.vocab_size == args.vocab_size
    assert engine.kv_cache_bytes == 2 * args.n_layers * args.n_kv_heads * args.head_size * 2 * 256 * 4  # f32
    prompts = [ids(tokenizer, p) for p in PROMPTS[:2]]
    for prompt in prompts:
        run(engine, prompt, greedy(7))
    assert sorted(observer.prefilled) == sorted(len(p) for p in prompts)
    assert len(observer.first) == 2 and all(0 < s < 30 for s in observer.first) and observer.generated == 14
    # Stopping with work in flight ends every request, running or waiting, with a reason.
    streams = [engine.submit(ids(tokenizer, p), greedy(200)) for p in PROMPTS]
    engine.stop()
    for stream in streams:
        stream.text()
        assert stream.finish.reason in ("error", "length")
    assert any(s.finish.error == "the server is shutting down" for s in streams)
    with pytest.raises(QueueFull, match="shutting down"):
        engine.submit(prompts[0], greedy(1))
    # f16, and a context llama.cpp rounds up to its 256-cell granule: the bytes it really holds.
    half = LlamaCppEngine(models["random"].gguf, tokenizer, slots=2, context=128, kv_dtype="f16")
    assert half.context == 128
    assert half.kv_cache_bytes == 2 * args.n_layers * args.n_kv_heads * args.head_size * 2 * 256 * 2
    half.stop()  # never started: frees llama.cpp's memory at once


def test_bad_gguf_is_one_clear_error(tmp_path, tokenizer):
    from phalanx.errors import PhalanxError

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(PhalanxError, match="could not load"):
        LlamaCppEngine(bad, tokenizer)


def test_drop_in_under_the_real_app(models):
    """phalanx's own app (Ollama and OpenAI routes, /metrics) over loopback on either engine, the same GGUF
    file: the replies are the same, token for token, and so are the counts the metrics see."""
    import openai
    import uvicorn
    from serve_helpers import wait_healthy

    from phalanx.serve.core.served import load_served_model
    from phalanx.serve.http.app import create_app
    from phalanx.serve.http.metrics import ServeMetrics
    from phalanx.serve.server import bind

    served = load_served_model(models["random"].gguf, name="tiny")
    tokenizer = served.loaded.tokenizer
    replies = {}
    for kind in ("torch", "llama.cpp"):
        metrics = ServeMetrics()
        if kind == "torch":
            engine = Engine(served.loaded.model, tokenizer, slots=4, max_queue=4, context=256, observer=metrics)
        else:
            engine = LlamaCppEngine(
                models["random"].gguf,
                tokenizer,
                slots=4,
                max_queue=4,
                context=256,
                threads=1,
                kv_dtype="f32",
                observer=metrics,
            )
        sock = bind("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(create_app(served, engine, metrics), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            wait_healthy(url)
            with httpx.Client(base_url=url, timeout=60) as http:
                generated = http.post(
                    "/api/generate",
                    json={
                        "model": "tiny",
                        "prompt": "ROMEO:",
                        "stream": False,
                        "options": {"temperature": 0, "num_predict": 20, "repeat_penalty": 1.3},
                    },
                ).json()
                chat = http.post(
                    "/api/chat",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "Who is there?"}],
                        "options": {"temperature": 0.8, "seed": 5, "num_predict": 12},
                    },
                )
                pieces = [json.loads(line)["message"]["content"] for line in chat.text.splitlines() if line]
                counted = [
                    line
                    for line in http.get("/metrics").text.splitlines()
                    if line.startswith(("phalanx_serve_generated_tokens_total", "phalanx_serve_prompt_tokens"))
                ]
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            reply = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Speak"}],
                temperature=0,
                max_tokens=16,
                logprobs=True,
                top_logprobs=2,
            )
        finally:
            server.should_exit = True
            thread.join(30)
        choice = reply.choices[0]
        replies[kind] = {
            "generate": (generated["response"], generated["eval_count"], generated["done_reason"]),
            "chat": "".join(pieces),
            "metrics": counted,
            "openai": (
                choice.message.content,
                choice.finish_reason,
                reply.usage.completion_tokens,
                [t.token for t in choice.logprobs.content],
            ),
            "logprobs": [t.logprob for t in choice.logprobs.content],
        }
    ours, theirs = replies["llama.cpp"], replies["torch"]
    assert ours["generate"][1] == 20 and ours["openai"][2] == 16 and ours["chat"]
    for key in ("generate", "chat", "metrics", "openai"):
        assert ours[key] == theirs[key], key
    assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-4)


def test_phalanx_serve_engine_llamacpp(models, served_run, tmp_path):
    """The real CLI: `phalanx serve GGUF --engine llamacpp` answers through phalanx's API on llama.cpp;
    a run directory (no GGUF) is refused with the command that makes one."""
    import re
    import subprocess
    import sys

    from serve_helpers import wait_healthy

    from tests.helpers import phalanx

    refused = phalanx("serve", str(served_run), "--engine", "llamacpp", "--port", "0", check=False, timeout=120)
    assert refused.returncode == 2 and "--engine llamacpp serves a GGUF export" in refused.stderr
    assert "phalanx export" in refused.stderr and "Traceback" not in refused.stderr

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "phalanx",
                "serve",
                str(models["random"].gguf),
                "--engine",
                "llamacpp",
                "--port",
                "0",
                "--slots",
                "2",
                "--threads",
                "1",
                "--model-name",
                "tiny",
                "--log-level",
                "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "llama.cpp, cpu" in log.read_text()
        wait_healthy(found.group(1), proc, log)
        reply = httpx.post(
            f"{found.group(1)}/api/generate",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": "ROMEO:",
                "stream": False,
                "options": {"temperature": 0, "num_predict": 8},
            },
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["eval_count"] == 8 and reply.json()["done_reason"] == "length"
    finally:
        proc.terminate()
        proc.wait(30)
