"""LoRA against a full fine-tune at a preset's shape (default `1b`, Llama 3.2 1B): the optimizer state and
the checkpoint each writes, real (`phalanx train`, one step and one checkpoint on this machine) and as
the planner predicts them (plan/memory.py).

Writes a random bf16 checkpoint of the shape (bench/pretrained_load_bench.py's writer) with a small BPE
tokenizer beside it, then trains one step from it twice through the CLI: with `lora.rank` (default 16,
every linear) and without. Reported per run: the checkpoint's bytes on disk, the bytes of its model and
optimizer tensors (from the checkpoint's DCP metadata), the process's peak resident set, and the
planner's optimizer-state and gradient bytes for one process.

Usage: .venv/bin/python bench/lora_bench.py [--preset 1b] [--rank 16] [--skip-full] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from pretrained_load_bench import write_checkpoint  # noqa: E402


def tensor_bytes(step: Path) -> dict[str, int]:
    from phalanx.run.safe_dcp import read_metadata_file

    sizes = {"model": 0, "optim": 0}
    for key, meta in read_metadata_file(step / ".metadata").state_dict_metadata.items():
        size = getattr(meta, "size", None)
        if size is None:  # bytes items (the optimizer's non-tensor values)
            continue
        itemsize = meta.properties.dtype.itemsize if hasattr(meta.properties.dtype, "itemsize") else 4
        sizes[key.split(".", 1)[0]] = sizes.get(key.split(".", 1)[0], 0) + math.prod(size) * itemsize
    return sizes


def train_once(checkpoint: Path, corpus: Path, runs: Path, name: str, extra: list[str]) -> dict:
    started = time.perf_counter()
    command = [
        sys.executable, "-m", "phalanx", "train", f"model.pretrained={checkpoint}", f"data.sources=[{corpus}]",
        f"run.dir={runs}", f"run.name={name}", "train.max_steps=1", "train.seq_len=64", "train.global_batch_size=1",
        "train.eval_interval=1000", "train.eval_batches=1", "checkpoint.interval=1", "checkpoint.memory_interval=0",
        "train.dtype=float32", "--json", *extra,
    ]  # fmt: skip
    proc = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:], "seconds": time.perf_counter() - started}
    peak_kib = next(int(line.split()[-1]) for line in proc.stderr.splitlines() if "Maximum resident" in line)
    step = sorted((runs / name / "checkpoints").glob("step_*"))[-1]
    on_disk = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    return {
        "checkpoint_bytes": on_disk,
        **{f"{k}_tensor_bytes": v for k, v in tensor_bytes(step).items()},
        "peak_rss_bytes": peak_kib * 1024,
        "seconds": round(time.perf_counter() - started, 1),
    }


def planned(preset: str, rank: int) -> dict:
    from phalanx.models.presets import get_preset
    from phalanx.plan.memory import Workload, estimate

    out = {}
    for label, lora in (("lora", rank), ("full", 0)):
        e = estimate(Workload(get_preset(preset), "none", 1, 1, 64, dtype="float32", device_kind="cpu", lora_rank=lora))
        out[label] = {"optimizer_bytes": e.optimizer_states, "gradient_bytes": e.gradients, "peak_bytes": e.peak_bytes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--skip-full", action="store_true", help="only the LoRA run (a full fine-tune needs ~20 GB)")
    parser.add_argument("--dir", type=Path)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=opts.dir) as tmp:
        tmp = Path(tmp)
        from phalanx.data.corpus import iter_documents, resolve_sources
        from phalanx.data.tokenizer import train_tokenizer

        checkpoint = tmp / "checkpoint"
        checkpoint.mkdir()
        write_checkpoint(opts.preset, checkpoint)
        plays = [s for s in resolve_sources(["builtin:shakespeare"], Path.cwd()) if s.path.stem == "macbeth"]
        text = next(iter_documents(plays))
        train_tokenizer([text], 384).save(str(checkpoint / "tokenizer.json"))
        corpus = tmp / "macbeth.txt"
        corpus.write_text(text)
        runs = tmp / "runs"
        results = {"preset": opts.preset, "rank": opts.rank, "planned": planned(opts.preset, opts.rank)}
        results["lora"] = train_once(checkpoint, corpus, runs, "lora", [f"lora.rank={opts.rank}"])
        if not opts.skip_full:
            results["full"] = train_once(checkpoint, corpus, runs, "full", [])
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
