"""`phalanx plan` through the real CLI: JSON for machines, tables for people, one line for mistakes."""

import json

import pytest

from phalanx.plan.devices import device_names
from tests.helpers import phalanx


def plan_json(*args: str) -> dict:
    return json.loads(phalanx("plan", *args, "--json").stdout)


def test_plan_json_for_one_device():
    report = plan_json(
        "8b", "--gpu", "mi300x", "--gpus", "8", "--seq-len", "4096", "--micro-batch", "2", "--strategy", "fsdp"
    )
    assert (report["device"], report["devices"], report["strategy"]) == ("mi300x", 8, "fsdp")
    assert report["dtype"] == "bfloat16"
    assert (report["micro_batch"], report["seq_len"], report["params"]) == (2, 4096, 8030261248)
    assert report["fits"] is True and report["max_micro_batch"] >= 2
    memory = report["memory"]
    assert sum(memory["at_peak"].values()) == memory["peak_bytes"]
    assert report["tokens_per_sec"] > 0


def test_flags_override_the_config():
    base = plan_json("demo", "--gpu", "cpu")
    assert (base["strategy"], base["micro_batch"], base["seq_len"], base["dtype"]) == ("ddp", 16, 256, "float32")
    changed = plan_json(
        "demo", "--gpu", "cpu", "--gpus", "2", "--strategy", "fsdp", "--micro-batch", "4", "--activation-checkpointing"
    )
    assert (changed["strategy"], changed["micro_batch"], changed["accumulation"]) == ("fsdp", 4, 2)
    assert changed["activation_checkpointing"] is True
    assert changed["memory"]["peak_bytes"] < base["memory"]["peak_bytes"]


def test_compare_lists_every_device():
    result = plan_json("70b", "--gpus", "8", "--compare", "--activation-checkpointing")
    assert [row["device"] for row in result["devices"]] == device_names()
    assert result["job"]["activation_checkpointing"] is True
    table = phalanx("plan", "70b", "--gpus", "8", "--compare").stdout
    assert all(name in table for name in device_names()) and "max B (AC)" in table


def test_table_output():
    text = phalanx("plan", "125m", "--gpu", "h100", "--gpus", "2", "--strategy", "fsdp").stdout
    assert "memory per rank at its peak" in text and "largest micro batch" in text and "tokens/s" in text


def fails(*args: str) -> str:
    proc = phalanx("plan", *args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (("8b", "--gpu", "mi301x"), ["mi300x", "h100", "h200", "cpu"]),
        (("9b", "--gpu", "h100"), ["tiny", "125m", "70b", "demo"]),
        (("8b",), ["--gpu", "--compare"]),
        (("8b", "--gpu", "h100", "--strategy", "zero3"), ["ddp", "fsdp"]),
        (("8b", "--gpu", "h100", "--mfu", "40"), ["--mfu"]),
    ],
)
def test_mistakes_are_one_line(args, words):
    line = fails(*args)
    assert all(word in line for word in words), line
