"""`model.pretrained`: a run starts from a Hugging Face checkpoint made by transformers, under every layout
each rank loading only its own shards, trains on with the checkpoint's tokenizer, records which
checkpoint it was, and halts and resumes exactly."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from phalanx.data.tokenizer import train_tokenizer
from phalanx.models.families import hf_names
from phalanx.models.from_config import pretrained_args
from phalanx.run.layout import RunDir
from tests.helpers import launched, losses_by_step, phalanx, train_json
from tests.hf_checkpoints import hf_tensors, make_llama_checkpoint

WORKER = Path(__file__).with_name("pretrained_worker.py")


@pytest.fixture(scope="module")
def tokenizer_file(corpus, tmp_path_factory) -> Path:
    from phalanx.data.corpus import iter_documents, resolve_sources

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer(iter_documents(resolve_sources([str(corpus)], Path.cwd())), 384).save(str(path))
    return path


@pytest.fixture(scope="module")
def checkpoint(tokenizer_file, tmp_path_factory) -> Path:
    """Untied, sharded in several files."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama"), tokenizer_file, tied=False, max_shard_size="60KB")


@pytest.fixture(scope="module")
def tied_checkpoint(tokenizer_file, tmp_path_factory) -> Path:
    """Tied, as Llama 3.2 is: no lm_head.weight in the file; a pipeline's last stage loads its copy."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama-tied"), tokenizer_file, tied=True, seed=1)


def pretrained_run(tiny_args: list[str], checkpoint: Path) -> list[str]:
    """tiny_args without the shape keys the checkpoint decides (same shape as TINY)."""
    fixed = ("model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim", "data.vocab_size")
    return [a for a in tiny_args if not a.startswith(fixed)] + [f"model.pretrained={checkpoint}"]


def loaded_under(tmp_path: Path, checkpoint: Path, parallel: dict, nproc: int) -> dict[str, torch.Tensor]:
    """Every rank's parameters after loading the checkpoint under `parallel`, merged."""
    out = tmp_path / f"params-{len(list(tmp_path.iterdir()))}.pt"
    result = launched(WORKER, json.dumps(parallel), str(checkpoint), str(out), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = {}
    for rank in range(nproc):
        merged.update(torch.load(f"{out}.{rank}", weights_only=True))
    return merged


def assert_holds_checkpoint(params: dict[str, torch.Tensor], checkpoint: Path, atol: float = 0.0) -> None:
    expected = hf_tensors(checkpoint)
    names = hf_names(pretrained_args(checkpoint))
    assert set(params) == set(names)
    for ours, theirs in names.items():
        torch.testing.assert_close(params[ours], expected[theirs], rtol=0, atol=atol, msg=ours)


def test_one_process_loads_every_tensor_of_a_sharded_checkpoint(tmp_path, checkpoint):
    assert len(list(checkpoint.glob("model-*.safetensors"))) > 1
    assert_holds_checkpoint(loaded_under(tmp_path, checkpoint, {}, 1), checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, tied",
    [
        ({"strategy": "fsdp"}, False),
        ({"tp": 2}, False),
        ({"pp": 2}, False),
        ({"pp": 2}, True),
        ({"cp": 2}, False),
        ({"strategy": "ddp"}, True),
    ],
    ids=["fsdp", "tp", "pp", "pp-tied", "cp", "ddp-tied"],
)
def test_every_layout_loads_the_checkpoint_shard_by_shard(request, tmp_path, parallel, tied):
    checkpoint = request.getfixturevalue("tied_checkpoint" if tied else "checkpoint")
    params = loaded_under(tmp_path, checkpoint, parallel, 2)
    if tied and "output.weight" in params:  # the last stage's own copy of the weight, which one process lacks
        assert torch.equal(params.pop("output.weight"), params["tok_embeddings.weight"])
    assert_holds_checkpoint(params, checkpoint)


def test_a_run_starts_from_the_checkpoint_and_records_it(tiny_args, checkpoint, tokenizer_file):
    # Two steps at a learning rate of 1e-12 move no weight by more than a few 1e-12, while any other
    # start (phalanx's own initialisation) differs by about 0.02.
    result = train_json(*pretrained_run(tiny_args, checkpoint), "train.max_steps=2", "train.lr=1e-12")
    run = RunDir(result["run_dir"])
    record = json.loads(run.pretrained.read_text())
    digest = hashlib.sha256()
    files = sorted(f for pattern in ("*.json", "*.safetensors") for f in checkpoint.glob(pattern))
    for f in files:
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode() + f.read_bytes())
    assert record["path"] == str(checkpoint) and record["sha256"] == digest.hexdigest()
    assert run.tokenizer.read_bytes() == tokenizer_file.read_bytes()  # data prepared with its tokenizer
    events = [json.loads(line) for line in run.events.read_text().splitlines()]
    assert [e["path"] for e in events if e["kind"] == "pretrained_loaded"] == [str(checkpoint)]

    from phalanx.run.model_loader import load_model

    assert_holds_checkpoint(load_model(run.path).model.state_dict(), checkpoint, atol=1e-10)


@pytest.mark.slow
def test_a_pretrained_run_halts_and_resumes_exactly(tiny_args, checkpoint):
    args = pretrained_run(tiny_args, checkpoint)
    whole = train_json(*[a.replace("run.name=", "run.name=whole-") for a in args])
    halted = [a.replace("run.name=", "run.name=halted-") for a in args]
    assert train_json(*halted, "train.halt_at_step=6")["steps"] == 6
    resumed = train_json(*halted)
    assert losses_by_step(whole["run_dir"]) == losses_by_step(resumed["run_dir"])


@pytest.mark.parametrize(
    "change, message",
    [
        (["model.pretrained=/nonexistent/checkpoint"], "model.pretrained=/nonexistent/checkpoint does not exist"),
        (["model.dim=128"], "model.dim comes from the pretrained checkpoint's config.json"),
        (["data.tokenizer=tokenizer.json"], "remove data.tokenizer"),
    ],
    ids=["missing", "shape-key", "second-tokenizer"],
)
def test_bad_pretrained_settings_get_one_line_and_exit_2(tiny_args, checkpoint, change, message):
    result = phalanx("train", *pretrained_run(tiny_args, checkpoint), *change, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
