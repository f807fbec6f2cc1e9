"""CPU training step: phalanx's model + optimizer against a minimal nanoGPT-style trainer, side by side.

The shape is nanoGPT's small character-level config with a 4096 vocab: 6 layers, dim 384, 6 heads,
context 256, batch 16, tied embeddings. phalanx uses SwiGLU with ffn 1024 and the reference a 4x GELU
MLP (384 x 1536): three 384x1024 matrices against two 384x1536 ones, so parameters and matmul FLOPs per
token match. Both take the same random tokens, gradient clipping at 1.0 and AdamW (the reference with
torch's default, phalanx with build_optimizer). Each mode's steps alternate between the two systems in
rounds, so a shared machine's load falls on both alike. phalanx's step, like train_step, sets glibc's
malloc to keep freed memory (keep_freed_memory); that setting is the process's, so the minimal GPT's
steps after the first run with it too (bench/cpu_train_ab.py --arms malloc measures it on and off).

    .venv/bin/python bench/cpu_train_vs_minimal_gpt.py --modes fp32,bf16,compile --rounds 5
    .venv/bin/python bench/cpu_train_vs_minimal_gpt.py --profile fp32   # top ops of phalanx's step
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.config.schema import TrainSection
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.flops import flops_per_token
from phalanx.parallel.apply import parallelize
from phalanx.parallel.distributed import DistEnv
from phalanx.train.optim import build_optimizer, clip_gradients
from phalanx.train.step import keep_freed_memory

LAYERS, DIM, HEADS, FFN, CONTEXT, BATCH, VOCAB = 6, 384, 6, 1024, 256, 16, 4096


class MinimalBlock(nn.Module):
    """GPT-2's block as nanoGPT writes it: pre-LayerNorm, fused qkv, SDPA causal, 4x GELU MLP, no biases."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM, bias=False), nn.LayerNorm(DIM, bias=False)
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(DIM, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class MinimalGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(CONTEXT, DIM)
        self.h = nn.ModuleList(MinimalBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM, bias=False)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def phalanx_args() -> ModelArgs:
    return ModelArgs(
        dim=DIM,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=HEADS,
        ffn_dim=FFN,
        vocab_size=VOCAB,
        max_seq_len=CONTEXT,
        rope_theta=10000.0,
        tie_embeddings=True,
    )


def make_phalanx(compiled: bool):
    torch.manual_seed(0)
    model = parallelize(
        Transformer(phalanx_args()),
        "none",
        DistEnv(0, 1, 0, torch.device("cpu"), None),
        activation_checkpointing=False,
        compile=compiled,
        dtype=torch.float32,
    )
    train = TrainSection(seq_len=CONTEXT, micro_batch_size=BATCH, global_batch_size=BATCH)
    optimizer = build_optimizer(model, train)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(inputs, targets, bf16):
        # The trainer's step body (train_step): malloc keeping freed memory, autocast forward, float32
        # loss, clipping, AdamW.
        keep_freed_memory()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        clip_gradients(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return model, step


def make_minimal(compiled: bool):
    torch.manual_seed(0)
    model = MinimalGPT()
    forward = torch.compile(model) if compiled else model
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )

    def step(inputs, targets, bf16):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(inputs)
            loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return model, step


MODES = {"fp32": (False, False), "bf16": (False, True), "compile": (True, False), "compile-bf16": (True, True)}


def run_mode(mode: str, rounds: int, steps: int, warmup: int) -> dict:
    compiled, bf16 = MODES[mode]
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    systems = {"phalanx": make_phalanx(compiled), "minimal": make_minimal(compiled)}
    times = {name: [] for name in systems}
    for _, step in systems.values():
        for _ in range(warmup):
            step(inputs, targets, bf16)
    for _ in range(rounds):
        for name, (_, step) in systems.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                step(inputs, targets, bf16)
                times[name].append(time.perf_counter() - t0)
    fpt = flops_per_token(phalanx_args(), CONTEXT)
    out = {"mode": mode, "flops_per_token": fpt, "threads": torch.get_num_threads()}
    for name, (model, _) in systems.items():
        median = statistics.median(times[name])
        tps = BATCH * CONTEXT / median
        out[name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "median_step_s": round(median, 4),
            "steps": [round(t, 3) for t in times[name]],
            "tokens_per_s": round(tps, 1),
            "tflops": round(tps * fpt / 1e12, 4),
        }
    out["speedup"] = round(out["minimal"]["median_step_s"] / out["phalanx"]["median_step_s"], 3)
    return out


def profile(mode: str, system: str, rows: int) -> str:
    compiled, bf16 = MODES[mode]
    _, step = (make_phalanx if system == "phalanx" else make_minimal)(compiled)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for _ in range(2):
        step(inputs, targets, bf16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step(inputs, targets, bf16)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def matmul_gflops() -> float:
    """This CPU's plain fp32 2048^3 matmul rate, the yardstick the issue quotes."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048**3 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp32,bf16,compile")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per system per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", metavar="MODE", help="print the top ops of one system's step instead")
    parser.add_argument("--system", default="phalanx", choices=("phalanx", "minimal"))
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    if args.profile:
        print(profile(args.profile, args.system, args.rows))
        return
    print(json.dumps({"matmul_2048_fp32_gflops": round(matmul_gflops(), 1)}), flush=True)
    for mode in args.modes.split(","):
        print(json.dumps(run_mode(mode, args.rounds, args.steps, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
