"""train_step on CPU sets glibc's malloc to keep freed memory (train/step.py's keep_freed_memory, issue 33):
a block freed and allocated again comes back without page faults, and a CPU training step turns the
setting on. Each check runs in a fresh interpreter, since the setting is the whole process's and pytest's
own process may have it on already."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

GLIBC = "CS_GNU_LIBC_VERSION" in os.confstr_names and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
pytestmark = pytest.mark.skipif(
    not GLIBC, reason="keep_freed_memory sets glibc's malloc; other C libraries are left alone"
)


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


FAULTS_ON_REUSE = """
import resource, torch
from phalanx.train.step import keep_freed_memory
print(keep_freed_memory())
for _ in range(12):  # a block larger than glibc's largest mmap threshold, allocated, filled and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_freed_block_comes_back_without_page_faults():
    kept, *faults = run(FAULTS_ON_REUSE).split()
    assert kept == "True"
    # 64 MiB is 16384 pages of 4 KiB: each round would fault on all of them again if the block went back
    # to the kernel (glibc's default). Kept, the heap grows for the first rounds (an aligned allocation
    # fits a freed block only once the free space around it suffices), then serves the block from there.
    assert max(int(n) for n in faults[-4:]) < 200


TRAIN_STEP = """
import torch
import phalanx.train.step as step
from phalanx.models.decoder import ModelArgs, Transformer
assert step._memory_kept is None  # nothing sets it before a step
model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=50, max_seq_len=16))
tokens = torch.randint(0, 50, (2, 9))
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
step.train_step(model, optimizer, list(model.parameters()), [(tokens[:, :-1], tokens[:, 1:])],
                device=torch.device("cpu"), grad_clip=1.0)
print(step._memory_kept)
"""


def test_a_cpu_training_step_turns_it_on():
    assert run(TRAIN_STEP) == "True"
