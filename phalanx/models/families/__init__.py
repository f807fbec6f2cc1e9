"""The Hugging Face architectures phalanx reads and writes: Llama, Mistral, Qwen2 and Qwen3, and the
mixtures of experts Mixtral, Qwen3-MoE and DeepSeek-V3.

All are Llama's decoder (models/decoder.py) with a few additions that ModelArgs switches on (DeepSeek-V3's
attention is one: models/mla.py). Each
family's module says how its config.json maps to ModelArgs and back and which tensors it adds to the
shared ones (common.py). This module is the one entry point: from a config to ModelArgs, from ModelArgs
to a config, and the tensor names between phalanx's state dict and an HF file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.families import common, deepseek_v3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from phalanx.models.families.common import expert_slice, state_name

__all__ = ["args_from_hf_config", "expert_slice", "hf_config", "hf_names", "state_name", "unused_tensors"]

# model_type (phalanx's ModelArgs.family) -> its module
_MODULES = {module.MODEL_TYPE: module for module in (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3)}
SUPPORTED_ARCHITECTURES = tuple(module.ARCHITECTURE for module in _MODULES.values())


def _family_of_config(config: dict, where: Path):
    """The family module of an HF config, by model_type (as transformers' AutoConfig picks the class)
    with `architectures` agreeing: another head on the same decoder (e.g. LlamaForSequenceClassification)
    has other tensors and another meaning."""
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    module = _MODULES.get(model_type)
    if module is None and model_type is None and len(architectures) == 1:
        module = next((m for m in _MODULES.values() if m.ARCHITECTURE == architectures[0]), None)
    if module is None or any(name != module.ARCHITECTURE for name in architectures):
        named = ", ".join(map(str, architectures)) or "no architectures"
        kind = f"a {model_type!r} model" if model_type is not None else "a model without a model_type"
        raise PhalanxError(
            f"{where}/{common.CONFIG_FILE} is {kind} ({named}); phalanx runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return module


def args_from_hf_config(config: dict, where: Path) -> ModelArgs:
    """phalanx ModelArgs for the config.json (as a dict) of the HF directory `where`; refuses, in one line,
    an architecture phalanx does not run and any setting its model cannot compute."""
    if not isinstance(config, dict):
        raise PhalanxError(f"{where}/{common.CONFIG_FILE} is not a JSON object")
    module = _family_of_config(config, Path(where))
    file = f"{where}/{common.CONFIG_FILE}"
    try:
        rope_types = getattr(module, "ROPE_TYPES", common.ROPE_TYPES)
        found = common.unsupported(config, rope_types) + module.unsupported(config)
        if found:
            raise PhalanxError(f"{file} uses {module.ARCHITECTURE} features phalanx cannot run: {', '.join(found)}")
        fields = {**common.read_args(config), **module.read_args(config)}
    except KeyError as e:
        raise PhalanxError(f"{file} lacks {e.args[0]!r}") from None
    except common.ConfigValueError as e:
        raise PhalanxError(f"{file}: {e}") from None
    try:
        return ModelArgs(family=module.MODEL_TYPE, **fields)
    except PhalanxError as e:  # the shape itself is impossible (ModelArgs.validate)
        raise PhalanxError(f"{file}: {e}") from None


def _family_of_args(args: ModelArgs):
    module = _MODULES[args.family]
    found = module.inexpressible(args)
    if args.n_experts and not hasattr(module, "MOE_NAMES"):
        found.append(f"{args.n_experts} experts (families mixtral, qwen3_moe and deepseek_v3 have them)")
    elif common.deepseek_routing(args) and "expert_bias" not in getattr(module, "MOE_NAMES", {}):
        found.append("DeepSeek-V3's routing (sigmoid scores, expert groups, shared experts or scaled weights)")
    if args.attention == "mla" and getattr(module, "ATTENTION", "gqa") != "mla":
        found.append("multi-head latent attention (family deepseek_v3 has it)")
    if found:
        raise PhalanxError(
            f"a model of family {args.family!r} cannot be written as {module.ARCHITECTURE} with "
            f"{', '.join(found)}; set model.family to match"
        )
    return module


def hf_config(args: ModelArgs, bos_id: int, eos_id: int, dtype: torch.dtype) -> dict:
    """config.json of the family's HF architecture for a model of `args`, its weights stored in `dtype`."""
    module = _family_of_args(args)
    config = common.write_config(args, module.MODEL_TYPE, module.ARCHITECTURE, bos_id, eos_id, dtype)
    return config | module.write_config(args)


def hf_names(args: ModelArgs) -> dict[str, str]:
    """phalanx name -> HF tensor name, for every tensor the HF file holds (output.weight left out when
    tied to the embedding). An MoE expert's projection is named with its index, `layers.0.feed_forward.w1[3]`:
    expert_slice(state, name) is the tensor any of these names names, state_name(name) its state-dict key."""
    module = _family_of_args(args)
    layer_names = module.layer_names(args) if hasattr(module, "layer_names") else module.LAYER_NAMES
    return common.tensor_names(args, layer_names, getattr(module, "MOE_NAMES", None))


def unused_tensors(args: ModelArgs, names) -> set[str]:
    """Of an HF file's tensor names, those its family stores beside the model and phalanx leaves unread,
    as transformers does: DeepSeek-V3's multi-token-prediction module (deepseek_v3.py)."""
    unused = getattr(_MODULES[args.family], "unused_tensor", None)
    return {name for name in names if unused is not None and unused(args, name)}
