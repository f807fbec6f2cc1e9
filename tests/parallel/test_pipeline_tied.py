"""Tied embeddings under pipeline parallelism: the first stage's embedding and the last stage's output head
each hold a copy of the one weight, start equal, have their gradients summed after every backward and
stay equal, bit for bit; the gradient norm counts the weight once; checkpoints carry the keys one process
writes, so they reshard between pp and tp (or one process) both ways. Through real processes (gloo): the
layout worker trains a few steps under each layout, and the real launcher trains `model.preset=tiny`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.parallel.pipeline import (
    PipelinedModel,
    TiedEmbeddingCopy,
    TransformerStage,
    counted_in_grad_norm,
    split_layers,
)
from tests.helpers import launched, losses_by_step, read_metrics, train_json

ARGS = ModelArgs(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16, tie_embeddings=True
)
WORKER = Path(__file__).with_name("layout_worker.py")
EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


def test_the_last_stage_lists_its_copy_under_the_names_one_process_saves():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    stages = [TransformerStage(model, plan) for plan in split_layers(ARGS.n_layers, 2)]
    for stage in stages:
        stage.part.init_rope()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12))
    assert torch.equal(stages[1](stages[0](tokens)), model(tokens))  # one process: still the one weight
    first, last = PipelinedModel(model, stages[:1]), PipelinedModel(model, stages[1:])
    # The last stage's rank lists the head's weight first under the embedding's name, as one process does,
    # so its optimizer state is keyed by that name, and its model state holds both names.
    assert next(iter(last.named_parameters()))[0] == EMBEDDING
    assert isinstance(last.tok_embeddings, TiedEmbeddingCopy) and last.tok_embeddings.weight is last.output.weight
    assert first.tok_embeddings is model.tok_embeddings and first.output is None
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    assert {EMBEDDING, HEAD} <= set(last.state_dict())
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    _, saved_by_one = get_state_dict(model, torch.optim.AdamW(model.parameters()), options=options)
    _, saved_by_last = get_state_dict(last, torch.optim.AdamW(last.parameters()), options=options)
    assert f"state.{EMBEDDING}.exp_avg" in saved_by_last and f"state.{HEAD}.exp_avg" not in saved_by_last
    assert {k for k in saved_by_last if EMBEDDING in k} == {k for k in saved_by_one if EMBEDDING in k}


def test_only_the_marked_copy_is_left_out_of_the_norm():
    with torch.device("meta"):
        model = Transformer(ARGS)
    last = PipelinedModel(model, [TransformerStage(model, split_layers(ARGS.n_layers, 2)[1])])
    assert counted_in_grad_norm(last.output.weight)
    last.retie()  # what build_parallel_model does once the stage is materialised
    assert not counted_in_grad_norm(last.output.weight)
    assert all(counted_in_grad_norm(p) for name, p in last.named_parameters() if name != EMBEDDING)


# -- a few steps under each layout (the layout worker) ---------------------------------------------------


def trained(tmp_path: Path, parallel: dict, nproc: int, schedule: str = "1f1b") -> list[dict]:
    """Every rank's parameters before and after four steps of the tied worker model, its losses and norms."""
    out = tmp_path / f"tied-{len(list(tmp_path.iterdir()))}.pt"
    options = {"model": {"tie_embeddings": True}, "steps": 4, "schedule": schedule}
    result = launched(WORKER, json.dumps(parallel), str(out), json.dumps(options), nproc=nproc)
    assert result.returncode == 0, f"{parallel} on {nproc} ranks exited {result.returncode}:\n{result.stderr[-4000:]}"
    return [torch.load(f"{out}.{rank}") for rank in range(nproc)]


@pytest.fixture(scope="module")
def one_process_steps(tmp_path_factory) -> dict:
    return trained(tmp_path_factory.mktemp("tied-one"), {}, 1)[0]


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(a)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, nproc, schedule",
    [
        ({"pp": 2}, 2, "1f1b"),
        ({"pp": 2}, 2, "interleaved_1f1b"),
        ({"pp": 2, "strategy": "fsdp"}, 4, "1f1b"),
        ({"pp": 2, "tp": 2}, 4, "1f1b"),
        ({"pp": 4}, 4, "1f1b"),  # the copies on pp ranks 0 and 3: a group of their own
    ],
    ids=["pp2-1f1b", "pp2-interleaved", "pp2-dp_shard2", "pp2-tp2", "pp4"],
)
def test_copies_start_equal_and_stay_equal(one_process_steps, tmp_path, parallel, nproc, schedule):
    ranks = trained(tmp_path, parallel, nproc, schedule)
    one = one_process_steps
    # pp is the outermost mesh dimension: the first half of the ranks hold stage 0, the second the last.
    first, last = ranks[0], ranks[-1]
    assert HEAD not in first["after"] and EMBEDDING in last["after"]
    # The head's copy starts as the embedding does, which starts as one process's tied weight.
    assert torch.equal(first["before"][EMBEDDING], one["before"][EMBEDDING])
    assert torch.equal(last["before"][HEAD], one["before"][EMBEDDING])
    # Four updates later, still equal to the bit (and they did move), and its second name is the same tensor.
    assert torch.equal(first["after"][EMBEDDING], last["after"][HEAD])
    assert torch.equal(last["after"][EMBEDDING], last["after"][HEAD])
    assert not torch.equal(first["after"][EMBEDDING], first["before"][EMBEDDING])
    # As one process trains: the summed gradient is the tied one, and the norm (clip 0.5, so it acts)
    # counts the weight once, on every rank.
    last_stage_losses = [r["losses"] for r in ranks if r["losses"][0] is not None]
    for step, expected in enumerate(one["losses"]):
        mean = sum(losses[step] for losses in last_stage_losses) / len(last_stage_losses)  # dp ranks: equal halves
        assert relative(expected, mean) < 1e-4, (step, expected, mean)
    for r in ranks:
        assert max(relative(a, b) for a, b in zip(one["norms"], r["norms"])) < 1e-4, (one["norms"], r["norms"])


# -- through the launcher ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_tied(corpus, tmp_path_factory):
    """Ten steps of the tiny preset (tied embeddings) on one process."""
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("pipeline-tied")
    args = [*TINY, "model.preset=tiny", "train.max_steps=10", f"data.sources=[{corpus}]", f"run.dir={root}"]
    summary = train_json(*args, "parallel.strategy=none", "run.name=one")
    return args, summary


def by_step(run_dir: str, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in read_metrics(Path(run_dir)) if key in m}


def max_relative(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys() and len(a) == 10
    return max(relative(a[s], b[s]) for s in a)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])  # interleaved: four stages for two layers
def test_tied_losses_match_one_process(one_tied, schedule):
    args, baseline = one_tied
    summary = train_json(
        *args, "parallel.pp=2", f"parallel.pp_schedule={schedule}", f"run.name=pp2-{schedule}", "--nproc", "2"
    )
    assert abs(summary["val_loss_start"] - baseline["val_loss_start"]) < 1e-5  # the same initial weights
    assert relative(baseline["val_loss_final"], summary["val_loss_final"]) < 1e-4
    assert max_relative(by_step(baseline["run_dir"], "loss"), by_step(summary["run_dir"], "loss")) < 1e-4
    # The trainer's norm (clipped at 1.0): the tied weight counted once, not once per stage holding it.
    assert max_relative(by_step(baseline["run_dir"], "grad_norm"), by_step(summary["run_dir"], "grad_norm")) < 1e-4


@pytest.mark.slow
def test_tied_checkpoints_reshard_between_tp_and_pp(one_tied):
    args, _ = one_tied
    tp, pp = ["parallel.tp=2", "--nproc", "2"], ["parallel.pp=2", "--nproc", "2"]
    expected = losses_by_step(Path(train_json(*args, "run.name=tp-straight", *tp)["run_dir"]))
    # Written by two tensor-parallel ranks (one tied weight, split by vocabulary), resumed by two stages:
    # both copies and the optimizer state load from the embedding's keys.
    train_json(*args, "run.name=tp-to-pp", "train.halt_at_step=4", *tp)
    to_pp = train_json(*args, "run.name=tp-to-pp", *pp)
    assert to_pp["steps"] == 10
    assert max_relative(expected, losses_by_step(Path(to_pp["run_dir"]))) < 1e-4
    # And back: written by two stages, resumed by two tensor-parallel ranks.
    train_json(*args, "run.name=pp-to-tp", "train.halt_at_step=4", *pp)
    to_tp = train_json(*args, "run.name=pp-to-tp", *tp)
    assert max_relative(expected, losses_by_step(Path(to_tp["run_dir"]))) < 1e-4
