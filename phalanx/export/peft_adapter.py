"""PEFT export of a LoRA run: its adapters alone, in the layout Hugging Face's peft library saves, so that
`PeftModel.from_pretrained(base, DIR)` puts them on the base model in transformers (or a server that takes
LoRA adapters, such as vLLM, serves them) without phalanx.

phalanx's adapters are peft's: A (rank x in) and B (out x rank) on the same linear layers, scaled by
alpha / rank (models/lora.py), so the export only renames them. Files written:

  adapter_config.json         peft's LoraConfig: peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
                              lora_dropout, target_modules (HF module names: q_proj ... down_proj), bias
                              "none", base_model_name_or_path (the base checkpoint the run trained on)
  adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight and .lora_B.weight per layer
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from phalanx.models.decoder import ModelArgs
from phalanx.models.families import hf_names
from phalanx.run.model_loader import LoraAdapters

ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# peft's prefix for a causal LM's tensors: its PeftModel's base_model (a LoraModel) holds the HF model.
PEFT_PREFIX = "base_model.model."


def peft_names(args: ModelArgs, names: list[str]) -> dict[str, str]:
    """phalanx adapter name (`layers.0.attention.wq.lora_A`) -> peft's tensor name
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), through the family's HF names."""
    hf = hf_names(args)
    found = {}
    for name in names:
        module, _, matrix = name.rpartition(".")
        found[name] = f"{PEFT_PREFIX}{hf[f'{module}.weight'].removesuffix('.weight')}.{matrix}.weight"
    return found


def adapter_config(adapters: LoraAdapters, modules: list[str]) -> dict:
    """adapter_config.json: peft's LoraConfig for these adapters on HF modules `modules` (full names)."""
    lora = adapters.lora
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in modules}),
        "bias": "none",
        "base_model_name_or_path": str(lora.base),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_adapter(adapters: LoraAdapters, out: Path, dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write the adapters' PEFT files into the (empty) directory `out`; returns the files written."""
    from safetensors.torch import save_file

    names = peft_names(adapters.args, sorted(adapters.tensors))
    tensors = {names[name]: t.detach().to("cpu", dtype).contiguous() for name, t in adapters.tensors.items()}
    modules = [name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for name in tensors]
    config = out / ADAPTER_CONFIG_FILE
    config.write_text(json.dumps(adapter_config(adapters, modules), indent=2) + "\n")
    weights = out / ADAPTER_WEIGHTS_FILE
    save_file(dict(sorted(tensors.items())), str(weights), metadata={"format": "pt"})
    weights.chmod(config.stat().st_mode & 0o777)  # safetensors writes owner-only files
    return [config, weights]
