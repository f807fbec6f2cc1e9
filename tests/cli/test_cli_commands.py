import pytest

"""The other commands: config show, data prepare, bench."""

import json
from pathlib import Path

import yaml

from tests.helpers import phalanx


def test_config_show_yaml_and_json(tmp_path):
    cfg = tmp_path / "my.yaml"
    cfg.write_text("extends: demo\ntrain:\n  max_steps: 50\n")
    shown = yaml.safe_load(phalanx("config", "show", str(cfg), "train.lr=0.001").stdout)
    assert shown["train"]["max_steps"] == 50 and shown["train"]["lr"] == 0.001
    assert set(shown) == {
        "run",
        "model",
        "data",
        "train",
        "lora",
        "parallel",
        "checkpoint",
        "safe",
        "observe",
        "eval",
    }
    as_json = json.loads(phalanx("config", "show", "train.max_steps=7", "--json").stdout)
    assert as_json["train"]["max_steps"] == 7 and as_json["run"]["name"] == "demo"


def test_data_prepare_reports_and_reuses_cache(tiny_args):
    first = json.loads(phalanx("data", "prepare", *tiny_args, "--json").stdout)
    assert first["vocab_size"] <= 384 and first["train_tokens"] > 10 * first["val_tokens"] > 0
    again = json.loads(phalanx("data", "prepare", *tiny_args, "--json").stdout)
    assert again == first


@pytest.mark.slow
def test_bench_reports_throughput():
    out = json.loads(
        phalanx(
            "bench", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--json"
        ).stdout
    )
    assert out["params"] == 4196608 and out["tokens_per_sec"] > 0 and out["achieved_tflops"] > 0
    assert out["mfu"] is None
    with_peak = json.loads(
        phalanx(
            "bench",
            "tiny",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--peak-tflops",
            "1",
            "--json",
        ).stdout
    )
    assert with_peak["mfu"] == with_peak["achieved_tflops"]


def test_config_show_writes_the_presets_shape_out():
    shown = phalanx("config", "show").stdout
    model = yaml.safe_load(shown)["model"]
    assert (
        model["preset"],
        model["dim"],
        model["n_layers"],
        model["n_heads"],
        model["n_kv_heads"],
        model["ffn_dim"],
        model["max_seq_len"],
        model["tie_embeddings"],
    ) == ("tiny", 256, 4, 8, 4, 768, 256, True)
    assert model["vocab_size"] is None and "vocab_size: null  # the tokenizer's" in shown
    assert "micro_batch_size: null  # global_batch_size / ranks: 16 on 1, 8 on 2, 4 on 4, 2 on 8" in shown
    big = json.loads(phalanx("config", "show", "model.preset=8b", "model.n_layers=2", "--json").stdout)["model"]
    assert (big["dim"], big["n_layers"], big["ffn_dim"], big["vocab_size"]) == (4096, 2, 14336, None)


@pytest.mark.slow
def test_runs_import_takes_json(tiny_args, tmp_path):
    from tests.helpers import train_json

    summary = train_json(*tiny_args, "train.max_steps=2", "observe.store=none")
    out = json.loads(phalanx("runs", "import", summary["run_dir"], "--runs", str(tmp_path), "--json").stdout)
    assert out["imported"][0]["run_dir"] == summary["run_dir"] and out["imported"][0]["id"] >= 1
    listed = json.loads(phalanx("runs", "list", "--runs", str(tmp_path), "--json").stdout)
    assert [r["id"] for r in listed] == [out["imported"][0]["id"]]


@pytest.mark.slow
def test_the_store_keeps_the_config_as_the_run_used_it(tiny_args, runs_root):
    """What the dashboard and `runs compare` show: the tokenizer's vocabulary and the micro batch of the
    launch's rank count written in, not the nulls that mean "whatever the run finds"."""
    from tests.helpers import train_json

    summary = train_json(*tiny_args, "train.max_steps=2", "train.micro_batch_size=null", "model.dim=null")
    name = summary["run_dir"].rsplit("/", 1)[-1]
    run = json.loads(phalanx("runs", "show", name, "--runs", str(runs_root), "--json").stdout)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(Path(summary["run_dir"]) / "tokenizer.json")).get_vocab_size()
    assert run["config"]["model"]["vocab_size"] == vocab
    assert run["config"]["model"]["dim"] == 256  # the tiny preset's, as the run built it
    assert run["config"]["train"]["micro_batch_size"] == 8  # the global batch on one rank
    saved = yaml.safe_load((Path(summary["run_dir"]) / "config.yaml").read_text())
    assert saved["train"]["micro_batch_size"] is None  # the run's own file keeps the config as given
