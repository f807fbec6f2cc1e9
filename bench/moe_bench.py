"""Mixtures of experts on this machine: a `tiny-moe` training step against `tiny` (about the same active
parameters: 4.20 M and 4.20 M) through `phalanx bench`, and one MoE layer's experts as grouped GEMMs
(torch._grouped_mm) against a loop over the experts, forward and backward, at tiny-moe's shape.

Usage: .venv/bin/python bench/moe_bench.py [--steps 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from phalanx.models.moe import MoE


def bench_step(preset: str, steps: int, dtype: str) -> dict:
    command = [sys.executable, "-m", "phalanx", "bench", preset, "--seq-len", "256", "--micro-batch", "16"]
    command += ["--steps", str(steps), "--warmup", "2", "--dtype", dtype, "--json"]
    return json.loads(
        subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    )


def time_layer(layer: MoE, x: torch.Tensor, repeats: int = 10) -> float:
    """Median seconds of one forward and backward of `layer` on `x`."""
    times = []
    for _ in range(repeats + 2):
        x.grad = None
        layer.zero_grad()
        start = time.perf_counter()
        out = layer(x)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    opts = parser.parse_args()
    for preset in ("tiny", "tiny-moe"):
        result = bench_step(preset, opts.steps, opts.dtype)
        print(
            preset, {k: result.get(k) for k in ("median_step_seconds", "tokens_per_sec", "achieved_tflops", "params")}
        )

    torch.manual_seed(0)
    layer = MoE(dim=256, ffn_dim=384, n_experts=8, top_k=2, norm_topk_prob=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(16, 256, 256, requires_grad=True)  # one micro-batch of tiny's bench: 16 x 256 tokens
    grouped = time_layer(layer, x)
    grouped_mm = torch._grouped_mm
    del torch._grouped_mm  # the loop a torch without grouped GEMMs runs
    try:
        looped = time_layer(layer, x)
    finally:
        torch._grouped_mm = grouped_mm
    print(f"one MoE layer, 4096 tokens, forward + backward: grouped {grouped * 1e3:.1f} ms, loop {looped * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
