"""llama.cpp through llama-cpp-python's low-level (ctypes) API: one model, one context whose KV cache holds
`sequences` parallel sequences, and one token batch reused for every step.

Only what the llama.cpp engine needs: queue tokens of any sequence into the batch, decode it in one
call, read the logits of the tokens that asked for them, forget a finished sequence's cache entries.
Every pointer is owned here and freed by close(); nothing of it is thread-safe, so one thread (the
engine's) does all the calls.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from phalanx.errors import PhalanxError

KV_DTYPES = ("f16", "f32")

_backend_lock = threading.Lock()
_backend_ready = False


class DecodeError(RuntimeError):
    """llama_decode refused or failed a batch (its return code says which)."""


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:  # a dependency, but a build can fail on an odd platform
        raise PhalanxError(
            f"the llama.cpp engine needs llama-cpp-python (pip install 'phalanx[llamacpp]'), which "
            f"does not import here: {e}"
        ) from e
    return llama_cpp


# ggml's log levels (ggml.h): 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line.
_GGML_ERROR = 4
_llama_log = logging.getLogger("phalanx.serve.llamacpp")
_log_callback = None  # kept referenced: llama.cpp holds only the C pointer


def _route_llama_cpp_log(llama_cpp) -> None:
    """llama.cpp's own lines into Python logging: errors as errors, the rest (model loading chatter, and
    warnings meant for other set-ups, such as a context shorter than the model's) at debug level.
    llama-cpp-python's handler prints ggml warnings as errors (its level table is off by one)."""
    global _log_callback

    @llama_cpp.llama_log_callback
    def callback(level, text, user_data):
        line = text.decode("utf-8", errors="replace").rstrip("\n")
        if line:
            _llama_log.log(logging.ERROR if level == _GGML_ERROR else logging.DEBUG, "%s", line)

    _log_callback = callback
    llama_cpp.llama_log_set(callback, None)


def _init_backend(llama_cpp) -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            _route_llama_cpp_log(llama_cpp)
            llama_cpp.llama_backend_init()
            _backend_ready = True


class LlamaCppContext:
    def __init__(
        self,
        gguf_path: Path,
        sequences: int,
        context: int | None,
        threads: int,
        kv_dtype: str = "f16",
        batch_tokens: int = 512,
        use_extra_buffers: bool = False,
        unified_kv: bool = False,
        flash_attention: bool | None = None,
    ):
        llama_cpp = self._lib = _llama_cpp()
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (got {kv_dtype!r})")
        if not 1 <= sequences <= llama_cpp.llama_max_parallel_sequences():
            raise ValueError(
                f"llama.cpp runs 1 to {llama_cpp.llama_max_parallel_sequences()} parallel sequences "
                f"(asked for {sequences})"
            )
        _init_backend(llama_cpp)
        self._model = self._ctx = self._batch = None
        model_params = llama_cpp.llama_model_default_params()
        # llama.cpp's "extra" buffer types (AMX tiles, repacked quantised blocks) kill the process with SIGILL
        # where the CPU lists AMX but the kernel does not grant its tile state: plain buffers unless asked.
        model_params.use_extra_bufts = use_extra_buffers
        model_params.n_gpu_layers = 0  # the engine reports device "cpu": keep every layer there
        self._model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), model_params)
        if not self._model:
            raise PhalanxError(f"llama.cpp could not load {gguf_path} as a GGUF model")
        try:
            vocab = llama_cpp.llama_model_get_vocab(self._model)
            self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
            self.bos_id, self.eos_id = llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)
            self.max_context = llama_cpp.llama_model_n_ctx_train(self._model)
            self.context = min(context or self.max_context, self.max_context)
            self.batch_tokens = max(batch_tokens, sequences)  # every sequence's decode token fits one batch
            self.sequences = sequences
            self._kv_bytes_per_value = 2 if kv_dtype == "f16" else 4
            params = llama_cpp.llama_context_default_params()
            # Room for every sequence to fill its context. Not unified (by default): each sequence has its own
            # stream of `context` cells, so its attention spans its own cells only, not every slot's, and
            # they are the same cells, in the same order, whatever the other sequences do.
            params.n_ctx = sequences * self.context
            params.n_seq_max = sequences
            params.kv_unified = unified_kv
            params.n_batch = params.n_ubatch = self.batch_tokens
            params.n_threads = params.n_threads_batch = threads
            params.type_k = params.type_v = llama_cpp.GGML_TYPE_F16 if kv_dtype == "f16" else llama_cpp.GGML_TYPE_F32
            if flash_attention is None:
                # llama.cpp's CPU flash-attention kernel rounds through f16 (logits off by ~2e-3 even with an
                # f32 cache, measured; 5e-6 without it): an f32 cache asks for f32 arithmetic, so it goes off;
                # otherwise llama.cpp decides (its "auto").
                fa_type = (
                    llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
                    if kv_dtype == "f32"
                    else llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
                )
            else:
                fa_type = (
                    llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
                    if flash_attention
                    else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
                )
            params.flash_attn_type = fa_type
            params.no_perf = True
            self._ctx = llama_cpp.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise PhalanxError(
                    f"llama.cpp could not create a context of {sequences} x {self.context} tokens for {gguf_path}"
                )
            self._memory = llama_cpp.llama_get_memory(self._ctx)
            self._batch = llama_cpp.llama_batch_init(self.batch_tokens, 0, 1)
        except BaseException:
            self.close()
            raise
        self.kv_cache_bytes = self._kv_cache_bytes()

    def _kv_cache_bytes(self) -> int:
        """K and V of every layer for every cell of the cache, as llama.cpp allocates them (it rounds the
        cells up to multiples of 256)."""
        lib, model = self._lib, self._model
        head_dim = lib.llama_model_n_embd(model) // lib.llama_model_n_head(model)
        per_cell = 2 * lib.llama_model_n_layer(model) * lib.llama_model_n_head_kv(model) * head_dim
        return per_cell * lib.llama_n_ctx(self._ctx) * self._kv_bytes_per_value

    # ---- one step: clear, add tokens, decode, read logits ----

    @property
    def queued(self) -> int:
        return self._batch.n_tokens

    def clear(self) -> None:
        self._batch.n_tokens = 0

    def add(self, token: int, position: int, sequence: int, logits: bool) -> int:
        """Queue one token of a sequence at its position; returns its row (for logits())."""
        batch, row = self._batch, self._batch.n_tokens
        if row >= self.batch_tokens:
            raise DecodeError(f"the batch holds at most {self.batch_tokens} tokens")
        batch.token[row] = token
        batch.pos[row] = position
        batch.n_seq_id[row] = 1
        batch.seq_id[row][0] = sequence
        batch.logits[row] = logits
        batch.n_tokens = row + 1
        return row

    def decode(self) -> None:
        rc = self._lib.llama_decode(self._ctx, self._batch)
        if rc != 0:
            meaning = {1: "no room in the KV cache for the batch", 2: "aborted", -1: "invalid input batch"}
            raise DecodeError(f"llama_decode returned {rc} ({meaning.get(rc, 'a fatal error')})")

    def logits(self, row: int) -> np.ndarray:
        """A copy of one queued token's next-token logits (the next decode overwrites llama.cpp's buffer)."""
        pointer = self._lib.llama_get_logits_ith(self._ctx, row)
        if not pointer:
            raise DecodeError(f"llama.cpp has no logits for batch row {row}")
        return np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).copy()

    def forget(self, sequence: int) -> None:
        """Drop every cache entry of a sequence, freeing its cells for the next one."""
        self._lib.llama_memory_seq_rm(self._memory, sequence, -1, -1)

    def close(self) -> None:
        lib = self._lib
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None
