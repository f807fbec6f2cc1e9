"""A checkpoint someone else wrote must never run code: not in generate, export, serve, nor a resume.

The payload is what an attacker would write: a `.metadata` whose unpickling first writes a marker file
and then returns the real metadata, with the manifest's checksums rewritten to match."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.run.checkpoints import latest_checkpoint, verify_checkpoint, write_manifest
from phalanx.run.layout import RunDir
from phalanx.run.safe_dcp import SafeLoadPlanner, UnsafeCheckpointError, read_metadata_file
from tests.helpers import phalanx, train_json


class _Payload:
    """Unpickles by evaluating an expression: write the marker, then hand back the real object."""

    def __init__(self, marker: Path, real: bytes):
        self.marker, self.real = marker, real

    def __reduce__(self):
        expr = f"(open({str(self.marker)!r}, 'w').write('ran'), __import__('pickle').loads({self.real!r}))[1]"
        return eval, (expr,)


def plant_payload(checkpoint: Path, marker: Path) -> None:
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker, metadata.read_bytes())))
    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint)  # the attacker rewrites the checksums too
    assert verify_checkpoint(checkpoint) is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("safe-ckpt")
    summary = train_json(*TINY, "train.max_steps=4", f"data.sources=[{corpus}]", f"run.dir={root}", "run.name=clean")
    return Path(summary["run_dir"])


@pytest.fixture
def crafted(trained, tmp_path):
    """A copy of the trained run whose newest checkpoint carries the payload; and the marker's path."""
    run = tmp_path / "runs" / "crafted"
    shutil.copytree(trained, run)
    marker = tmp_path / "marker"
    plant_payload(latest_checkpoint(RunDir(run).checkpoints), marker)
    return run, marker


@pytest.mark.slow
def test_the_payload_is_real(crafted):
    """Plain pickle (what torch's reader does) runs it and still gets working metadata: the test can fail."""
    run, marker = crafted
    metadata = pickle.loads((latest_checkpoint(RunDir(run).checkpoints) / ".metadata").read_bytes())
    assert marker.read_text() == "ran" and type(metadata).__name__ == "Metadata"


def test_the_allow_list_reads_real_metadata_and_refuses_the_payload(trained, crafted):
    clean = read_metadata_file(latest_checkpoint(RunDir(trained).checkpoints) / ".metadata")
    assert type(clean).__name__ == "Metadata" and clean.state_dict_metadata
    run, marker = crafted
    with pytest.raises(UnsafeCheckpointError, match="builtins.eval"):
        read_metadata_file(latest_checkpoint(RunDir(run).checkpoints) / ".metadata")
    assert not marker.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "{run}", "ROMEO:", "--max-new-tokens", "4"],
        ["export", "{run}", "--format", "hf", "--out", "{out}"],
        ["export", "{run}", "--format", "gguf", "--out", "{out}"],
        ["serve", "{run}", "--port", "0"],
    ],
    ids=["generate", "export-hf", "export-gguf", "serve"],
)
def test_loading_commands_refuse_a_crafted_checkpoint(crafted, tmp_path, command):
    run, marker = crafted
    out = tmp_path / "export"
    proc = phalanx(*[a.format(run=run, out=out) for a in command], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to load" in proc.stderr and "builtins.eval" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr  # one clear line
    assert not marker.exists() and not out.exists()


def test_resume_refuses_a_crafted_checkpoint(crafted, corpus):
    from tests.conftest import TINY

    run, marker = crafted
    proc = phalanx(
        "train",
        *TINY,
        "train.max_steps=6",
        f"data.sources=[{corpus}]",
        f"run.dir={run.parent}",
        f"run.name={run.name}",
        "checkpoint.resume=auto",
        "--json",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "refusing to load" in proc.stderr and not marker.exists()


def test_byte_items_load_without_pickle(tmp_path):
    """The optimizer's non-tensor items: plain values load, a pickled callable is refused."""
    marker = tmp_path / "marker"

    class Item:
        class dest_index:
            fqn = "optim.param_groups"

    good = io.BytesIO()
    torch.save([{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}], good)
    good.seek(0)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    planner.load_bytes(Item, good)
    assert planner.state_dict["optim.param_groups"][0]["betas"] == (0.9, 0.95)

    bad = io.BytesIO()
    torch.save(_Payload(marker, pickle.dumps([])), bad)
    bad.seek(0)
    with pytest.raises(UnsafeCheckpointError, match="optim.param_groups"):
        planner.load_bytes(Item, bad)
    assert not marker.exists()
