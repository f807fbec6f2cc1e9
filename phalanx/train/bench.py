"""`phalanx bench`: time training steps (train/step.py, as `phalanx train` runs them) of a preset on this
device, on random tokens."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from phalanx.config.schema import ModelSection, TrainSection
from phalanx.models.decoder import Transformer
from phalanx.models.flops import achieved_tflops, count_params, flops_per_token, mfu, peak_tflops
from phalanx.models.from_config import model_args
from phalanx.parallel.apply import parallelize
from phalanx.parallel.device import compute_dtype, device_name, peak_memory_gib, pick_device
from phalanx.parallel.distributed import DistEnv
from phalanx.train.optim import build_optimizer
from phalanx.train.step import train_step


def run_bench(
    preset: str,
    seq_len: int,
    micro_batch: int,
    steps: int,
    warmup: int,
    *,
    device: str = "auto",
    dtype: str = "auto",
    compile: bool = False,
    activation_checkpointing: bool = False,
    peak: float | None = None,
) -> dict[str, Any]:
    dev = pick_device(device)
    args = model_args(ModelSection(preset=preset), seq_len=seq_len)
    train = TrainSection(seq_len=seq_len, micro_batch_size=micro_batch, global_batch_size=micro_batch)
    torch.manual_seed(0)
    with torch.device(dev):  # built in place: an 8b model need not pass through host memory
        model = Transformer(args)
    cdtype = compute_dtype(dtype, dev)
    env = DistEnv(0, 1, 0, dev, None)
    model = parallelize(
        model, "none", env, activation_checkpointing=activation_checkpointing, compile=compile, dtype=cdtype
    )
    optimizer = build_optimizer(model, train)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = torch.randint(0, args.vocab_size, (micro_batch, seq_len + 1), device=dev)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        train_step(
            model,
            optimizer,
            params,
            [(inputs, targets)],
            device=dev,
            grad_clip=train.grad_clip,
            autocast=lambda: torch.autocast(dev.type, dtype=cdtype, enabled=cdtype != torch.float32),
        )

    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    tps = micro_batch * seq_len / median
    fpt = flops_per_token(args, seq_len)
    peak = peak or peak_tflops(device_name(dev))
    tflops = achieved_tflops(tps, fpt)
    return {
        "preset": preset,
        "params": count_params(args),
        "device": device_name(dev),
        "dtype": str(cdtype),
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "compile": compile,
        "activation_checkpointing": activation_checkpointing,
        "timed_steps": steps,
        "median_step_seconds": median,
        "tokens_per_sec": tps,
        "flops_per_token": fpt,
        "achieved_tflops": tflops,
        "peak_tflops": peak,
        "mfu": mfu(tps, fpt, peak),
        "peak_mem_gib": peak_memory_gib(dev),
        "torch": torch.__version__,
    }
