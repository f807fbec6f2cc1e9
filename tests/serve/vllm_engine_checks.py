"""The vLLM engine's checks, run by test_serve_vllm_engine.py inside the venv that has vLLM (scripts/
setup_vllm.sh): phalanx's own engine and the vLLM one on the same Hugging Face export, in one process.
Prints one JSON object of what each check saw; the test asserts on it.

Usage: python vllm_engine_checks.py EXPORT_DIR PROMPTS_JSON
"""

from __future__ import annotations

import json
import sys
import time

import torch

from phalanx.run.model_loader import load_model
from phalanx.serve.core.contract import PromptTooLong
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.core.structured_output import FormatError
from phalanx.serve.engines.torch_engine import Engine
from phalanx.serve.engines.vllm_engine import VllmEngine

GENERATE = 24


def greedy(n: int = GENERATE, **kwargs) -> SamplingOptions:
    return SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


def outcome(stream) -> dict:
    text = stream.text()
    return {
        "text": text,
        "finish": stream.finish.reason,
        "error": stream.finish.error,
        "completion_tokens": stream.finish.completion_tokens,
        "tokens": [entry["bytes"] for entry in stream.logprobs],
        "logprobs": [entry["logprob"] for entry in stream.logprobs],
        "top": [[t["bytes"] for t in entry["top_logprobs"]] for entry in stream.logprobs],
    }


def together(engine, prompts: list[list[int]], options: SamplingOptions, k: int = 3) -> list[dict]:
    streams = [engine.submit(ids, options, top_logprobs=k) for ids in prompts]
    return [outcome(s) for s in streams]


def main() -> None:
    export, prompts = sys.argv[1], json.loads(sys.argv[2])
    loaded = load_model(export)
    torch_engine = Engine(loaded.model, loaded.tokenizer, slots=4, max_queue=8)
    vllm_engine = VllmEngine(export, loaded.tokenizer, torch.float32, slots=4, max_queue=8, context=256)
    out: dict = {"kv_cache_bytes": vllm_engine.kv_cache_bytes, "context": vllm_engine.context}
    for engine in (torch_engine, vllm_engine):
        engine.start()
    try:
        out["torch_alone"] = [together(torch_engine, [p], greedy())[0] for p in prompts]
        out["vllm_alone"] = [together(vllm_engine, [p], greedy())[0] for p in prompts]
        out["vllm_together"] = together(vllm_engine, prompts, greedy())
        # Prompt and reply are shorter than repeat_last_n, so phalanx's window spans what vLLM's penalty does.
        penalised = greedy(repeat_penalty=1.5, repeat_last_n=64)
        out["torch_penalised"] = [together(torch_engine, [p], penalised)[0] for p in prompts]
        out["vllm_penalised"] = [together(vllm_engine, [p], penalised)[0] for p in prompts]

        # A stop string: the text ends before it and the request ends with "stop".
        full = out["vllm_alone"][0]["text"]
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        out["stop"] = {
            "string": stop,
            "full": full,
            **outcome(vllm_engine.submit(prompts[0], greedy(stop=(stop,)), top_logprobs=0)),
        }

        # Sampling with a seed is repeatable; end-of-text is honoured where ignore_eos is not set.
        seeded = SamplingOptions(temperature=1.0, top_k=50, seed=7, max_tokens=GENERATE)
        out["seeded"] = [vllm_engine.submit(prompts[1], seeded).text() for _ in range(2)]

        # A cancelled request ends "cancelled" and frees its slot for the next one.
        long = vllm_engine.submit(prompts[2], greedy(200))
        next(iter(long))
        long.cancel()
        rest = long.text()
        out["cancelled"] = {"finish": long.finish.reason, "after": len(rest)}
        out["after_cancel"] = outcome(vllm_engine.submit(prompts[3], greedy(8), top_logprobs=0))["finish"]

        # A token the model does not have fails that request alone; its neighbour finishes.
        bad = vllm_engine.submit(prompts[0][:3] + [10**6], greedy(8))
        good = vllm_engine.submit(prompts[1], greedy(8))
        out["bad_token"] = {
            "bad": (bad.text(), bad.finish.reason, bad.finish.error),
            "good": (good.text(), good.finish.reason),
        }

        try:
            vllm_engine.submit(list(range(1, 300)), greedy(8))
            out["too_long"] = "accepted"
        except PromptTooLong as e:
            out["too_long"] = str(e)
        try:
            vllm_engine.vocabulary.constraint('{"type": "object"}')
            out["grammar"] = "accepted"
        except FormatError as e:
            out["grammar"] = str(e)

        # Throughput, for the record only: the same 4 greedy streams of 64 tokens on each engine.
        for name, engine in (("torch", torch_engine), ("vllm", vllm_engine)):
            start = time.perf_counter()
            done = together(engine, prompts, greedy(64), k=None)
            out[f"{name}_tokens_per_s"] = sum(d["completion_tokens"] for d in done) / (time.perf_counter() - start)
    finally:
        torch_engine.stop()
        vllm_engine.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
