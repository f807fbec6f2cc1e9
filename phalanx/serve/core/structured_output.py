"""Constrained decoding: a request's output held to a JSON schema (structured output, forced tool calls).

llguidance compiles the schema into a grammar and, at every step, says which tokens may come next; the
sampler sets every other logit to -inf before it tempers and draws, so whatever the model would have
said, the text parses (and validates). The mask belongs to one request's row alone: neighbours in the
batch never see it, and a request without a format samples exactly as before.

JSON is generated compact (no optional whitespace): a model that is unsure would otherwise be free to
pad with spaces until the token budget runs out. The grammar is complete once the only token it allows
is end-of-text; the engine then ends the request with "stop" without spending a step on that token.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from phalanx.serve.core.schema_compiler import FormatError, SchemaCompiler, compile_in_this_process, first_line

# Ollama's `format: "json"` and OpenAI's `json_object`: any JSON object (as llama.cpp's json grammar).
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class ConstraintError(ValueError):
    """The sampled token broke the grammar (only a bug could do it: the mask forbids such tokens)."""


def schema_grammar(schema: Any) -> str:
    """llguidance's grammar for a JSON schema you trust, compiled in this process (FormatError when it
    cannot be). A request's schema goes through the vocabulary's SchemaCompiler instead: some schemas
    crash the process that compiles them."""
    if not isinstance(schema, dict):
        raise FormatError(f"a JSON schema must be an object, not {type(schema).__name__}")
    return compile_in_this_process(json.dumps(schema))


class TokenVocabulary:
    """The tokenizer as llguidance sees it (built once per engine, on first use), each token's bytes, and
    the compiler of requests' schemas into grammars over it."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, model_vocab: int):
        self._tokenizer, self.eos_id, self.model_vocab = tokenizer, eos_id, model_vocab
        self._ll: LLTokenizer | None = None
        self._compiler: SchemaCompiler | None = None

    @property
    def compiler(self) -> SchemaCompiler:
        """Made on the first schema: the tokenizer's JSON (megabytes for a large vocabulary) is not
        serialised at start-up for a server that never sees one."""
        if self._compiler is None:
            self._compiler = SchemaCompiler(self._tokenizer.to_str(), self.eos_id)
        return self._compiler

    @property
    def ll(self) -> LLTokenizer:
        if self._ll is None:
            self._ll = LLTokenizer(self._tokenizer.to_str(), eos_token=self.eos_id)
        return self._ll

    def token_bytes(self, token: int) -> bytes:
        if token >= self.ll.vocab_size:  # a padded embedding row no text maps to
            return b""
        return self.ll.decode_bytes([token])

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh matcher for one request (each sample of n > 1 needs its own)."""
        matcher = LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise FormatError(f"the JSON schema is not supported: {first_line(matcher.get_error())}")
        return TokenConstraint(matcher, self.eos_id, self.model_vocab, self.ll.vocab_size)


class TokenConstraint:
    """One request's grammar state: which tokens may come next, advanced by each token taken."""

    def __init__(self, matcher: LLMatcher, eos_id: int, model_vocab: int, tokenizer_vocab: int):
        self.matcher, self.eos_id = matcher, eos_id
        self.model_vocab, self.tokenizer_vocab = model_vocab, tokenizer_vocab
        self._allowed: torch.Tensor | None = None

    def allowed(self, device: torch.device) -> torch.Tensor:
        """A bool mask over the model's vocabulary (rows past the tokenizer's are never allowed)."""
        if self._allowed is None:
            bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
            allowed = torch.zeros(self.model_vocab, dtype=torch.bool)
            n = min(self.model_vocab, self.tokenizer_vocab, bias.numel())
            allowed[:n] = bias[:n] > 0
            if not allowed.any():
                raise ConstraintError("the grammar allows no next token")
            self._allowed = allowed
        return self._allowed.to(device)

    def apply(self, logits_V: torch.Tensor) -> torch.Tensor:
        return logits_V.masked_fill(~self.allowed(logits_V.device), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(
                f"token {token} does not fit the requested format: {first_line(self.matcher.get_error())}"
            )
        self._allowed = None

    @property
    def complete(self) -> bool:
        """The grammar is finished: nothing but end-of-text may follow."""
        if self.matcher.is_stopped():
            return True
        if not self.matcher.is_accepting():
            return False
        allowed = self.allowed(torch.device("cpu"))
        return bool(allowed[self.eos_id]) and int(allowed.sum()) == 1


def ollama_format_schema(fmt: Any) -> dict[str, Any] | None:
    """Ollama's `format`: "" (none), "json" (any JSON object) or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ANY_JSON_OBJECT
    if isinstance(fmt, dict):
        return fmt
    raise FormatError('format must be "json" or a JSON schema object')


def openai_format_schema(response_format: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise FormatError('response_format json_schema must be {"name": ..., "schema": {...}}')
        return spec.get("schema") or ANY_JSON_OBJECT
    raise FormatError('response_format type must be "text", "json_object" or "json_schema"')
