"""Layouts: the mesh from the config, identical initial weights under every layout (meta-device build,
materialised shard by shard), and training losses that match one process through the real launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.config.schema import ParallelSection
from phalanx.errors import PhalanxError
from phalanx.parallel.mesh import Layout, resolve_layout
from tests.helpers import launched, losses_by_step, train_json

WORKER = Path(__file__).with_name("layout_worker.py")


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ({}, 1, Layout(1, 1, 1)),
        ({"strategy": "ddp"}, 4, Layout(4, 1, 1)),
        ({"strategy": "fsdp"}, 4, Layout(1, 4, 1)),
        ({"tp": 2}, 4, Layout(2, 1, 2)),
        ({"tp": 2, "strategy": "fsdp"}, 8, Layout(1, 4, 2)),
        ({"dp_replicate": 2, "dp_shard": -1}, 8, Layout(2, 4, 1)),
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 8, Layout(2, 2, 2)),
        ({"pp": 2, "strategy": "fsdp"}, 4, Layout(1, 2, 1, pp=2)),
        ({"pp": 2, "cp": 2, "tp": 2}, 16, Layout(2, 1, 2, pp=2, cp=2)),
    ],
)
def test_layout_from_config(given, world, expected):
    assert resolve_layout(ParallelSection(**given), world) == expected


@pytest.mark.parametrize(
    "given, world, message",
    [
        ({"tp": 3}, 4, r"parallel.pp=1 x cp=1 x tp=3 = 3 does not divide the world size 4"),
        ({"pp": 2, "tp": 2}, 6, r"parallel.pp=2 x cp=1 x tp=2 = 4 does not divide the world size 6"),
        ({"dp_replicate": 2, "dp_shard": 3}, 8, "does not multiply to the world size 8"),
        ({"dp_shard": 3}, 4, "does not multiply to the world size 4"),
    ],
)
def test_layouts_that_do_not_fit_are_named(given, world, message):
    with pytest.raises(PhalanxError, match=message):
        resolve_layout(ParallelSection(**given), world)


def build(tmp_path: Path, parallel: dict, nproc: int) -> dict[str, torch.Tensor]:
    out = tmp_path / f"params-{len(list(tmp_path.iterdir()))}.pt"
    result = launched(WORKER, json.dumps(parallel), str(out), nproc=nproc)
    assert result.returncode == 0, f"{parallel} on {nproc} ranks exited {result.returncode}:\n{result.stderr[-4000:]}"
    merged: dict[str, torch.Tensor] = {}
    for rank in range(nproc):  # every rank's share: pipeline stages hold different parameters
        merged.update(torch.load(f"{out}.{rank}"))
    return merged


@pytest.mark.slow
def test_every_layout_starts_from_the_same_weights(tmp_path):
    one = build(tmp_path, {}, 1)
    for parallel, nproc in [
        ({"strategy": "ddp"}, 2),
        ({"strategy": "fsdp"}, 2),
        ({"tp": 2}, 2),
        ({"pp": 2}, 2),
        ({"cp": 2}, 2),
        ({"tp": 2, "strategy": "fsdp"}, 4),
    ]:
        other = build(tmp_path, parallel, nproc)
        assert other.keys() == one.keys()
        different = [k for k in one if not torch.equal(one[k], other[k])]
        assert not different, f"{parallel}: {different}"


def relative_differences(a: dict[int, float], b: dict[int, float]) -> list[float]:
    assert a.keys() == b.keys()
    return [abs(a[s] - b[s]) / abs(a[s]) for s in a]


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("layouts")
    args = [*TINY, "train.max_steps=10", f"data.sources=[{corpus}]", f"run.dir={root}", "parallel.strategy=none"]
    summary = train_json(*args, "run.name=one")
    return args, summary


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, nproc",
    [(["parallel.tp=2"], 2), (["parallel.tp=2", "parallel.strategy=fsdp"], 4)],
    ids=["tp2", "dp_shard2-tp2"],
)
def test_losses_match_one_process(one_process, overrides, nproc, request):
    args, baseline = one_process
    args = [a for a in args if a != "parallel.strategy=none"]
    summary = train_json(*args, *overrides, f"run.name={request.node.callspec.id}", "--nproc", str(nproc))
    assert abs(summary["val_loss_start"] - baseline["val_loss_start"]) < 1e-5  # the same initial weights
    diffs = relative_differences(losses_by_step(Path(baseline["run_dir"])), losses_by_step(Path(summary["run_dir"])))
    assert max(diffs) < 1e-4, diffs


@pytest.mark.slow
def test_tp_resume_is_exact_and_reshards_to_one_process(one_process):
    args, baseline = one_process
    args = [a for a in args if a != "parallel.strategy=none"]
    straight = train_json(*args, "parallel.tp=2", "run.name=tp-straight", "--nproc", "2")
    train_json(*args, "parallel.tp=2", "run.name=tp-halted", "train.halt_at_step=4", "--nproc", "2")
    resumed = train_json(*args, "parallel.tp=2", "run.name=tp-halted", "--nproc", "2")
    assert losses_by_step(Path(resumed["run_dir"])) == losses_by_step(Path(straight["run_dir"]))  # bit for bit

    # A checkpoint written by tp=2 ranks resumes on one process, continuing within float noise.
    train_json(*args, "parallel.tp=2", "run.name=tp-to-one", "train.halt_at_step=4", "--nproc", "2")
    one = train_json(*args, "parallel.strategy=none", "run.name=tp-to-one")
    diffs = relative_differences(losses_by_step(Path(straight["run_dir"])), losses_by_step(Path(one["run_dir"])))
    assert max(diffs) < 1e-4, diffs
