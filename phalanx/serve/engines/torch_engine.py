"""The inference engine: continuous batching over a preallocated KV cache.

One background thread owns the model. The cache holds `slots` rows of `context` positions, allocated
once. A request waits in a bounded queue until a slot is free; at the next step boundary it joins: the
prompts joining at one boundary are prefilled together, in one forward pass over all their tokens with
each prompt attending only to its own (prefill.py), each into its own cache row, and their first tokens
come out together; then every step decodes one token for all running requests in a single batched
forward, each row at its own position. Finished rows free their slot at once. One boundary takes at most
MAX_PREFILL_TOKENS prompt tokens (a longer prompt is chunked, below), so a burst joins over several
boundaries with a decode step between each: first tokens come out pass by pass, and running rows are
never stalled for a whole burst's prefill. A prompt longer than prefill_chunk tokens is prefilled chunk by
chunk, one chunk per boundary, into a one-row cache of its own (so decode steps never touch its half-made
rows), beside that boundary's short prompts and with a decode step of the running requests between its
chunks; after its last chunk its keys and values move into a packed row and its first token comes out.
Long prompts take turns, one chunking at a time, in the order they joined.

A decode step is sized to what runs, not to the server (on CPU, where it can be proven row-invariant):
running requests keep the low rows of the cache packed (a leaving request's row is refilled by moving
the last one down, one copy per departure rather than a gather per step), the step runs over the first
`width` rows, width the running count rounded up to a power of two (capped at slots), and attends over
the first `span` positions, span the longest live row rounded up by at most 25% (step_span). So
one request on a 16-slot server decodes one row over its own length, and the few shapes there are keep
any shape cache (oneDNN's primitives, a compiled graph) small.

Greedy decoding gives a request the same tokens alone as in a busy batch because each row's math never
sees its neighbours or the step's width: the linear layers run through oneDNN on packed weights
(row_invariant.py), whose rows are the same bits at any batch size, where MKL's are not (decode steps take
a kernel of phalanx's own with oneDNN's very bits where a start check proves them: decode_kernel.py); a prompt's
attention in a batched prefill is the very call its prefill alone makes; the attention of batched
decoding is spelt out row by row (models/token_pass.py DecodeRows), and positions beyond a row's length weigh
exactly 0 whatever the span. Where that cannot be had (a GPU, another dtype) every step keeps today's
full shape, (slots, 1) over the whole context, idle rows padded; and where tall products are not
row-invariant (bf16 on this CPU: batched_prefill) each prompt is prefilled alone through the model's own
forward. Chunking holds everywhere: a prompt's chunks are cut from its length alone (prefill.chunk_plan)
and each chunk pass holds that prompt only, so its passes have the same shapes and inputs, hence the same
bits, alone and in company, on any device and dtype. Sampling is per row, with the request's own generator.

Callers hold a RequestStream: text pieces as they are decoded (whole characters, never part of a stop
string), then one Finish with the reason and the counts and timings.

A request may bring a TokenConstraint (structured output: only tokens its grammar allows are sampled in
its row, and it ends with "stop" once the grammar is complete) and ask for log-probabilities: each taken
token's log-softmax under the model's raw logits (before penalties, temperature, filters or the grammar's
mask, as OpenAI reports them) with the k likeliest alternatives, carried by the piece its text ends up in.
Neither changes which token a row takes: greedy rows without a grammar still take the batch's argmax.
A request may also have its prompt scored (prompt_logprobs: OpenAI's echo with logprobs): its prefill
keeps the hidden rows of every prompt position and scores them through the head apart from the pass
(prompt_scoring.py), so nothing else in the pass changes; with max_tokens 0 it ends there.

No single request can stop the thread: a failure in one request's set-up, sampling or text decoding
fails that request alone (reason "error"), and only a failed batched forward fails the requests of that
step. Anything else that escapes a step fails what was running and the loop goes on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from phalanx.data.tokenizer import special_tokens
from phalanx.models.decoder import KVCache, Transformer
from phalanx.models.token_pass import Cached, decode_attention_dtype
from phalanx.serve.core.contract import EngineObserver, Request
from phalanx.serve.core.sampler import RequestSampler
from phalanx.serve.core.scheduler import Pending, ScheduledEngine, SlotScheduler
from phalanx.serve.core.structured_output import TokenVocabulary
from phalanx.serve.core.text_stream import IncrementalText, StopMatcher
from phalanx.serve.engines.decode_block import decode_step_rows
from phalanx.serve.engines.decode_kernel import decode_kernel_available
from phalanx.serve.engines.prefill import (
    MAX_PREFILL_TOKENS,
    PREFILL_CHUNK_TOKENS,
    chunk_plan,
    prefill_chunk,
    prefill_rows_agree,
    prefill_together,
)
from phalanx.serve.engines.prompt_scoring import KeepRows, row_logprobs, scored_span
from phalanx.serve.engines.row_invariant import make_rows_invariant

log = logging.getLogger("phalanx.serve")


@dataclass
class _Running:
    request: Request
    slot: int
    position: int  # where the next fed token goes in the cache
    sampler: RequestSampler
    text: IncrementalText
    stops: StopMatcher
    prefill_started_at: float
    last_token: int = 0
    generated: int = 0
    first_token_at: float | None = None
    logprobs: list[dict] | None = None  # entries whose text has not been handed out yet
    prompt_scores: list[dict] | None = None  # a scored prompt's entries so far (its chunks come one by one)


class _SlotCache:
    """One row of the shared cache, shaped like a batch-of-one KVCache (views: writes land in it)."""

    def __init__(self, cache: KVCache, row: int):
        self.max_len = cache.max_len
        self._layers = [(k[row : row + 1], v[row : row + 1]) for k, v in zip(cache.k, cache.v)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]


class _StepCache:
    """The first `width` rows and `span` positions of the shared cache: what one decode step reads (views:
    the step's writes, at positions below span, land in the cache)."""

    def __init__(self, cache: KVCache, width: int, span: int):
        self.max_len = span
        self._layers = [(k[:width, :, :span], v[:width, :, :span]) for k, v in zip(cache.k, cache.v)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]


def step_width(running: int, slots: int) -> int:
    """Rows a decode step runs over: the running count rounded up to a power of two, at most slots."""
    return min(1 << (running - 1).bit_length(), slots)


def step_span(longest: int, context: int) -> int:
    """Positions a decode step attends over: the longest live row rounded up to a multiple of a quarter
    of the power of two below it (at most 25% beyond it, four shapes per doubling), at least 32."""
    if longest <= 32:
        return min(32, context)
    quarter = 1 << max((longest - 1).bit_length() - 3, 0)
    return min(-(-longest // quarter) * quarter, context)


class Engine(ScheduledEngine):
    """The torch engine: the module's docstring; its scheduler (serve/core/scheduler.py) runs it."""

    scores_prompts = True

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        slots: int = 8,
        max_queue: int = 64,
        context: int | None = None,
        observer: EngineObserver | None = None,
    ):
        args = model.args
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.specials = special_tokens(tokenizer)  # refuses a tokenizer without them, before anything starts
        self.bos_id, self.eos_id = self.specials.bos_id, self.specials.eos_id
        self.slots, self.max_queue = slots, max_queue
        self.context = min(context or args.max_seq_len, args.max_seq_len)
        self.observer = observer
        self.vocabulary = TokenVocabulary(tokenizer, self.eos_id, args.vocab_size)
        self.scheduler = SlotScheduler(
            self, "phalanx-engine", slots, max_queue, self.context, self.specials.stop_ids, self.vocabulary, observer
        )
        weight = model.tok_embeddings.weight
        self.device = weight.device
        # The dtype decode attends in (float32 on CPU, whatever the model's): no cast of the cache per step,
        # for twice a bf16 model's cache memory.
        cache_dtype = decode_attention_dtype(self.device, weight.dtype)
        self.cache = KVCache(args, slots, self.context, dtype=cache_dtype, device=self.device)
        # Steps sized to the running requests only where each row is then provably the same bits; prompts
        # prefilled together only where tall products keep them so too (prefill.py).
        self.sized_steps = make_rows_invariant(self.model)
        self.batched_prefill = self.sized_steps and prefill_rows_agree(self.model)
        # Decode attention in the decode kernel where it runs (a float32 cache on an AVX-512 CPU): each row
        # over its own positions only, summed alone, so still the same bits alone and in company.
        kernel = cache_dtype == torch.float32 and self.device.type == "cpu" and decode_kernel_available(cache_dtype)
        self._decode_rows = decode_step_rows(self.model, kernel)  # native blocks where they cover a layer
        # A burst of long prompts joins over several boundaries, a decode step between each (prefill.py).
        self.prefill_budget = MAX_PREFILL_TOKENS if self.batched_prefill else float("inf")
        # Longer prompts are prefilled a chunk per boundary (None: each in one pass), into a one-row cache
        # of their own: decode steps write their idle rows' position 0, which must not land in a prompt
        # half prefilled, and the running rows stay packed. One prompt chunks at a time, the rest queue.
        self.prefill_chunk: int | None = PREFILL_CHUNK_TOKENS
        self._chunk_cache = KVCache(args, 1, self.context, dtype=cache_dtype, device=self.device)
        self._chunking: deque[_Running] = deque()  # joined, prompt not yet prefilled; the first is chunking
        self._chunked_to = 0  # where the first one's next chunk starts
        # The tokens whose keys and values the chunk cache holds, from position 0: a later long prompt that
        # begins with the same whole chunks (a chat's next turn resends the conversation) skips them.
        self._chunk_cache_tokens: list[int] = []
        self.reused_prompt_tokens = 0  # prompt tokens so skipped, in all
        self._rows: dict[int, int] = {}  # slot -> its cache row; running requests hold rows 0..n-1

    # ---- the caller's side ----

    @property
    def kv_cache_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (*self.cache.k, *self.cache.v, *self._chunk_cache.k, *self._chunk_cache.v)
        )

    # ---- the engine thread (EngineSteps) ----

    def run_thread(self, loop: Callable[[], None]) -> None:
        # This thread only ever does inference. Inference mode rather than no_grad: tensors made here carry
        # no version counters or autograd state, which took 8-10% off a one-row decode step's work outside
        # the matrix products (measured, 125m shape, bf16 and float32).
        with torch.inference_mode():
            loop()

    def _chunked(self, request: Request) -> bool:
        return self.prefill_chunk is not None and len(request.prompt_ids) > self.prefill_chunk

    def boundary_tokens(self, request: Request) -> int:
        # A chunked prompt is not in the boundary's batched pass: its chunks have passes of their own.
        return 0 if self._chunked(request) else len(request.prompt_ids)

    def release(self, slot: int) -> None:
        """Keep the running rows packed: the last row moves into the freed one (its live positions only)."""
        for i, run in enumerate(self._chunking):  # cancelled or failed before its prompt was prefilled
            if run.slot == slot:
                del self._chunking[i]
                if i == 0:
                    self._chunked_to = 0  # the next one starts from its first chunk
                return
        row = self._rows.pop(slot, None)
        if row is None or row == len(self._rows):
            return
        last_slot = next(s for s, r in self._rows.items() if r == len(self._rows))
        moved = self.scheduler.running.get(last_slot)
        live = self.cache.max_len if moved is None else min(moved.position + 1, self.cache.max_len)
        for k, v in zip(self.cache.k, self.cache.v):
            k[row, :, :live] = k[len(self._rows), :, :live]
            v[row, :, :live] = v[len(self._rows), :, :live]
        self._rows[last_slot] = row

    def join_all(self, pending: Pending) -> None:
        """Start the requests joining at this boundary and take their first tokens: their prompts prefilled
        together in one pass where that is each prompt's own bits (batched_prefill), else one at a time;
        then one chunk of the long prompt whose turn it is."""
        runs = [run for run in (self._start(*pending.popleft()) for _ in range(len(pending))) if run]
        self._chunking.extend(run for run in runs if self._chunked(run.request))
        runs = [run for run in runs if not self._chunked(run.request)]
        for group in [runs] if self.batched_prefill else [[run] for run in runs]:
            if not group:
                continue
            started = time.perf_counter()
            for run in group:
                run.prefill_started_at = started
            keep = self._keep_for_scoring(group)
            try:
                logits_NV = self._prefill(group, keep)
            except Exception as e:  # the prefill itself: fail the requests in it, keep serving
                log.exception("prefill failed")
                for run in group:
                    self.scheduler.finish(run, "error", f"generation failed: {e}")
                continue
            for i, (run, logits_V) in enumerate(zip(group, logits_NV)):  # each on its own: one failure fails one
                try:
                    if self.observer:
                        self.observer.prompt_prefilled(len(run.request.prompt_ids))
                    if keep is not None and run.prompt_scores is not None:
                        self._score(run, keep.kept[i], 0)
                    self._first_token(run, logits_V)
                except Exception as e:
                    log.exception("first token failed")
                    self.scheduler.finish(run, "error", f"generation failed: {e}")
        if self._chunking:
            self._prefill_next_chunk()

    def _keep_for_scoring(self, group: list[_Running]) -> KeepRows | None:
        """Where a batched (or lone) prefill of `group` keeps the hidden rows of its scored prompts, along
        the prompts laid end to end; None when none of them is scored."""
        if all(run.prompt_scores is None for run in group):
            return None
        spans, at = [], 0
        for run in group:
            n = len(run.request.prompt_ids)
            spans.append((at, at + n - 1) if run.prompt_scores is not None else (at, at))
            at += n
        return KeepRows(spans)

    def _score(self, run: _Running, hidden_TD: torch.Tensor, start: int) -> None:
        """Score the prompt tokens after `start` that these hidden rows predict; once the whole prompt is
        scored, the entries go to the stream (before its first piece)."""
        prompt = run.request.prompt_ids
        logprobs_TV = row_logprobs(self.model, hidden_TD)
        run.prompt_scores += self.scheduler.prompt_entries(prompt[start:], logprobs_TV, run.request.prompt_logprobs)
        if len(run.prompt_scores) == len(prompt) - 1:
            run.request.stream.prompt_logprobs = run.prompt_scores

    def _first_token(self, run: _Running, logits_V: torch.Tensor) -> None:
        if run.request.limit == 0:  # a prompt only scored (max_tokens 0): done once prefilled
            return self.scheduler.finish(run, "length")
        self.scheduler.take(run, run.sampler.pick(logits_V, run.request.constraint), logits_V)

    def _prefill_next_chunk(self) -> None:
        """One chunk of the first chunking prompt; after its last, the prompt joins the decoding rows and
        its first token comes out."""
        run = self._chunking[0]
        if run.request.stream.cancelled:  # not another chunk for a client that has gone
            return self.scheduler.finish(run, "cancelled")
        prompt = run.request.prompt_ids
        if self._chunked_to == 0:
            run.prefill_started_at = time.perf_counter()
            self._chunked_to = self._reusable_chunks(run)
            self.reused_prompt_tokens += self._chunked_to
        start = self._chunked_to
        end = dict(chunk_plan(len(prompt), self.prefill_chunk))[start]
        keep = None if run.prompt_scores is None else KeepRows([scored_span(start, end, len(prompt))])
        self._chunk_cache_tokens = prompt[:start]  # a pass that fails midway leaves what it wrote unknown
        try:
            logits_V = prefill_chunk(self.model, prompt[start:end], self._chunk_cache, start, keep)
            if keep is not None:
                self._score(run, keep.kept[0], start)
        except Exception as e:  # this prompt's pass alone: fail it, keep serving the others
            log.exception("prefill failed")
            return self.scheduler.finish(run, "error", f"generation failed: {e}")
        self._chunked_to = end
        self._chunk_cache_tokens = prompt[:end]
        if end < len(prompt):
            return
        self._chunking.popleft()
        self._chunked_to = 0
        if run.request.limit == 0:  # scored only: it never needs a cache row
            if self.observer:
                self.observer.prompt_prefilled(len(prompt))
            return self.scheduler.finish(run, "length")
        # Into the next packed row; it decodes from the next step on.
        row = self._rows[run.slot] = len(self._rows)
        for k, v, chunk_k, chunk_v in zip(self.cache.k, self.cache.v, self._chunk_cache.k, self._chunk_cache.v):
            k[row, :, :end] = chunk_k[0, :, :end]
            v[row, :, :end] = chunk_v[0, :, :end]
        try:
            if self.observer:
                self.observer.prompt_prefilled(len(prompt))
            self._first_token(run, logits_V)
        except Exception as e:
            log.exception("first token failed")
            self.scheduler.finish(run, "error", f"generation failed: {e}")

    def _reusable_chunks(self, run: _Running) -> int:
        """Where this long prompt's chunking may start: after the whole chunks it shares, token for token,
        with what the chunk cache holds, short of its last chunk (whose pass gives the first token). Those
        keys and values came from the very passes this prompt would make (chunks are cut from position 0
        at fixed sizes, and a chunk's pass depends only on the tokens up to its end), so skipping them
        changes no bit. A scored prompt needs every chunk's hidden rows, so it skips none."""
        if run.prompt_scores is not None:
            return 0
        prompt, cached = run.request.prompt_ids, self._chunk_cache_tokens
        common = next((i for i, (a, b) in enumerate(zip(prompt, cached)) if a != b), min(len(prompt), len(cached)))
        last_chunk = chunk_plan(len(prompt), self.prefill_chunk)[-1][0]
        return min(common // self.prefill_chunk * self.prefill_chunk, last_chunk)

    def _prefill(self, group: list[_Running], keep: KeepRows | None) -> torch.Tensor:
        """Each run's prompt into its cache row; the logits (n, V) of each prompt's last token (and the
        scored prompts' hidden rows into `keep`)."""
        if self.batched_prefill:
            return prefill_together(
                self.model,
                [run.request.prompt_ids for run in group],
                self.cache,
                [self._rows[run.slot] for run in group],
                keep,
            )
        (run,) = group  # one at a time, through the model's own forward
        prompt_1T = torch.tensor([run.request.prompt_ids], dtype=torch.long, device=self.device)
        cached = Cached(_SlotCache(self.cache, self._rows[run.slot]))
        return self.model(prompt_1T, cached if keep is None else keep.around(cached))[:, -1]

    def _start(self, slot: int, request: Request) -> _Running | None:
        """A joining request's running state in the next free cache row; None if it ends before a prefill."""
        # The vocabulary check too: a token-id prompt (OpenAI's completions) with an id the embedding lacks
        # would fail the whole batched pass it joined.
        if self.scheduler.ends_before_start(request, self.model.args.vocab_size):
            return None
        try:
            run = _Running(
                request,
                slot,
                len(request.prompt_ids),
                RequestSampler(request.options, request.prompt_ids, self.context, self.device),
                IncrementalText(self.tokenizer),
                StopMatcher(request.options.stop),
                time.perf_counter(),
                logprobs=None if request.top_logprobs is None else [],
                prompt_scores=None if request.prompt_logprobs is None else [],
            )
        except Exception as e:  # options no validation caught (a seed torch cannot take, say)
            log.exception("request set-up failed")
            return self.scheduler.finish_unstarted(request, "error", f"generation failed: {e}")
        self.scheduler.occupy(slot, run)
        if not self._chunked(request):  # a chunked prompt takes its row after its last chunk
            self._rows[slot] = len(self._rows)
        return run

    def step(self) -> None:
        runs = [run for run in self.scheduler.running.values() if run.slot in self._rows]  # not the prompts chunking
        if not runs:
            return
        rows = [self._rows[run.slot] for run in runs]  # fixed for this step: a release moves rows for the next
        if self.sized_steps:
            width = step_width(len(runs), self.slots)
            span = step_span(max(run.position for run in runs) + 1, self.cache.max_len)
        else:
            width, span = self.slots, self.cache.max_len
        tokens, positions = [0] * width, [0] * width  # idle rows: token 0 at position 0, ignored
        for run, row in zip(runs, rows):
            tokens[row], positions[row] = run.last_token, run.position
        try:
            tokens_N1 = torch.tensor(tokens, dtype=torch.long, device=self.device).view(width, 1)
            positions_N = torch.tensor(positions, dtype=torch.long, device=self.device)
            cache = _StepCache(self.cache, width, span)
            logits_NV = self.model(tokens_N1, self._decode_rows(cache, positions_N))[:, 0].float()
            greedy = logits_NV.argmax(dim=-1).tolist()
        except Exception as e:  # the batched forward itself: fail this step's requests, keep serving
            log.exception("decode step failed")
            for run in runs:
                self.scheduler.finish(run, "error", f"generation failed: {e}")
            return
        for run, row in zip(runs, rows):  # each row on its own: one request's bad sample fails it alone
            try:
                constraint = run.request.constraint
                if run.sampler.greedy_without_penalties and constraint is None:
                    token = greedy[row]
                else:
                    token = run.sampler.pick(logits_NV[row], constraint)
                run.position += 1
                self.scheduler.take(run, token, logits_NV[row])
            except Exception as e:
                log.warning("request in slot %d failed: %s", run.slot, e)
                if self.scheduler.holds(run):
                    self.scheduler.finish(run, "error", f"generation failed: {e}")
