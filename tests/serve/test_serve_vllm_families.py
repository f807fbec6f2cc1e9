"""The vLLM engine serves every family phalanx exports: the same greedy tokens as phalanx's own engine on
the same Hugging Face export of a Qwen2 (q/k/v biases), a Qwen3 (q/k norms, a head_dim of its own), a
Mistral (a sliding window shorter than prompt and reply), a Mixtral and a Qwen3-MoE model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from phalanx.models.decoder import ModelArgs, Transformer

pytestmark = pytest.mark.slow  # needs .venv-vllm (scripts/setup_vllm.sh), and starts vLLM: tens of seconds

ARGS = ModelArgs(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=384, max_seq_len=256)
FAMILIES = {
    "qwen2": {"family": "qwen2", "qkv_bias": True},
    "qwen3": {"family": "qwen3", "qk_norm": True, "head_dim": 32},
    "mistral": {"family": "mistral", "sliding_window": 12},
    # Mixtures of experts: vLLM's fused MoE against phalanx's grouped GEMMs.
    "mixtral": {"family": "mixtral", "n_experts": 4, "n_experts_per_token": 2},
    "qwen3_moe": {
        "family": "qwen3_moe",
        "qk_norm": True,
        "head_dim": 32,
        "n_experts": 4,
        "n_experts_per_token": 2,
        "expert_ffn_dim": 64,
    },
}
TEXTS = ["ROMEO: wherefore art thou", "JULIET:\nO Romeo, Romeo!"]
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: make it with scripts/setup_vllm.sh")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_gives_phalanx_engines_greedy_tokens(family, tokenizer, tmp_path):
    from phalanx.export.hf import write_hf_export
    from phalanx.run.model_loader import LoadedModel

    args = ModelArgs(**{**ARGS.__dict__, **FAMILIES[family]})
    torch.manual_seed(0)
    model = Transformer(args).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1: give them values that matter
        for name, p in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.2)
    write_hf_export(LoadedModel(model, tokenizer, tmp_path), tmp_path)
    prompts = [[0] + tokenizer.encode(text).ids for text in TEXTS]
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_family_checks.py")), str(tmp_path), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    for ours, theirs in zip(runs["torch"], runs["vllm"]):
        assert ours["finish"] == theirs["finish"] == "length"
        assert theirs["tokens"] == ours["tokens"]
        assert max(abs(a - b) for a, b in zip(ours["logprobs"], theirs["logprobs"])) < 1e-3
