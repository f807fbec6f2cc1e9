"""The Hugging Face directory format as both sides see it: tensor names, file names and reading one back.

phalanx's model computes exactly what HF's Llama computes (RoPE already in HF's rotate_half layout), so
the two differ only in tensor names. phalanx/export/hf.py writes such a directory; this module reads
one (phalanx's own export, or a Llama checkpoint from elsewhere) for the model loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from phalanx.data.tokenizer import special_ids
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

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
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The HF name of a phalanx parameter (`layers.3.attention.wq.weight` -> `model.layers.3.self_attn...`)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


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
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope_type={rope_type}")
    scaling = {}
    if rope_type == "llama3":
        try:
            scaling = {
                "rope_scaling_factor": float(rope["factor"]),
                "rope_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_high_freq_factor": float(rope["high_freq_factor"]),
                "rope_original_max_seq_len": int(rope["original_max_position_embeddings"]),
            }
        except (KeyError, TypeError, ValueError):
            unsupported.append(
                "a llama3 rope scaling without factor, low/high_freq_factor and original_max_position_embeddings"
            )
    try:
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        if (config.get("head_dim") or dim // n_heads) != dim // n_heads:  # null means the default
            unsupported.append(f"head_dim={config['head_dim']} (phalanx needs hidden_size / num_attention_heads)")
        if unsupported:
            raise PhalanxError(f"{where} uses Llama features phalanx does not support: {', '.join(unsupported)}")
        return ModelArgs(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads", n_heads),
            ffn_dim=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            max_seq_len=config["max_position_embeddings"],
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            **scaling,
        )
    except KeyError as e:
        raise PhalanxError(f"{where}/{CONFIG_FILE} lacks {e.args[0]!r}") from None


def read_hf_args(path: Path) -> ModelArgs:
    """The ModelArgs of an HF export directory, from its config.json alone."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PhalanxError(f"{path}/{CONFIG_FILE} is not valid JSON") from None
    except OSError as e:
        raise PhalanxError(f"{path}/{CONFIG_FILE} could not be read: {e.strerror}") from None
    return model_args_from_hf_config(config, Path(path))


def read_hf_model(path: Path) -> Transformer:
    """A phalanx model (float32, on the CPU) from an HF Llama directory. Weights come from
    model.safetensors only (never pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not is_hf_export(path):
        raise PhalanxError(f"{path} is not a Hugging Face export (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    args = read_hf_args(path)
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
        raise PhalanxError(
            f"{path}/{WEIGHTS_FILE} does not match its config: "
            f"missing {missing[:3] or 'none'}, unexpected {unexpected[:3] or 'none'}"
        )
    state = {ours[hf]: tensor.float() for hf, tensor in hf_tensors.items()}
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.to_empty(device="cpu")
    model.init_weights()  # rebuilds the RoPE tables (buffers, not in the file) and re-ties the output
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise PhalanxError(
            f"{path}/{WEIGHTS_FILE} does not match its config: {str(e).splitlines()[-1].strip()}"
        ) from None
    return model


def read_hf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of an export as phalanx uses it: encode() adds nothing, callers prepend BOS (the
    export's post-processor, which prepends BOS for HF users, is dropped)."""
    file = Path(path) / TOKENIZER_FILE
    try:
        spec = json.loads(file.read_text())
    except FileNotFoundError:
        raise PhalanxError(f"{path} has no {TOKENIZER_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PhalanxError(f"{file} is not valid JSON") from None
    spec["post_processor"] = None
    try:
        tokenizer = Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise PhalanxError(f"{file} is not a valid tokenizer: {str(e).splitlines()[0]}") from None
    special_ids(tokenizer, file)
    return tokenizer
