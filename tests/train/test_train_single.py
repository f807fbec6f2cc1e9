import pytest

"""One-process training through the real CLI: outputs, loss, exact resume, checkpoints, generation."""

import json

from phalanx.run.checkpoints import latest_checkpoint, list_checkpoints
from tests.helpers import losses_by_step, phalanx, read_metrics, train_json

SUMMARY_KEYS = {
    "run_dir",
    "steps",
    "tokens_seen",
    "val_loss_start",
    "val_loss_final",
    "train_loss_final",
    "tokens_per_sec",
    "achieved_tflops",
    "mfu",
    "last_checkpoint",
    "wall_seconds",
}


def test_train_writes_run_and_loss_falls(tiny_args):
    summary = train_json(*tiny_args)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["steps"] == 12 and summary["tokens_seen"] == 12 * 8 * 32
    assert summary["val_loss_final"] < summary["val_loss_start"] - 0.3
    assert summary["mfu"] is None  # no peak is known for a CPU unless train.peak_tflops says it
    run_dir = summary["run_dir"]
    metrics = read_metrics(run_dir)
    assert metrics[0]["step"] == 0 and metrics[0]["val_loss"] == summary["val_loss_start"]  # eval at step 0
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 13))
    for m in steps:
        assert {
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_sec",
            "achieved_tflops",
            "peak_mem_gib",
            "step_seconds",
            "compute_seconds",
            "time",
        } <= m.keys()
    assert [m["step"] for m in metrics if "val_loss" in m] == [0, 6, 12]
    assert steps[0]["lr"] < steps[1]["lr"]  # warm-up
    assert steps[-1]["lr"] < steps[2]["lr"]  # cosine decay
    from pathlib import Path

    root = Path(run_dir)
    assert (root / "config.yaml").is_file() and (root / "tokenizer.json").is_file()
    assert [p.name for p in list_checkpoints(root / "checkpoints")] == [
        "step_00000004",
        "step_00000008",
        "step_00000012",
    ]
    assert summary["last_checkpoint"] == str(latest_checkpoint(root / "checkpoints"))


@pytest.mark.slow
def test_peak_tflops_gives_mfu(tiny_args):
    summary = train_json(*tiny_args, "train.max_steps=3", "train.peak_tflops=0.5")
    assert summary["mfu"] == summary["achieved_tflops"] / 0.5


def test_exact_resume_single_process(tiny_args):
    whole = train_json(*tiny_args)
    name = whole["run_dir"].rsplit("/", 1)[-1]
    halted_args = [a for a in tiny_args if not a.startswith("run.name=")] + [f"run.name={name}-halted"]
    halted = train_json(*halted_args, "train.halt_at_step=5")
    assert halted["steps"] == 5 and halted["last_checkpoint"].endswith("step_00000005")
    resumed = train_json(*halted_args)
    assert resumed["steps"] == 12
    a, b = losses_by_step(whole["run_dir"]), losses_by_step(resumed["run_dir"])
    assert a == b  # bit for bit, every step
    assert resumed["val_loss_final"] == whole["val_loss_final"]


@pytest.mark.slow
def test_finished_run_is_not_trained_again(tiny_args):
    first = train_json(*tiny_args, "train.max_steps=3")
    again = train_json(*tiny_args, "train.max_steps=3")
    assert again["steps"] == 3 and again["train_loss_final"] == first["train_loss_final"]
    assert len([m for m in read_metrics(first["run_dir"]) if "loss" in m]) == 3


@pytest.mark.slow
def test_resume_never_starts_over_and_keeps_the_old_checkpoints(tiny_args):
    first = train_json(*tiny_args, "train.max_steps=3")
    fresh = train_json(*tiny_args, "train.max_steps=3", "checkpoint.resume=never")
    assert [m["step"] for m in read_metrics(fresh["run_dir"])].count(1) == 2
    from pathlib import Path

    kept = list(Path(first["run_dir"]).glob("checkpoints.before-*/step_00000003"))
    assert len(kept) == 1 and fresh["last_checkpoint"] != str(kept[0])


@pytest.mark.slow
def test_generate_from_trained_run(tiny_args):
    summary = train_json(*tiny_args)
    args = ["generate", summary["run_dir"], "ROMEO:", "--max-new-tokens", "20", "--seed", "3"]
    first, second = phalanx(*args).stdout, phalanx(*args).stdout
    assert first.startswith("ROMEO:") and len(first) > len("ROMEO:") + 5
    assert first == second  # a seed makes sampling repeatable
    greedy = phalanx("generate", summary["run_dir"], "ROMEO:", "--temperature", "0", "--max-new-tokens", "8").stdout
    assert (
        greedy
        == phalanx(
            "generate", summary["last_checkpoint"], "ROMEO:", "--temperature", "0", "--max-new-tokens", "8"
        ).stdout
    )


@pytest.mark.slow
def test_partial_checkpoint_is_ignored(tiny_args):
    summary = train_json(*tiny_args, "train.max_steps=4")
    root = summary["last_checkpoint"].rsplit("/", 1)[0]
    from pathlib import Path

    (Path(root) / ".tmp-step_00000008").mkdir()  # a save that died half-way
    resumed = train_json(*tiny_args, "train.max_steps=6")
    assert resumed["steps"] == 6
    assert json.loads((Path(root) / "step_00000006" / "trainer.json").read_text())["step"] == 6


@pytest.mark.slow
def test_activation_checkpointing_and_compile_train_save_and_generate(tiny_args):
    """Both wrap the blocks; checkpoints must still load into the plain model that generate builds."""
    plain = train_json(*tiny_args, "train.max_steps=4")
    name = plain["run_dir"].rsplit("/", 1)[-1]
    wrapped_args = [a for a in tiny_args if not a.startswith("run.name=")] + [f"run.name={name}-wrapped"]
    wrapped = train_json(
        *wrapped_args, "train.max_steps=4", "train.activation_checkpointing=true", "train.compile=true"
    )
    a, b = losses_by_step(plain["run_dir"]), losses_by_step(wrapped["run_dir"])
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-4 for s in a)
    assert phalanx("generate", wrapped["run_dir"], "ROMEO:", "--max-new-tokens", "5").stdout.startswith("ROMEO:")


def test_auto_dtype_takes_bf16_where_the_cpu_has_bf16_units_and_says_so(tiny_args):
    import torch

    from phalanx.parallel.device import compute_dtype, cpu_has_bf16_units

    units = cpu_has_bf16_units()
    assert compute_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if units else torch.float32)
    auto = phalanx("train", *tiny_args, "train.dtype=auto", "train.max_steps=6", "--json")
    said = [line for line in auto.stderr.splitlines() if line.startswith("train.dtype auto:")]
    expected = "bfloat16 autocast (this CPU has bf16 matrix units" if units else "float32 (this CPU has no bf16"
    assert len(said) == 1 and said[0].startswith(f"train.dtype auto: {expected}"), auto.stderr
    # The loss falls as in float32: the same 6 steps, the first and last losses within 2% of float32's.
    pinned = [a.replace("run.name=", "run.name=f32-") for a in tiny_args]
    f32 = losses_by_step(train_json(*pinned, "train.max_steps=6")["run_dir"])
    ours = losses_by_step(json.loads(auto.stdout.strip().splitlines()[-1])["run_dir"])
    assert ours.keys() == f32.keys() and ours[6] < ours[1]
    assert ours[1] == pytest.approx(f32[1], rel=0.02) and ours[6] == pytest.approx(f32[6], rel=0.02)
