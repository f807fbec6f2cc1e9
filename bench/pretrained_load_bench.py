"""Host memory of loading a pretrained Hugging Face checkpoint (`model.pretrained`, train/pretrained.py) per
rank: the issue's bound is this rank's shard of the model plus the largest single tensor.

Writes a random checkpoint of a preset's shape (default the `1b` shape, Llama 3.2 1B: 1.24 B parameters,
bf16 safetensors in shards of about 1 GB, as the hub's are), then under torch's launcher each rank builds
the model on the meta device for the layout, materialises its shard, resets its peak resident set
(`/proc/self/clear_refs`, Linux), loads the checkpoint and reads the peak back (VmHWM). Reported per rank:
the resident set before the model was built, its shard's bytes, the largest tensor's bytes (float32, what
a rank holds it in), and the peak during the load above the pre-build baseline.

Usage: .venv/bin/python bench/pretrained_load_bench.py [--preset 1b] [--nproc 2] [--strategy fsdp] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def write_checkpoint(preset: str, out: Path, shard_bytes: int = 1 << 30) -> None:
    from safetensors.torch import save_file

    from phalanx.models.families import hf_config, hf_names
    from phalanx.models.presets import get_preset
    from phalanx.run.hf_format import expected_shapes

    args = get_preset(preset)
    (out / "config.json").write_text(json.dumps(hf_config(args, 0, 1, torch.bfloat16), indent=2))
    shapes, names = expected_shapes(args), hf_names(args)
    generator = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for hf in names.values():
        tensor = (torch.randn(shapes[hf], generator=generator) * 0.02).to(torch.bfloat16)
        if current and size + tensor.nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[hf], size = tensor, size + tensor.nbytes
    shards.append(current)
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, tensors in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index["weight_map"].update({hf: name for hf in tensors})
        index["metadata"]["total_size"] += sum(t.nbytes for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rank_main(checkpoint: str, strategy: str, out: str) -> None:
    import torch.distributed as dist

    from phalanx.config.schema import ParallelSection
    from phalanx.models.from_config import pretrained_args
    from phalanx.parallel.build import build_parallel_model
    from phalanx.parallel.mesh import build_mesh, resolve_layout
    from phalanx.train.pretrained import load_pretrained

    dist.init_process_group("gloo")
    args = pretrained_args(Path(checkpoint))
    layout = resolve_layout(ParallelSection(strategy=strategy), dist.get_world_size())
    baseline = status_kib("VmRSS") * 1024
    model = build_parallel_model(
        args, layout, build_mesh(layout, "cpu"), torch.device("cpu"), seed=0,
        activation_checkpointing=False, compile=False, dtype=torch.float32, initialise=False,
    )  # fmt: skip
    shard = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
        for p in {id(p): p for p in model.parameters()}.values()
    )
    Path("/proc/self/clear_refs").write_text("5")  # peak resident set := current
    started = time.perf_counter()
    load_pretrained(model, args, Path(checkpoint))
    seconds = time.perf_counter() - started
    peak = status_kib("VmHWM") * 1024
    largest = max(p.numel() for p in model.parameters()) * 4  # a DTensor's numel is the whole tensor's
    record = {
        "rank": dist.get_rank(),
        "baseline_gib": baseline / 2**30,
        "shard_gib": shard / 2**30,
        "largest_tensor_gib": largest / 2**30,
        "peak_above_baseline_gib": (peak - baseline) / 2**30,
        "bound_gib": (shard + largest) / 2**30,
        "load_seconds": seconds,
    }
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(record))
    dist.barrier()
    del model
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary one)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=options.dir) as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        checkpoint.mkdir()
        started = time.perf_counter()
        write_checkpoint(options.preset, checkpoint)
        size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
        print(f"wrote a {size / 2**30:.2f} GiB {options.preset} checkpoint in {time.perf_counter() - started:.0f} s")
        out = Path(tmp) / "rank"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
        command += [str(options.nproc), __file__, "--rank-main", str(checkpoint), options.strategy, str(out)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for rank in range(options.nproc):
            r = json.loads(Path(f"{out}.{rank}").read_text())
            print(
                f"rank {r['rank']}: shard {r['shard_gib']:.2f} GiB + largest tensor {r['largest_tensor_gib']:.2f} GiB "
                f"= bound {r['bound_gib']:.2f} GiB; peak during the load {r['peak_above_baseline_gib']:.2f} GiB above "
                f"the {r['baseline_gib']:.2f} GiB before the build; load {r['load_seconds']:.1f} s"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-main"]:
        rank_main(*sys.argv[2:])
    else:
        main()
