"""The decode kernel (serve/engines/decode_kernel.py) against oneDNN's packed products, on this CPU.

1. Products: each width's rows times 48 weights of the `125m` shape's sizes (768 x 2304, 768 x 768,
   2048 x 768 twice, 1024 x 768 twice: w2's 2048 inputs are two chunks of 1024), cycled so that they
   stream from memory as a decode step's do; the best of 5 passes, as GB/s of weights read (the kernel's
   panels in torch's ordinary pages and in the engine's huge-page arena; the speed-up is the arena's
   over oneDNN), and whether every output's bits equal oneDNN's.
2. Decode steps: the engine's one-step forward (the model prepared as the engine prepares it, a
   160-position span, every row at position 120), kernel off, on, and on with native blocks
   (decode_block.py, what the engine runs), the median of 50 steps.

Usage: .venv/bin/python bench/decode_kernel_bench.py [--threads 1] [--widths 1,2,4,8,16] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time

import torch

from phalanx.models.decoder import KVCache, Transformer
from phalanx.models.presets import MODEL_PRESETS
from phalanx.models.token_pass import DecodeRows, decode_attention_dtype
from phalanx.serve.engines.decode_block import NativeDecodeRows, native_blocks
from phalanx.serve.engines.decode_kernel import KernelDecodeRows, decode_kernel_available, pack_panels, panel_linear
from phalanx.serve.engines.huge_pages import HugePageArena
from phalanx.serve.engines.row_invariant import make_rows_invariant
from phalanx.serve.engines.torch_engine import _StepCache

SHAPES = [(2304, 768), (768, 768), (2048, 768), (2048, 768), (768, 1024), (768, 1024)]


def products(dtype: torch.dtype, width: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(*SHAPES[i % 6], generator=generator) / 30).to(dtype) for i in range(48)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    panels = [pack_panels(w) for w in weights]
    arena = HugePageArena(HugePageArena.room_for([q.numel() * q.element_size() for q in panels]))
    huge = [arena.put(q) for q in panels]  # as the engine lays them (huge_pages.py)
    xs = {k: torch.randn(width, k, generator=generator).to(dtype) for k in (768, 1024)}
    onednn = torch.ops.mkldnn._linear_pointwise
    same = all(
        torch.equal(panel_linear(xs[w.shape[1]], q, w.shape[0]), onednn(xs[w.shape[1]], p, None, "none", [], ""))
        for w, p, q in zip(weights, packed, panels)
    )

    def best(product, weights_as) -> float:
        """product(x, w, weight_as) over every weight, weight_as the form it reads; the best of 5 passes."""
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for w, form in zip(weights, weights_as):
                product(xs[w.shape[1]], w, form)
            times.append(time.perf_counter() - start)
        return min(times)

    read = sum(w.numel() * w.element_size() for w in weights) / 1e9
    kernel = best(lambda x, w, q: panel_linear(x, q, w.shape[0]), panels)
    kernel_huge = best(lambda x, w, q: panel_linear(x, q, w.shape[0]), huge)
    baseline = best(lambda x, w, p: onednn(x, p, None, "none", [], ""), packed)
    return {
        "kernel_GBps": read / kernel,
        "huge_GBps": read / kernel_huge,
        "onednn_GBps": read / baseline,
        "same_bits": same,
    }


def step_ms(dtype: torch.dtype, width: int, mode: str) -> float:
    """mode: "off" (torch's products and attention), "kernel" (the kernel's products and attention, each
    block's other ops from Python) or "native" (each block one native call, decode_block.py)."""
    os.environ["PHALANX_DECODE_KERNEL"] = "0" if mode == "off" else "1"
    args = dataclasses.replace(MODEL_PRESETS["125m"], vocab_size=4096)
    torch.manual_seed(0)
    model = Transformer(args).to(dtype).eval()
    make_rows_invariant(model)
    cache_dtype = decode_attention_dtype(torch.device("cpu"), dtype)
    cache = KVCache(args, 16, 2048, dtype=cache_dtype, device=torch.device("cpu"))
    rows = {"off": DecodeRows, "kernel": KernelDecodeRows}.get(mode) or functools.partial(
        NativeDecodeRows, blocks=native_blocks(model)
    )
    tokens, positions = torch.full((width, 1), 5), torch.full((width,), 120)
    times = []
    with torch.inference_mode():
        for i in range(70):
            start = time.perf_counter()
            model(tokens, rows(_StepCache(cache, width, 160), positions))[:, 0].float().argmax(-1).tolist()
            if i >= 20:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--widths", default="1,2,4,8,16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    if not all(decode_kernel_available(d) for d in dtypes):
        raise SystemExit("the decode kernel does not run here (AVX-512, avx512_bf16 for bf16, a C++ compiler)")
    print(
        f"{args.threads} thread(s)\n\n| dtype | rows | kernel GB/s | in huge pages | oneDNN GB/s | speed-up | same bits |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for dtype in dtypes:
        for width in widths:
            r = products(dtype, width)
            speedup = r["huge_GBps"] / r["onednn_GBps"]
            print(
                f"| {str(dtype)[6:]} | {width} | {r['kernel_GBps']:.1f} | {r['huge_GBps']:.1f} | {r['onednn_GBps']:.1f}"
                f" | {speedup:.2f}x"
                f" | {'yes' if r['same_bits'] else 'NO'} |"
            )
    print(
        "\n| dtype | rows | step, kernel off | kernel on | native blocks | speed-up |\n|---|---:|---:|---:|---:|---:|"
    )
    for dtype in dtypes:
        for width in (1, 16):
            off, on, native = (step_ms(dtype, width, mode) for mode in ("off", "kernel", "native"))
            print(
                f"| {str(dtype)[6:]} | {width} | {off:.1f} ms | {on:.1f} ms | {native:.1f} ms | {off / native:.2f}x |"
            )


if __name__ == "__main__":
    main()
