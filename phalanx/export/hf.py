"""Hugging Face export: a directory transformers loads as the model's own architecture (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM, by ModelArgs.family), and phalanx's model
loader reads back (phalanx/run/hf_format.py).

phalanx's model computes exactly what HF's computes (RoPE already in HF's rotate_half layout), so the
export only renames tensors (models/families/); no weight is permuted. Files written:

  config.json             the family's config
  model.safetensors       the weights, HF names (lm_head.weight left out when tied to the embeddings);
                          above max_shard_bytes, shards model-00001-of-0000N.safetensors instead, with
                          model.safetensors.index.json naming each tensor's shard (HF's layout)
  tokenizer.json          the model's tokenizer; encoding prepends BOS where it has one (tokenizer_files.py)
  tokenizer_config.json   special tokens, max length and the chat template (a checkpoint's own, for a
                          model that came from one)
  generation_config.json  BOS and stop ids, so generate() stops at end of text (or of a turn)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from phalanx.data.tokenizer import hf_tokenizer_config
from phalanx.errors import PhalanxError
from phalanx.export.tokenizer_files import hf_generation_config, hf_tokenizer_json
from phalanx.models.decoder import Transformer
from phalanx.models.families import expert_slice, hf_config, hf_names
from phalanx.run.hf_format import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
)
from phalanx.run.model_loader import LoadedModel

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# HF's default shard size ("5GB", decimal): small enough for its hub and for loading one shard at a time.
MAX_SHARD_BYTES = 5 * 10**9


def hf_state_dict(model: Transformer, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The model's weights under HF names, in `dtype` and contiguous (as safetensors needs them). The output
    projection is left out when tied: it shares the embeddings' storage, which safetensors refuses, and HF
    re-ties it from the embeddings anyway."""
    state = model.state_dict()
    return {theirs: _hf_tensor(expert_slice(state, ours), dtype) for ours, theirs in hf_names(model.args).items()}


def _hf_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().to("cpu", dtype).contiguous()


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names (in order) grouped into shards of at most max_shard_bytes each, filled in order as HF
    does; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def shard_file(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_weights(model: Transformer, out: Path, dtype: torch.dtype, max_shard_bytes: int) -> list[str]:
    """The weights as model.safetensors, or as shards and their index above max_shard_bytes; returns the
    file names. Tensors are converted one shard at a time, so at most a shard's worth is copied at once."""
    from safetensors.torch import save_file

    state, names = model.state_dict(), hf_names(model.args)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {theirs: expert_slice(state, ours).numel() * itemsize for ours, theirs in names.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    ours = {theirs: name for name, theirs in names.items()}
    files = [WEIGHTS_FILE] if len(plan) == 1 else [shard_file(i, len(plan)) for i in range(len(plan))]
    for file, shard in zip(files, plan):
        tensors = {name: _hf_tensor(expert_slice(state, ours[name]), dtype) for name in shard}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values()), "total_parameters": model.num_params()},
            "weight_map": {name: file for file, shard in zip(files, plan) for name in shard},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_FILE)
    return files


def write_hf_export(
    loaded: LoadedModel, out: Path, dtype: str = "f32", max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """Write the HF files of `loaded` into the (empty) directory `out`; returns the files written."""
    if max_shard_bytes <= 0:
        raise PhalanxError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    torch_dtype = TORCH_DTYPES[dtype]
    args = loaded.model.args
    specials = loaded.specials
    # first: refuses a model its family cannot express
    config = hf_config(args, specials.bos_id, specials.eos_id, torch_dtype)
    files = {
        CONFIG_FILE: json.dumps(config, indent=2),
        GENERATION_CONFIG_FILE: json.dumps(hf_generation_config(specials), indent=2),
        TOKENIZER_FILE: hf_tokenizer_json(loaded.tokenizer),
        TOKENIZER_CONFIG_FILE: json.dumps(
            hf_tokenizer_config(args.max_seq_len, specials, loaded.chat_template), indent=2
        ),
    }
    for name, text in files.items():
        (out / name).write_text(text + "\n")
    weights = write_weights(loaded.model, out, torch_dtype, max_shard_bytes)
    # safetensors writes its files owner-only (0600); give them the same permissions as the files beside them.
    for name in weights:
        (out / name).chmod((out / CONFIG_FILE).stat().st_mode & 0o777)
    return [out / name for name in (*files, *weights)]
