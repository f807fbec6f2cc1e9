"""The model a server serves: loaded from a run directory or an export, with its name, chat template
and the facts the APIs report about it (/api/tags, /api/show, /v1/models)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from phalanx.data.chat_template import CHAT_STOP, CHAT_TEMPLATE, render_chat
from phalanx.data.prompt_tokens import PromptEncoder
from phalanx.run.model_loader import LoadedModel, load_model


@dataclass
class ServedModel:
    name: str  # as clients ask for it; "NAME" and "NAME:latest" are the same model when NAME has no tag
    loaded: LoadedModel
    source: Path
    load_seconds: float
    loaded_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def chat_stops(self) -> list[str]:
        # Where a reply ends besides its stop ids: phalanx's template ends a turn with a blank line and the
        # next speaker's name, which a model trained on plays goes on to write. A checkpoint's template
        # ends a turn with a token (<|eot_id|>, <|im_end|>), among the stop ids already.
        return list(CHAT_STOP) if self.loaded.chat_template == CHAT_TEMPLATE else []

    def matches(self, requested: str) -> bool:
        return requested == self.name or (":" not in self.name and requested == f"{self.name}:latest")

    @property
    def tagged_name(self) -> str:
        return self.name if ":" in self.name else f"{self.name}:latest"

    # Kept once computed: keep_alive (serve/http/keep_alive.py) may take the weights out of memory for a while.
    @cached_property
    def parameters(self) -> int:
        return self.loaded.model.num_params()

    @cached_property
    def size_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())

    @property
    def digest(self) -> str:
        """An identifier of this model (source and shape), not a hash of the weights' bytes."""
        args = self.loaded.model.args.__dict__
        return hashlib.sha256(json.dumps([str(self.loaded.checkpoint), args], sort_keys=True).encode()).hexdigest()

    @cached_property
    def prompt_encoder(self) -> PromptEncoder:
        return PromptEncoder(self.loaded.tokenizer)

    def chat_prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation rendered with the chat template, ready for the assistant's turn.
        Special-token strings in what users wrote stay text: only the template's markers are control
        tokens (phalanx/data/prompt_tokens.py)."""

        def render(shown: list[dict[str, Any]]) -> str:
            try:
                return render_chat(shown, template=self.loaded.chat_template, **self.loaded.specials.template_strings())
            except Exception as e:  # jinja2's errors from a template that came with an export
                raise ValueError(f"the chat template could not render these messages: {e}") from None

        return self.prompt_encoder.chat_ids(messages, render)

    def text_prompt_ids(self, text: str) -> list[int]:
        """Plain text to continue, framed as in training: BOS (where the tokenizer has one), then the text
        (special-token strings in it are text, never control tokens)."""
        return self.loaded.specials.frame(self.prompt_encoder.text_ids(text))

    def details(self) -> dict[str, Any]:
        """Ollama's `details` object."""
        return {
            "parent_model": "",
            "format": self.loaded.format,
            "family": self.loaded.model.args.family,
            "families": [self.loaded.model.args.family],
            "parameter_size": _human_count(self.parameters),
            "quantization_level": _DTYPE_NAMES.get(next(self.loaded.model.parameters()).dtype, "unknown"),
        }


_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}  # as GGUF names them


def _human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def load_served_model(
    path: Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, name: str | None = None
) -> ServedModel:
    """A run directory (its newest checkpoint), a checkpoint directory, an HF export or a GGUF export."""
    started = time.perf_counter()
    loaded = load_model(path, device)
    if dtype is not None:
        loaded.model.to(dtype)
    return ServedModel(name or loaded.name, loaded, Path(path).resolve(), time.perf_counter() - started)
