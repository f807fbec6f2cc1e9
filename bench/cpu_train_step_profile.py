"""Where one CPU training step of phalanx's model goes, grouped by kind of work (issue 33, item 2).

The model and step are cpu_train_vs_minimal_gpt.py's (nanoGPT's shape: 6 layers, dim 384, 6 heads,
context 256, batch 16, vocab 4096; forward, float32 loss, backward, clipping, fused AdamW). The profiler
records torch's ops on CPU; each op's self time goes to one group (matmul, attention, element-wise,
casts, loss, optimizer, ...) by its name. Prints the groups' shares of the profiled time and the top
ops, as markdown tables. --malloc default profiles the step with glibc's own malloc behaviour instead of
train_step's keep_freed_memory; --threads 1 measures the work with less noise on shared cores.

    .venv/bin/python bench/cpu_train_step_profile.py --mode bf16 --steps 3
    .venv/bin/python bench/cpu_train_step_profile.py --mode fp32 --threads 1 --malloc default
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_train_vs_minimal_gpt import BATCH, CONTEXT, VOCAB, make_minimal, make_phalanx  # noqa: E402

import phalanx.train.step as step_module  # noqa: E402
from phalanx.train.step import keep_freed_memory  # noqa: E402

# Op name -> group, first match wins. Attention's kernels and casts are named by torch's aten ops.
GROUPS = [
    ("optimizer", ("_fused_adamw", "adamw", "optimizer.step", "Optimizer.step")),
    ("clip (grad norm)", ("_foreach_norm", "_foreach_mul", "linalg_vector_norm", "clamp", "_foreach_div")),
    ("loss (log_softmax / nll)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("attention (SDPA)", ("flash_attention", "scaled_dot_product", "_efficient_attention", "_scaled_dot")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "addmm_")),
    ("casts / copies", ("aten::copy_", "aten::to", "_to_copy", "aten::clone", "aten::contiguous")),
    ("embedding", ("embedding",)),
    ("concat", ("aten::cat",)),
    ("reductions", ("aten::sum", "aten::mean", "aten::pow", "aten::rsqrt")),
    ("element-wise", ("aten::mul", "aten::add", "aten::sub", "aten::silu", "aten::addcmul", "aten::neg", "aten::div")),
    ("allocation / zero", ("aten::empty", "aten::zero_", "aten::fill_", "aten::zeros", "aten::ones", "aten::resize_")),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(key in name for key in keys):
            return group
    return "other"


def build(system: str, mode: str):
    bf16 = mode == "bf16"
    _, step = (make_phalanx if system == "phalanx" else make_minimal)(False)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return lambda: step(inputs, targets, bf16)


def profile(system: str, mode: str, steps: int, rows: int) -> str:
    run = build(system, mode)
    for _ in range(3):  # kept memory reaches its steady state (no page faults) by the third step
        run()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = collections.defaultdict(float)
    for e in events:
        groups[group_of(e.key)] += e.self_cpu_time_total
    lines = [
        f"### {system}, {mode}, {torch.get_num_threads()} threads: {steps} profiled steps, {wall:.3f} s a step (wall, profiler on), "
        f"{total / 1e6 / steps:.3f} s of op self time a step",
        "",
        "| group | ms / step | % of op time |",
        "|---|---|---|",
    ]
    for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {group} | {us / 1e3 / steps:.1f} | {100 * us / total:.1f} |")
    lines += ["", "| op | group | calls / step | ms / step | % of op time |", "|---|---|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]:
        lines.append(
            f"| {e.key} | {group_of(e.key)} | {e.count / steps:.0f} | {e.self_cpu_time_total / 1e3 / steps:.1f} | "
            f"{100 * e.self_cpu_time_total / total:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--system", default="phalanx", choices=("phalanx", "minimal"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    parser.add_argument(
        "--malloc", default="kept", choices=("kept", "default"), help="kept: keep_freed_memory(), as train_step does"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.malloc == "kept":
        keep_freed_memory()
    else:  # glibc's own behaviour: mark the setting as done (refused) so the step leaves malloc alone
        step_module._memory_kept = False
    print(profile(args.system, args.mode, args.steps, args.rows))


if __name__ == "__main__":
    main()
