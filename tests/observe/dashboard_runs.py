"""Runs written into a real store through RunStore's own writing API, shaped as the trainer, the node
agent and the telemetry sampler write them: for dashboard tests that need things a CPU test machine
cannot produce (accelerator telemetry, a rollback), at known steps and times."""

from __future__ import annotations

import math
from pathlib import Path

from phalanx.observe.store import RunStore

T0 = 1_700_000_000.0
TOKENS_PER_STEP = 8 * 32  # global batch x sequence length, as in the config below
RESTART_AT, RESUMED_FROM = 20, 15  # rank 0 dies after logging step 20; the restart resumes at 15
ROLLBACK_AT, ROLLED_BACK_TO = 32, 30
CHECKPOINT_EVERY = 5
WARMUP_SECONDS = 3.0  # the first step of each launch compiles: many times a steady step


def config(name: str, lr: float = 3e-4, devices: str = "auto") -> dict:
    return {
        "run": {"name": name, "dir": "/runs"},
        "model": {"preset": "tiny", "dim": 64},
        "train": {"max_steps": 40, "lr": lr, "global_batch_size": 8, "seq_len": 32, "dtype": "float32"},
        "parallel": {"device": devices},
    }


def fill_run(
    store: RunStore,
    root: Path,
    name: str,
    steps: int = 40,
    lr: float = 3e-4,
    gpus: bool = True,
    mfu: bool = True,
    status: str | None = "finished",
) -> int:
    """A 2-rank run of `steps` steps, a restart after step RESTART_AT (steps RESUMED_FROM+1..RESTART_AT
    run twice), a rollback at ROLLBACK_AT, checkpoints every CHECKPOINT_EVERY steps, validation every
    10, slow warm-up steps, and a telemetry sample per step (with two GPUs when `gpus`)."""
    run_id = store.start_run(
        name, root / name, config(name, lr, "auto" if gpus else "cpu"), "tiny (0.1M)", 2, steps, "node-a"
    )
    metrics, ranks, events, telemetry = [], [], [], []
    events.append({"kind": "training_started", "time": T0, "rank": 0, "step": 0})
    clock = T0

    def train(step: int, warmup: bool) -> None:
        nonlocal clock
        seconds = WARMUP_SECONDS if warmup else 0.5
        clock += seconds
        loss = 6.0 * math.exp(-step / 25) + 0.3 * math.sin(step * 1.7)  # a noisy, falling curve
        metrics.append(
            {
                "step": step,
                "time": clock,
                "loss": loss,
                "lr": lr,
                "grad_norm": 1.0 + 0.5 * math.cos(step),
                "tokens_per_sec": TOKENS_PER_STEP / seconds,
                "mfu": 0.3 if mfu else None,
                "achieved_tflops": 0.02,
                "peak_mem_gib": 1.5 if gpus else None,
                "step_seconds": seconds,
                "tokens_seen": step * TOKENS_PER_STEP,
            }
        )
        for rank in range(2):
            ranks.append(
                {
                    "step": step,
                    "rank": rank,
                    "node": "node-a",
                    "time": clock,
                    "step_seconds": seconds,
                    "compute_seconds": seconds * (1.6 if rank == 1 else 1.0),
                    "data_seconds": 0.01,
                }
            )
        if step % 10 == 0:
            metrics.append({"step": step, "time": clock, "val_loss": 6.1 * math.exp(-step / 25), "eval_seconds": 0.2})
        if step % CHECKPOINT_EVERY == 0:
            events.append(
                {
                    "kind": "checkpoint_saved",
                    "time": clock + 0.01,
                    "rank": 0,
                    "step": step,
                    "seconds": 0.1,
                    "path": f"/runs/{name}/checkpoints/step_{step:08d}",
                }
            )
        telemetry.append(
            {
                "time": clock,
                "node": "node-a",
                "host": {
                    "cpu_ratio": 0.4 + 0.01 * step,
                    "memory_used_bytes": 8 * 2**30 + step * 2**24,
                    "memory_total_bytes": 64 * 2**30,
                    "disk_free_bytes": 500 * 2**30,
                    "load1": 2.0,
                },
                "devices": [
                    {
                        "device": d,
                        "utilization_ratio": 0.9,
                        "memory_used_bytes": (20 + d) * 2**30,
                        "memory_total_bytes": 80 * 2**30,
                        "temperature_c": 60.0 + d + step / 10,
                        "power_w": 300.0 + 10 * d,
                        "ecc_uncorrectable": 0,
                        "memory_ratio": 0.25,
                    }
                    for d in range(2)
                ]
                if gpus
                else [],
            }
        )

    for step in range(1, min(steps, RESTART_AT) + 1):
        train(step, warmup=step == 1)
    if steps > RESTART_AT:
        events += [
            {
                "kind": "worker_failed",
                "time": clock + 1,
                "rank": 0,
                "node": "node-a",
                "exitcode": -9,
                "step": None,
                "attempt": 0,
                "ranks": [{"rank": 0, "exitcode": -9}],
            },
            {
                "kind": "restart",
                "time": clock + 2,
                "node": "node-a",
                "rank": None,
                "attempt": 1,
                "reason": "rank 0 exited with code -9",
            },
            {"kind": "checkpoint_loaded", "time": clock + 4, "rank": 0, "step": RESUMED_FROM, "seconds": 0.2},
            {"kind": "training_started", "time": clock + 4, "rank": 0, "step": RESUMED_FROM},
        ]
        clock += 4
        for step in range(RESUMED_FROM + 1, steps + 1):
            train(step, warmup=step == RESUMED_FROM + 1)
            if step == ROLLBACK_AT:
                events.append(
                    {
                        "kind": "rollback",
                        "time": clock + 0.02,
                        "rank": 0,
                        "step": ROLLBACK_AT,
                        "to_step": ROLLED_BACK_TO,
                    }
                )
    events.sort(key=lambda e: e["time"])
    store.ingest(run_id, metrics, ranks, events, {}, telemetry)
    if status is not None:
        store.finish_run(run_id, status)
    return run_id
