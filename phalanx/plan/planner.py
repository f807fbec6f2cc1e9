"""Will this training run fit, how large a micro batch fits, and how fast would it go?

`plan()` turns a config (or a model preset) plus a device into a report; `compare()` asks the same of
every known device. Memory comes from memory.estimate (one rank's peak over a training step), speed
from model FLOPs at a stated MFU, as the trainer reports MFU (phalanx.models.flops).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.flops import count_params, flops_per_token
from phalanx.models.presets import MODEL_PRESETS
from phalanx.plan.devices import Device
from phalanx.plan.memory import Workload, estimate

GIB = 2**30
DEFAULT_HEADROOM = 0.10  # of device memory: runtime context, NCCL/RCCL buffers, allocator fragmentation
DEFAULT_MFU = 0.40
MAX_SEQ_DEFAULT = 8192  # a preset trains at its context length, up to this


@dataclass(frozen=True)
class Job:
    """What is being planned, before a device is chosen."""

    name: str  # the config path or preset name it came from
    args: ModelArgs
    strategy: str
    world_size: int
    micro_batch: int
    seq_len: int
    accumulation: int
    activation_checkpointing: bool
    dtype: str  # auto | float32 | bfloat16 (auto: bf16 on GPUs, fp32 on CPU, as the trainer does)
    # For 4-D layouts (propose.py): context-parallel ranks, and the pipeline's schedule and micro-batches.
    cp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    # A run config's own layout (parallel.tp/pp/cp/dp_*) when it sets one beyond plain data parallelism:
    # planned as given, as the flags would be.
    config_layout: dict[str, int] | None = None
    lora_rank: int = 0  # the config's lora.rank and lora.targets: the adapters alone train
    lora_targets: str = "all"

    def workload(self, device: Device, **changes: Any) -> Workload:
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device.kind == "gpu" else "float32")
        fields = dict(
            args=self.args,
            strategy=self.strategy,
            world_size=self.world_size,
            micro_batch=self.micro_batch,
            seq_len=self.seq_len,
            accumulation=self.accumulation,
            activation_checkpointing=self.activation_checkpointing,
            dtype=dtype,
            device_kind=device.kind,
            lora_rank=self.lora_rank,
            lora_targets=self.lora_targets,
        )
        return Workload(**{**fields, **changes})


def resolve_job(
    source: str,
    gpus: int,
    *,
    strategy: str | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: bool | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Job:
    """A Job from a model preset name or a run config (a YAML path or a config preset, with `section.key=value`
    overrides as `phalanx train` takes them); options override both."""
    if gpus < 1:
        raise PhalanxError(f"--gpus must be at least 1, got {gpus}")
    if source in MODEL_PRESETS and not Path(source).is_file():
        if overrides:
            raise PhalanxError(
                f"overrides such as '{overrides[0]}' apply to a run config, not the model preset "
                f"'{source}'; use --micro-batch, --seq-len and --strategy, or plan a config"
            )
        args = MODEL_PRESETS[source]
        seq = seq_len or min(args.max_seq_len, MAX_SEQ_DEFAULT)
        job = Job(
            source, args, strategy or "fsdp", gpus, micro_batch or 1, seq, 1, bool(activation_checkpointing), "auto"
        )
    else:
        job = _job_from_config(source, gpus, strategy, micro_batch, seq_len, activation_checkpointing, overrides)
    if job.args.n_experts and job.lora_rank:  # as the trainer (train/resume.py: check_moe)
        raise PhalanxError(f"a mixture of experts ({job.args.n_experts} experts) does not train with LoRA yet")
    if job.strategy == "none" and gpus > 1:
        raise PhalanxError(f"strategy none runs one process; use --strategy ddp or fsdp for --gpus {gpus}")
    if job.seq_len > job.args.max_seq_len:
        raise PhalanxError(f"--seq-len {job.seq_len} exceeds the model's max_seq_len {job.args.max_seq_len}")
    for name in ("micro_batch", "seq_len"):
        if getattr(job, name) < 1:
            raise PhalanxError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(job, name)}")
    return job


def _job_from_config(
    source: str,
    gpus: int,
    strategy: str | None,
    micro_batch: int | None,
    seq_len: int | None,
    activation_checkpointing: bool | None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Job:
    from phalanx.config.loader import load_config, preset_names
    from phalanx.models.from_config import model_args

    if not Path(source).is_file() and source not in preset_names() and not source.endswith((".yaml", ".yml")):
        raise PhalanxError(
            f"'{source}' is neither a config file, a config preset ({', '.join(preset_names())}) "
            f"nor a model preset ({', '.join(MODEL_PRESETS)})"
        )
    config = load_config(source, overrides)
    tc = config.train
    # The vocabulary the run's tokenizer would have: model.vocab_size if set, else at most data.vocab_size.
    vocab = config.model.vocab_size or config.data.vocab_size
    args = dataclasses.replace(model_args(config.model), vocab_size=vocab)
    strat = strategy or config.parallel.strategy
    ranks = gpus if strat != "none" else 1
    if micro_batch is None and tc.micro_batch_size is None and tc.global_batch_size % ranks:
        raise PhalanxError(
            f"train.global_batch_size ({tc.global_batch_size}) must be a multiple of the {ranks} "
            f"ranks, which share each batch evenly (override it: train.global_batch_size=N)"
        )
    micro = micro_batch or tc.micro_batch(ranks)  # as the trainer: each rank's share when not set
    if tc.global_batch_size % (micro * ranks):
        raise PhalanxError(
            f"train.global_batch_size ({tc.global_batch_size}) must be a multiple of the micro "
            f"batch ({micro}) x {ranks} ranks = {micro * ranks}"
        )
    return Job(
        source,
        args,
        strat,
        gpus,
        micro,
        seq_len or tc.seq_len,
        tc.global_batch_size // (micro * ranks),
        tc.activation_checkpointing if activation_checkpointing is None else activation_checkpointing,
        tc.dtype,
        cp=config.parallel.cp,
        pp_schedule=config.parallel.pp_schedule,
        pp_microbatches=config.parallel.pp_microbatches,
        config_layout=_config_layout(config.parallel, gpus),
        lora_rank=config.lora.rank,
        lora_targets=config.lora.targets,
    )


def _config_layout(parallel, gpus: int) -> dict[str, int] | None:
    """The degrees the trainer would use (parallel/mesh.py resolves them the same way)."""
    from phalanx.parallel.mesh import resolve_layout

    plain = parallel.tp == parallel.pp == parallel.cp == parallel.ep == 1
    if plain and parallel.dp_shard is None and parallel.dp_replicate is None:
        return None
    layout = resolve_layout(parallel, gpus)
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp_shard": layout.dp_shard,
        "dp_replicate": layout.dp_replicate,
        "ep": layout.ep,
    }


def plan(job: Job, device: Device, *, mfu: float = DEFAULT_MFU, headroom: float = DEFAULT_HEADROOM) -> dict[str, Any]:
    """The report for one device: memory per rank, whether it fits, the largest micro batch, speed."""
    _check_fractions(mfu, headroom)
    workload = job.workload(device)
    memory = estimate(workload)
    usable = usable_bytes(device, job.world_size, headroom)
    other_ac = not job.activation_checkpointing
    other = estimate(job.workload(device, activation_checkpointing=other_ac))
    tokens = projected_tokens_per_sec(job.args, job.seq_len, device, mfu, job.world_size)
    return {
        "source": job.name,
        "device": device.name,
        "device_kind": device.kind,
        "devices": job.world_size,
        "device_memory_gib": device.memory_gib,
        "peak_tflops": device.peak_tflops,
        "device_source": device.source,
        "model": dataclasses.asdict(job.args),
        "params": count_params(job.args),
        "strategy": workload.strategy,
        "dtype": workload.dtype,
        "micro_batch": job.micro_batch,
        "seq_len": job.seq_len,
        "accumulation": job.accumulation,
        "global_batch": job.micro_batch * job.accumulation * (job.world_size if job.strategy != "none" else 1),
        "activation_checkpointing": job.activation_checkpointing,
        "memory": {**memory.as_dict(), "peak_gib": memory.peak_bytes / GIB},
        "headroom": headroom,
        "usable_gib_per_rank": usable / GIB,
        "fits": memory.peak_bytes <= usable,
        "max_micro_batch": max_micro_batch(job, device, headroom),
        "other_activation_checkpointing": {
            "activation_checkpointing": other_ac,
            "peak_gib": other.peak_bytes / GIB,
            "fits": other.peak_bytes <= usable,
            "max_micro_batch": max_micro_batch(
                dataclasses.replace(job, activation_checkpointing=other_ac), device, headroom
            ),
        },
        "mfu": mfu,
        "flops_per_token": flops_per_token(job.args, job.seq_len),
        "tokens_per_sec_per_device": tokens / job.world_size,
        "tokens_per_sec": tokens,
    }


def compare(
    job: Job, devices: list[Device], *, mfu: float = DEFAULT_MFU, headroom: float = DEFAULT_HEADROOM
) -> list[dict[str, Any]]:
    """One row per device: the same job on `job.world_size` of each."""
    _check_fractions(mfu, headroom)
    rows = []
    for device in devices:
        memory = estimate(job.workload(device))
        with_ac = dataclasses.replace(job, activation_checkpointing=True)
        best = max_micro_batch(job, device, headroom)
        best_ac = best if job.activation_checkpointing else max_micro_batch(with_ac, device, headroom)
        tokens = projected_tokens_per_sec(job.args, job.seq_len, device, mfu, job.world_size)
        rows.append(
            {
                "device": device.name,
                "memory_gib": device.memory_gib,
                "peak_tflops": device.peak_tflops,
                "dtype": job.workload(device).dtype,
                "peak_gib": memory.peak_bytes / GIB,
                "fits": memory.peak_bytes <= usable_bytes(device, job.world_size, headroom),
                "max_micro_batch": best,
                "max_micro_batch_with_ac": best_ac,
                # Only where some micro batch fits: a run that cannot start has no speed.
                "tokens_per_sec": tokens if (best or best_ac) else None,
            }
        )
    return rows


def job_summary(job: Job) -> dict[str, Any]:
    return {
        "source": job.name,
        "params": count_params(job.args),
        "model": dataclasses.asdict(job.args),
        "strategy": job.strategy,
        "devices": job.world_size,
        "micro_batch": job.micro_batch,
        "seq_len": job.seq_len,
        "accumulation": job.accumulation,
        "activation_checkpointing": job.activation_checkpointing,
        "dtype": job.dtype,
    }


def usable_bytes(device: Device, ranks: int, headroom: float) -> float:
    """Memory one rank may use: the device less the headroom; a CPU host's RAM is split among its ranks."""
    total = device.memory_gib * GIB * (1 - headroom)
    return total / ranks if device.shared_by_ranks else total


def max_micro_batch(job: Job, device: Device, headroom: float, limit: int = 1 << 20) -> int:
    """The largest micro batch whose step fits (same accumulation, seq len, AC), 0 if none does."""
    usable = usable_bytes(device, job.world_size, headroom)

    def fits(batch: int) -> bool:
        return estimate(job.workload(device, micro_batch=batch)).peak_bytes <= usable

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):  # memory grows with the batch: double, then bisect
        low, high = high, high * 2
    if high > limit:
        return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def projected_tokens_per_sec(args: ModelArgs, seq_len: int, device: Device, mfu: float, devices: int) -> float:
    """Training tokens/s of `devices` devices that each sustain `mfu` of their peak on model FLOPs
    (6N + attention, without activation checkpointing's recompute, as the trainer counts MFU). CPU ranks
    share one host, and so its peak."""
    per_device = mfu * device.peak_tflops * 1e12 / flops_per_token(args, seq_len)
    return per_device if device.shared_by_ranks else per_device * devices


def _check_fractions(mfu: float, headroom: float) -> None:
    if not 0 < mfu <= 1:
        raise PhalanxError(f"--mfu is a fraction of peak in (0, 1], got {mfu}")
    if not 0 <= headroom < 1:
        raise PhalanxError(f"--headroom is a fraction of device memory in [0, 1), got {headroom}")
