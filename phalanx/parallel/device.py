"""Which device and collective backend this process uses, vendor-neutral.

`torch.cuda` drives both NVIDIA (CUDA) and AMD (ROCm/HIP) builds of PyTorch; `torch.version.hip` tells
them apart, and the `nccl` backend is RCCL on ROCm.
"""

from __future__ import annotations

import platform

import torch

from phalanx.errors import PhalanxError


def pick_device(preference: str, local_rank: int = 0) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PhalanxError("parallel.device=cuda but this torch build sees no GPU (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise PhalanxError(f"local rank {local_rank} has no GPU: this node has {count}; use --nproc {count} or fewer")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def pick_backend(preference: str, device: torch.device) -> str:
    if preference != "auto":
        if preference == "nccl" and device.type != "cuda":
            raise PhalanxError("parallel.backend=nccl needs GPUs; use gloo (or auto) on CPU")
        return preference
    return "nccl" if device.type == "cuda" else "gloo"


def compute_dtype(preference: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 autocast on GPUs, and on CPUs with bf16 matrix units (a tiny-model training step 1.9x
    float32's speed on AMX, BENCHMARKS.md); float32 on other CPUs, whose bf16 products are emulated and
    slower than float32's. Across ranks on CPUs, bf16 only where every rank has the units (one
    all-reduce where a process group is up): ranks that computed in different dtypes would not be one
    model's replicas."""
    if preference == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if _every_rank(cpu_has_bf16_units()) else torch.float32
    if preference == "float8":
        return torch.bfloat16  # what everything but the float8 matmuls computes in
    return getattr(torch, preference)


def _every_rank(flag: bool) -> bool:
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    agreed = torch.tensor([int(flag)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # CPU ranks: gloo
    return bool(agreed.item())


def cpu_has_bf16_units() -> bool:
    """AMX tiles or AVX-512-bf16: where oneDNN's bf16 products run well above float32's rate."""
    checks = (getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    return any(check is not None and check() for check in checks)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocator peak on GPUs, resident set peak on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
