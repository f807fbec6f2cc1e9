"""GGUF export for llama.cpp and Ollama, written with the `gguf` package's GGUFWriter: Llama, Mistral and
Mixtral as llama.cpp's `llama` architecture (Mixtral with expert_count and its experts), Qwen2 as `qwen2`
(with attn_{q,k,v}.bias), Qwen3 as `qwen3` (with attn_{q,k}_norm), Qwen3-MoE as `qwen3moe`, DeepSeek-V3
as `deepseek2` (its keys and tensors in gguf_deepseek.py); check_llama_cpp_computes refuses what those
architectures cannot run.

(Named gguf_export, not gguf, so it never shadows the `gguf` package.)

Two things differ from the HF export:
- For the llama architecture, Q and K projections (and their biases) are permuted. phalanx (like HF)
  applies RoPE in the rotate_half layout: within a head, dimension i is rotated together with dimension
  i + E/2. llama.cpp's llama architecture uses the original interleaved layout (LLAMA_ROPE_TYPE_NORM):
  dimensions 2i and 2i+1 rotate together. Moving row i of each head to row 2i, and row i + E/2 to row
  2i + 1, makes llama.cpp rotate the same pairs by the same angles (the attention scores are unchanged,
  since q and k are permuted alike). llama.cpp rotates qwen2 and qwen3 in the rotate_half layout
  (LLAMA_ROPE_TYPE_NEOX), as HF's Qwen does, so their rows are written as they are.
- Norm weights stay float32 whatever --dtype says: llama.cpp computes norms in f32 and they are tiny.

Quantised types (q8_0, q5_1, q5_0, q4_1, q4_0) are written with the gguf package's own quantisers
(gguf.quants), block by block along each weight's rows as llama.cpp reads them; a weight whose rows are
not a whole number of 32-value blocks is written as f16 instead, as llama.cpp's own quantiser does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from phalanx.data.tokenizer import special_tokens
from phalanx.errors import PhalanxError
from phalanx.export.export import QUANTISED
from phalanx.export.gguf_deepseek import add_deepseek2_keys, check_deepseek2_computes, deepseek2_tensors
from phalanx.export.tokenizer_files import ensure_special_tokens
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rope import rope_frequency_divisors
from phalanx.run.gguf_deepseek import DEEPSEEK_ARCH, DEEPSEEK_FAMILY
from phalanx.run.gguf_format import (
    AUX_LOSS_KEY,
    FAMILY_ARCH,
    FAMILY_KEY,
    ROPE_SCALING_KEYS,
    gguf_name,
    interleave_rotary_rows,
    rotary_heads,
)
from phalanx.run.model_loader import LoadedModel

# phalanx's tokenizer splits text with ByteLevel(use_regex=True), i.e. the GPT-2 regex
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# llama.cpp maps the pre-tokenizer name "gpt-2" to exactly that regex (LLAMA_VOCAB_PRE_TYPE_GPT2,
# implemented by unicode_regex_split_custom_gpt2). "llama-bpe" (Llama 3's) would split digits in threes
# and attach a non-letter to the following word, and "default" splits punctuation differently, so
# either would hand our merges different pieces and give other ids.
PRE_TOKENIZER = "gpt-2"
# Ollama's own Go engine ignores that name: for the llama (and qwen2) architecture it reads the split
# regex itself from tokenizer.ggml.pretokenizer and falls back to Llama 3's (Qwen2's). So the regex is
# written out as well. (Its qwen3 model, as read in ollama/ollama's model/models/qwen3/model.go, hard-codes
# Qwen's regex and would split some text differently; llama.cpp goes by tokenizer.ggml.pre.)
PRE_TOKENIZER_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gguf_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under llama.cpp names, float32, Q/K permuted where the architecture rotates
    interleaved pairs; output left out when tied (llama.cpp then uses token_embd for the output). One at a
    time, so a caller converting them to f16 never holds a second full copy of the model."""
    args = model.args
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        tensor = tensor.detach().to("cpu", torch.float32)
        heads = rotary_heads(name, args)
        if heads is not None:
            tensor = interleave_rotary_rows(tensor, heads)
        yield gguf_name(name), tensor.contiguous()


def check_llama_cpp_computes(args: ModelArgs) -> None:
    """Refuse, in one line, a model that llama.cpp would load as another model or not at all (DeepSeek-V3:
    gguf_deepseek.check_deepseek2_computes). Each limit was measured with llama-cpp-python 0.3.36 on
    phalanx's own exports (tests/export/test_export_gguf_families.py):
    - llama.cpp applies no sliding window to the llama, qwen2 or qwen3 architecture: with
      `{arch}.attention.sliding_window` written it logs n_swa = 0, and its logits are those of full
      causal attention (off by ~0.2 from the windowed model's past the window). A window of at least
      max_seq_len never hides a key within the context, so such a model is exported, the key kept for
      phalanx's reader.
    - Only qwen3 reads attn_q_norm / attn_k_norm (and requires them); llama and qwen2 fail on the extra
      tensors ("wrong number of tensors").
    - qwen2 sizes attn_q as dim x dim, so its heads must be dim / n_heads wide.
    - Only llama reads rope_freqs (Llama 3.1 scaling); qwen2 and qwen3 fail on it.
    (q/k/v biases load on all three.)"""
    if args.family == DEEPSEEK_FAMILY:  # its own architecture, deepseek2 (gguf_deepseek.py)
        check_deepseek2_computes(args)
        return
    arch = FAMILY_ARCH[args.family]
    refusal = None
    if args.n_experts and (args.n_dense_layers or not args.norm_topk_prob):
        refusal = (
            "dense first layers or top-k weights that are not renormalised (its MoE graphs put experts in "
            "every layer and renormalise)"
        )
    elif args.sliding_window is not None and args.sliding_window < args.max_seq_len:
        refusal = (
            f"a sliding window of {args.sliding_window} tokens: llama.cpp attends to the whole context, so "
            f"beyond {args.sliding_window} tokens it would compute another model (set model.sliding_window "
            f">= max_seq_len {args.max_seq_len}, or export --format hf)"
        )
    elif args.qk_norm != (arch in ("qwen3", "qwen3moe")):
        refusal = "q/k norms" if args.qk_norm else f"no q/k norms (llama.cpp's {arch} requires them)"
    elif arch == "qwen2" and args.head_size * args.n_heads != args.dim:
        refusal = f"head_dim {args.head_size} with {args.n_heads} heads and dim {args.dim} (it needs dim / n_heads)"
    elif arch != "llama" and rope_frequency_divisors(args) is not None:
        refusal = "Llama 3.1 RoPE scaling (llama.cpp reads rope_freqs for the llama architecture only)"
    if refusal is not None:
        raise PhalanxError(
            f"GGUF export: llama.cpp's {arch} architecture (family {args.family}) cannot run a model with {refusal}"
        )


def _vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, their GGUF token types, merges as "a b") for a byte-level BPE tokenizer."""
    import gguf

    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    gpt2_split = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
    # llama.cpp would silently tokenise such a tokenizer differently: refuse rather than export a model
    # that reads other ids than it was trained on.
    if spec["model"]["type"] != "BPE" or not gpt2_split or spec.get("normalizer"):
        raise PhalanxError(
            "GGUF export supports byte-level BPE tokenizers with the GPT-2 split and no normalizer "
            f"(as phalanx trains them), not model {spec['model']['type']} with pre-tokenizer "
            f"{pre.get('type')} and normalizer {(spec.get('normalizer') or {}).get('type')}"
        )
    id_to_token = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    if max(id_to_token) >= vocab_size:
        raise PhalanxError(
            f"the tokenizer has ids up to {max(id_to_token)}, beyond the model's vocab_size {vocab_size}"
        )
    added = tokenizer.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in id_to_token:  # an embedding row the tokenizer never produces
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.NORMAL)
    # tokenizers writes merges as "a b" strings (< 0.20) or as [a, b] pairs (>= 0.20)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, [int(t) for t in types], merges


def _file_type(dtype: str):
    import gguf

    return getattr(gguf.LlamaFileType, {"f32": "ALL_F32", "f16": "MOSTLY_F16"}.get(dtype, f"MOSTLY_{dtype.upper()}"))


def _numpy_in(tensor: torch.Tensor, dtype: str) -> tuple[np.ndarray, object]:
    """(array, raw_dtype for GGUFWriter.add_tensor) of a float32 tensor stored as `dtype`."""
    import gguf

    if dtype == "f32" or tensor.ndim == 1:  # norms and biases stay f32
        return tensor.numpy(), None
    if dtype in QUANTISED:
        qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        if tensor.shape[-1] % block == 0:
            return gguf.quants.quantize(tensor.numpy(), qtype), qtype
        dtype = "f16"
    if dtype == "f16":
        return tensor.to(torch.float16).numpy(), None
    # numpy has no bfloat16: hand the writer the raw 16-bit patterns and say what they are.
    return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16


def write_gguf(loaded: LoadedModel, path: Path, name: str, dtype: str = "f32") -> None:
    import gguf

    args: ModelArgs = loaded.model.args
    check_llama_cpp_computes(args)
    tokenizer = ensure_special_tokens(loaded.tokenizer)
    specials = special_tokens(tokenizer)
    tokens, token_types, merges = _vocabulary(tokenizer, args.vocab_size)

    deepseek = args.family == DEEPSEEK_FAMILY
    # also writes general.architecture, and prefixes the model's keys with it
    writer = gguf.GGUFWriter(str(path), arch=DEEPSEEK_ARCH if deepseek else FAMILY_ARCH[args.family])
    writer.add_name(name)
    writer.add_string(FAMILY_KEY, args.family)
    if args.sliding_window is not None:  # never one llama.cpp would have to apply (checked above)
        writer.add_sliding_window(args.sliding_window)
    writer.add_file_type(_file_type(dtype))
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    if args.n_experts:  # a mixture of experts (models/moe.py)
        writer.add_float32(AUX_LOSS_KEY, args.router_aux_loss_coef)
    if deepseek:  # multi-head latent attention and DeepSeek's routing
        add_deepseek2_keys(writer, args)
    else:
        _add_attention_and_expert_keys(writer, args)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)

    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_string("tokenizer.ggml.pretokenizer", PRE_TOKENIZER_REGEX)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    if specials.bos is not None:  # a tokenizer without BOS (Qwen's) names none
        writer.add_bos_token_id(tokenizer.token_to_id(specials.bos))
    writer.add_eos_token_id(specials.eos_id)
    if specials.end_of_turn_id is not None:  # where a chat turn ends (<|eot_id|>, <|im_end|>)
        writer.add_eot_token_id(specials.end_of_turn_id)
    writer.add_add_bos_token(specials.bos_id is not None)  # as the training documents started
    writer.add_add_eos_token(False)
    writer.add_chat_template(loaded.chat_template)  # phalanx's own, or the checkpoint's the model came from

    for tensor_name, tensor in (deepseek2_tensors if deepseek else gguf_tensors)(loaded.model):
        array, raw_dtype = _numpy_in(tensor, dtype)
        writer.add_tensor(tensor_name, array, raw_dtype=raw_dtype)
    divisors = rope_frequency_divisors(args)
    if divisors is not None:  # Llama 3.1 scaling: llama.cpp divides each RoPE frequency by these
        writer.add_tensor("rope_freqs.weight", divisors.numpy().astype(np.float32))
        for name, key in ROPE_SCALING_KEYS.items():  # and phalanx's reader rebuilds the model's shape from these
            value = getattr(args, name)
            writer.add_uint32(key, value) if isinstance(value, int) else writer.add_float32(key, value)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_attention_and_expert_keys(writer, args: ModelArgs) -> None:
    """The llama, qwen2, qwen3 and qwen3moe architectures' sizes of the feed-forward, experts and heads."""
    writer.add_feed_forward_length(args.ffn_dim)
    if args.n_experts:
        writer.add_expert_count(args.n_experts)
        writer.add_expert_used_count(args.n_experts_per_token)
        if FAMILY_ARCH[args.family] == "qwen3moe":  # llama's graph sizes its experts by feed_forward_length
            writer.add_expert_feed_forward_length(args.moe_ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_key_length(args.head_size)  # llama.cpp's default, dim / n_heads, is wrong where head_dim is set
    writer.add_value_length(args.head_size)
    writer.add_rope_dimension_count(args.head_size)
