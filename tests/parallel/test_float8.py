"""train.dtype=float8 runs only where the hardware has fp8 matrix cores; elsewhere one clear line."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.parallel.float8 import check_float8
from tests.helpers import phalanx


def test_float8_on_cpu_is_one_line_and_writes_nothing(tiny_args, runs_root):
    proc = phalanx("train", *tiny_args, "train.dtype=float8", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: train.dtype=float8 needs a GPU with fp8 matrix cores (MI300X/MI325X/MI355X or H100/H200/B200-class "
        "GPUs); this runs on cpu: use bfloat16 or auto"
    ]
    name = next(a.split("=", 1)[1] for a in tiny_args if a.startswith("run.name="))
    assert not (runs_root / name).exists()


def test_float8_refuses_a_cpu_device_directly():
    with pytest.raises(PhalanxError, match="this runs on cpu"):
        check_float8(torch.device("cpu"))
