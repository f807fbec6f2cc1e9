"""The tokenizer files of a Hugging Face export (read back by phalanx/run/hf_format.py).

phalanx frames every text as [BOS] + ids itself and keeps the tokenizer free of a post-processor. An HF
user calls `tokenizer(text)` and expects the framing the model was trained with, as Llama 3's tokenizer
gives, so the exported tokenizer.json gains a post-processor that prepends BOS. Chat prompts are not
affected: the chat template writes `bos_token` itself, and transformers' apply_chat_template encodes its
text without special tokens (as llama.cpp and Ollama do with add_bos_token).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, processors

from phalanx.data.chat_template import CHAT_TEMPLATE
from phalanx.data.tokenizer import BOS, EOS, special_ids


def ensure_special_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` in which BOS and EOS are added special tokens (so decoding can skip them,
    and no pre-tokenizer ever splits them); trained tokenizers already have them, a user's may not."""
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    special_ids(tokenizer)
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    missing = [t for t in (BOS, EOS) if t not in added]
    if missing:
        # Already in the vocabulary (special_ids checked): adding them marks them, keeping their ids.
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    return tokenizer


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """tokenizer.json text for the export: the run's tokenizer, specials checked, BOS prepended on encode."""
    tokenizer = ensure_special_tokens(tokenizer)
    bos, _ = special_ids(tokenizer)
    if tokenizer.encode("a").ids[:1] != [bos]:
        prepend_bos = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
        )
        current = tokenizer.post_processor
        tokenizer.post_processor = prepend_bos if current is None else processors.Sequence([current, prepend_bos])
    return tokenizer.to_str(pretty=True)


def hf_tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json: what transformers' AutoTokenizer needs beyond tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
