"""4-D layouts in the planner: bubble and in-flight arithmetic, communication, proposals, the CLI."""

import json

import pytest

from phalanx.errors import PhalanxError
from phalanx.models.presets import MODEL_PRESETS
from phalanx.plan import planner, propose
from phalanx.plan.devices import get_device
from phalanx.plan.memory import Workload, _StepWalk, estimate
from phalanx.plan.parallelism import Parallelism, communication
from tests.helpers import phalanx


@pytest.mark.parametrize(
    "schedule, m, pp, bubble, in_flight",
    [
        ("1f1b", 12, 4, 3 / 15, 4),
        ("gpipe", 12, 4, 3 / 15, 12),
        ("interleaved_1f1b", 12, 4, 1.5 / 13.5, (2 * 3 + 4 + 1) / 2),  # Megatron's warm-up, v = 2
        ("1f1b", 3, 1, 0.0, 1),
    ],
)
def test_bubble_and_micro_batches_in_flight(schedule, m, pp, bubble, in_flight):
    par = Parallelism(pp=pp, microbatches=m, schedule=schedule)
    assert par.bubble_fraction() == pytest.approx(bubble)
    assert par.in_flight() == pytest.approx(in_flight)


def test_more_micro_batches_shrink_the_bubble():
    bubbles = [Parallelism(pp=8, microbatches=m).bubble_fraction() for m in (8, 16, 64)]
    assert bubbles[0] > bubbles[1] > bubbles[2] > 0


def test_communication_by_kind():
    args = MODEL_PRESETS["8b"]
    fsdp = communication(args, Parallelism(dp_shard=8), 1, 4096, "bfloat16")
    assert set(fsdp) == {"fsdp all-gather", "fsdp reduce-scatter"}
    # 2-D: TP traffic appears, FSDP's shrinks with the parameters each TP rank holds
    two_d = communication(args, Parallelism(dp_shard=4, tp=2), 1, 4096, "bfloat16")
    assert two_d["tp activations"] > 0 and two_d["fsdp all-gather"] < fsdp["fsdp all-gather"]
    tokens_d = 4096 * args.dim * 2 * (1 / 2)  # bf16, ring over 2 ranks
    expected_tp = args.n_layers * 8 * tokens_d + 2 * 4096 * args.vocab_size * 2 * (1 / 2)
    assert two_d["tp activations"] == pytest.approx(expected_tp)
    pipe = communication(args, Parallelism(dp_shard=2, pp=4, microbatches=8), 1, 4096, "bfloat16")
    assert pipe["pp send/recv"] == pytest.approx(2 * 8 * 4096 * args.dim * 2)
    ring = communication(args, Parallelism(dp_shard=2, cp=4), 1, 4096, "bfloat16")
    kv = 2 * 1024 * args.n_kv_heads * args.head_size * 2
    assert ring["cp K/V ring"] == pytest.approx(3 * args.n_layers * kv * 3)


def test_pipeline_stage_holds_its_micro_batches_in_flight():
    args = MODEL_PRESETS["8b"]
    one = estimate(Workload(args, "fsdp", 8, 1, 4096))
    four = estimate(Workload(args, "fsdp", 8, 1, 4096, in_flight=4))
    # three more micro-batches' blocks, each what autograd saves for one block (test_plan_memory checks that),
    # and each micro-batch's RoPE tables
    walk = _StepWalk(Workload(args, "fsdp", 8, 1, 4096))
    per_micro_batch = args.n_layers * walk.block_saved() + walk.rope_saved()
    assert four.peak_bytes - one.peak_bytes == pytest.approx(3 * per_micro_batch)
    # tensor parallelism divides each rank's resident state (parameters, gradients, optimizer states)
    tp = estimate(Workload(args, "fsdp", 4, 1, 4096, tp=2))
    assert tp.optimizer_states == pytest.approx(one.optimizer_states, rel=0.01)  # 8 ranks either way


@pytest.mark.parametrize("preset, gpu, gpus", [("70b", "mi300x", 64), ("405b", "mi355x", 512)])
def test_proposals_name_a_layout_that_fits(preset, gpu, gpus):
    job = planner.resolve_job(preset, gpus)
    result = propose.propose(job, get_device(gpu), mfu=0.4, headroom=0.1, do_trace=False)
    chosen = result["chosen"]
    assert chosen["fits"] and Parallelism(**chosen["layout"]).world_size == gpus
    assert chosen["layout"]["tp"] <= 8 and chosen["peak_gib"] <= chosen["usable_gib_per_rank"]
    fitting = [c for c in result["candidates"] if c["fits"]]
    assert len(result["candidates"]) >= 10 and chosen["tokens_per_sec"] >= 0.98 * max(
        c["tokens_per_sec"] for c in fitting
    )
    assert "layouts considered" in result["reason"] and "tokens/s" in result["reason"]
    assert all(c.get("why_not") for c in result["candidates"] if c is not chosen)
    # one global batch under every layout: micro-batches x data-parallel replicas is the same
    sizes = {c["layout"]["microbatches"] * c["layout"]["dp_replicate"] * c["layout"]["dp_shard"] for c in fitting}
    assert sizes == {gpus}


def test_bad_layouts_say_why():
    job = planner.resolve_job("70b", 64)
    for kwargs, words in (
        ({"tp": 3}, "does not divide --gpus"),
        ({"tp": 16, "pp": 1}, "n_kv_heads"),
        ({"tp": 8, "pp": 64, "dp_shard": None}, "does not divide"),
    ):
        with pytest.raises(PhalanxError, match=words):
            propose.given_layout(
                job, dp_replicate=None, dp_shard=kwargs.get("dp_shard"), tp=kwargs.get("tp"), pp=kwargs.get("pp")
            )


@pytest.mark.slow
def test_cli_proposes_and_plans_a_given_layout():
    proposal = json.loads(phalanx("plan", "70b", "--gpu", "mi300x", "--gpus", "64", "--no-trace", "--json").stdout)
    assert proposal["chosen"]["fits"] and proposal["device"] == "mi300x"
    given = json.loads(
        phalanx(
            "plan",
            "70b",
            "--gpu",
            "mi300x",
            "--gpus",
            "64",
            "--tp",
            "8",
            "--pp",
            "2",
            "--pp-schedule",
            "interleaved_1f1b",
            "--no-trace",
            "--json",
        ).stdout
    )
    layout = given["chosen"]["layout"]
    assert (layout["tp"], layout["pp"], layout["dp_shard"], layout["schedule"]) == (8, 2, 4, "interleaved_1f1b")
    assert given["chosen"]["bubble_fraction"] == pytest.approx(0.5 / (16 + 0.5))
    table = phalanx("plan", "405b", "--gpu", "mi355x", "--gpus", "512", "--no-trace").stdout
    assert "layouts considered" in table and "why not" in table and "pp send/recv" in table


@pytest.mark.parametrize(
    "args, words",
    [
        (("--tp", "3"), ["--tp 3", "--gpus 64"]),
        (("--tp", "8", "--strategy", "fsdp"), ["--strategy"]),
        (("--pp", "2", "--pp-schedule", "zigzag"), ["1f1b", "gpipe"]),
    ],
)
def test_layout_mistakes_are_one_line(args, words):
    proc = phalanx("plan", "70b", "--gpu", "mi300x", "--gpus", "64", "--no-trace", *args, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(word in lines[0] for word in words), lines[0]


def test_context_parallelism_splits_each_sequence():
    import dataclasses

    device = get_device("h100")
    job = planner.resolve_job("8b", 16, seq_len=8192)
    rows = []
    for cp in (1, 2):
        with_cp = dataclasses.replace(job, cp=cp)
        par = propose.given_layout(with_cp, dp_replicate=None, dp_shard=None, tp=2, pp=None)
        rows.append(propose.evaluate(with_cp, device, par, mfu=0.4, headroom=0.1))
    one, two = rows
    assert two["layout"]["dp_shard"] == one["layout"]["dp_shard"] // 2
    assert 0.45 < two["memory"]["activations"] / one["memory"]["activations"] < 0.55  # half of every sequence
    assert "cp K/V ring" in two["communication_bytes"] and "cp K/V ring" not in one["communication_bytes"]
    # FSDP still shards over dp_shard x cp = 8 ranks: the same resident state per rank
    assert two["memory"]["optimizer_states"] == one["memory"]["optimizer_states"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=2"], {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 1}),  # ddp: replicas, as the trainer
        (["parallel.tp=2", "parallel.strategy=fsdp"], {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}),
    ],
)
def test_a_run_configs_own_layout_is_planned(overrides, expected):
    """`phalanx plan CONFIG` with parallel.tp/pp set plans the layout the trainer would build."""
    report = json.loads(
        phalanx("plan", "demo", *overrides, "--gpu", "mi300x", "--gpus", "4", "--no-trace", "--json").stdout
    )
    chosen = report["chosen"]["layout"]
    assert {k: chosen[k] for k in expected} == expected
