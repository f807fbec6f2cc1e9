"""Named model shapes. The Llama ones match Meta's published configs (1b, 8b and 70b without the RoPE
scaling of their Llama 3.1/3.2 versions, at 8K context; 405b is Llama 3.1's, scaling and 128K included)."""

import difflib

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.preset_names import PRESET_NAMES

MODEL_PRESETS: dict[str, ModelArgs] = {
    # Small enough to train a few hundred steps on two CPU cores.
    "tiny": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=768,
        vocab_size=4096,
        max_seq_len=256,
        rope_theta=10000.0,
        tie_embeddings=True,
    ),
    # GPT-2 small's size; vocab 50304 is GPT-2's 50257 rounded up to a multiple of 128 for fast matmuls.
    "125m": ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=2048,
        vocab_size=50304,
        max_seq_len=2048,
        rope_theta=10000.0,
        tie_embeddings=True,
    ),
    # Llama 3.2 1B.
    "1b": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    # Llama 3 8B.
    "8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    # Llama 3 70B.
    "70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    # Llama 3.1 405B, with its RoPE scaling for 128K tokens of context.
    "405b": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        tie_embeddings=False,
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=8192,
    ),
}

assert tuple(MODEL_PRESETS) == PRESET_NAMES, "preset_names.py lists the presets' names"


def get_preset(name: str) -> ModelArgs:
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    valid = ", ".join(MODEL_PRESETS)
    close = difflib.get_close_matches(name.lower(), MODEL_PRESETS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise PhalanxError(f"unknown model preset '{name}': {hint}valid presets are {valid}")
