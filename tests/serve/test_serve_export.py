"""Serving an HF export directory (safetensors weights, its tokenizer_config.json's chat template)
gives the replies of the run it was exported from."""

from __future__ import annotations

import httpx
from serve_helpers import MODEL, InProcessServer

from phalanx.export.hf import write_hf_export
from phalanx.run.model_loader import load_model


def test_export_dir_serves_the_same_replies_as_its_run(served_run, server, tmp_path):
    export = tmp_path / "hf"
    export.mkdir()
    write_hf_export(load_model(served_run), export)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Who is there?"}],
        "stream": False,
        "options": {"temperature": 0, "presence_penalty": 1.0, "num_predict": 12},
    }
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        from_run = http.post("/api/chat", json=body).json()
    with InProcessServer(export, slots=8, max_queue=4) as live, live.client() as http:  # 8 slots, as `server`
        shown = http.post("/api/show", json={"model": MODEL}).json()
        assert shown["details"]["format"] == "safetensors" and "ASSISTANT:" in shown["template"]
        from_export = http.post("/api/chat", json=body).json()
    assert from_export["message"] == from_run["message"] and from_run["message"]["content"].strip()
    assert from_export["prompt_eval_count"] == from_run["prompt_eval_count"]
