"""Hugging Face export: a directory transformers loads as `LlamaForCausalLM` (and phalanx's model loader
reads back, see phalanx/run/hf_format.py).

phalanx's model computes exactly what HF's Llama computes (RoPE already in HF's rotate_half layout), so
the export only renames tensors; no weight is permuted. Files written:

  config.json             the LlamaConfig
  model.safetensors       the weights, HF names (lm_head.weight left out when tied to the embeddings)
  tokenizer.json          the run's tokenizer; encoding prepends BOS (see tokenizer_files.py)
  tokenizer_config.json   special tokens, max length and the chat template
  generation_config.json  BOS/EOS ids, so generate() stops at end of text
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from phalanx.data.tokenizer import special_ids
from phalanx.export.tokenizer_files import hf_tokenizer_config, hf_tokenizer_json
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.run.hf_format import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    hf_name,
)
from phalanx.run.model_loader import LoadedModel

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def hf_state_dict(model: Transformer, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The model's weights under HF names, in `dtype` and contiguous (as safetensors needs them). The output
    projection is left out when tied: it shares the embeddings' storage, which safetensors refuses, and HF
    re-ties it from the embeddings anyway."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and model.args.tie_embeddings:
            continue
        tensors[hf_name(name)] = tensor.detach().to("cpu", dtype).contiguous()
    return tensors


def hf_config(args: ModelArgs, bos_id: int, eos_id: int, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_size,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # Older transformers read rope_theta and rope_scaling at the top level, newer ones rope_parameters.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_theta": args.rope_theta, **(hf_rope_scaling(args) or {"rope_type": "default"})},
        "rope_scaling": hf_rope_scaling(args),
        "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": HF_DTYPE_NAMES[dtype],
    }


def hf_rope_scaling(args: ModelArgs) -> dict | None:
    """Llama 3.1 RoPE scaling as HF configs spell it (rope_type "llama3"), or None."""
    if args.rope_scaling_factor == 1:
        return None
    return {
        "rope_type": "llama3",
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


def write_hf_export(loaded: LoadedModel, out: Path, dtype: str = "f32") -> list[Path]:
    """Write the HF files of `loaded` into the (empty) directory `out`; returns the files written."""
    from safetensors.torch import save_file

    torch_dtype = TORCH_DTYPES[dtype]
    args = loaded.model.args
    bos_id, eos_id = special_ids(loaded.tokenizer)
    files = {
        CONFIG_FILE: json.dumps(hf_config(args, bos_id, eos_id, torch_dtype), indent=2),
        GENERATION_CONFIG_FILE: json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2),
        TOKENIZER_FILE: hf_tokenizer_json(loaded.tokenizer),
        TOKENIZER_CONFIG_FILE: json.dumps(hf_tokenizer_config(args.max_seq_len), indent=2),
    }
    for name, text in files.items():
        (out / name).write_text(text + "\n")
    save_file(hf_state_dict(loaded.model, torch_dtype), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    # safetensors writes its file owner-only (0600); give it the same permissions as the files beside it.
    (out / WEIGHTS_FILE).chmod((out / CONFIG_FILE).stat().st_mode & 0o777)
    return [out / name for name in (*files, WEIGHTS_FILE)]
