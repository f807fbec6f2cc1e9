"""Byte-level BPE tokenizer (HF `tokenizers`): train one on the corpus, or load a user's tokenizer.json.

Byte-level means every string round-trips exactly (no unknown token), whatever its script. Each document
is framed as [BOS] + ids + [EOS] so the model learns where texts start and stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phalanx.errors import PhalanxError

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS]  # trained tokenizers give them ids 0 and 1
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1  # every byte, the specials, and at least one merge


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    if vocab_size < MIN_VOCAB_SIZE:
        raise PhalanxError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE tokenizer: the minimum is {MIN_VOCAB_SIZE} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens + 1 merge)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the corpus or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise PhalanxError(f"tokenizer file {path} not found")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise PhalanxError(f"tokenizer file {path} is not a valid tokenizer.json: {str(e).splitlines()[0]}") from None
    special_ids(tokenizer, path)  # fail now, not halfway through tokenising
    return tokenizer


def special_ids(tokenizer: Tokenizer, where: str | Path = "tokenizer") -> tuple[int, int]:
    """(bos_id, eos_id); a tokenizer without both special tokens cannot frame documents."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    missing = [name for name, i in ((BOS, bos), (EOS, eos)) if i is None]
    if missing:
        raise PhalanxError(f"{where} lacks the special token(s) {', '.join(missing)}; add them to its vocabulary")
    return bos, eos


def encode_documents(tokenizer: Tokenizer, documents: Iterable[str], chunk_size: int = 64) -> Iterator[np.ndarray]:
    """Yield one uint32 array per document: [BOS] + ids + [EOS]. encode_batch runs a chunk of documents
    in parallel in Rust, which is several times faster than encoding them one by one."""
    bos, eos = special_ids(tokenizer)
    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use: ~2x faster
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    docs = iter(documents)
    while chunk := list(islice(docs, chunk_size)):
        for encoding in encode_batch(chunk, add_special_tokens=False):
            ids = np.empty(len(encoding.ids) + 2, dtype=np.uint32)
            ids[0], ids[1:-1], ids[-1] = bos, encoding.ids, eos
            yield ids
