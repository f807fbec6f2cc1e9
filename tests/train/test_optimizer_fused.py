"""The trainer's AdamW runs torch's fused kernel where torch has one, and optimizer state saved by the
per-tensor implementation (every checkpoint written before fused was chosen) resumes on the fused one."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from phalanx.config.schema import TrainSection
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.parallel.distributed import DistEnv
from phalanx.train.checkpoint import Checkpointer
from phalanx.train.optim import adamw_implementation, build_optimizer

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
ENV = DistEnv(0, 1, 0, torch.device("cpu"), None)
TRAIN = TrainSection(seq_len=8, micro_batch_size=2, global_batch_size=2)


def model_(seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ARGS)
    model.init_weights()
    return model


def step(model: Transformer, optimizer: torch.optim.Optimizer, seed: int) -> None:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def ran_fused_kernel(model: Transformer, optimizer: torch.optim.Optimizer) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, optimizer, seed=99)
    return any(event.key == "aten::_fused_adamw_" for event in prof.key_averages())


def test_fused_where_torch_has_the_kernel_default_elsewhere():
    model = model_(0)
    optimizer = build_optimizer(model, TRAIN)
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]
    assert ran_fused_kernel(model, optimizer)
    with torch.device("meta"):  # no fused kernel for meta tensors: torch's default, which builds there
        assert adamw_implementation(list(Transformer(ARGS).parameters())) == {}
    assert adamw_implementation([torch.zeros(2, dtype=torch.int64)]) == {}


def test_per_tensor_adamw_checkpoint_resumes_on_the_fused_one(tmp_path):
    old_model = model_(0)
    groups = build_optimizer(old_model, TRAIN).param_groups  # the same groups, as before fused was chosen
    old = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
        lr=TRAIN.lr,
        betas=(TRAIN.beta1, TRAIN.beta2),
        eps=1e-8,
    )
    assert not old.param_groups[0]["fused"]
    for seed in range(3):
        step(old_model, old, seed)
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=2, env=ENV)
    saved = checkpointer.save(3, old_model, old, {"model_args": ARGS.__dict__})

    model = model_(1)
    optimizer = build_optimizer(model, TRAIN)
    checkpointer.load(saved, model, optimizer)
    # The saved groups said "not fused": the optimizer keeps the implementation it was built with.
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in old.param_groups]
    for p, q in zip(old_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(old.state[p][key], optimizer.state[q][key]), key
    assert ran_fused_kernel(model, optimizer)  # the resumed step is the fused kernel's
    step(old_model, old, seed=99)  # the same step on the per-tensor implementation: the same update to rounding
    for p, q in zip(old_model.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
