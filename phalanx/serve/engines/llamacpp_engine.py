"""An inference engine on llama.cpp, implementing the engine contract (serve/core/contract.py: ServingEngine).

The same front (submit -> RequestStream of text pieces then one Finish, start/stop, alive/waiting/active,
kv_cache_bytes, the observer hooks, QueueFull/PromptTooLong), so the Ollama and OpenAI routes, limits and
metrics stay phalanx's; underneath, llama.cpp runs the run's GGUF export.

One background thread owns a llama.cpp context whose KV cache holds `slots` sequences of `context`
tokens (slots x context cells; by default each sequence in its own stream of them, so its attention
spans its own cells only, or one unified pool with unified_kv=True). Continuous batching: a request waits in a bounded
queue until a slot is free and joins at the next step boundary; every step is one llama_decode of a
single batch holding one decode token for each running sequence and the next prompt chunk of each
joining one, so prefill never stalls the others. A finished sequence's cache entries are removed at once
and its slot is free for the next step.

Prompt chunks are cut at fixed offsets (multiples of the batch size less the slots' decode tokens), not
by how full a step is, so a prompt is fed in the same pieces whatever else runs, into the same cells of
its own stream; with llama.cpp's matrix products computed row by row this keeps a request's greedy
tokens the same alone and in a busy batch (the tests check it, in both cache layouts).

Sampling is phalanx's own RequestSampler on each token's row of llama.cpp's logits (handed over as a
torch tensor), so temperature, top_k/top_p/min_p, the penalties, seeds and structured output (a
TokenConstraint) behave exactly as in the torch engine; llama.cpp's sampler chain is not used. Token ids
are phalanx's tokenizer's: the GGUF export carries that vocabulary and tokenises the same.

As in the torch engine, no single request can stop the thread: a bad request (a token id the model does
not have, options the sampler cannot take) fails alone with reason "error"; a failed llama_decode fails
the requests of that step; anything else that escapes a step fails what was running and the loop goes on.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from phalanx.data.tokenizer import special_tokens
from phalanx.errors import PhalanxError
from phalanx.serve.core.contract import EngineObserver, Request
from phalanx.serve.core.sampler import RequestSampler
from phalanx.serve.core.scheduler import Pending, ScheduledEngine, SlotScheduler, join_each
from phalanx.serve.core.structured_output import TokenVocabulary
from phalanx.serve.core.text_stream import IncrementalText, StopMatcher
from phalanx.serve.engines.llamacpp_context import LlamaCppContext

log = logging.getLogger("phalanx.serve")

CPU = torch.device("cpu")


@dataclass
class _Sequence:
    """A request holding a slot: its sequence id in llama.cpp's cache is the slot number."""

    request: Request
    slot: int
    sampler: RequestSampler
    text: IncrementalText
    stops: StopMatcher
    prefill_started_at: float
    fed: int = 0  # tokens in the cache: the next one goes at this position
    last_token: int = 0
    generated: int = 0
    first_token_at: float | None = None
    logprobs: list[dict] | None = None  # entries whose text has not been handed out yet
    prefilled: bool = False
    chunk_end: int = 0  # while prefilling: where this step's prompt chunk ends
    rows: list[int] = field(default_factory=list)  # this step's batch row of the token it reads logits at

    @property
    def prompt_left(self) -> int:
        return len(self.request.prompt_ids) - self.fed


class LlamaCppEngine(ScheduledEngine):
    def __init__(
        self,
        gguf_path: Path | str,
        tokenizer: Tokenizer,
        slots: int = 8,
        max_queue: int = 64,
        context: int | None = None,
        threads: int | None = None,
        observer: EngineObserver | None = None,
        kv_dtype: str = "f16",
        batch_tokens: int = 512,
        use_extra_buffers: bool = False,
        unified_kv: bool = False,
        flash_attention: bool | None = None,
    ):
        """gguf_path: a phalanx GGUF export (its vocabulary is `tokenizer`'s). context: tokens per slot
        (default and most: the model's context_length). threads: llama.cpp's (default: torch's, which
        `phalanx serve --threads` sets). kv_dtype: the cache's element type, f16 (llama.cpp's default) or
        f32 (closest to the torch engine). batch_tokens: the most tokens one step decodes.
        use_extra_buffers: llama.cpp's AMX/repacked weight buffers, off by default because on CPUs whose
        kernel does not grant AMX tile state they die with SIGILL. unified_kv: one pool of cells for all
        sequences (llama.cpp's kv_unified) instead of a stream per sequence. flash_attention: llama.cpp's;
        by default off with an f32 cache (its CPU kernel rounds through f16) and llama.cpp's choice with f16."""
        if slots < 1 or max_queue < 0:  # before llama.cpp allocates anything
            raise ValueError("an engine needs at least one slot and a queue of at least 0")
        self.tokenizer = tokenizer
        self.specials = special_tokens(tokenizer)  # refuses a tokenizer without them, before anything starts
        self.bos_id, self.eos_id = self.specials.bos_id, self.specials.eos_id
        self.slots, self.max_queue = slots, max_queue
        self.device = CPU
        self.threads = threads or torch.get_num_threads() or os.cpu_count() or 1
        self.llama = LlamaCppContext(
            Path(gguf_path),
            slots,
            context,
            self.threads,
            kv_dtype,
            batch_tokens,
            use_extra_buffers,
            unified_kv,
            flash_attention,
        )
        # BOS is compared only where the tokenizer has one: a GGUF without BOS names none, and llama.cpp
        # then reports a default of its own (phalanx feeds the prompt's ids itself, so it is never used).
        theirs = (self.llama.bos_id if self.bos_id is not None else None, self.llama.eos_id)
        if theirs != (self.bos_id, self.eos_id):
            self.llama.close()
            raise PhalanxError(
                f"{gguf_path} has begin/end-of-text tokens {theirs[0]}/{theirs[1]}, "
                f"the tokenizer {self.bos_id}/{self.eos_id}: it was not exported with this tokenizer"
            )
        self.context = self.llama.context
        self.vocab_size = self.llama.vocab_size
        # Prompt chunks start at multiples of this, whatever the load (see the module's docstring).
        self.prefill_chunk = self.llama.batch_tokens - slots if self.llama.batch_tokens > slots else 1
        self.observer = observer
        self.vocabulary = TokenVocabulary(tokenizer, self.eos_id, self.vocab_size)
        self.scheduler = SlotScheduler(
            self,
            "phalanx-llamacpp-engine",
            slots,
            max_queue,
            self.context,
            self.specials.stop_ids,
            self.vocabulary,
            observer,
        )

    # ---- the caller's side (the rest of ServingEngine is ScheduledEngine's) ----

    @property
    def kv_cache_bytes(self) -> int:
        return self.llama.kv_cache_bytes

    # ---- the engine thread (EngineSteps) ----

    def thread_ends(self) -> None:
        self.llama.close()  # llama.cpp's memory goes with the thread (or at stop() if it never started)

    def release(self, slot: int) -> None:
        self.llama.forget(slot)  # its cells are free for the next step's tokens

    def join_all(self, pending: Pending) -> None:
        join_each(pending, self._join)

    def _join(self, slot: int, request: Request) -> None:
        """Give a request its slot; its prompt is fed by the coming steps."""
        if self.scheduler.ends_before_start(request, self.vocab_size):
            return
        try:
            seq = _Sequence(
                request,
                slot,
                RequestSampler(request.options, request.prompt_ids, self.context, CPU),
                IncrementalText(self.tokenizer),
                StopMatcher(request.options.stop),
                time.perf_counter(),
                logprobs=None if request.top_logprobs is None else [],
            )
        except Exception as e:  # options no validation caught (a seed torch cannot take, say)
            log.exception("request set-up failed")
            return self.scheduler.finish_unstarted(request, "error", f"generation failed: {e}")
        self.llama.forget(slot)  # nothing of the slot's last sequence may leak into this one's attention
        self.scheduler.occupy(slot, seq)

    def step(self) -> None:
        """One llama_decode: a token for every decoding sequence, then whole prompt chunks while they fit."""
        llama = self.llama
        llama.clear()
        seqs = list(self.scheduler.running.values())
        decoding = [s for s in seqs if s.prefilled]
        for seq in decoding:
            seq.rows = [llama.add(seq.last_token, seq.fed, seq.slot, True)]
        in_batch = list(decoding)
        for seq in (s for s in seqs if not s.prefilled):  # in the order they joined
            prompt, start = seq.request.prompt_ids, seq.fed
            end = min(len(prompt), (start // self.prefill_chunk + 1) * self.prefill_chunk)
            if llama.queued + (end - start) > llama.batch_tokens:
                break  # the rest wait for the next step (the oldest joiner first)
            for position in range(start, end):
                row = llama.add(prompt[position], position, seq.slot, position == len(prompt) - 1)
            seq.chunk_end, seq.rows = end, [row] if end == len(prompt) else []
            in_batch.append(seq)
        try:
            llama.decode()
        except Exception as e:  # the batch itself: fail this step's requests, keep serving
            log.exception("llama_decode failed")
            for seq in in_batch:
                self.scheduler.finish(seq, "error", f"generation failed: {e}")
            return
        for seq in in_batch:  # each sequence on its own: one request's bad sample fails it alone
            try:
                self._advance(seq)
            except Exception as e:
                log.warning("request in slot %d failed: %s", seq.slot, e)
                if self.scheduler.holds(seq):
                    self.scheduler.finish(seq, "error", f"generation failed: {e}")

    def _advance(self, seq: _Sequence) -> None:
        """Account for what this step fed, and take a token where it gave logits."""
        if seq.prefilled:
            seq.fed += 1
        else:
            seq.fed = seq.chunk_end
            if seq.prompt_left:
                return
            seq.prefilled = True
            if self.observer:
                self.observer.prompt_prefilled(len(seq.request.prompt_ids))
        logits_V = torch.from_numpy(self.llama.logits(seq.rows[0]))
        constraint = seq.request.constraint
        if seq.sampler.greedy_without_penalties and constraint is None:
            token = int(logits_V.argmax())
        else:
            token = seq.sampler.pick(logits_V, constraint)
        self.scheduler.take(seq, token, logits_V)
