"""GGUF export for llama.cpp and Ollama, written with the `gguf` package's GGUFWriter (architecture `llama`).

(Named gguf_export, not gguf, so it never shadows the `gguf` package.)

Two things differ from the HF export:
- Q and K projections are permuted. phalanx (like HF) applies RoPE in the rotate_half layout: within
  a head, dimension i is rotated together with dimension i + E/2. llama.cpp's llama architecture uses
  the original interleaved layout: dimensions 2i and 2i+1 rotate together. Moving row i of each head to
  row 2i, and row i + E/2 to row 2i + 1, makes llama.cpp rotate the same pairs by the same angles (the
  attention scores are unchanged, since q and k are permuted alike).
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

from phalanx.data.chat_template import CHAT_TEMPLATE
from phalanx.data.tokenizer import special_ids
from phalanx.errors import PhalanxError
from phalanx.export.export import QUANTISED
from phalanx.export.tokenizer_files import ensure_special_tokens
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rope import rope_frequency_divisors
from phalanx.run.gguf_format import ROPE_SCALING_KEYS, gguf_name, interleave_rotary_rows
from phalanx.run.model_loader import LoadedModel

# phalanx's tokenizer splits text with ByteLevel(use_regex=True), i.e. the GPT-2 regex
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# llama.cpp maps the pre-tokenizer name "gpt-2" to exactly that regex (LLAMA_VOCAB_PRE_TYPE_GPT2,
# implemented by unicode_regex_split_custom_gpt2). "llama-bpe" (Llama 3's) would split digits in threes
# and attach a non-letter to the following word, and "default" splits punctuation differently, so
# either would hand our merges different pieces and give other ids.
PRE_TOKENIZER = "gpt-2"
# Ollama's own Go engine ignores that name: for the llama architecture it reads the split regex itself
# from tokenizer.ggml.pretokenizer and falls back to Llama 3's. So the regex is written out as well.
PRE_TOKENIZER_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gguf_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under llama.cpp names, float32, Q/K permuted; output left out when tied
    (llama.cpp then uses token_embd for the output). One at a time, so a caller converting them to f16
    never holds a second full copy of the model."""
    args = model.args
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        tensor = tensor.detach().to("cpu", torch.float32)
        if name.endswith("attention.wq.weight"):
            tensor = interleave_rotary_rows(tensor, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = interleave_rotary_rows(tensor, args.n_kv_heads)
        yield gguf_name(name), tensor.contiguous()


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

    if dtype == "f32" or tensor.ndim == 1:  # norms stay f32
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
    tokenizer = ensure_special_tokens(loaded.tokenizer)
    bos_id, eos_id = special_ids(tokenizer)
    tokens, token_types, merges = _vocabulary(tokenizer, args.vocab_size)

    writer = gguf.GGUFWriter(str(path), arch="llama")  # also writes general.architecture
    writer.add_name(name)
    writer.add_file_type(_file_type(dtype))
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_dimension_count(args.head_size)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)

    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_string("tokenizer.ggml.pretokenizer", PRE_TOKENIZER_REGEX)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(True)  # every training document started with BOS
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    for tensor_name, tensor in gguf_tensors(loaded.model):
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
