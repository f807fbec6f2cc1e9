"""Experts sharded by FSDP over the ranks that hold the same ones (parallel/expert_parallel.py,
shard_experts), on 4 real gloo ranks: ep=2 x dp_shard=4 keeps 1/4 of every expert weight on each rank
between steps, not the 1/2 that expert parallelism alone would leave, and trains as FSDP over the same 4
ranks does (the same micro-batches, so the same load-balancing losses)."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import launched

WORKER = Path(__file__).with_name("layout_worker.py")
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def trained(tmp_path: Path, parallel: dict, n_experts: int) -> list[dict]:
    """Every rank's parameters before and after 3 steps of a 2-layer Mixtral, its losses, norms and the
    numel of its local shards."""
    out = tmp_path / f"{'-'.join(f'{k}{v}' for k, v in parallel.items())}-{n_experts}.pt"
    model = {"family": "mixtral", "n_experts": n_experts, "n_experts_per_token": 2, "router_aux_loss_coef": 0.02}
    result = launched(WORKER, json.dumps(parallel), str(out), json.dumps({"model": model}), nproc=4)
    assert result.returncode == 0, f"{parallel} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("n_experts", [8, 2], ids=["whole-experts", "within-experts"])
def test_experts_are_sharded_over_their_replicas(tmp_path, n_experts):
    """8 experts: each rank keeps 2 whole ones (4 per ep rank, split by expert between its 2 replicas).
    2 experts: one per ep rank, which its replicas split along the hidden dimension."""
    fsdp = trained(tmp_path, {"strategy": "fsdp"}, n_experts)
    ep = trained(tmp_path, {"strategy": "fsdp", "ep": 2}, n_experts)
    experts = [name for name in ep[0]["local"] if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS]
    assert len(experts) == 2 * len(EXPERT_WEIGHTS)
    for rank in ep:
        for name in experts:
            assert rank["local"][name] * 4 == rank["before"][name].numel(), name
    assert ep[0]["before"].keys() == fsdp[0]["before"].keys()
    for name in fsdp[0]["before"]:
        assert torch.equal(ep[0]["before"][name], fsdp[0]["before"][name]), name
    assert ep[0]["losses"] == pytest.approx(fsdp[0]["losses"], rel=1e-5)
    assert ep[0]["norms"] == pytest.approx(fsdp[0]["norms"], rel=1e-5)
    # The update, from the gradients' mean over all 4 ranks as FSDP's. Adam divides by the gradients'
    # size, so an element whose gradient is near 0 moves by the summation order's noise: 1e-5 of the
    # 3e-2 that 3 steps at lr 1e-2 move the others. (Adam hides a gradient scaled as a whole: the norms
    # above show one.)
    for name in experts:
        torch.testing.assert_close(ep[0]["after"][name], fsdp[0]["after"][name], rtol=1e-4, atol=1e-5)
    for rank in ep[1:]:  # the replicas gathered the same whole experts
        for name in experts:
            assert torch.equal(rank["after"][name], ep[0]["after"][name]), name
