"""A/B of one setting on the CPU training step, in one process, steps alternating (issue 33).

`--arms malloc`: glibc's malloc settings. Arm "default" puts glibc's own behaviour back as far as mallopt can, and as kindly as it can: an mmap
threshold of 32 MiB (the most its dynamic threshold reaches after a few frees), a trim threshold of twice
that (what the dynamic rule sets), mmap allowed, and malloc_trim before each of its steps (so it starts
from pages handed back, as it would after the previous step's frees). Arm "kept" is
phalanx.train.step.keep_freed_memory's setting: no mmap, no trimming.

`--arms attention`: the step's attention through SDPA (torch's flash kernel) against phalanx's own CPU
kernel (phalanx/models/cpu_attention.py), switched by PHALANX_CPU_ATTENTION, with malloc as the trainer
sets it. The minimal GPT takes SDPA in both arms: its figures are the control.

The model and step are
cpu_train_vs_minimal_gpt.py's (nanoGPT's shape); the minimal GPT is timed under both arms too. The
2048^3 matmul rate (into a preallocated output, so page faults stay out of it) is measured before and
after, and the load average with each figure.

    .venv/bin/python bench/cpu_train_ab.py --arms malloc --modes bf16,fp32 --steps 12
    .venv/bin/python bench/cpu_train_ab.py --arms attention --modes bf16,fp32 --steps 10
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_train_vs_minimal_gpt import BATCH, CONTEXT, VOCAB, make_minimal, make_phalanx, phalanx_args  # noqa: E402

from phalanx.models.flops import flops_per_token  # noqa: E402

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
LIBC = ctypes.CDLL(None)


def arm_default() -> None:
    LIBC.mallopt(M_MMAP_MAX, 65536)
    LIBC.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
    LIBC.mallopt(M_TRIM_THRESHOLD, 64 * 2**20)
    LIBC.malloc_trim(0)


def arm_kept() -> None:
    LIBC.mallopt(M_MMAP_MAX, 0)
    LIBC.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def attention(on: bool):
    def arm() -> None:
        arm_kept()
        os.environ["PHALANX_CPU_ATTENTION"] = "1" if on else "0"

    return arm


ARM_SETS = {
    "malloc": {"default": arm_default, "kept": arm_kept},
    "attention": {"sdpa": attention(False), "kernel": attention(True)},
}


def matmul_gflops(dtype: torch.dtype) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    out = torch.empty(2048, 2048, dtype=dtype)
    torch.mm(a, b, out=out)
    best = min(_timed(lambda: torch.mm(a, b, out=out)) for _ in range(6))
    return 2 * 2048**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_both(fn) -> tuple[float, float]:
    """Wall time and this process's CPU time (all threads): on shared cores the second counts the work
    done, not the waits for a core (though it still counts OpenMP's spinning at barriers)."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def stats(times: list[float]) -> dict:
    s = sorted(times)
    return {"min": round(s[0], 3), "p25": round(s[len(s) // 4], 3), "median": round(s[len(s) // 2], 3)}


def run_mode(mode: str, steps: int, arms: dict) -> dict:
    bf16 = mode == "bf16"
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    systems = {"phalanx": make_phalanx(False)[1], "minimal": make_minimal(False)[1]}
    dtype = torch.bfloat16 if bf16 else torch.float32
    out = {"mode": mode, "load_before": os.getloadavg()[0], "matmul_gflops_before": round(matmul_gflops(dtype), 1)}
    times = {(system, arm): [] for system in systems for arm in arms}
    cpu = {(system, arm): [] for system in systems for arm in arms}
    for step in systems.values():  # warm-up
        step(inputs, targets, bf16)
    for _ in range(steps):
        for system, step in systems.items():
            for arm, setup in arms.items():
                setup()
                wall, used = _timed_both(lambda step=step: step(inputs, targets, bf16))
                times[system, arm].append(wall)
                cpu[system, arm].append(used)
    out["matmul_gflops_after"] = round(matmul_gflops(dtype), 1)
    out["load_after"] = os.getloadavg()[0]
    flops = BATCH * CONTEXT * flops_per_token(phalanx_args(), CONTEXT)
    rate = max(out["matmul_gflops_before"], out["matmul_gflops_after"])
    for (system, arm), ts in times.items():
        st = stats(ts)
        st["pct_of_matmul_at_min"] = round(100 * flops / st["min"] / 1e9 / rate, 1)
        st["cpu_s"] = stats(cpu[system, arm])
        out[f"{system}/{arm}"] = st
    before, after = arms
    for system in systems:
        for key in ("min", "p25"):
            ratio = out[f"{system}/{before}"][key] / out[f"{system}/{after}"][key]
            out[f"{system} {before}/{after} {key}"] = round(ratio, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", choices=sorted(ARM_SETS), required=True)
    parser.add_argument("--modes", default="bf16,fp32")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per system and arm")
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for mode in args.modes.split(","):
        print(json.dumps(run_mode(mode, args.steps, ARM_SETS[args.arms])), flush=True)


if __name__ == "__main__":
    main()
