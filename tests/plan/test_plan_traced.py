"""The traced plan: the real parallelised step (parallel/build.py's model, TP, FSDP2, AdamW) run on fake
tensors with a fake process group, its peak from torch's FSDP memory tracker. It must agree with the
hand model, and both with a real gloo step where one can run here; and 70B on 64 ranks runs that way."""

import json
import subprocess
import sys

import pytest

from phalanx.models.flops import count_params
from phalanx.models.presets import MODEL_PRESETS
from phalanx.plan import planner, propose
from phalanx.plan.devices import get_device
from phalanx.plan.memory import Workload, estimate
from phalanx.plan.traced import trace_step

TOLERANCE = 0.10


@pytest.mark.parametrize(
    "dp_shard, tp, dtype, ac",
    [
        (2, 1, "float32", False),  # FSDP
        (2, 2, "bfloat16", True),  # FSDP x TP, FSDP2's bf16 mixed precision, checkpointed blocks
    ],
)
def test_traced_step_agrees_with_the_hand_model(dp_shard, tp, dtype, ac):
    args = MODEL_PRESETS["tiny"]
    traced = trace_step(
        args, dp_shard=dp_shard, tp=tp, micro_batch=4, seq_len=256, dtype=dtype, activation_checkpointing=ac
    )
    hand = estimate(
        Workload(args, "fsdp", dp_shard, 4, 256, dtype=dtype, device_kind="gpu", tp=tp, activation_checkpointing=ac)
    )
    assert abs(hand.peak_bytes - traced.peak_bytes) / traced.peak_bytes <= TOLERANCE, (hand, traced)
    assert traced.activations > 0 and traced.at_peak["parameters"] > 0


@pytest.mark.slow
def test_real_tensor_parallel_step_matches_both(tmp_path):
    """Two gloo ranks with tp=2 through torch's launcher (plan/measure.py: peak live tensor bytes from
    the allocator's events): the hand model and the traced step both land within 10%."""
    args = MODEL_PRESETS["tiny"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "phalanx.plan.measure",
        "--preset",
        "tiny",
        "--strategy",
        "fsdp",
        "--tp",
        "2",
        "--micro-batch",
        "4",
        "--seq-len",
        "256",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # allocations never seen freed (gloo frees some on its own threads): small beside the peak
    assert all(r["tp"] == 2 and r["unpaired_bytes"] < 0.05 * r["peak_tensor_bytes"] for r in ranks), ranks
    measured = max(r["peak_tensor_bytes"] for r in ranks)
    hand = estimate(Workload(args, "none", 1, 4, 256, dtype="float32", device_kind="cpu", tp=2)).peak_bytes
    traced = trace_step(args, tp=2, micro_batch=4, seq_len=256, dtype="float32").peak_bytes
    assert abs(hand - measured) / measured <= TOLERANCE, (hand, measured)
    assert abs(traced - measured) / measured <= TOLERANCE, (traced, measured)


@pytest.mark.slow
def test_70b_builds_shards_and_steps_on_64_fake_ranks():
    """model.preset=70b on the meta device, TP x FSDP2 over a fake process group of 64 ranks, one rank
    simulated here: forward, backward and AdamW run on fake tensors, and the planner reports that peak."""
    job = planner.resolve_job("70b", 64)
    device = get_device("mi300x")
    par = propose.given_layout(job, dp_replicate=None, dp_shard=None, tp=8, pp=None)
    report = propose.plan_layout(job, device, par, mfu=0.4, headroom=0.1, do_trace=True)
    row = report["chosen"]
    traced = row["traced"]
    # one micro-batch traced; the other 7 of the step's 8 (64 sequences over 8 replicas) from the hand model
    assert row["memory_source"] == "traced" and row["layout"]["microbatches"] == 8
    assert row["peak_gib"] == pytest.approx(traced["peak_gib"] + traced["more_micro_batches_gib"])
    at_peak = row["traced"]["at_peak_gib"]
    # this rank holds 1/64 of the float32 weights (norms whole within TP), nothing like 70B's 282 GB
    shard_gib = 4 * count_params(MODEL_PRESETS["70b"]) / 64 / 2**30
    assert shard_gib * 0.99 <= at_peak["parameters"] <= shard_gib * 1.05
    assert row["traced"]["activations_gib"] > 1  # the forward ran at 8192 tokens
    assert abs(row["traced"]["hand_over_traced"] - 1) <= TOLERANCE
    assert row["fits"] == (row["peak_gib"] <= row["usable_gib_per_rank"])


@pytest.mark.slow
def test_real_fsdp_by_tp_step_matches_both(tmp_path):
    """Four gloo ranks, dp_shard=2 x tp=2, a tiny-shaped model widened so the resident state dominates:
    the hand model and the traced step (through backward) within 10% of the measured peak. The traced
    step's raw peak is higher, in gradient clipping: the fake process group's artefact, not the run's."""
    import dataclasses

    args = dataclasses.replace(MODEL_PRESETS["tiny"], dim=1024, ffn_dim=4096, n_heads=8)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "phalanx.plan.measure",
        "--preset",
        "tiny",
        "--strategy",
        "fsdp",
        "--tp",
        "2",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--model",
        "dim=1024",
        "--model",
        "ffn_dim=4096",
        "--model",
        "n_heads=8",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = max(json.loads((tmp_path / f"rank{r}.json").read_text())["peak_tensor_bytes"] for r in range(4))
    hand = estimate(Workload(args, "fsdp", 2, 1, 16, dtype="float32", device_kind="cpu", tp=2)).peak_bytes
    traced = trace_step(args, dp_shard=2, tp=2, micro_batch=1, seq_len=16, dtype="float32")
    assert abs(hand - measured) / measured <= TOLERANCE, (hand, measured)
    assert abs(traced.through_backward_bytes - measured) / measured <= TOLERANCE, (traced, measured)
    assert traced.peak_bytes > 1.2 * measured  # the clipping artefact is still there: drop this and the
    # max() in propose.trace() together once torch no longer shows it
