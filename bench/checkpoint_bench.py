"""What a checkpoint costs training: the stall of a synchronous save against an asynchronous one
(checkpoint.async, DCP async_save), and save / verify throughput, for the `125m` preset with AdamW.

One process on this machine's CPU; the checkpoint goes to --dir (a local disk by default). The stall is
how long the training loop stands still for a save: all of it when synchronous; the copy of the state
into host memory when asynchronous (the write then runs beside training; here beside a busy loop of
forward/backward steps, so the figure includes the contention a real run would see).

Usage: .venv/bin/python bench/checkpoint_bench.py [--preset 125m] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from phalanx.models.decoder import Transformer
from phalanx.models.presets import get_preset
from phalanx.parallel.distributed import DistEnv
from phalanx.run.checkpoints import list_checkpoints, verify_checkpoint
from phalanx.train.checkpoint import Checkpointer


def train_step(model, optimizer, tokens) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(get_preset(args.preset))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, model.args.vocab_size, (1, 129))
    train_step(model, optimizer, tokens)  # the optimizer's state exists, as in training
    env = DistEnv(0, 1, 0, torch.device("cpu"), None)
    root = Path(tempfile.mkdtemp(prefix="phalanx-ckpt-bench-", dir=args.dir))
    sync, stall, write, verify, size = [], [], [], [], 0
    try:
        for i in range(args.repeats):
            checkpointer = Checkpointer(root / "sync", keep=1, env=env)
            t0 = time.perf_counter()
            path = checkpointer.save(i + 1, model, optimizer, {"model_args": {}})
            sync.append(time.perf_counter() - t0)
            size = sum(f.stat().st_size for f in path.iterdir())
            t0 = time.perf_counter()
            assert verify_checkpoint(path) is None
            verify.append(time.perf_counter() - t0)

            checkpointer = Checkpointer(root / "async", keep=1, env=env, asynchronous=True)
            t0 = time.perf_counter()
            assert checkpointer.start(i + 1, model, optimizer, {"model_args": {}}) is None
            stall.append(time.perf_counter() - t0)
            while (outcome := checkpointer.finish(wait=False)) is None:
                train_step(model, optimizer, tokens)  # training goes on beside the write
            assert isinstance(outcome.result, Path) and list_checkpoints(root / "async")
            write.append(outcome.write_seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = size / 1e9
    report = {
        "preset": args.preset,
        "checkpoint_gb": round(gb, 3),
        "repeats": args.repeats,
        "sync_stall_s": round(statistics.median(sync), 3),
        "async_stall_s": round(statistics.median(stall), 3),
        "async_write_s": round(statistics.median(write), 3),
        "save_gb_per_s": round(gb / statistics.median(sync), 3),
        "verify_gb_per_s": round(gb / statistics.median(verify), 3),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
