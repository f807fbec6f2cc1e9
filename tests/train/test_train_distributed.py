"""Two ranks through torch's elastic launcher on gloo: DDP and FSDP2 match one process; DDP resumes exactly."""

import pytest

from tests.helpers import losses_by_step, train_json


def rename(args, suffix):
    return [a + suffix if a.startswith("run.name=") else a for a in args]


@pytest.fixture
def single(tiny_args):
    return train_json(*tiny_args)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(tiny_args, single, strategy):
    two = train_json(*rename(tiny_args, f"-{strategy}"), f"parallel.strategy={strategy}", "--nproc", "2")
    one, many = losses_by_step(single["run_dir"]), losses_by_step(two["run_dir"])
    assert one.keys() == many.keys()
    for step in one:  # same global batches; only the float reduction order differs
        assert many[step] == pytest.approx(one[step], rel=1e-5, abs=1e-5)
    assert two["val_loss_final"] == pytest.approx(single["val_loss_final"], rel=1e-5)


def test_exact_resume_two_ddp_ranks(tiny_args):
    whole = train_json(*rename(tiny_args, "-whole"), "--nproc", "2")
    halted = rename(tiny_args, "-halted")
    assert train_json(*halted, "train.halt_at_step=6", "--nproc", "2")["steps"] == 6
    resumed = train_json(*halted, "--nproc", "2")
    assert losses_by_step(whole["run_dir"]) == losses_by_step(resumed["run_dir"])


@pytest.mark.slow
def test_a_null_micro_batch_splits_the_global_batch_over_any_rank_count(tiny_args):
    """train.micro_batch_size null (the shipped default): each rank takes its share of the global batch in
    one pass, so the same config trains on 1 and 2 ranks to the same losses and the same validation set."""
    derived = [*tiny_args, "train.micro_batch_size=null", "train.max_steps=4", "checkpoint.interval=4"]
    one = train_json(*rename(derived, "-one"))
    two = train_json(*rename(derived, "-two"), "--nproc", "2")
    a, b = losses_by_step(one["run_dir"]), losses_by_step(two["run_dir"])
    assert a.keys() == b.keys() == {1, 2, 3, 4}
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-5)
    assert two["val_loss_start"] == pytest.approx(one["val_loss_start"], rel=1e-6)
