"""The tokenizer files of a Hugging Face export (read back by phalanx/run/hf_format.py).

phalanx frames every text itself ([BOS] + ids, or ids alone for a tokenizer without BOS) and keeps the
tokenizer free of a post-processor. An HF user calls `tokenizer(text)` and expects the framing the model
was trained with, as Llama 3's tokenizer gives, so where the tokenizer has a BOS the exported
tokenizer.json gains a post-processor that prepends it (and none where it has no BOS: Qwen's). Chat
prompts are not affected: the chat template writes `bos_token` itself, and transformers'
apply_chat_template encodes its text without special tokens (as llama.cpp and Ollama do with add_bos_token).

The special tokens and chat template are the model's own (data/tokenizer.py special_tokens, LoadedModel's
chat_template): phalanx's names and template for a model phalanx trained, a checkpoint's for a model that
came from one (or a run started from one).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, processors

from phalanx.data.tokenizer import SpecialTokens, same_specials, special_tokens


def ensure_special_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` (carrying its specials) in which BOS, EOS and the end of turn are added
    special tokens (so decoding can skip them, and no pre-tokenizer ever splits them); trained tokenizers
    and checkpoints' already have them, a user's may not."""
    specials = special_tokens(tokenizer)
    tokenizer = same_specials(Tokenizer.from_str(tokenizer.to_str()), tokenizer)
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    missing = [t for t in (specials.bos, specials.eos, specials.end_of_turn) if t is not None and t not in added]
    if missing:
        # Already in the vocabulary (special_tokens checked): adding them marks them, keeping their ids.
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    return tokenizer


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """tokenizer.json text for the export: the tokenizer, specials checked, BOS prepended on encode where
    the model was trained with one."""
    tokenizer = ensure_special_tokens(tokenizer)
    specials = special_tokens(tokenizer)
    bos, bos_id = specials.bos, specials.bos_id
    if bos_id is not None and tokenizer.encode("a").ids[:1] != [bos_id]:
        prepend_bos = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
        current = tokenizer.post_processor
        tokenizer.post_processor = prepend_bos if current is None else processors.Sequence([current, prepend_bos])
    return tokenizer.to_str(pretty=True)


def hf_generation_config(specials: SpecialTokens) -> dict:
    """generation_config.json: generate() stops at every stop id (EOS, the end of turn, a checkpoint's
    others), a single id where EOS is the only one."""
    stops = list(specials.stop_ids) or [specials.eos_id]
    return {"bos_token_id": specials.bos_id, "eos_token_id": stops[0] if len(stops) == 1 else stops}
