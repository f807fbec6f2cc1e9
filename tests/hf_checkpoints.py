"""Small random Hugging Face checkpoints made by transformers itself, as a user's pretrained model would
come: config.json, safetensors weights (one file or shards with their index) and a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# The shape of tests/conftest.py's TINY runs, so a run can start from these checkpoints.
TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 160,
    "max_position_embeddings": 64,
}


def make_llama_checkpoint(
    out: Path,
    tokenizer_file: Path,
    *,
    tied: bool = True,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random LlamaForCausalLM over the tokenizer's vocabulary, saved with save_pretrained; its
    tokenizer beside it. Returns `out`."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    vocab = tokenizer.get_vocab_size()
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")
    config = transformers.LlamaConfig(
        **TINY_SHAPE,
        vocab_size=vocab,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # norms start at one; give them values so a norm loaded wrongly shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "model_max_length": 64})
    )
    return out


def hf_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files, by HF name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
