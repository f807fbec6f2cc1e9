"""Checkpoints keep loading across the optimizer-state layout change: flattened by parameter name now
(pipeline stages hold different parameters), lists of groups before."""

from __future__ import annotations

import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.parallel.distributed import DistEnv
from phalanx.run.layout import TRAINER_STATE
from phalanx.train.checkpoint import Checkpointer, state_dict_options

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
ENV = DistEnv(0, 1, 0, torch.device("cpu"), None)


def trained(seed: int) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Transformer(ARGS)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer


def test_both_optimizer_layouts_load(tmp_path):
    model, optimizer = trained(0)
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=3, env=ENV)
    saved = checkpointer.save(1, model, optimizer, {"model_args": ARGS.__dict__})
    assert state_dict_options(saved).flatten_optimizer_state_dict is True

    listed = tmp_path / "listed"  # the same state as written before the change
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=listed)
    shutil.copy(saved / TRAINER_STATE, listed / TRAINER_STATE)
    assert state_dict_options(listed).flatten_optimizer_state_dict is False

    for path in (saved, listed):
        fresh, fresh_optimizer = trained(1)
        checkpointer.load(path, fresh, fresh_optimizer)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            assert torch.equal(a, b)
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(optimizer.state[p]["exp_avg_sq"], fresh_optimizer.state[q]["exp_avg_sq"])
