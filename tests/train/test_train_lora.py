"""LoRA (models/lora.py, `lora.rank`): the base stays bit-identical and holds no optimizer state, checkpoints
hold the adapters and name the base, training under FSDP and tensor parallelism matches one process, a
halted run resumes exactly, and what LoRA cannot run with is refused in one line. QLoRA
(lora.quantize_base) trains the same adapters on a 4-bit NF4 base."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.config.schema import TrainSection
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.lora import apply_lora, is_adapter, merge
from phalanx.run.layout import RunDir
from phalanx.run.safe_dcp import read_metadata_file
from phalanx.train.optim import build_optimizer
from phalanx.train.step import train_step
from tests.helpers import losses_by_step, phalanx, train_json
from tests.train.test_train_pretrained import (  # noqa: F401 (fixtures)
    checkpoint,
    pretrained_run,
    tied_checkpoint,
    tokenizer_file,
)

SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=32)
LORA = ["lora.rank=4", "lora.alpha=8", "train.max_steps=8", "checkpoint.interval=4", "checkpoint.memory_interval=0"]


def test_training_moves_only_the_adapters_and_merging_keeps_the_function():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SMALL, qkv_bias=True, family="qwen2"))
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapted = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets="all")
    assert len(adapted) == 2 * 7
    for name, param in model.named_parameters():  # the initialisation the build applies (adapter_rule)
        if name.endswith("lora_A"):
            torch.nn.init.normal_(param, std=0.25)
        elif name.endswith("lora_B"):
            torch.nn.init.zeros_(param)
    optimizer = build_optimizer(model, TrainSection(lr=1e-2, warmup_steps=0))
    tokens = torch.randint(0, 50, (4, 17))
    for _ in range(3):
        train_step(
            model,
            optimizer,
            [p for p in model.parameters() if p.requires_grad],
            [(tokens[:, :-1], tokens[:, 1:])],
            device=torch.device("cpu"),
            grad_clip=1.0,
        )
    for name, param in model.named_parameters():
        if is_adapter(name):
            assert param.requires_grad
        else:
            assert not param.requires_grad and torch.equal(param, base[name]), name  # bit-identical
    held = {id(p) for p in optimizer.state}
    assert held == {id(p) for n, p in model.named_parameters() if is_adapter(n)}
    assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if n.endswith("lora_B"))
    model.eval()
    with torch.no_grad():
        adapted_logits = model(tokens)
        merged_logits = merge(model)(tokens)
    assert not any(is_adapter(n) for n, _ in model.named_parameters())
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_lora_run_checkpoints_its_adapters_names_its_base_and_resumes_exactly(tiny_args, tied_checkpoint):  # noqa: F811
    """On a tied checkpoint (Llama 3.2's): the frozen head is saved under neither of its names."""
    args = [*pretrained_run(tiny_args, tied_checkpoint), *LORA]
    whole = train_json(*args, "run.name=lora-whole")
    run = RunDir(Path(whole["run_dir"]))
    step = sorted(run.checkpoints.glob("step_*"))[-1]
    keys = read_metadata_file(step / ".metadata").state_dict_metadata
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(is_adapter(k) for k in model_keys), sorted(model_keys)[:5]
    trainer = json.loads((step / "trainer.json").read_text())
    assert trainer["lora"]["rank"] == 4 and trainer["base"]["path"] == str(tied_checkpoint.absolute())
    assert trainer["base"]["sha256"] == json.loads(run.pretrained.read_text())["sha256"]
    halted = [*args, "run.name=lora-halted"]
    assert train_json(*halted, "train.halt_at_step=4")["steps"] == 4
    resumed = train_json(*halted)
    assert losses_by_step(resumed["run_dir"]) == losses_by_step(whole["run_dir"])  # the base read again, exactly


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.strategy=fsdp"], ["parallel.tp=2"]])
def test_lora_under_fsdp_and_tensor_parallelism_matches_one_process(tiny_args, checkpoint, layout):  # noqa: F811
    args = [*pretrained_run(tiny_args, checkpoint), *LORA]
    one = train_json(*args, "run.name=lora-one")
    two = train_json(*args, "run.name=lora-two", *layout, "--nproc", "2")
    a, b = losses_by_step(one["run_dir"]), losses_by_step(two["run_dir"])
    assert a.keys() == b.keys()
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), (step, a[step], b[step])


def test_lora_without_a_pretrained_model_is_refused_in_one_line(tiny_args):
    proc = phalanx("train", *tiny_args, "lora.rank=4", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [
        "error: lora.rank needs model.pretrained: LoRA adapts a pretrained model's weights"
    ], proc.stderr


QLORA = [*LORA, "lora.quantize_base=true"]


@pytest.mark.slow
def test_qlora_trains_adapters_on_a_4_bit_base_resumes_exactly_and_runs_under_ddp(tiny_args, checkpoint):  # noqa: F811
    args = [*pretrained_run(tiny_args, checkpoint), *QLORA]
    proc = phalanx("train", *args, "run.name=qlora-whole", "--json")
    assert "frozen weights quantized to 4-bit NF4" in proc.stderr and "W1205" not in proc.stderr
    whole = json.loads(proc.stdout.strip().splitlines()[-1])
    full = train_json(*pretrained_run(tiny_args, checkpoint), *LORA, "run.name=lora-full-base")
    # The same adapters on the 4-bit base: close to the full-precision base's losses, not equal to them.
    q, f = losses_by_step(whole["run_dir"]), losses_by_step(full["run_dir"])
    assert q[1] != f[1] and q[1] == pytest.approx(f[1], rel=0.05)
    assert q[max(q)] < q[1]
    run = RunDir(Path(whole["run_dir"]))
    step = sorted(run.checkpoints.glob("step_*"))[-1]
    keys = read_metadata_file(step / ".metadata").state_dict_metadata
    assert all(is_adapter(k) for k in keys if k.startswith("model.")), sorted(keys)[:5]
    halted = [*args, "run.name=qlora-halted"]
    assert train_json(*halted, "train.halt_at_step=4")["steps"] == 4
    resumed = train_json(*halted)
    assert losses_by_step(resumed["run_dir"]) == q  # the base read and quantized again, exactly
    ddp = losses_by_step(train_json(*args, "run.name=qlora-ddp", "--nproc", "2")["run_dir"])
    assert ddp.keys() == q.keys() and all(ddp[s] == pytest.approx(q[s], rel=1e-5) for s in q), (ddp, q)

    # Served, the adapters go onto the pretrained weights themselves (the model loader merges them).
    from phalanx.run.model_loader import load_model

    assert not any(is_adapter(n) for n in load_model(run.path).model.state_dict())


def test_qlora_is_refused_in_one_line_where_it_cannot_run(tiny_args, checkpoint, tmp_path):  # noqa: F811
    args = [*pretrained_run(tiny_args, checkpoint), *QLORA]
    proc = phalanx("train", *args, "parallel.tp=2", "--nproc", "2", check=False)
    assert proc.returncode == 2 and "error: lora.quantize_base (QLoRA) runs on one process or with data" in proc.stderr
    # Where torchao is not installed (here: hidden behind a package of that name that fails to import).
    hidden = tmp_path / "hide" / "torchao"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('torchao is hidden from this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{hidden.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "train", *args], capture_output=True, text=True, env=env, timeout=300
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: lora.quantize_base needs torchao's NF4, and torchao is not installed")
