"""Supervised fine-tuning end to end through `phalanx train` (data.kind: sft): a small model learns a
rule-based chat task made here (reply with the user's words in alphabetical order) to at least 90% exact-match
greedy replies on held-out prompts, served by phalanx's own engine through the run's chat template; and
layouts fine-tuning cannot run yet are refused in one line."""

from __future__ import annotations

import json
import random

import pytest

from phalanx.run.records import read_events
from phalanx.serve.core.options import DEFAULTS, SamplingOptions
from phalanx.serve.core.served import load_served_model
from tests.helpers import losses_by_step, phalanx, train_json

WORDS = "red blue green gold grey pink black white brown amber ivory olive".split()
SFT = [
    "model.dim=96",
    "model.n_layers=3",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=256",
    "model.max_seq_len=64",
    "data.kind=sft",
    "data.vocab_size=300",
    "train.seq_len=64",
    "train.global_batch_size=16",
    "train.lr=3e-3",
    "train.warmup_steps=20",
    "train.eval_interval=100",
    "checkpoint.interval=1000",
    "checkpoint.memory_interval=0",
    "train.dtype=float32",  # layouts compared within 1e-5 (`auto` is bf16 on some CPUs)
]


def sorting_records(rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[dict]:
    records = []
    while len(records) < n:
        words = rng.sample(WORDS, rng.randint(3, 5))
        prompt = " ".join(words)
        if prompt in exclude:
            continue
        reply = " ".join(sorted(words))
        records.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]})
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_a_small_model_learns_a_chat_rule_to_90_percent_on_held_out_prompts(tmp_path):
    rng = random.Random(0)
    held_out = sorting_records(rng, 40)
    seen = {r["messages"][0]["content"] for r in held_out}
    data = write_jsonl(tmp_path / "sort.jsonl", sorting_records(rng, 3000, exclude=seen))
    summary = train_json(
        *SFT, f"data.sources=[{data}]", f"run.dir={tmp_path / 'runs'}", "run.name=sort", "train.max_steps=400"
    )
    served = load_served_model(summary["run_dir"])
    from phalanx.serve.server import build_engine

    engine = build_engine("torch", served, slots=1, max_queue=0, context=None, observer=None)
    engine.start()
    options = SamplingOptions(**{**DEFAULTS, "temperature": 0.0, "max_tokens": 24, "seed": 0})
    right, wrong = 0, []
    try:
        for record in held_out:
            user, expected = (m["content"] for m in record["messages"])
            ids = served.chat_prompt_ids([{"role": "user", "content": user}])
            reply = "".join(engine.submit(ids, options)).strip()
            if reply == expected:
                right += 1
            else:
                wrong.append((user, reply, expected))
    finally:
        engine.stop()
    print(f"exact match on held-out prompts: {right}/{len(held_out)}; val loss {summary['val_loss_final']:.4f}")
    assert right >= 0.9 * len(held_out), wrong[:5]
    # At every evaluation the run wrote its replies to the first validation prompts: at the end, right.
    samples = [e for e in read_events(summary["run_dir"]) if e["kind"] == "sample_reply"]
    assert {e["step"] for e in samples} == {0, 100, 200, 300, 400}
    final = [e for e in samples if e["step"] == 400]
    assert len(final) == 3 and all(e["prompt"].strip().startswith("USER:") for e in final)
    users = [e["prompt"].split("USER:", 1)[1].split("ASSISTANT:")[0].split() for e in final]
    assert sum(e["reply"].strip() == " ".join(sorted(u)) for e, u in zip(final, users)) >= 2, final


@pytest.mark.parametrize("layout", ["parallel.pp=2", "parallel.cp=2"])
def test_fine_tuning_refuses_pipeline_and_context_parallelism_in_one_line(tmp_path, layout):
    data = write_jsonl(tmp_path / "sort.jsonl", sorting_records(random.Random(1), 40))
    proc = phalanx(
        "train",
        *SFT,
        f"data.sources=[{data}]",
        f"run.dir={tmp_path / 'runs'}",
        "train.max_steps=2",
        layout,
        "--nproc",
        "2",
        check=False,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"does not run with {layout.split('=')[0]} > 1" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.strategy=ddp"], ["parallel.strategy=fsdp"], ["parallel.tp=2"]])
def test_two_ranks_fine_tune_to_the_losses_of_one_process(tmp_path, layout):
    """Ranks hold rows with different numbers of trained tokens: each step's loss is still the mean over
    all of the step's trained tokens, so two ranks match one process."""
    data = write_jsonl(tmp_path / "sort.jsonl", sorting_records(random.Random(2), 300))
    common = [*SFT, f"data.sources=[{data}]", f"run.dir={tmp_path / 'runs'}", "train.max_steps=6"]
    one = train_json(*common, "run.name=one")
    two = train_json(*common, "run.name=two", *layout, "--nproc", "2")
    a, b = losses_by_step(one["run_dir"]), losses_by_step(two["run_dir"])
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), (step, a[step], b[step])
    assert two["val_loss_final"] == pytest.approx(one["val_loss_final"], rel=1e-5)
