"""The GGUF format (llama.cpp's) as both sides see it: which llama.cpp architecture each family is,
tensor names, the rotary row order, and reading an export back into a phalanx model and tokenizer for the
model loader.

phalanx/export/gguf_export.py writes such a file; this module reads one (phalanx's own export, or a
llama, qwen2 or qwen3 GGUF with a byte-level BPE vocabulary). Quantised weights are dequantised to float32
with the gguf package's own decoders, so the torch engine computes what the file holds. Reading never
executes anything: GGUF is a flat table of typed values and tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from phalanx.data.tokenizer import specials_from_ids
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rope import rope_frequency_divisors

GGUF_FILE = "model.gguf"
# Each family under the name llama.cpp gives its architecture. Mistral is Llama's graph plus a sliding
# window (which llama.cpp never applies: see gguf_export.py), so it is written as `llama`, its own name
# kept in FAMILY_KEY.
# Mixtral is llama's graph with experts (llama.cpp reads expert_count); Qwen3-MoE has its own name.
FAMILY_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "llama",
    "qwen3_moe": "qwen3moe",
}
# What llama.cpp has no key for, written so that an export reads back as the ModelArgs it came from.
AUX_LOSS_KEY = "phalanx.moe.router_aux_loss_coef"
# llama.cpp rotates `llama` heads in the interleaved layout (LLAMA_ROPE_TYPE_NORM), so their Q and K rows
# are permuted; qwen2 and qwen3 rotate in the rotate_half layout (NEOX), phalanx's own, so theirs are not.
INTERLEAVED_ROPE_ARCHS = ("llama",)
# phalanx's family, which the architecture alone does not tell for Mistral: written so that reading an
# export back gives the very ModelArgs it was written from.
FAMILY_KEY = "phalanx.family"
# Llama 3.1 RoPE scaling: llama.cpp needs only the frequency divisors (rope_freqs), phalanx's model its
# four parameters, so the export writes both and the reader checks that they agree.
ROPE_SCALING_KEYS = {
    "rope_scaling_factor": "phalanx.rope.scaling.factor",
    "rope_low_freq_factor": "phalanx.rope.scaling.low_freq_factor",
    "rope_high_freq_factor": "phalanx.rope.scaling.high_freq_factor",
    "rope_original_max_seq_len": "phalanx.rope.scaling.original_context_length",
}

# phalanx name (per layer: after "layers.N.") -> llama.cpp name (per layer: after "blk.N.")
_LAYER_NAMES = {
    "attention.wq.weight": "attn_q.weight",
    "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight",
    "attention.wo.weight": "attn_output.weight",
    "attention.wq.bias": "attn_q.bias",  # Qwen2
    "attention.wk.bias": "attn_k.bias",
    "attention.wv.bias": "attn_v.bias",
    "attention.q_norm.weight": "attn_q_norm.weight",  # Qwen3
    "attention.k_norm.weight": "attn_k_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    # A mixture of experts (models/moe.py): the router, and each projection's experts stacked in one
    # tensor, as llama.cpp reads them ((experts, out, in) here; ggml lists the dimensions reversed).
    "feed_forward.router.weight": "ffn_gate_inp.weight",
    "feed_forward.w1": "ffn_gate_exps.weight",
    "feed_forward.w3": "ffn_up_exps.weight",
    "feed_forward.w2": "ffn_down_exps.weight",
    "attention_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}


def gguf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"blk.{index}.{_LAYER_NAMES[rest]}"


def interleave_rotary_rows(w_OD: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a Q or K projection (its weight, or its bias of shape (O,)) from
    rotate_half pairs (i, i + E/2) to interleaved pairs (2i, 2i + 1), head by head. O = n_heads * E rows."""
    O = w_OD.shape[0]
    E = O // n_heads
    # (heads, half, E/2, ...): half 0 holds the first members of the pairs, half 1 their partners; swapping
    # the two middle axes puts each pair on adjacent rows.
    return w_OD.reshape(n_heads, 2, E // 2, *w_OD.shape[1:]).transpose(1, 2).reshape(w_OD.shape)


def halve_rotary_rows(w_OD: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of interleave_rotary_rows: llama.cpp's row order back to phalanx's."""
    O = w_OD.shape[0]
    E = O // n_heads
    return w_OD.reshape(n_heads, E // 2, 2, *w_OD.shape[1:]).transpose(1, 2).reshape(w_OD.shape)


def rotary_heads(name: str, args: ModelArgs) -> int | None:
    """How many heads the Q or K projection (weight or bias) `name` holds, where the file keeps it in
    llama.cpp's interleaved row order; None for every other tensor, and for architectures that rotate in
    phalanx's own layout."""
    if FAMILY_ARCH[args.family] not in INTERLEAVED_ROPE_ARCHS:
        return None
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.n_kv_heads
    return None


def gguf_file(path: Path) -> Path | None:
    """The GGUF file that `path` names (the file itself, or an export directory holding model.gguf)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / GGUF_FILE).is_file():
        return path / GGUF_FILE
    return None


def read_gguf(file: Path) -> tuple[Transformer, Tokenizer, str | None]:
    """(model in float32 on the CPU, tokenizer, chat template or None) of a llama, qwen2, qwen3, qwen3moe or
    deepseek2 GGUF file."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # the gguf package raises ValueError, struct errors or numpy's on a bad file
        raise PhalanxError(
            f"{file} is not a readable GGUF file: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch == "deepseek2":  # MLA and DeepSeek's routing: its own layout (imported here: it imports this module)
        from phalanx.run.gguf_deepseek import read_deepseek2

        model = read_deepseek2(file, fields, {t.name: t for t in reader.tensors})
        return model, _tokenizer(file, fields, model.args.vocab_size), fields.get("tokenizer.chat_template")
    archs = sorted({*FAMILY_ARCH.values(), "deepseek2"})
    if arch not in archs:
        raise PhalanxError(f"{file} holds architecture {arch!r}; phalanx reads {', '.join(archs)} GGUF files only")
    tensors = {t.name: t for t in reader.tensors}
    args = _model_args(file, arch, fields, tensors)
    state = {}
    for name, shape in _expected_shapes(args).items():
        tensor = tensors.get(gguf_name(name))
        if tensor is None:
            raise PhalanxError(f"{file} has no tensor {gguf_name(name)}")
        values = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=torch.float32)
        if tuple(values.shape) != shape:
            raise PhalanxError(f"{file}: {tensor.name} has shape {tuple(values.shape)}, the model needs {shape}")
        heads = rotary_heads(name, args)
        state[name] = values if heads is None else halve_rotary_rows(values, heads)
    _check_rope_divisors(file, args, tensors)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()  # the RoPE tables (buffers, not in the file) and the tied output
    model.load_state_dict(state, strict=True)
    return model, _tokenizer(file, fields, args.vocab_size), fields.get("tokenizer.chat_template")


def _model_args(file: Path, arch: str, fields: dict, tensors: dict) -> ModelArgs:
    def need(key: str):
        if f"{arch}.{key}" not in fields:
            raise PhalanxError(f"{file} lacks {arch}.{key}")
        return fields[f"{arch}.{key}"]

    embedding = tensors.get("token_embd.weight")
    vocab = fields.get(f"{arch}.vocab_size") or (
        len(fields["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in fields else None
    )
    if embedding is None or vocab is None:
        raise PhalanxError(f"{file} has no token embedding or vocabulary")
    experts = int(fields.get(f"{arch}.expert_count", 0))
    # A file not phalanx's own: the family of its architecture's name (llama with experts: Mixtral).
    family = fields.get(FAMILY_KEY, "mixtral" if arch == "llama" and experts else arch)
    if FAMILY_ARCH.get(family) != arch:
        raise PhalanxError(f"{file}: {FAMILY_KEY} {family!r} is not a family written as architecture {arch!r}")
    scaling = {name: _decimal(fields[key]) for name, key in ROPE_SCALING_KEYS.items() if key in fields}
    heads, dim = int(need("attention.head_count")), int(need("embedding_length"))
    # llama.cpp's rule: key_length where given, else dim / heads. Kept as None where it is that quotient,
    # so a model with the default head size reads back with the ModelArgs it was exported from (one that
    # set head_dim to that very quotient reads back as None: the same model).
    head_dim = fields.get(f"{arch}.attention.key_length")
    if head_dim is not None and fields.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise PhalanxError(f"{file}: key_length and value_length differ; phalanx's heads have one size")
    if head_dim is not None and dim % heads == 0 and head_dim == dim // heads:
        head_dim = None
    # phalanx applies the window the file states; llama.cpp applies none to these architectures, which is
    # why phalanx exports only windows that hide nothing within the context (gguf_export.py).
    window = fields.get(f"{arch}.attention.sliding_window")
    return ModelArgs(
        dim=dim,
        n_layers=int(need("block_count")),
        n_heads=heads,
        n_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        ffn_dim=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        max_seq_len=int(need("context_length")),
        rope_theta=_decimal(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=_decimal(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
        family=family,
        head_dim=None if head_dim is None else int(head_dim),
        # The tensors say which of these a model has: llama.cpp reads them where present.
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=None if window is None else int(window),
        **{k: (int(v) if k == "rope_original_max_seq_len" else v) for k, v in scaling.items()},
        **({} if not experts else _moe_args(file, arch, fields)),
    )


def _moe_args(file: Path, arch: str, fields: dict) -> dict:
    """A mixture of experts' fields: llama.cpp's expert keys (its MoE graphs renormalise the top-k
    weights), the expert width apart from the dense one for qwen3moe."""
    used = fields.get(f"{arch}.expert_used_count")
    if used is None:
        raise PhalanxError(f"{file} lacks {arch}.expert_used_count")
    width = fields.get(f"{arch}.expert_feed_forward_length")
    return {
        "n_experts": int(fields[f"{arch}.expert_count"]),
        "n_experts_per_token": int(used),
        "expert_ffn_dim": None if width is None else int(width),
        "router_aux_loss_coef": _decimal(fields.get(AUX_LOSS_KEY, 0.0)),
    }


def _decimal(value) -> float:
    """A float32 field as the decimal it was written from (1e-05, not 9.99999974e-06): numpy prints a
    float32 with the fewest digits that read back as the same float32."""
    return float(str(np.float32(value)))


def _expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if args.tie_embeddings:
        shapes.pop("output.weight", None)
    return shapes


def _check_rope_divisors(file: Path, args: ModelArgs, tensors: dict) -> None:
    stored = tensors.get("rope_freqs.weight")
    expected = rope_frequency_divisors(args)
    if stored is None and expected is None:
        return
    if (
        stored is None
        or expected is None
        or not np.allclose(np.asarray(stored.data, np.float32), expected.numpy(), rtol=1e-5)
    ):
        raise PhalanxError(
            f"{file}: its RoPE frequency divisors (rope_freqs) do not follow from "
            "phalanx.rope.scaling.*; phalanx reads Llama 3.1 scaling only as its own export writes it"
        )


def _tokenizer(file: Path, fields: dict, vocab_size: int) -> Tokenizer:
    """The byte-level BPE tokenizer the vocabulary describes; encode() adds nothing (callers add BOS)."""
    import gguf

    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise PhalanxError(
            f"{file} has tokenizer {fields.get('tokenizer.ggml.model')!r}; phalanx reads byte-level "
            "BPE ('gpt2') vocabularies only"
        )
    tokens, types = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.token_type")
    types = types or [int(gguf.TokenType.NORMAL)] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != gguf.TokenType.UNUSED}
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=kind == gguf.TokenType.CONTROL, normalized=False)
        for t, kind in zip(tokens, types)
        if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    # Its special tokens are the file's own ids (a Qwen export has no BOS, a chat model an end of turn).
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    if eos_id is None:
        raise PhalanxError(f"{file} names no EOS token (tokenizer.ggml.eos_token_id)")
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    framed = bos_id is not None and fields.get("tokenizer.ggml.add_bos_token", True)
    specials_from_ids(
        tokenizer,
        file,
        bos_id if framed else None,
        eos_id,
        end_of_turn_id=fields.get("tokenizer.ggml.eot_token_id"),
        unframed_bos=tokenizer.id_to_token(bos_id) if bos_id is not None and not framed else None,
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise PhalanxError(f"{file}: the vocabulary has more tokens than the model's {vocab_size} embedding rows")
    return tokenizer
