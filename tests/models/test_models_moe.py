"""Mixtures of experts (models/moe.py, families mixtral and qwen3_moe) against transformers' own
implementations: small random Mixtral and Qwen3-MoE checkpoints made by transformers here load into
phalanx with the same logits within 1e-5 (float32), and phalanx's export loads into transformers with
the same logits; the grouped GEMMs equal a loop over the experts, forward and backward; the load-balancing
loss is transformers' for one layer; a tiny MoE trains through the real CLI, generates, and what it
cannot run yet is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.families import hf_config
from phalanx.models.flops import count_params
from phalanx.models.moe import MoE, imbalance
from phalanx.models.presets import MODEL_PRESETS
from phalanx.run.hf_format import read_hf_model
from tests.helpers import phalanx, read_metrics, train_json

transformers = pytest.importorskip("transformers")

SHAPE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)
MODELS = {
    "mixtral": ModelArgs(**SHAPE, family="mixtral", n_experts=4, n_experts_per_token=2, sliding_window=16),
    "qwen3_moe": ModelArgs(
        **SHAPE,
        family="qwen3_moe",
        qk_norm=True,
        head_dim=32,
        n_experts=6,
        n_experts_per_token=3,
        expert_ffn_dim=48,
        norm_topk_prob=False,
        n_dense_layers=1,
    ),
    "qwen3_moe-normalised": ModelArgs(
        **SHAPE, family="qwen3_moe", qk_norm=True, n_experts=4, n_experts_per_token=2, expert_ffn_dim=32
    ),
}


def transformers_model(args: ModelArgs, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**json.loads(json.dumps(hf_config(args, 0, 1, torch.float32))))
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_transformers_checkpoint_loads_with_its_logits(name, tmp_path):
    args = MODELS[name]
    theirs = transformers_model(args)
    theirs.save_pretrained(tmp_path)
    ours = read_hf_model(tmp_path).eval()
    assert ours.args == args
    assert ours.num_params() == count_params(args) == sum(p.numel() for p in theirs.parameters())
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_phalanx_export_loads_into_transformers_with_our_logits(name, tmp_path):
    from safetensors.torch import save_file

    from phalanx.export.hf import hf_state_dict

    args = MODELS[name]
    torch.manual_seed(2)
    ours = Transformer(args).eval()
    (tmp_path / "config.json").write_text(json.dumps(hf_config(args, 0, 1, torch.float32)))
    save_file(hf_state_dict(ours), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (1, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_grouped_gemms_equal_a_loop_over_the_experts_forward_and_backward(monkeypatch):
    torch.manual_seed(4)
    layer = MoE(dim=32, ffn_dim=48, n_experts=5, top_k=2, norm_topk_prob=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 7, 32)
    grouped_x = x.clone().requires_grad_()
    grouped = layer(grouped_x)
    grouped.backward(torch.ones_like(grouped))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    monkeypatch.delattr(torch, "_grouped_mm")  # the loop a torch without grouped GEMMs runs
    looped_x = x.clone().requires_grad_()
    looped = layer(looped_x)
    looped.backward(torch.ones_like(looped))
    torch.testing.assert_close(grouped, looped, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped_x.grad, looped_x.grad, rtol=1e-5, atol=1e-6)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
    counts = layer.routed  # both forwards' tokens, each counted for its 2 experts
    assert counts.shape == (5,) and int(counts.sum()) == 2 * 3 * 7 * 2
    assert imbalance(torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0]])) == [1.0, 4.0]


def test_the_load_balancing_loss_is_transformers_for_one_layer():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(5)
    args = ModelArgs(**{**SHAPE, "n_layers": 1}, family="mixtral", n_experts=4, n_experts_per_token=2)
    model = Transformer(args).train()
    layer = model.layers["0"].feed_forward
    seen = {}
    layer.register_forward_hook(lambda module, inputs, output: seen.setdefault("x", inputs[0]))
    model(torch.randint(0, args.vocab_size, (2, 16)))
    logits = layer.router(seen["x"].reshape(-1, args.dim))
    expected = load_balancing_loss_func((logits,), args.n_experts, args.n_experts_per_token)
    torch.testing.assert_close(layer.aux_loss, expected, rtol=1e-5, atol=1e-6)


def test_the_load_balancing_loss_joins_backward_with_its_weight():
    """BalanceGradient: a backward from the logits alone gives the router the gradient of the
    cross-entropy plus aux_loss_scale times each layer's load-balancing loss, as if they were summed."""
    torch.manual_seed(5)
    args = ModelArgs(**SHAPE, family="mixtral", n_experts=4, n_experts_per_token=2, router_aux_loss_coef=0.02)
    model = Transformer(args).train()
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    layers = [m for m in model.modules() if isinstance(m, MoE)]

    def router_grads(injected: float, added: float) -> torch.Tensor:
        model.zero_grad()
        for m in layers:
            m.aux_loss_scale = injected
        loss = model(tokens).logsumexp(-1).mean()
        (loss + added * sum(m.aux_loss for m in layers)).backward()
        return torch.cat([m.router.weight.grad.flatten() for m in layers])

    injected = router_grads(injected=0.3, added=0.0)
    torch.testing.assert_close(injected, router_grads(injected=0.0, added=0.3), rtol=1e-5, atol=1e-8)
    assert (injected - router_grads(injected=0.0, added=0.0)).abs().max() > 1e-3  # the balance counts


def test_activation_checkpointing_counts_each_routed_token_once():
    """Checkpointed blocks route again in backward (the recomputation): the counts the balance and the
    metrics read must not double."""
    from phalanx.models.moe import moe_layers
    from phalanx.parallel.apply import wrap_blocks

    args = MODEL_PRESETS["tiny-moe"]
    torch.manual_seed(0)
    model = Transformer(args).train()
    wrap_blocks(model, activation_checkpointing=True, compile=False)
    model(torch.randint(0, args.vocab_size, (2, 16))).float().logsumexp(-1).mean().backward()
    assert [int(layer.routed.sum()) for layer in moe_layers(model)] == [2 * 16 * args.n_experts_per_token] * 4


def test_presets_count_all_and_active_parameters():
    mixtral = MODEL_PRESETS["mixtral-8x7b"]
    assert count_params(mixtral) == 46_702_792_704  # Mixtral 8x7B's published 46.7B
    assert count_params(mixtral, active=True) == 12_879_925_248  # and its 12.9B active per token
    qwen = MODEL_PRESETS["qwen3-30b-a3b"]  # its card: 30.5B in total, 3.3B activated
    assert round(count_params(qwen) / 1e9, 1) == 30.5 and int(count_params(qwen, active=True) / 1e8) == 33


def test_a_tiny_moe_trains_and_what_it_cannot_run_yet_is_one_line(tiny_args):
    moe = [a for a in tiny_args if not a.startswith("model.")] + ["model.preset=tiny-moe", "model.max_seq_len=64"]
    summary = train_json(*moe)
    assert summary["val_loss_final"] < summary["val_loss_start"] - 0.3
    # Every step's routing balance: per layer the busiest of 8 experts over the mean (1 to 8 / 2 = 4).
    steps = [m for m in read_metrics(summary["run_dir"]) if "loss" in m]
    assert len(steps) == 12
    for m in steps:
        assert len(m["moe_imbalance_by_layer"]) == 4 and m["moe_imbalance"] == max(m["moe_imbalance_by_layer"])
        assert all(1.0 <= x <= 4.0 for x in m["moe_imbalance_by_layer"])
    # The serving engine decodes it (a prefill, then batched decode steps through the experts).
    text = phalanx("generate", summary["run_dir"], "ROMEO:", "--max-new-tokens", "12", "--seed", "0").stdout
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")
    proc = phalanx("train", *moe, "model.preset=deepseek-v3-tiny", "parallel.cp=2", "--nproc", "2", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [
        "error: a mixture of experts (8 experts) does not run with parallel.cp and multi-head latent attention "
        "(DeepSeek-V3) yet; context parallelism takes its experts whole on every cp rank"
    ], proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.strategy=ddp"], ["parallel.strategy=fsdp"]])
def test_a_tiny_moe_under_ddp_and_fsdp_matches_one_process(tiny_args, layout):
    """6 steps: further on, the layouts' different summation orders flip a routing decision now and then
    (measured under FSDP: 1.8e-6 relative at step 7, 5.3e-5 at step 9), which a dense model never has."""
    from tests.helpers import losses_by_step

    moe = [a for a in tiny_args if not a.startswith("model.")] + ["model.preset=tiny-moe", "model.max_seq_len=64"]
    one = losses_by_step(train_json(*moe, "run.name=moe-one", "train.max_steps=6")["run_dir"])
    two = losses_by_step(train_json(*moe, "run.name=moe-two", *layout, "train.max_steps=6", "--nproc", "2")["run_dir"])
    assert one.keys() == two.keys()
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), (step, one[step], two[step])


def test_the_planner_plans_a_mixture_of_experts_and_refuses_what_the_trainer_refuses():
    """phalanx plan models MoE blocks and expert parallelism (tests/plan/test_plan_moe.py); like the
    trainer, it refuses context parallelism with experts, in one line."""
    proc = phalanx("plan", "mixtral-8x7b", "--gpu", "mi300x", "--gpus", "8", "--no-trace", "--json")
    chosen = json.loads(proc.stdout)["chosen"]
    assert chosen["fits"] and chosen["memory"]["peak_bytes"] > 0 and chosen["tokens_per_sec"] > 0
    proc = phalanx("plan", "mixtral-8x7b", "--gpu", "mi300x", "--gpus", "8", "--cp", "2", "--ep", "2", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: a mixture of experts (8 experts) does not run")
    proc = phalanx("plan", "mixtral-8x7b", "--gpu", "mi300x", "--gpus", "8", "--cp", "2", "--no-trace", "--json")
    assert json.loads(proc.stdout)["chosen"]["layout"]["cp"] == 2


@pytest.mark.slow
def test_lora_adapts_a_mixture_of_experts_attention_and_peft_puts_it_on_transformers(tiny_args, tmp_path):
    """LoRA on a trained tiny-moe run: only the attention's adapters train (experts and router frozen),
    and peft puts the exported adapters on transformers' Mixtral (the base's HF export) with the run's
    logits. What LoRA cannot adapt yet is one line."""
    peft = pytest.importorskip("peft")
    from phalanx.run.model_loader import load_model

    moe = [a for a in tiny_args if not a.startswith("model.")] + ["model.preset=tiny-moe", "model.max_seq_len=64"]
    base = train_json(*moe, "run.name=moe-base", "train.max_steps=4")["run_dir"]
    adapt = [
        *moe,
        "run.name=moe-lora",
        f"model.pretrained={base}",
        "lora.rank=4",
        "lora.alpha=8",
        "lora.targets=attention",
    ]
    lora = train_json(*adapt, "train.max_steps=6", "train.lr=3e-3")
    assert lora["val_loss_final"] < lora["val_loss_start"]
    phalanx("export", base, "--format", "hf", "--out", str(tmp_path / "hf"))
    phalanx("export", lora["run_dir"], "--format", "peft", "--out", str(tmp_path / "peft"))
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    ours, before = load_model(lora["run_dir"]).model.eval(), load_model(base).model.eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()(tokens).logits
        torch.testing.assert_close(theirs, ours(tokens), rtol=0, atol=1e-5)
        assert (ours(tokens) - before(tokens)).abs().max() > 1e-3  # the adapters trained
    # The experts and the router as the base left them: the merged run differs in attention alone.
    merged, original = ours.state_dict(), before.state_dict()
    moved = {k for k in merged if not torch.equal(merged[k], original[k])}
    assert moved and all(".attention." in k for k in moved), sorted(moved)
    for extra, error in (
        (
            ["lora.targets=all"],
            "error: LoRA on a mixture of experts adapts its attention only (lora.targets "
            "attention, not all): the experts are stacked weights, not linear layers",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.ep=2", "--nproc", "2"],
            "error: LoRA on a mixture of experts does not run with parallel.ep yet; use FSDP or data parallelism",
        ),
    ):
        proc = phalanx("train", *adapt, *extra, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and errors == [error], proc.stderr
