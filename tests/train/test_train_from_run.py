"""`model.pretrained` naming a run phalanx trained (job/base_model.py): the run's newest checkpoint is
converted once into RUN_DIR/base, a Hugging Face checkpoint, and the new run starts from exactly its
weights; a relaunch reuses the conversion; a LoRA fine-tune of it loads back merged; what cannot be a
source is refused in one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.data.chat_template import CHAT_TEMPLATE, read_template
from phalanx.job.base_model import SOURCE_RECORD
from phalanx.run.hf_format import is_hf_export
from phalanx.run.layout import RunDir
from phalanx.run.model_loader import load_model
from tests.conftest import TINY
from tests.helpers import phalanx, train_json

SHAPE = ("model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim", "data.vocab_size")


@pytest.fixture(scope="module")
def source_run(corpus, runs_root) -> Path:
    """A tiny run of 4 steps: the model a fine-tune starts from."""
    args = [*TINY, f"data.sources=[{corpus}]", f"run.dir={runs_root}", "run.name=from-run-source"]
    return Path(train_json(*args, "train.max_steps=4")["run_dir"])


def from_run(tiny_args: list[str], source: Path) -> list[str]:
    """tiny_args without the keys the source decides, starting from `source`."""
    return [a for a in tiny_args if not a.startswith(SHAPE)] + [f"model.pretrained={source}"]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_model(path).model.state_dict()


def test_a_run_starts_from_another_run_through_one_conversion(tiny_args, source_run):
    # At a learning rate of 1e-12 two steps move no weight by more than a few 1e-12: the run's weights
    # after them are the source's, which any other start (phalanx's own initialisation) is not.
    args = [*from_run(tiny_args, source_run), "train.lr=1e-12", "checkpoint.interval=2"]
    first = phalanx("train", *args, "train.max_steps=2", "--json")
    run = RunDir(json.loads(first.stdout.strip().splitlines()[-1])["run_dir"])
    assert "converted" in first.stderr and is_hf_export(run.base)
    record = json.loads((run.base / SOURCE_RECORD).read_text())
    assert record["source"] == str(source_run) and Path(record["checkpoint"]).name == "step_00000004"
    assert json.loads(run.pretrained.read_text())["path"] == str(run.base)
    source = weights(source_run)
    assert all(torch.equal(source[n], t) for n, t in weights(run.base).items())  # float32: exact
    for name, tensor in weights(run.path).items():
        torch.testing.assert_close(tensor, source[name], rtol=0, atol=1e-10, msg=name)
    assert read_template(run.path) == CHAT_TEMPLATE  # phalanx's template came along with the tokenizer

    # The relaunch resumes, reusing the conversion: nothing is converted again.
    stamp = (run.base / "model.safetensors").stat().st_mtime_ns
    again = phalanx("train", *args, "train.max_steps=4", "--json")
    assert json.loads(again.stdout.strip().splitlines()[-1])["steps"] == 4
    assert "converted" not in again.stderr and (run.base / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_a_lora_fine_tune_of_a_run_loads_back_merged(tiny_args, source_run):
    args = [*from_run(tiny_args, source_run), "lora.rank=4", "train.max_steps=4", "checkpoint.memory_interval=0"]
    run = RunDir(train_json(*args)["run_dir"])
    trainer = json.loads((sorted(run.checkpoints.glob("step_*"))[-1] / "trainer.json").read_text())
    assert trainer["base"]["path"] == str(run.base)
    merged, source = weights(run.path), weights(source_run)
    assert set(merged) == set(source)
    assert any(not torch.equal(merged[n], source[n]) for n in merged)  # the adapters moved the model


def test_what_cannot_be_a_source_is_refused_in_one_line(tiny_args, source_run, tmp_path):
    def refused(source: Path, *more: str) -> str:
        result = phalanx("train", *from_run(tiny_args, source), *more, check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        return result.stderr

    untrained = tmp_path / "untrained"
    untrained.mkdir()
    (untrained / "config.yaml").write_text("model: {preset: tiny}\n")
    assert "has no checkpoint yet; train it first" in refused(untrained)
    name = next(a for a in tiny_args if a.startswith("run.name=")).split("=", 1)[1]
    own = Path(next(a for a in tiny_args if a.startswith("run.dir=")).split("=", 1)[1]) / name
    assert "is this run's own directory" in refused(own / "checkpoints" / "step_00000004")

    # A run converted from one source does not silently switch to another.
    phalanx("train", *from_run(tiny_args, source_run), "train.max_steps=1")
    other = source_run / "checkpoints" / "step_00000004"
    assert f"was converted from {source_run}, not model.pretrained={other}" in refused(other)
