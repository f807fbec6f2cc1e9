"""The Ollama `options` phalanx accepts and ignores, as Ollama itself ignores the ones a model's runner
has no use for: its llama.cpp runner's settings (threads, GPU layers, memory mapping) and samplers that
phalanx does not have (mirostat, typical_p, tfs_z). They are typed as Ollama types them, so a wrong type
is still a 400; a name Ollama does not know at all stays an error ("unknown field"), since a typo such as
`temprature` quietly ignored would sample with a setting the caller did not mean.
"""

from __future__ import annotations

from phalanx.serve.http.common import Int64, StrictModel


class IgnoredOllamaOptions(StrictModel):
    # Sampling and context that llama.cpp offers and phalanx's engine does not.
    num_keep: Int64 | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: Int64 | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    # The runner's hardware and memory settings.
    num_batch: Int64 | None = None
    num_gpu: Int64 | None = None
    main_gpu: Int64 | None = None
    num_thread: Int64 | None = None
    num_gqa: Int64 | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    embedding_only: bool | None = None
    rope_frequency_base: float | None = None
    rope_frequency_scale: float | None = None

    def used(self) -> dict:
        """The options phalanx acts on, as given (the ignored ones and those left out dropped)."""
        return self.model_dump(exclude_none=True, exclude=set(IgnoredOllamaOptions.model_fields))
