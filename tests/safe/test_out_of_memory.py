"""A rank out of memory, through the real launcher (2 gloo ranks): named, with its step and allocation, in one
line; retried once; stopped with exit code 10 when the same step runs out again, rather than restarted in
vain until the restarts run out (exit 4, which a scheduler requeues: the issue's deterministic OOM).

The `oom` fault asks the real CPU allocator for 1 PiB (phalanx/safe/inject.py), which refuses it with its
own error, the one a batch too large for the machine gets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.errors import RankOutOfMemoryError
from phalanx.run.records import read_events
from phalanx.safe.inject import OOM_BYTES
from phalanx.safe.out_of_memory import allocation_failure, is_out_of_memory
from tests.helpers import phalanx


def test_allocator_errors_are_read_for_size_and_device():
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(OOM_BYTES, dtype=torch.uint8)  # the real CPU allocator's refusal
    assert is_out_of_memory(cpu.value)
    assert allocation_failure(f"RuntimeError: {cpu.value}").describe() == "tried to allocate 1.0 PiB on the CPU"
    # torch's CUDA/HIP caching allocator, in its current and its older wording (no GPU on this machine)
    assert (
        allocation_failure(
            "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB"
        ).describe()
        == "tried to allocate 20.0 MiB on GPU 0"
    )
    assert (
        allocation_failure(
            "OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB (GPU 3; 63.98 GiB total capacity)"
        ).describe()
        == "tried to allocate 2.0 GiB on GPU 3"
    )
    assert not is_out_of_memory(RuntimeError("Connection closed by peer"))


def test_the_same_step_out_of_memory_twice_stops_naming_the_rank_and_size(tiny_args):
    # Rank 1 runs out of memory at step 6 on every attempt. Rank 0, waiting for it in the gradient
    # all-reduce, is killed by the agent; it has often been silent as long (in one drill 0.2708 s against
    # rank 1's 0.2697 s), which is all the attribution of a plain crash has to go on between them.
    faults = [{"fault": "oom", "rank": 1, "step": 6, "repeat": True}]
    proc = phalanx(
        "train",
        *tiny_args,
        "train.max_steps=24",
        "train.eval_interval=100",
        "checkpoint.interval=4",
        f"safe.inject={json.dumps(faults)}",
        "--nproc",
        "2",
        check=False,
    )
    said = proc.stderr
    assert proc.returncode == RankOutOfMemoryError.exit_code == 10, said[-4000:]
    assert "Traceback" not in said and "can't allocate memory" not in said  # one line, not 70
    assert (
        "rank 1 ran out of memory at step 6 (tried to allocate 1.0 PiB on the CPU); retried once, as memory "
        "another process held may be free now; restarting from step " in said
    )
    assert (
        said.strip()
        .splitlines()[-1]
        .startswith(
            "error: rank 1 ran out of memory at step 6 (tried to allocate 1.0 PiB on the CPU), as on the previous "
            "attempt: every restart would too"
        )
    )
    setting = dict(a.split("=", 1) for a in tiny_args)
    events = read_events(Path(setting["run.dir"]) / setting["run.name"])
    failed = [e for e in events if e["kind"] == "worker_failed"]
    assert [(e["rank"], e["step"], e["reason"], e["bytes"], e["device"]) for e in failed] == [
        (1, 6, "out_of_memory", OOM_BYTES, "CPU")
    ] * 2
    assert sum(e["kind"] == "restart" for e in events) == 1  # one retry, not max_restarts of them
