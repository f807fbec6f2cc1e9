"""Pipeline parallelism: the balanced split by layer, stages that compute what the whole model does under
its parameter names, refusals as one line, and through the real launcher (gloo) losses that match one
process under each schedule, exact resume, and checkpoints that reshard between pp=2 and one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.config.schema import ParallelSection
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.parallel.pipeline import (
    PipelinedModel,
    StagePlan,
    TransformerStage,
    check_pipeline,
    rank_stage_indices,
    split_layers,
)
from tests.helpers import losses_by_step, phalanx, train_json

ARGS = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)


def test_stages_are_balanced_with_embedding_and_head_counted():
    assert split_layers(4, 2) == [StagePlan(0, (0, 1), True, False), StagePlan(1, (2, 3), False, True)]
    # Six units over four stages: [embedding], [0, 1], [2], [3, head].
    assert [p.layers for p in split_layers(4, 4)] == [(), (0, 1), (2,), (3,)]
    for n_layers, n_stages in [(2, 2), (2, 4), (7, 3), (32, 8), (80, 16)]:
        plans = split_layers(n_layers, n_stages)
        costs = [len(p.layers) + p.first + p.last for p in plans]
        assert max(costs) - min(costs) <= 1, (n_layers, n_stages, costs)
        assert [i for p in plans for i in p.layers] == list(range(n_layers))  # contiguous, each layer once
        assert plans[0].first and plans[-1].last and sum(p.first + p.last for p in plans) == 2


def test_interleaved_placement_loops_over_ranks():
    assert rank_stage_indices(0, 2, 2) == [0, 2] and rank_stage_indices(1, 2, 2) == [1, 3]
    assert rank_stage_indices(3, 4, 1) == [3]


@pytest.mark.parametrize(
    "given, message",
    [
        ({"pp": 2}, None),  # tied embeddings: a copy on the first and the last stage (test_pipeline_tied.py)
        ({"pp": 4, "pp_schedule": "interleaved_1f1b", "tied": False}, "8 pipeline stages need at least 6 layers"),
        ({"pp": 2, "cp": 2, "tied": False}, "does not compose with parallel.cp"),
        ({"pp": 2, "pp_microbatches": 3, "tied": False}, "pp_microbatches=3 does not divide the micro-batch of 4"),
        ({"pp": 2, "pp_microbatches": 4, "pp_schedule": "interleaved_1f1b", "tied": False, "layers": 6}, None),
        (
            {"pp": 4, "pp_microbatches": 2, "pp_schedule": "interleaved_1f1b", "tied": False, "layers": 6},
            "multiple of parallel.pp",
        ),
    ],
)
def test_what_pipelining_refuses_is_one_line(given, message):
    given = dict(given)
    args = ModelArgs(
        **{**ARGS.__dict__, "tie_embeddings": given.pop("tied", True), "n_layers": given.pop("layers", ARGS.n_layers)}
    )
    if message is None:
        check_pipeline(args, ParallelSection(**given), micro_rows=4)
        return
    with pytest.raises(PhalanxError, match=message):
        check_pipeline(args, ParallelSection(**given), micro_rows=4)


@pytest.mark.parametrize("n_stages", [2, 3, 6])
def test_stages_chained_compute_the_whole_model_under_its_names(n_stages):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    stages = [TransformerStage(model, plan) for plan in split_layers(ARGS.n_layers, n_stages)]
    for stage in stages:
        stage.part.init_rope()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12))
    x = tokens
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(tokens))
    # Every parameter once, under the name one process gives it: seeded init and checkpoints line up.
    names = [name for stage in stages for name, _ in stage.part.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    rank0 = PipelinedModel(model, stages[0::2])
    assert {n for n, _ in rank0.named_parameters()} == {n for s in stages[0::2] for n, _ in s.part.named_parameters()}


@pytest.mark.parametrize(
    "overrides, message",
    [(["parallel.pp_microbatches=3"], "pp_microbatches=3 does not divide")],
    ids=["microbatches"],
)
def test_bad_pipelines_are_refused_before_any_rank_starts(tiny_args, overrides, message):
    proc = phalanx("train", *tiny_args, "parallel.pp=2", *overrides, "--nproc", "2", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr  # one line, from the launcher
    assert "Traceback" not in proc.stderr and "starting 2 ranks" not in proc.stdout + proc.stderr


# -- through the launcher -----------------------------------------------------------------------------


def relative_differences(a: dict[int, float], b: dict[int, float]) -> list[float]:
    assert a.keys() == b.keys() and len(a) == 10
    return [abs(a[s] - b[s]) / abs(a[s]) for s in a]


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """Ten steps on one process, untied (tied embeddings under pp: test_pipeline_tied.py)."""
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("pipeline")
    args = [*TINY, "train.max_steps=10", "model.tie_embeddings=false", f"data.sources=[{corpus}]", f"run.dir={root}"]
    summary = train_json(*args, "parallel.strategy=none", "run.name=one")
    return args, summary


def pipelined(args: list[str], name: str, *overrides: str, nproc: int = 2) -> dict:
    return train_json(*args, "parallel.pp=2", *overrides, f"run.name={name}", "--nproc", str(nproc))


@pytest.fixture(scope="module")
def pp_straight(one_process):
    """Ten uninterrupted steps with pp=2 and the default schedule (1f1b)."""
    return pipelined(one_process[0], "pp2-1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])  # interleaved: four stages in all
def test_losses_match_one_process(one_process, pp_straight, schedule):
    args, baseline = one_process
    summary = (
        pp_straight if schedule == "1f1b" else pipelined(args, f"pp2-{schedule}", f"parallel.pp_schedule={schedule}")
    )
    assert abs(summary["val_loss_start"] - baseline["val_loss_start"]) < 1e-5  # the same initial weights
    assert abs(summary["val_loss_final"] - baseline["val_loss_final"]) / baseline["val_loss_final"] < 1e-4
    diffs = relative_differences(losses_by_step(Path(baseline["run_dir"])), losses_by_step(Path(summary["run_dir"])))
    assert max(diffs) < 1e-4, diffs


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["parallel.strategy=fsdp"], ["parallel.tp=2"]], ids=["pp2-dp_shard2", "pp2-tp2"])
def test_pipeline_composes_on_four_ranks(one_process, overrides, request):
    args, baseline = one_process
    summary = pipelined(args, request.node.callspec.id, *overrides, nproc=4)
    diffs = relative_differences(losses_by_step(Path(baseline["run_dir"])), losses_by_step(Path(summary["run_dir"])))
    assert max(diffs) < 1e-4, diffs


@pytest.mark.slow
def test_pp_resume_is_exact(one_process, pp_straight):
    args, _ = one_process
    straight = pp_straight
    halted = pipelined(args, "pp-halted", "train.halt_at_step=4")
    assert halted["steps"] == 4 and halted["halted"]
    resumed = pipelined(args, "pp-halted")
    assert losses_by_step(Path(resumed["run_dir"])) == losses_by_step(Path(straight["run_dir"]))  # bit for bit


@pytest.mark.slow
def test_checkpoints_reshard_between_one_process_and_pp(one_process):
    args, baseline = one_process
    expected = losses_by_step(Path(baseline["run_dir"]))
    # Written on one process, resumed with pp=2 (each stage loads its own layers and their optimizer state).
    train_json(*args, "parallel.strategy=none", "run.name=one-to-pp", "train.halt_at_step=4")
    to_pp = pipelined(args, "one-to-pp")
    assert max(relative_differences(expected, losses_by_step(Path(to_pp["run_dir"])))) < 1e-4
    # And back: written by two stages, resumed on one process.
    pipelined(args, "pp-to-one", "train.halt_at_step=4")
    to_one = train_json(*args, "parallel.strategy=none", "run.name=pp-to-one")
    assert max(relative_differences(expected, losses_by_step(Path(to_one["run_dir"])))) < 1e-4
