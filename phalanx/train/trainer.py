"""The training loop. Every rank runs `train(config)`; rank 0 also writes the run's files.

Read top to bottom: set-up (process group, data, model, parallelism, optimizer, resume), the step loop
(micro-batches with gradient accumulation, clipping, optimizer step, metrics, evaluation, checkpoints),
then the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from phalanx.config.schema import Config
from phalanx.data.loader import BatchLoader, TokenDataset
from phalanx.data.prepare import PreparedData
from phalanx.models.flops import achieved_tflops, flops_per_token, mfu, peak_tflops
from phalanx.models.from_config import model_args
from phalanx.models.llama import Transformer
from phalanx.parallel.apply import gradient_sync, parallelize
from phalanx.parallel.device import compute_dtype, device_name, peak_memory_gib
from phalanx.parallel.distributed import DistEnv, all_reduce_sum, init_distributed, teardown
from phalanx.train.checkpoint import Checkpointer, check_model_shape, latest_checkpoint, read_trainer_state
from phalanx.train.evaluate import Evaluator
from phalanx.train.metrics import JsonlSink, NullSink, ProgressLine
from phalanx.train.optim import build_optimizer, clip_gradients, lr_at
from phalanx.train.run_dir import checkpoints_dir, prepared_data

SUMMARY_FILE = "summary.json"


def train(config: Config, show_progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the configured training on this rank; returns the run summary."""
    env = init_distributed(config.parallel.strategy, config.parallel.backend, config.parallel.device)
    try:
        # Model and optimizer live only inside _train, so they are released before the group is destroyed.
        return _train(config, env, show_progress)
    finally:
        teardown()


def _train(config: Config, env: DistEnv, show_progress: bool) -> dict[str, Any]:
    started = time.perf_counter()
    tc, run_dir = config.train, config.run_dir
    data = prepared_data(run_dir)
    args = model_args(config.model, data.vocab_size, tc.seq_len)

    torch.manual_seed(tc.seed)
    model = Transformer(args).to(env.device)  # built on CPU first: the same weights on any device
    dtype = compute_dtype(tc.dtype, env.device)
    fsdp = env.distributed and config.parallel.strategy == "fsdp"
    model = parallelize(model, config.parallel.strategy, env,
                        activation_checkpointing=tc.activation_checkpointing, compile=tc.compile, dtype=dtype)
    # Under FSDP the mixed-precision policy casts parameters; elsewhere autocast does.
    use_autocast = dtype != torch.float32 and not fsdp
    autocast = (lambda: torch.autocast(env.device.type, dtype=dtype)) if use_autocast else contextlib.nullcontext
    optimizer = build_optimizer(model, tc)
    params = [p for p in model.parameters() if p.requires_grad]

    loader = BatchLoader(TokenDataset(data.train_shards, tc.seq_len), tc.seq_len, tc.global_batch_size,
                         tc.micro_batch_size, env.rank, env.world_size, tc.seed,
                         pin_memory=env.device.type == "cuda")
    evaluator = Evaluator(TokenDataset(data.val_shards, tc.seq_len), tc, env, autocast)
    checkpointer = Checkpointer(checkpoints_dir(run_dir), config.checkpoint.keep, env)

    state: dict[str, Any] = {}
    resume_from = resume_path(config)
    if resume_from is not None:
        check_model_shape(resume_from, dataclasses.asdict(args))
        state = checkpointer.load(resume_from, model, optimizer)
        loader.load_state_dict(state["loader"])
    start_step = state.get("step", 0)

    tokens_per_step = tc.global_batch_size * tc.seq_len
    fpt = flops_per_token(args, tc.seq_len)
    peak = tc.peak_tflops or peak_tflops(device_name(env.device))

    def device_rates(tokens_per_sec: float | None) -> dict[str, float | None]:
        """Achieved TFLOP/s and MFU of one device, from the global token rate."""
        if not tokens_per_sec:
            return {"achieved_tflops": None, "mfu": None}
        per_device = tokens_per_sec / env.world_size
        return {"achieved_tflops": achieved_tflops(per_device, fpt), "mfu": mfu(per_device, fpt, peak)}

    sink = JsonlSink(run_dir / "metrics.jsonl") if env.is_main else NullSink()
    progress = ProgressLine(tc.max_steps, start_step, enabled=show_progress and env.is_main)

    val_loss = state.get("val_loss")
    val_loss_start = state.get("val_loss_start")
    if start_step == 0:
        val_loss = val_loss_start = evaluator.loss(model)
        sink.write({"step": 0, "val_loss": val_loss})
    train_loss = state.get("train_loss")
    last_checkpoint = str(resume_from) if resume_from else None
    end_step = tc.halt_at_step or tc.max_steps
    timed_steps, timed_seconds = 0, 0.0

    with progress:
        for step in range(start_step + 1, end_step + 1):
            t0 = time.perf_counter()
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro_batches = loader.next_batch()
            loss_sum = torch.zeros((), device=env.device)
            for i, (inputs, targets) in enumerate(micro_batches):
                inputs = inputs.to(env.device, non_blocking=True)
                targets = targets.to(env.device, non_blocking=True)
                with gradient_sync(model, enabled=i == len(micro_batches) - 1):
                    with autocast():
                        logits = model(inputs)
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                    (loss / len(micro_batches)).backward()
                loss_sum += loss.detach()
            grad_norm = clip_gradients(params, tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # One small all-reduce per step: every rank's micro-batch losses, averaged.
            train_loss = all_reduce_sum(loss_sum).item() / (len(micro_batches) * env.world_size)
            step_seconds = time.perf_counter() - t0
            if step > start_step + 1 or step == end_step:  # the first step pays for warm-up/compilation
                timed_steps, timed_seconds = timed_steps + 1, timed_seconds + step_seconds

            tps = tokens_per_step / step_seconds
            record = {"step": step, "loss": train_loss, "lr": lr, "grad_norm": grad_norm.item(),
                      "tokens_per_sec": tps, **device_rates(tps), "peak_mem_gib": peak_memory_gib(env.device),
                      "step_seconds": step_seconds, "tokens_seen": step * tokens_per_step}
            if step % tc.eval_interval == 0 or step == tc.max_steps:
                val_loss = record["val_loss"] = evaluator.loss(model)
                progress.log(f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
            sink.write(record)
            progress.update(step, train_loss, tps, val_loss)

            if step % config.checkpoint.interval == 0 or step == end_step:
                saved = checkpointer.save(step, model, optimizer, {
                    "loader": loader.state_dict(), "model_args": dataclasses.asdict(args),
                    "val_loss_start": val_loss_start, "val_loss": val_loss, "train_loss": train_loss,
                    "world_size": env.world_size})
                last_checkpoint = str(saved)
    sink.close()

    steps_done = max(start_step, end_step)
    tps = tokens_per_step * timed_steps / timed_seconds if timed_steps else None
    summary = {
        "run_dir": str(run_dir), "steps": steps_done, "tokens_seen": steps_done * tokens_per_step,
        "val_loss_start": val_loss_start, "val_loss_final": val_loss, "train_loss_final": train_loss,
        "tokens_per_sec": tps, **device_rates(tps),
        "last_checkpoint": last_checkpoint, "wall_seconds": time.perf_counter() - started,
        "halted": tc.halt_at_step is not None and steps_done < tc.max_steps,
    }
    if env.is_main:
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    return summary


def resume_path(config: Config) -> Path | None:
    """The checkpoint this run continues from, per `checkpoint.resume`."""
    choice = config.checkpoint.resume
    if choice == "never":
        return None
    if choice == "auto":
        return latest_checkpoint(checkpoints_dir(config.run_dir))
    path = Path(choice)
    read_trainer_state(path)  # a clear error now rather than deep inside DCP
    return path


def check_resume_compatible(config: Config, data: PreparedData) -> None:
    """Run before launching ranks, so a shape mismatch is one line from the launcher, not N from ranks."""
    path = resume_path(config)
    if path is not None:
        check_model_shape(path, dataclasses.asdict(model_args(config.model, data.vocab_size, config.train.seq_len)))
