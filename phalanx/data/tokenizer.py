"""Byte-level BPE tokenizer (HF `tokenizers`): train one on the corpus, or load a user's tokenizer.json;
and the one owner of a tokenizer's special tokens.

Byte-level means every string round-trips exactly (no unknown token), whatever its script. Each document
is framed as [BOS] + ids + [EOS] so the model learns where texts start and stop ([ids] + [EOS] for a
tokenizer without BOS, as Qwen's: its models were trained that way).

Special tokens. A tokenizer phalanx trained has phalanx's own, `<|begin_of_text|>` and `<|end_of_text|>`.
A checkpoint's tokenizer has whatever its model was trained with (Llama 3 the same names, Mistral `<s>`
and `</s>`, Qwen no BOS and `<|endoftext|>`), named by the files beside its tokenizer.json:
tokenizer_config.json (`bos_token`, `eos_token`, `add_bos_token`, the chat template),
special_tokens_map.json (older checkpoints) and generation_config.json (`eos_token_id`: the ids that end
generation, e.g. Llama 3 Instruct's `<|eot_id|>`). Those files travel with the tokenizer: a prepared data
directory and a run started from a checkpoint keep copies under the same names, beside their tokenizer.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phalanx.data.chat_template import CHAT_TEMPLATE_FILE, read_template
from phalanx.errors import PhalanxError

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS]  # trained tokenizers give them ids 0 and 1
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1  # every byte, the specials, and at least one merge

# The files beside a Hugging Face tokenizer.json that say what its special tokens are and how it is used.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_COMPANIONS = (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, GENERATION_CONFIG_FILE, CHAT_TEMPLATE_FILE)
# Tokens that end a chat turn in the families phalanx runs and their kin (Llama 3, ChatML as in Qwen, Phi,
# Gemma): one counts as the end of turn where the chat template writes it.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")
# Where the specials travel: an attribute of the tokenizer object itself (tokenizers.Tokenizer takes one),
# set only by this module. A tokenizer is handed to engines, exporters, encoders and tests in many more
# places than a LoadedModel is, and each would otherwise need a second argument that could disagree with
# it; a copy (Tokenizer.from_str) loses the attribute and falls back to phalanx's own names, which a
# checkpoint's tokenizer lacks, so a lost attribute is refused loudly rather than guessed.
_ATTRIBUTE = "phalanx_specials"


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's special tokens as phalanx uses them."""

    eos: str  # ends every training document
    eos_id: int
    bos: str | None = None  # what chat templates get as bos_token; None: the tokenizer has none
    bos_id: int | None = None  # prefixed to every text; None where the model was trained without (Qwen)
    end_of_turn: str | None = None  # what ends an assistant's turn in the chat template, where it is not EOS
    end_of_turn_id: int | None = None
    stop_ids: tuple[int, ...] = ()  # every id that ends generation: EOS first, then the rest

    def frame(self, ids: list[int]) -> list[int]:
        """A text's ids as the model saw texts in training: BOS first where there is one."""
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def template_strings(self) -> dict[str, str]:
        """bos_token and eos_token as a chat template renders them."""
        return {"bos_token": self.bos or "", "eos_token": self.eos}


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
    """A tokenizer.json, with the special tokens its companion files beside it name (phalanx's own names
    where there are none)."""
    path = Path(path)
    if not path.is_file():
        raise PhalanxError(f"tokenizer file {path} not found")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise PhalanxError(f"tokenizer file {path} is not a valid tokenizer.json: {str(e).splitlines()[0]}") from None
    return read_specials(tokenizer, path.parent, path)  # fail now, not halfway through tokenising


def companion_files(directory: Path) -> list[Path]:
    """The companion files (TOKENIZER_COMPANIONS) there are in `directory`."""
    return [Path(directory) / name for name in TOKENIZER_COMPANIONS if (Path(directory) / name).is_file()]


def special_tokens(tokenizer: Tokenizer, where: str | Path = "tokenizer") -> SpecialTokens:
    """The specials read_specials or with_specials gave `tokenizer`; else phalanx's own names, which a
    tokenizer phalanx trained has (refused in one line where it lacks them)."""
    found = getattr(tokenizer, _ATTRIBUTE, None)
    if found is not None:
        return found
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    missing = [name for name, i in ((BOS, bos), (EOS, eos)) if i is None]
    if missing:
        raise PhalanxError(f"{where} lacks the special token(s) {', '.join(missing)}; add them to its vocabulary")
    return SpecialTokens(EOS, eos, BOS, bos, stop_ids=(eos,))


def special_ids(tokenizer: Tokenizer, where: str | Path = "tokenizer") -> tuple[int | None, int]:
    """(bos_id, eos_id) of special_tokens(); bos_id None for a tokenizer without BOS."""
    specials = special_tokens(tokenizer, where)
    return specials.bos_id, specials.eos_id


def with_specials(tokenizer: Tokenizer, specials: SpecialTokens) -> Tokenizer:
    """`tokenizer`, carrying `specials` from now on (returned for chaining)."""
    setattr(tokenizer, _ATTRIBUTE, specials)
    return tokenizer


def same_specials(copy: Tokenizer, original: Tokenizer) -> Tokenizer:
    """`copy` (a Tokenizer.from_str of `original`) with the specials of `original`."""
    found = getattr(original, _ATTRIBUTE, None)
    return copy if found is None else with_specials(copy, found)


def specials_from_ids(
    tokenizer: Tokenizer,
    where: str | Path,
    bos_id: int | None,
    eos_id: int,
    stop_ids: Iterable[int] = (),
    end_of_turn_id: int | None = None,
    unframed_bos: str | None = None,
) -> Tokenizer:
    """`tokenizer` carrying the specials given by id (as a GGUF file names them), each checked.
    unframed_bos: where bos_id is None, a BOS the tokenizer has but texts are not framed with (a GGUF
    with add_bos_token false), which templates still see as bos_token."""

    def token(i: int, what: str) -> str:
        text = tokenizer.id_to_token(i) if isinstance(i, int) and not isinstance(i, bool) and i >= 0 else None
        if text is None:
            raise PhalanxError(f"{where}: its {what} {i!r} is not a token of its vocabulary")
        return text

    bos = unframed_bos if bos_id is None else token(bos_id, "BOS id")
    eos = token(eos_id, "EOS id")
    eot = None if end_of_turn_id is None else token(end_of_turn_id, "end-of-turn id")
    for i in stop_ids:
        token(i, "stop id")
    stops = tuple(dict.fromkeys([eos_id, *stop_ids, *([] if end_of_turn_id is None else [end_of_turn_id])]))
    return with_specials(tokenizer, SpecialTokens(eos, eos_id, bos, bos_id, eot, end_of_turn_id, stops))


def read_specials(tokenizer: Tokenizer, directory: Path, where: str | Path | None = None) -> Tokenizer:
    """`tokenizer` carrying the specials its companion files in `directory` name: BOS and EOS from
    tokenizer_config.json (special_tokens_map.json beneath it), no BOS where bos_token is null or
    add_bos_token false; the stop ids from generation_config.json's eos_token_id; the end of turn where
    the chat template writes one of END_OF_TURN_TOKENS. Where no file names BOS or EOS, phalanx's own."""
    directory = Path(directory)
    where = where if where is not None else directory / "tokenizer.json"
    names: dict[str, Any] = {}
    for file in (SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE):  # the later file wins
        names.update(_json_object(directory / file))
    generation = _json_object(directory / GENERATION_CONFIG_FILE)
    stop_ids = _id_list(generation.get("eos_token_id"), directory / GENERATION_CONFIG_FILE)

    if "bos_token" not in names and "eos_token" not in names:
        own = special_tokens(tokenizer, where)
        bos, bos_id, eos, eos_id = own.bos, own.bos_id, own.eos, own.eos_id
    else:
        config = directory / (
            TOKENIZER_CONFIG_FILE if (directory / TOKENIZER_CONFIG_FILE).is_file() else SPECIAL_TOKENS_MAP_FILE
        )
        bos = _token_text(names.get("bos_token"), "bos_token", config)
        eos = _token_text(names.get("eos_token"), "eos_token", config)
        if eos is None:
            if not stop_ids:
                raise PhalanxError(f"{config} names no eos_token (and {GENERATION_CONFIG_FILE} no eos_token_id)")
            eos = tokenizer.id_to_token(stop_ids[0])
        bos_id = None if bos is None else _token_id(tokenizer, bos, "bos_token", config)
        eos_id = _token_id(tokenizer, eos, "eos_token", config)
        if names.get("add_bos_token") is False:  # a BOS the model was never given texts with
            bos_id = None
    template = read_template(directory)
    eot = next(
        (t for t in END_OF_TURN_TOKENS if template and t in template and tokenizer.token_to_id(t) is not None), None
    )
    eot_id = None if eot is None or eot == eos else tokenizer.token_to_id(eot)
    return specials_from_ids(tokenizer, where, bos_id, eos_id, stop_ids, eot_id, unframed_bos=bos)


def _json_object(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PhalanxError(f"{file} is not valid JSON") from None
    if not isinstance(value, dict):
        raise PhalanxError(f"{file} is not a JSON object")
    return value


def _token_text(value: Any, key: str, file: Path) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or (isinstance(value, str) and value):
        return value
    raise PhalanxError(f'{file}: {key} must be a token string or an object with its "content", not {value!r}')


def _token_id(tokenizer: Tokenizer, text: str, key: str, file: Path) -> int:
    i = tokenizer.token_to_id(text)
    if i is None:
        raise PhalanxError(f"{file} names {key} {text!r}, which its tokenizer's vocabulary lacks")
    return i


def _id_list(value: Any, file: Path) -> list[int]:
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else [] if value is None else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise PhalanxError(f"{file}: eos_token_id must be a token id or a list of them, not {value!r}")
    return ids


def encode_documents(tokenizer: Tokenizer, documents: Iterable[str], chunk_size: int = 64) -> Iterator[np.ndarray]:
    """Yield one uint32 array per document: [BOS] + ids + [EOS] (no BOS for a tokenizer without one).
    encode_batch runs a chunk of documents in parallel in Rust, which is several times faster than
    encoding them one by one."""
    specials = special_tokens(tokenizer)
    head = [] if specials.bos_id is None else [specials.bos_id]
    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use: ~2x faster
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    docs = iter(documents)
    while chunk := list(islice(docs, chunk_size)):
        for encoding in encode_batch(chunk, add_special_tokens=False):
            ids = np.empty(len(head) + len(encoding.ids) + 1, dtype=np.uint32)
            ids[: len(head)], ids[len(head) : -1], ids[-1] = head, encoding.ids, specials.eos_id
            yield ids


def hf_tokenizer_config(max_length: int, specials: SpecialTokens, chat_template: str) -> dict:
    """tokenizer_config.json: what transformers' AutoTokenizer needs beyond tokenizer.json (an HF export
    writes it; the server's /tokenizer_info answers it)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials.bos,
        "eos_token": specials.eos,
        "pad_token": None,
        "add_bos_token": specials.bos_id is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": chat_template,
    }
