"""Hugging Face export of a real tiny run: transformers loads it and computes phalanx's logits; the
tokenizer and chat template come out identical; load_model reads it back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from phalanx.data.chat_template import CHAT_TEMPLATE, render_chat
from phalanx.data.tokenizer import BOS, EOS, special_ids
from phalanx.export.hf import hf_state_dict, write_hf_export
from phalanx.models.decoder import Transformer
from phalanx.run.hf_format import is_hf_export, read_chat_template
from phalanx.run.model_loader import LoadedModel, load_model
from tests.conftest import TINY
from tests.helpers import phalanx, train_json

transformers = pytest.importorskip("transformers")

# Punctuation, an apostrophe, digits, runs of spaces, newlines and non-ASCII text: the tokenizer's
# pre-tokenizer and byte fallback all take part.
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?  'Tis 1597 -- café, naïve 東京.\n\nJULIET:"
MESSAGES = [
    {"role": "system", "content": "You are a player."},
    {"role": "user", "content": "  Speak the speech, I pray you.\n"},
    {"role": "assistant", "content": "Trippingly on the tongue."},
    {"role": "user", "content": "Again!"},
]


@pytest.fixture(scope="module")
def run_dir(corpus, runs_root) -> Path:
    summary = train_json(
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={runs_root}",
        "run.name=export-hf",
        "train.max_steps=4",
        "model.max_seq_len=128",
    )
    return Path(summary["run_dir"])


@pytest.fixture(scope="module")
def export_dir(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    report = json.loads(phalanx("export", str(run_dir), "--format", "hf", "--out", str(out), "--json").stdout)
    assert sorted(report["files"]) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    return out


def phalanx_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float()


def test_files_config_and_tensor_names(run_dir, export_dir):
    loaded = load_model(run_dir)
    args = loaded.model.args
    config = json.loads((export_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        args.dim,
        args.ffn_dim,
        args.n_layers,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        args.n_heads,
        args.n_kv_heads,
        args.head_size,
    )
    assert (config["vocab_size"], config["max_position_embeddings"]) == (args.vocab_size, args.max_seq_len)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (args.rope_theta, args.norm_eps)
    assert args.tie_embeddings  # the tiny preset ties them; the untied case is tested below
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"]) == special_ids(loaded.tokenizer) == (0, 1)
    generation = json.loads((export_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)

    with safe_open(str(export_dir / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
    per_layer = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    assert names == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{p}.weight" for i in range(args.n_layers) for p in per_layer
    }
    # No permutation: phalanx's RoPE layout is HF's, so q_proj is wq as it is.
    with safe_open(str(export_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(
            f.get_tensor("model.layers.1.self_attn.q_proj.weight"),
            loaded.model.layers["1"].attention.wq.weight.detach(),
        )
        assert torch.equal(
            f.get_tensor("model.layers.0.mlp.gate_proj.weight"),
            loaded.model.layers["0"].feed_forward.w1.weight.detach(),
        )


def test_transformers_logits_match_phalanx(run_dir, export_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32).eval()
    assert type(model) is transformers.LlamaForCausalLM
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    loaded = load_model(run_dir)

    ids = tokenizer(PROMPT).input_ids
    assert ids == [0] + loaded.tokenizer.encode(PROMPT).ids  # BOS prepended, then exactly our ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].float()
    ours = phalanx_logits(loaded.model, ids)
    diff = (hf - ours).abs().max().item()
    print(f"HF f32 logits: max abs diff {diff:.3g} over {tuple(ours.shape)}, logit std {ours.std().item():.3g}")
    assert diff < 1e-4


@pytest.mark.slow
def test_tokenizer_files_and_chat_template(run_dir, export_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (BOS, EOS)
    assert tokenizer.model_max_length == load_model(run_dir).model.args.max_seq_len
    spec = json.loads((export_dir / "tokenizer.json").read_text())
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    assert {BOS, EOS} <= specials

    assert read_chat_template(export_dir) == CHAT_TEMPLATE
    for add_generation_prompt in (True, False):
        hf_text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert hf_text == render_chat(MESSAGES, BOS, add_generation_prompt=add_generation_prompt)
    # Tokenised, the rendered chat starts with exactly one BOS: the template's.
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 0 and ids[1] != 0


@pytest.mark.slow
def test_load_hf_export_round_trip(run_dir, export_dir):
    assert is_hf_export(export_dir) and not is_hf_export(run_dir)
    original, reloaded = load_model(run_dir), load_model(export_dir)
    assert reloaded.checkpoint == export_dir and reloaded.model.args == original.model.args
    # The phalanx convention survives the trip: encode() adds no BOS, callers prepend it.
    assert reloaded.tokenizer.encode(PROMPT).ids == original.tokenizer.encode(PROMPT).ids
    ids = [0] + original.tokenizer.encode(PROMPT).ids
    assert torch.equal(phalanx_logits(reloaded.model, ids), phalanx_logits(original.model, ids))


@pytest.mark.slow
def test_tied_model_shares_lm_head(export_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reloaded = load_model(export_dir).model
    assert reloaded.output.weight is reloaded.tok_embeddings.weight


@pytest.mark.slow
def test_untied_model_and_half_precision(run_dir, tmp_path):
    """An untied model keeps lm_head.weight; f32, f16 and bf16 exports all load and keep its logits."""
    loaded = load_model(run_dir)
    tokenizer, args = loaded.tokenizer, loaded.model.args
    torch.manual_seed(0)
    untied = Transformer(type(args)(**{**args.__dict__, "tie_embeddings": False})).eval()
    ids = [0] + tokenizer.encode(PROMPT).ids
    ours = phalanx_logits(untied, ids)
    for dtype, torch_dtype, tolerance in (
        ("f32", torch.float32, 1e-4),
        ("f16", torch.float16, 2e-3),
        ("bf16", torch.bfloat16, 1e-2),
    ):
        out = tmp_path / dtype
        out.mkdir()
        write_hf_export(LoadedModel(untied, tokenizer, run_dir), out, dtype)
        config = json.loads((out / "config.json").read_text())
        assert config["tie_word_embeddings"] is False and config["torch_dtype"] == str(torch_dtype)[6:]
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" in f.keys()
            assert f.get_tensor("model.embed_tokens.weight").dtype == torch_dtype
        hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (hf(torch.tensor([ids])).logits[0] - ours).abs().max().item()
        print(
            f"HF {dtype} weights (computed in f32), untied, untrained: max abs diff {diff:.3g}, "
            f"logit std {ours.std().item():.3g}"
        )
        assert diff < tolerance
        reloaded = load_model(out).model
        assert reloaded.output.weight is not reloaded.tok_embeddings.weight
        assert torch.equal(reloaded.output.weight, hf_state_dict(untied, torch_dtype)["lm_head.weight"].float())


@pytest.mark.slow
def test_force_replaces_an_existing_export(run_dir, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    refused = phalanx("export", str(run_dir), "--format", "hf", "--out", str(out), check=False)
    assert refused.returncode == 2 and (out / "stale.bin").exists()
    phalanx("export", str(run_dir), "--format", "hf", "--out", str(out), "--dtype", "bf16", "--force")
    assert not (out / "stale.bin").exists() and is_hf_export(out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left behind
