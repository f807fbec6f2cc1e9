"""Greedy tokens of phalanx's engine and of the vLLM engine on one Hugging Face export, run by
test_serve_vllm_families.py inside the venv that has vLLM (scripts/setup_vllm.sh). Prints one JSON object.

Usage: python vllm_family_checks.py EXPORT_DIR PROMPTS_JSON
"""

from __future__ import annotations

import json
import sys

import torch

from phalanx.run.model_loader import load_model
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.torch_engine import Engine
from phalanx.serve.engines.vllm_engine import VllmEngine


def greedy_runs(engine, prompts: list[list[int]]) -> list[dict]:
    options = SamplingOptions(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for ids in prompts:
        stream = engine.submit(ids, options, top_logprobs=1)
        stream.text()
        runs.append(
            {
                "tokens": [entry["bytes"] for entry in stream.logprobs],
                "logprobs": [entry["logprob"] for entry in stream.logprobs],
                "finish": stream.finish.reason,
            }
        )
    return runs


def main() -> None:
    export, prompts = sys.argv[1], json.loads(sys.argv[2])
    loaded = load_model(export)
    engines = {
        "torch": Engine(loaded.model, loaded.tokenizer, slots=2, max_queue=8),
        "vllm": VllmEngine(export, loaded.tokenizer, torch.float32, slots=2, max_queue=8, context=256),
    }
    for engine in engines.values():
        engine.start()
    try:
        print(json.dumps({name: greedy_runs(engine, prompts) for name, engine in engines.items()}))
    finally:
        for engine in engines.values():
            engine.stop()


if __name__ == "__main__":
    main()
