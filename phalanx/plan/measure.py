"""Measure the peak tensor memory of real training steps, to check the planner against (tests, bench).

One rank runs what the trainer runs (phalanx's model, `parallelize()`, `build_optimizer()`, and the
trainer's own step, train/step.py: forward, float32 cross-entropy, backward, gradient clipping, AdamW,
zero_grad) on random tokens, and reports the highest number of bytes held by live tensors at any moment.

Why this measure: the plan predicts tensor memory, which is what a GPU allocator reports as
`max_memory_allocated`. Process RSS is the wrong yardstick on CPU: it carries hundreds of MB of
libraries, and glibc keeps freed memory mapped. torch's profiler with `profile_memory=True` receives
every allocation and free of c10's CPU allocator (each with its size), so the running sum of those
events, from before the model is built, is the live tensor bytes, including memory torch allocates
in C++ (DDP's gradient buckets, FSDP's all-gather and reduce-scatter buffers, autograd's saved
tensors, optimizer temporaries). A TorchDispatchMode tracker (torch.distributed._tools.MemTracker)
would miss allocations that never surface as an op's output, such as a kernel's workspace.

Run under torch's launcher: `python -m torch.distributed.run --standalone --nproc-per-node 2 -m
phalanx.plan.measure --preset tiny --strategy fsdp --micro-batch 4 --seq-len 256 --out DIR`; each rank
writes DIR/rank<R>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
from pathlib import Path
from typing import Any

import torch

from phalanx.config.schema import ModelSection, TrainSection
from phalanx.models.decoder import Transformer
from phalanx.models.from_config import model_args
from phalanx.models.lora import apply_lora, is_adapter
from phalanx.parallel.apply import parallelize
from phalanx.parallel.build import build_parallel_model, uses_fsdp
from phalanx.parallel.device import compute_dtype
from phalanx.parallel.distributed import init_distributed, teardown
from phalanx.parallel.mesh import Layout, build_mesh
from phalanx.train.optim import build_optimizer
from phalanx.train.step import train_step

BUILD, STEPS = "phalanx.plan.build", "phalanx.plan.steps"


def measure(
    preset: str,
    strategy: str,
    micro_batch: int,
    seq_len: int,
    *,
    steps: int = 2,
    accumulation: int = 1,
    activation_checkpointing: bool = False,
    dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
    tp: int = 1,
    lora_rank: int = 0,
    ep: int = 1,
) -> dict[str, Any]:
    """Peak live tensor bytes of this rank over `steps` optimizer steps (the second is the steady
    state: optimizer states exist while activations are alive)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    env = init_distributed(strategy, "gloo", "cpu")
    rss_base = _rss_bytes()  # after imports and process-group set-up
    args = model_args(ModelSection(preset=preset, **(overrides or {})), seq_len=seq_len)
    batch = micro_batch * accumulation * env.world_size
    train = TrainSection(seq_len=seq_len, micro_batch_size=micro_batch, global_batch_size=batch)
    cdtype = compute_dtype(dtype, env.device)
    clean = False
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as building:
            with record_function(BUILD):
                torch.manual_seed(0)
                layout = None
                if tp > 1 or ep > 1:  # built as training builds it (meta, TP, experts split, FSDP2, materialised)
                    layout = Layout(1, env.world_size // tp, tp, ep=ep)
                    model = build_parallel_model(
                        args,
                        layout,
                        build_mesh(layout, "cpu"),
                        env.device,
                        seed=0,
                        activation_checkpointing=activation_checkpointing,
                        compile=False,
                        dtype=cdtype,
                    )
                else:
                    model = Transformer(args)
                    if lora_rank:  # adapters on every block's linears, the rest frozen (as lora.targets: all)
                        apply_lora(model, lora_rank, 2.0 * lora_rank, 0.0, "all")
                        for name, param in model.named_parameters():
                            if is_adapter(name):
                                torch.nn.init.normal_(param, std=1.0 / lora_rank)
                    model = model.to(env.device)
                    model = parallelize(
                        model,
                        strategy,
                        env,
                        activation_checkpointing=activation_checkpointing,
                        compile=False,
                        dtype=cdtype,
                    )
                optimizer = build_optimizer(model, train)
                params = [p for p in model.parameters() if p.requires_grad]
        # The steps are traced apart, with each op's inputs: the last use of a buffer whose free no
        # profiled thread saw (see _peak_live_bytes). Not while building: recording inputs holds weak
        # references to tensors, and materialising the model swaps parameters, which refuses those.
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as stepping:
            fsdp = env.distributed and (strategy == "fsdp" if layout is None else uses_fsdp(layout))
            # As the trainer: under FSDP the mixed-precision policy casts parameters, elsewhere autocast does.
            autocast = (
                (lambda: torch.autocast("cpu", dtype=cdtype))
                if cdtype != torch.float32 and not fsdp
                else contextlib.nullcontext
            )
            generator = torch.Generator().manual_seed(env.rank)
            with record_function(STEPS):
                for _ in range(steps):
                    micro_batches = [
                        _random_batch(args.vocab_size, micro_batch, seq_len, generator) for _ in range(accumulation)
                    ]
                    train_step(
                        model,
                        optimizer,
                        params,
                        micro_batches,
                        device=env.device,
                        grad_clip=train.grad_clip,
                        autocast=autocast,
                    )
            del model, optimizer, params, micro_batches
            gc.collect()  # everything built above is freed inside the trace
        peak, unpaired = _peak_live_bytes([building.profiler.kineto_results, stepping.profiler.kineto_results])
        clean = True
    finally:
        teardown(clean)
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "preset": preset,
        "model": overrides or {},
        "strategy": strategy,
        "tp": tp,
        "ep": ep,
        "lora_rank": lora_rank,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "accumulation": accumulation,
        "activation_checkpointing": activation_checkpointing,
        "dtype": str(cdtype).removeprefix("torch."),
        "peak_tensor_bytes": peak,
        "unpaired_bytes": unpaired,
        "rss_delta_bytes": _rss_bytes(peak=True) - rss_base,
        "torch": torch.__version__,
    }


def _random_batch(vocab: int, batch: int, seq_len: int, generator: torch.Generator):
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _peak_live_bytes(traces) -> tuple[int, int]:
    """The highest live tensor bytes during the steps, and the bytes never seen freed.

    Allocations and frees are paired by address. The profiler only sees frees made on the profiled
    thread, and gloo sometimes drops the last reference to a buffer on one of its worker threads, at
    a time that varies from run to run: the copies gloo makes inside a collective (all-gather into a
    temporary, reduce-scatter of a clone), DDP's start-up broadcast of the weights. So a buffer made
    inside a collective counts until the collective returns (or its free, if seen sooner), one made
    while building the model and never seen freed counts until the steps start, one used by an op
    afterwards counts until its last use (a functional collective's output or input, such as the
    gathered logits under tensor parallelism, is freed wherever the last reference drops), and anything
    else never seen freed counts to the end (reported as `unpaired`).
    """
    by_address: dict[int, list[tuple[int, int, int | None]]] = {}  # (when, +bytes or -1, collective end)
    last_use: dict[int, int] = {}  # address -> the end of the last op that took a tensor stored there
    steps_start = None
    stack = [(node, None) for results in traces for node in results.experimental_event_tree()]
    while stack:
        node, collective_end = stack.pop()
        if collective_end is None and node.name.startswith("c10d::"):
            collective_end = node.end_time_ns
        stack.extend((child, collective_end) for child in node.children)
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            size = fields.alloc_size if fields.alloc_size > 0 else -1
            by_address.setdefault(fields.ptr, []).append((node.start_time_ns, size, collective_end))
        elif node.name == STEPS:
            steps_start = node.start_time_ns
        for address in _input_addresses(getattr(fields, "inputs", ())):
            last_use[address] = max(last_use.get(address, 0), node.end_time_ns)
    timeline, unpaired = [], 0
    for address, events in by_address.items():
        events.sort(key=lambda e: e[0])
        for k, (when, size, collective_end) in enumerate(events):
            if size < 0:
                continue
            later = events[k + 1] if k + 1 < len(events) else None
            freed = later[0] if later is not None else None  # its free, or the next allocation here
            if collective_end is not None:
                freed = collective_end if freed is None else min(freed, collective_end)
            elif freed is None and when < steps_start:
                freed = steps_start
            elif freed is None and last_use.get(address, 0) > when:
                freed = last_use[address]
            elif freed is None:
                unpaired += size
            timeline.append((when, size))
            if freed is not None:
                timeline.append((freed, -size))
    timeline.sort()  # at a tie, the free first
    live = peak = 0
    for when, nbytes in timeline:
        live += nbytes
        if when >= steps_start:
            peak = max(peak, live)
    return peak, unpaired


def _input_addresses(inputs) -> list[int]:
    """The storage addresses of an op's tensor inputs (record_shapes' metadata; a list input is a tensor list)."""
    found = []
    for value in inputs:
        for item in value if isinstance(value, list) else [value]:
            address = getattr(item, "storage_data_ptr", None)
            if address:
                found.append(address)
    return found


def _rss_bytes(peak: bool = False) -> int:
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    import psutil

    return psutil.Process().memory_info().rss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--strategy", choices=["none", "ddp", "fsdp"], required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="override a model shape field of the preset, e.g. vocab_size=512",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (the rest shard with FSDP)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (a mixture of experts)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every linear")
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args(argv)
    overrides = {key: int(value) for key, _, value in (item.partition("=") for item in opts.model)}
    result = measure(
        opts.preset,
        opts.strategy,
        opts.micro_batch,
        opts.seq_len,
        steps=opts.steps,
        accumulation=opts.accumulation,
        activation_checkpointing=opts.activation_checkpointing,
        dtype=opts.dtype,
        overrides=overrides,
        tp=opts.tp,
        lora_rank=opts.lora_rank,
        ep=opts.ep,
    )
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
