"""Fitting, the largest micro batch, projected speed, devices, and jobs from configs and presets."""

import dataclasses

import pytest

from phalanx.errors import PhalanxError
from phalanx.models.flops import PEAK_BF16_TFLOPS, flops_per_token, mfu
from phalanx.models.presets import MODEL_PRESETS
from phalanx.plan import planner
from phalanx.plan.devices import all_devices, device_names, get_device
from phalanx.plan.memory import estimate

GIB = 2**30


def test_devices_carry_vendor_memory_and_the_trainers_peaks():
    expected = {"mi300x": 192, "mi325x": 256, "mi355x": 288, "h100": 80, "h200": 141}
    for name, memory in expected.items():
        device = get_device(name.upper())
        assert device.memory_gib == memory and device.kind == "gpu"
        assert device.peak_tflops == PEAK_BF16_TFLOPS[name] and device.source
    cpu = get_device("cpu", cpu_peak_tflops=0.5)
    assert cpu.kind == "cpu" and cpu.shared_by_ranks and cpu.peak_tflops == 0.5 and cpu.memory_gib > 1
    assert get_device("cpu").peak_tflops > 0  # a guess from the cores without the flag


def test_unknown_device_lists_the_valid_ones():
    with pytest.raises(PhalanxError) as err:
        get_device("h1000")
    message = str(err.value)
    assert "did you mean 'h100'" in message and all(name in message for name in device_names())


def test_largest_micro_batch_fits_and_one_more_does_not():
    job = planner.resolve_job("8b", 8, seq_len=4096)
    for device in (get_device("mi300x"), get_device("h200"), get_device("h100")):
        best = planner.max_micro_batch(job, device, 0.1)
        usable = planner.usable_bytes(device, 8, 0.1)
        assert best >= 1
        assert estimate(job.workload(device, micro_batch=best)).peak_bytes <= usable
        assert estimate(job.workload(device, micro_batch=best + 1)).peak_bytes > usable


def test_nothing_fits_reports_zero():
    job = planner.resolve_job("70b", 1, strategy="ddp", seq_len=1024)
    assert planner.max_micro_batch(job, get_device("mi355x"), 0.1) == 0
    assert planner.plan(job, get_device("mi355x"))["fits"] is False


def test_cpu_ranks_share_the_host_memory():
    cpu = get_device("cpu")
    assert planner.usable_bytes(cpu, 4, 0.1) == pytest.approx(planner.usable_bytes(cpu, 1, 0.1) / 4)
    assert planner.usable_bytes(get_device("h100"), 4, 0.1) == planner.usable_bytes(get_device("h100"), 1, 0.1)


def test_projected_speed_is_the_stated_mfu_as_the_trainer_computes_it():
    job = planner.resolve_job("8b", 8, seq_len=8192)
    report = planner.plan(job, get_device("mi300x"), mfu=0.35)
    fpt = flops_per_token(MODEL_PRESETS["8b"], 8192)
    assert report["flops_per_token"] == fpt
    assert mfu(report["tokens_per_sec_per_device"], fpt, 1307.4) == pytest.approx(0.35)
    assert report["tokens_per_sec"] == pytest.approx(8 * report["tokens_per_sec_per_device"])


def test_plan_report_holds_both_activation_checkpointing_settings():
    job = planner.resolve_job("8b", 8, seq_len=8192)
    report = planner.plan(job, get_device("h100"))
    other = report["other_activation_checkpointing"]
    assert report["activation_checkpointing"] is False and other["activation_checkpointing"] is True
    assert other["peak_gib"] < report["memory"]["peak_gib"] and other["max_micro_batch"] > report["max_micro_batch"]
    assert report["fits"] == (report["memory"]["peak_bytes"] <= report["usable_gib_per_rank"] * GIB)


def test_compare_lists_every_device():
    job = planner.resolve_job("70b", 8, seq_len=8192)
    rows = planner.compare(job, all_devices())
    assert [row["device"] for row in rows] == device_names()
    by_name = {row["device"]: row for row in rows}
    assert by_name["mi355x"]["max_micro_batch_with_ac"] >= by_name["mi300x"]["max_micro_batch_with_ac"] >= 1
    assert by_name["h100"]["max_micro_batch_with_ac"] == 0 and by_name["h100"]["tokens_per_sec"] is None
    assert by_name["cpu"]["dtype"] == "float32" and by_name["h200"]["dtype"] == "bfloat16"


def test_preset_defaults():
    job = planner.resolve_job("125m", 2)
    assert (job.strategy, job.micro_batch, job.seq_len, job.accumulation) == ("fsdp", 1, 2048, 1)
    assert planner.resolve_job("70b", 8).seq_len == 8192


def test_job_from_the_demo_config_and_overrides():
    job = planner.resolve_job("demo", 1)
    assert (job.strategy, job.micro_batch, job.seq_len, job.accumulation) == ("ddp", 16, 256, 1)
    assert job.args == MODEL_PRESETS["tiny"] and job.dtype == "auto"
    job = planner.resolve_job("demo", 2, micro_batch=2, strategy="fsdp", activation_checkpointing=True)
    assert (job.strategy, job.micro_batch, job.accumulation, job.activation_checkpointing) == ("fsdp", 2, 4, True)


def test_job_from_a_yaml_file(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(
        "model:\n  preset: 1b\n  vocab_size: 32000\ndata:\n  vocab_size: 8000\ntrain:\n  seq_len: 1024\n"
        "  global_batch_size: 64\n  micro_batch_size: 4\n  dtype: float32\nparallel:\n  strategy: fsdp\n"
    )
    job = planner.resolve_job(str(path), 8)
    assert job.args == dataclasses.replace(MODEL_PRESETS["1b"], vocab_size=32000)
    assert (job.seq_len, job.micro_batch, job.accumulation, job.strategy) == (1024, 4, 2, "fsdp")
    assert job.workload(get_device("h100")).dtype == "float32"  # the config's dtype beats the device's


@pytest.mark.parametrize(
    "source, gpus, options, words",
    [
        ("giant", 1, {}, "tiny, 125m, 1b, 8b, 70b"),
        ("demo", 3, {}, "multiple of"),
        ("8b", 2, {"strategy": "none"}, "strategy none"),
        ("tiny", 1, {"seq_len": 512}, "max_seq_len"),
        ("tiny", 0, {}, "--gpus"),
    ],
)
def test_bad_jobs_say_why(source, gpus, options, words):
    with pytest.raises(PhalanxError) as err:
        planner.resolve_job(source, gpus, **options)
    assert words in str(err.value)


def test_bad_fractions():
    job = planner.resolve_job("tiny", 1)
    with pytest.raises(PhalanxError, match="mfu"):
        planner.plan(job, get_device("h100"), mfu=1.5)
    with pytest.raises(PhalanxError, match="headroom"):
        planner.compare(job, all_devices(), headroom=1.0)


def test_cpu_ranks_share_the_host_peak_gpus_add_theirs():
    cpu, h100 = get_device("cpu", cpu_peak_tflops=1.0), get_device("h100")
    one, four = planner.resolve_job("tiny", 1), planner.resolve_job("tiny", 4)
    assert planner.plan(four, cpu)["tokens_per_sec"] == pytest.approx(planner.plan(one, cpu)["tokens_per_sec"])
    assert planner.plan(four, h100)["tokens_per_sec"] == pytest.approx(4 * planner.plan(one, h100)["tokens_per_sec"])
