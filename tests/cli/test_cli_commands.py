"""The other commands: config show, data prepare, bench."""

import json

import yaml
from tests.helpers import phalanx


def test_config_show_yaml_and_json(tmp_path):
    cfg = tmp_path / "my.yaml"
    cfg.write_text("extends: demo\ntrain:\n  max_steps: 50\n")
    shown = yaml.safe_load(phalanx("config", "show", str(cfg), "train.lr=0.001").stdout)
    assert shown["train"]["max_steps"] == 50 and shown["train"]["lr"] == 0.001
    assert set(shown) == {"run", "model", "data", "train", "parallel", "checkpoint", "safe", "observe"}
    as_json = json.loads(phalanx("config", "show", "train.max_steps=7", "--json").stdout)
    assert as_json["train"]["max_steps"] == 7 and as_json["run"]["name"] == "demo"


def test_data_prepare_reports_and_reuses_cache(tiny_args):
    first = json.loads(phalanx("data", "prepare", *tiny_args, "--json").stdout)
    assert first["vocab_size"] <= 384 and first["train_tokens"] > 10 * first["val_tokens"] > 0
    again = json.loads(phalanx("data", "prepare", *tiny_args, "--json").stdout)
    assert again == first


def test_bench_reports_throughput():
    out = json.loads(phalanx("bench", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "2",
                             "--warmup", "1", "--json").stdout)
    assert out["params"] == 4196608 and out["tokens_per_sec"] > 0 and out["achieved_tflops"] > 0
    assert out["mfu"] is None
    with_peak = json.loads(phalanx("bench", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "1",
                                   "--warmup", "0", "--peak-tflops", "1", "--json").stdout)
    assert with_peak["mfu"] == with_peak["achieved_tflops"]
