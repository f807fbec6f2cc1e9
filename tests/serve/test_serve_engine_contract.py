"""The engine contract (serve/core/contract.py, serve/core/scheduler.py): every engine gives its callers
all of ServingEngine and its scheduler all of EngineSteps, and the two Protocols are enough to write an
engine: a small one written here from them alone serves through the same scheduler, queue limits and
cancellation as phalanx's own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from phalanx.models.decoder import ModelArgs
from phalanx.serve.core.contract import QueueFull, Request, ServingEngine
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.core.scheduler import EngineSteps, Pending, ScheduledEngine, SlotScheduler, join_each
from phalanx.serve.core.structured_output import TokenVocabulary
from phalanx.serve.core.text_stream import IncrementalText, StopMatcher
from phalanx.serve.engines.llamacpp_engine import LlamaCppEngine
from phalanx.serve.engines.torch_engine import Engine
from phalanx.serve.engines.vllm_engine import VllmEngine

ARGS = ModelArgs(
    dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=384, max_seq_len=64, rope_theta=10000.0
)  # the conftest's model and tokenizer fixtures read this


def members(protocol: type) -> set[str]:
    """A Protocol's attributes and methods (what a class must have to implement it)."""
    names = set(protocol.__dict__.get("__annotations__", {}))
    return names | {
        n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }


def test_the_protocols_name_what_the_callers_and_the_scheduler_use():
    assert {
        "submit",
        "start",
        "stop",
        "active",
        "waiting",
        "alive",
        "slots",
        "max_queue",
        "context",
        "vocabulary",
        "device",
        "kv_cache_bytes",
        "observer",
        "scores_prompts",
    } <= members(ServingEngine)
    assert {
        "join_all",
        "step",
        "release",
        "boundary_tokens",
        "run_thread",
        "thread_ends",
        "logprob_entry",
        "prefill_budget",
    } <= members(EngineSteps)


@pytest.mark.parametrize("engine_class", [Engine, LlamaCppEngine, VllmEngine])
def test_every_engine_implements_the_steps_and_holds_a_scheduler(engine_class):
    methods = members(EngineSteps) - {"prefill_budget"}  # an attribute, set per instance by the torch engine
    missing = sorted(m for m in methods if not callable(getattr(engine_class, m, None)))
    assert not missing, f"{engine_class.__name__} lacks {missing}"
    assert issubclass(engine_class, ScheduledEngine)


def test_the_torch_engine_has_all_of_serving_engine(model, tokenizer):
    engine = Engine(model, tokenizer, slots=2, max_queue=1)
    try:
        missing = sorted(m for m in members(ServingEngine) if not hasattr(engine, m))
        assert not missing
        assert isinstance(engine.scheduler, SlotScheduler) and engine.scheduler.steps is engine
    finally:
        engine.stop()


@dataclass
class _Echo:
    request: Request
    slot: int
    text: IncrementalText
    stops: StopMatcher
    prefill_started_at: float = field(default_factory=time.perf_counter)
    sampler: None = None
    last_token: int = 0
    generated: int = 0
    first_token_at: float | None = None
    logprobs: list[dict] | None = None


class EchoEngine(ScheduledEngine):
    """Replies with its prompt's tokens, one a step: an engine written from the contract alone."""

    prefill_budget = float("inf")

    def __init__(self, tokenizer, slots: int, max_queue: int):
        self.tokenizer, self.slots, self.max_queue, self.context = tokenizer, slots, max_queue, 64
        self.vocabulary = TokenVocabulary(tokenizer, 1, tokenizer.get_vocab_size())
        self.observer, self.device, self.steps_run = None, "cpu", 0
        self.scheduler = SlotScheduler(self, "echo-engine", slots, max_queue, self.context, [1], self.vocabulary, None)

    @property
    def kv_cache_bytes(self) -> int:
        return 0

    def run_thread(self, loop) -> None:
        loop()

    def thread_ends(self) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def boundary_tokens(self, request: Request) -> int:
        return len(request.prompt_ids)

    def logprob_entry(self, token: int, scores, k: int) -> dict:
        return self.scheduler.token_logprob(token, 0.0)

    def join_all(self, pending: Pending) -> None:
        join_each(pending, self._join)

    def _join(self, slot: int, request: Request) -> None:
        if not self.scheduler.ends_before_start(request):
            run = _Echo(request, slot, IncrementalText(self.tokenizer), StopMatcher(request.options.stop))
            self.scheduler.occupy(slot, run)

    def step(self) -> None:
        self.steps_run += 1
        time.sleep(0.01)  # a step takes time, as a model's does: a cancel lands between steps
        for run in list(self.scheduler.running.values()):
            prompt = run.request.prompt_ids
            self.scheduler.take(run, prompt[run.generated % len(prompt)], None)


def test_an_engine_written_from_the_contract_serves_through_the_scheduler(tokenizer):
    engine: ServingEngine = EchoEngine(tokenizer, slots=2, max_queue=1)
    engine.start()
    try:
        prompt = tokenizer.encode("wherefore art thou").ids
        stream = engine.submit(prompt, SamplingOptions(temperature=0, max_tokens=len(prompt)))
        assert stream.text() == tokenizer.decode(prompt)
        assert (stream.finish.reason, stream.finish.completion_tokens) == ("length", len(prompt))

        # Two slots and one queue place: a fourth request is refused at submit, holding nothing.
        long = SamplingOptions(temperature=0, max_tokens=50)
        streams = [engine.submit(prompt, long) for _ in range(3)]
        with pytest.raises(QueueFull):
            engine.submit(prompt, long)
        for s in streams:
            s.cancel()
        for s in streams:
            s.text()
            assert s.finish.reason == "cancelled" and s.finish.completion_tokens < 50
        assert engine.active == 0 and engine.waiting == 0
    finally:
        engine.stop()
    assert not engine.alive
