"""Preparation as Ray tasks on a real two-node Ray cluster on loopback (a head and a second node, one CPU
each, as in tests/launch/test_ray_launcher.py): the shards are the bytes a local preparation writes,
and both nodes tokenised (through `phalanx data prepare --ray-address`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.prepare_helpers import make_corpus
from tests.ray_cluster import RAY_ENV, loopback_cluster

pytestmark = pytest.mark.slow  # a Ray cluster takes 10-20 s to start

ray = pytest.importorskip("ray", reason="the Ray tests need the ray extra (pip install 'phalanx[ray]')")


@pytest.fixture(scope="module")
def ray_address():
    """The GCS address of a head and one more node, each 1 CPU; stopped after the module."""
    with loopback_cluster({"num_cpus": 1, "include_dashboard": False}, {"num_cpus": 1}) as cluster:
        yield cluster.address


def test_two_ray_nodes_write_the_bytes_of_a_local_preparation(tmp_path, ray_address):
    """From the command line, as a cluster is used (a driver connecting in-process to a cluster this
    same process started hangs in Ray's GCS client)."""
    make_corpus(tmp_path / "corpus")  # about a dozen units: files, and the Parquet file's 8 row groups
    command = [sys.executable, "-m", "phalanx", "data", "prepare", "data.sources=[corpus]", "data.vocab_size=400"]
    env = {**os.environ, **RAY_ENV}

    def prepare(runs: str, *extra: str) -> Path:
        done = subprocess.run(
            [*command, f"run.dir={tmp_path / runs}", "--json", *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr.decode()
        return Path(json.loads(done.stdout)["dir"])

    local, on_ray = prepare("local", "data.workers=1"), prepare("ray", "--ray-address", ray_address)
    assert local.name == on_ray.name and local.parent != on_ray.parent  # the same key, prepared twice
    files = sorted(p.name for p in local.iterdir() if p.suffix == ".bin" or p.name == "tokenizer.json")
    assert sorted(p.name for p in on_ray.iterdir() if p.suffix == ".bin" or p.name == "tokenizer.json") == files
    assert all((on_ray / f).read_bytes() == (local / f).read_bytes() for f in files)
    preparation = json.loads((on_ray / "manifest.json").read_text())["preparation"]
    assert preparation["ray_nodes"] == 2 and preparation["units"] >= 10  # dealt round both nodes
    assert [p.name for p in on_ray.parent.iterdir()] == [on_ray.name]  # the parts are gone
