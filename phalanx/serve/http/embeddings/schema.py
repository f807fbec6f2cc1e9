"""Request bodies of the embedding endpoints, strictly: Ollama's /api/embed and /api/embeddings, OpenAI's
/v1/embeddings. Ollama's `options` are taken as in generation and have no effect on an embedding."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from phalanx.serve.http.common import Int64, StrictModel
from phalanx.serve.http.ollama.schema import OllamaOptions


class OllamaEmbedRequest(StrictModel):
    model: str = Field(min_length=1)
    input: str | list[str] = []
    truncate: bool = True  # Ollama's default: inputs longer than the context are cut to it
    dimensions: Int64 | None = None
    options: OllamaOptions | None = None
    keep_alive: float | int | str | None = None

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class OllamaEmbeddingsRequest(StrictModel):
    """The older endpoint: one prompt, one (unnested) embedding."""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: OllamaOptions | None = None
    keep_alive: float | int | str | None = None


class OpenAIEmbeddingRequest(StrictModel):
    model: str = Field(min_length=1)
    # A string, strings, a token array, or token arrays, as OpenAI takes them.
    input: str | list[str] | list[Int64] | list[list[Int64]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None  # an end-user id for the caller's own records; phalanx keeps none
