"""Hugging Face export: a directory transformers loads as `LlamaForCausalLM`, and the way back into phalanx.

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
from phalanx.errors import PhalanxError
from phalanx.export.tokenizer_files import hf_tokenizer_config, hf_tokenizer_json, phalanx_tokenizer
from phalanx.models.llama import ModelArgs, Transformer
from phalanx.serve.generate import LoadedModel

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# phalanx parameter name (per layer: without the "layers.N." prefix) -> HF name
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    """The HF name of a phalanx parameter (`layers.3.attention.wq.weight` -> `model.layers.3.self_attn...`)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


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
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # Older transformers read rope_theta at the top level, newer ones rope_parameters.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_scaling": None,
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


def write_hf_export(loaded: LoadedModel, out: Path, dtype: str = "f32") -> list[Path]:
    """Write the HF files of `loaded` into the (empty) directory `out`; returns the files written."""
    from safetensors.torch import save_file

    torch_dtype = TORCH_DTYPES[dtype]
    args = loaded.model.args
    bos_id, eos_id = special_ids(loaded.tokenizer)
    files = {
        CONFIG_FILE: json.dumps(hf_config(args, bos_id, eos_id, torch_dtype), indent=2),
        "generation_config.json": json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2),
        "tokenizer.json": hf_tokenizer_json(loaded.tokenizer),
        TOKENIZER_CONFIG_FILE: json.dumps(hf_tokenizer_config(args.max_seq_len), indent=2),
    }
    for name, text in files.items():
        (out / name).write_text(text + "\n")
    save_file(hf_state_dict(loaded.model, torch_dtype), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    # safetensors writes its file owner-only (0600); give it the same permissions as the files beside it.
    (out / WEIGHTS_FILE).chmod((out / CONFIG_FILE).stat().st_mode & 0o777)
    return [out / name for name in (*files, WEIGHTS_FILE)]


# ---- reading an export back ----

def is_hf_export(path: Path) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def read_chat_template(path: Path) -> str | None:
    """The chat template in an export's tokenizer_config.json, or None if it has none."""
    try:
        template = json.loads((Path(path) / TOKENIZER_CONFIG_FILE).read_text()).get("chat_template")
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PhalanxError(f"{path}/{TOKENIZER_CONFIG_FILE} is not valid JSON") from None
    return template if isinstance(template, str) and template else None


def model_args_from_hf_config(config: dict, where: Path) -> ModelArgs:
    """phalanx ModelArgs for a LlamaConfig dict; refuses the Llama variants phalanx's model cannot run."""
    if config.get("model_type") != "llama":
        raise PhalanxError(f"{where} is a {config.get('model_type')!r} model; phalanx loads model_type 'llama'")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if config.get(k)]
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config['hidden_act']}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope_type={rope.get('rope_type', rope.get('type'))}")
    try:
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        if (config.get("head_dim") or dim // n_heads) != dim // n_heads:  # null means the default
            unsupported.append(f"head_dim={config['head_dim']} (phalanx needs hidden_size / num_attention_heads)")
        if unsupported:
            raise PhalanxError(f"{where} uses Llama features phalanx does not support: {', '.join(unsupported)}")
        return ModelArgs(
            dim=dim, n_layers=config["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads", n_heads), ffn_dim=config["intermediate_size"],
            vocab_size=config["vocab_size"], max_seq_len=config["max_position_embeddings"],
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise PhalanxError(f"{where}/{CONFIG_FILE} lacks {e.args[0]!r}") from None


def load_hf_export(path: Path, device: torch.device | str = "cpu") -> LoadedModel:
    """A phalanx model (float32) and tokenizer from an HF Llama directory such as `phalanx export` writes.
    Weights come from model.safetensors only (never pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not is_hf_export(path):
        raise PhalanxError(f"{path} is not a Hugging Face export (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PhalanxError(f"{path}/{CONFIG_FILE} is not valid JSON") from None
    args = model_args_from_hf_config(config, path)
    try:
        hf_tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise PhalanxError(f"{path}/{WEIGHTS_FILE} could not be read: {e}") from None

    with torch.device("meta"):
        model = Transformer(args)
    ours = {hf_name(name): name for name in model.state_dict()}
    if args.tie_embeddings:
        ours.pop("lm_head.weight")
    missing, unexpected = sorted(set(ours) - set(hf_tensors)), sorted(set(hf_tensors) - set(ours))
    if missing or unexpected:
        raise PhalanxError(f"{path}/{WEIGHTS_FILE} does not match its config: "
                           f"missing {missing[:3] or 'none'}, unexpected {unexpected[:3] or 'none'}")
    state = {ours[hf]: tensor.float() for hf, tensor in hf_tensors.items()}
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.to_empty(device="cpu")
    model.init_weights()  # rebuilds the RoPE tables (buffers, not in the file) and re-ties the output
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise PhalanxError(f"{path}/{WEIGHTS_FILE} does not match its config: {str(e).splitlines()[-1].strip()}") \
            from None
    return LoadedModel(model.to(device).eval(), phalanx_tokenizer(path), path)
