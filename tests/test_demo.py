"""The quick start's main job: `phalanx train` with no arguments, then text from the model."""

import json
import re

import pytest

from tests.helpers import phalanx


@pytest.mark.slow
def test_demo_learns_shakespeare(tmp_path):
    summary = json.loads(phalanx("train", "--json", cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert summary["run_dir"] == str(tmp_path / "runs" / "demo") and summary["steps"] == 250
    assert summary["val_loss_final"] <= 0.65 * summary["val_loss_start"]  # at least 35% below
    text = phalanx("generate", "runs/demo", "ROMEO:", "--max-new-tokens", "200", "--seed", "0", cwd=tmp_path).stdout
    speakers = re.findall(r"^[A-Z][A-Za-z' ]+:$", text, flags=re.MULTILINE)
    assert len(speakers) >= 3, text  # it writes a play: speaker lines followed by speeches
