"""Aggregate generated tokens/s of the llama.cpp engine vs the built-in torch engine, same weights.

A seeded random model (untied, so greedy paths do not collapse onto one token) of a given shape, a
tokenizer trained on the built-in corpus, the same weights in both engines (the llama.cpp one from an f32
GGUF written by phalanx's exporter), N concurrent greedy streams of a fixed length (ignore_eos), rounds
interleaved so a busy machine slows every engine alike; the median of the rounds is printed, per second
of wall-clock time and per second of this process's CPU time (the engines' threads do nearly all of it,
and on a machine shared with other work that is the steadier figure).

    .venv/bin/python bench/llamacpp_engine_bench.py --shape tiny --streams 1 4 --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from phalanx.data.corpus import iter_documents, resolve_sources
from phalanx.data.tokenizer import train_tokenizer
from phalanx.export.gguf_export import write_gguf
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.run.model_loader import LoadedModel
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.llamacpp_engine import LlamaCppEngine
from phalanx.serve.engines.torch_engine import Engine

SHAPES = {  # tiny: the serving tests' run; small: a few million parameters, where matmuls start to count
    "tiny": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 160, "vocab_size": 384},
    "small": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 688, "vocab_size": 2048},
}


def timed(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """Generated tokens per second of wall-clock and of CPU time, all streams together, from the first
    submit to the last token."""
    options = SamplingOptions(temperature=0, max_tokens=tokens, ignore_eos=True)
    started, cpu = time.perf_counter(), time.process_time()
    streams = [engine.submit(p, options) for p in prompts]
    threads = [threading.Thread(target=s.text) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s.finish.reason == "length" and s.finish.completion_tokens == tokens for s in streams)
    generated = len(prompts) * tokens
    return generated / (time.perf_counter() - started), generated / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()

    torch.set_num_threads(a.threads)
    sources = [s for s in resolve_sources(["builtin:shakespeare"], Path.cwd()) if s.path.stem == "romeo-and-juliet"]
    text = "\n\n".join(iter_documents(sources))
    shape = SHAPES[a.shape]
    tokenizer = train_tokenizer([text], shape["vocab_size"])
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**shape, max_seq_len=512, tie_embeddings=False)).eval()
    prompts = [[0] + tokenizer.encode(f"ROMEO: speak {i}, wherefore art thou").ids for i in range(max(a.streams))]
    slots = max(a.streams)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "model.gguf"
        write_gguf(LoadedModel(model, tokenizer, Path(tmp)), gguf, "bench")
        engines = {
            "torch f32": Engine(model, tokenizer, slots=slots, max_queue=0, context=256),
            "llama.cpp f32 KV": LlamaCppEngine(
                gguf, tokenizer, slots=slots, max_queue=0, context=256, threads=a.threads, kv_dtype="f32"
            ),
            "llama.cpp f16 KV": LlamaCppEngine(
                gguf, tokenizer, slots=slots, max_queue=0, context=256, threads=a.threads, kv_dtype="f16"
            ),
            "llama.cpp f16 KV unified": LlamaCppEngine(
                gguf,
                tokenizer,
                slots=slots,
                max_queue=0,
                context=256,
                threads=a.threads,
                kv_dtype="f16",
                unified_kv=True,
            ),
        }
        for engine in engines.values():
            engine.start()
            timed(engine, prompts[:1], 8)  # warm-up
        rates = {(name, n): [] for name in engines for n in a.streams}
        for _ in range(a.rounds):
            for n in a.streams:
                for name, engine in engines.items():
                    rates[name, n].append(timed(engine, prompts[:n], a.tokens))
        for engine in engines.values():
            engine.stop()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{a.shape} model ({params / 1e6:.2f}M parameters), {a.tokens} greedy tokens per stream, {a.threads} "
        f"thread(s), {a.rounds} interleaved rounds; aggregate tokens/s, median (min-max):"
    )
    print("| streams | per | " + " | ".join(engines) + " |")
    print("|---|---|" + "---|" * len(engines))
    for n in a.streams:
        for i, per in enumerate(("wall s", "CPU s")):
            cells = [cell([r[i] for r in rates[name, n]]) for name in engines]
            print(f"| {n} | {per} | " + " | ".join(cells) + " |")


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


if __name__ == "__main__":
    main()
