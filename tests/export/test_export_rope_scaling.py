"""Llama 3.1 RoPE scaling: phalanx's frequencies are transformers' "llama3" ones, and a scaled model
exported to HF and GGUF gives the same logits in transformers and llama.cpp as in phalanx."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rope import rope_frequency_divisors, rope_inverse_frequencies
from phalanx.run.model_loader import load_model
from tests.conftest import TINY
from tests.helpers import phalanx, train_json

# A context of 16 original positions makes the scaling bite within a short prompt.
SCALED = [
    "model.rope_scaling_factor=8",
    "model.rope_low_freq_factor=1",
    "model.rope_high_freq_factor=4",
    "model.rope_original_max_seq_len=16",
    "model.max_seq_len=128",
    "model.tie_embeddings=false",
]
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks? It is the east, and Juliet is the sun."


def test_frequencies_match_transformers_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = ModelArgs(
        dim=512,
        n_layers=1,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=64,
        vocab_size=32,
        max_seq_len=1024,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=64,
    )
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=1024, rope_theta=500000.0, rope_scaling=scaling
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inverse_frequencies(args.head_size, args.rope_theta) / rope_frequency_divisors(args)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    divisors = rope_frequency_divisors(args)
    assert divisors[0] == 1 and divisors[-1] == 8 and ((divisors > 1) & (divisors < 8)).any()  # all three regimes
    assert rope_frequency_divisors(dataclasses.replace(args, rope_scaling_factor=1.0)) is None


@pytest.fixture(scope="module")
def scaled_run(corpus, runs_root) -> Path:
    summary = train_json(
        *TINY, *SCALED, f"data.sources=[{corpus}]", f"run.dir={runs_root}", "run.name=rope-scaled", "train.max_steps=4"
    )
    return Path(summary["run_dir"])


def logits_of(model: Transformer, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().numpy()


@pytest.mark.slow
def test_hf_export_matches_transformers(scaled_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    phalanx("export", str(scaled_run), "--format", "hf", "--out", str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    loaded = load_model(scaled_run)
    ids = [0] + loaded.tokenizer.encode(PROMPT).ids
    assert len(ids) > 40
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    ours = logits_of(loaded.model, ids)
    assert np.abs(ours - theirs).max() < 1e-4
    # Without the scaling the same weights give other logits: the check above is sensitive to it.
    plain = Transformer(dataclasses.replace(loaded.model.args, rope_scaling_factor=1.0))
    plain.load_state_dict(loaded.model.state_dict())
    assert np.abs(logits_of(plain, ids) - theirs).max() > 100 * np.abs(ours - theirs).max()
    assert load_model(out).model.args == loaded.model.args  # read back, scaling included


@pytest.mark.slow
def test_gguf_export_matches_llama_cpp(scaled_run, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    out = tmp_path / "gguf"
    phalanx("export", str(scaled_run), "--format", "gguf", "--out", str(out))
    loaded = load_model(scaled_run)
    ids = [0] + loaded.tokenizer.encode(PROMPT).ids
    llm = llama_cpp.Llama(
        model_path=str(out / "model.gguf"),
        n_ctx=128,
        logits_all=True,
        n_threads=2,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    assert np.abs(logits_of(loaded.model, ids) - theirs).max() < 1e-4
