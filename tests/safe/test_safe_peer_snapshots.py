"""Peer copies of in-memory snapshots (phalanx/train/peer_snapshots.py).

Through the real launcher, two node agents on one machine (1 rank each, a fixed 2 nodes): node 1 is
killed with its rank mid-run and its snapshots removed (on a cluster the node's memory goes with it); a
replacement node-1 agent joins, its rank is sent the copy of its snapshot that node 0 holds, and the run
resumes from that step (newer than the disk checkpoint) with every loss bit-identical to a clean run.
In one pair of processes over a real gloo group: a corrupt peer copy is refused with one line, and the
rank falls back to the disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from phalanx.run.records import read_events
from phalanx.run.snapshots import run_snapshot_dirs
from tests.conftest import TINY
from tests.helpers import free_port, losses_by_step, train_json, wait_for_port
from tests.safe.test_safe_node_loss import children

STEPS = [
    "train.max_steps=60",
    "train.eval_interval=30",
    "checkpoint.interval=20",
    "checkpoint.keep=10",
    "checkpoint.memory_interval=1",
]


@pytest.mark.slow
def test_replacement_node_resumes_from_the_peer_copy_bit_identically(corpus, runs_root):
    args = TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}", "run.name=drill-peer", *STEPS]
    port = free_port()
    node = [
        sys.executable,
        "-m",
        "phalanx",
        "train",
        *args,
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--json",
    ]
    survivor = subprocess.Popen([*node, "--node-rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_port(port)  # the rendezvous store lives with node 0, as in test_safe_node_loss.py
    doomed = subprocess.Popen([*node, "--node-rank", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = runs_root / "drill-peer"
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count('"loss"') >= 25:
            break
        time.sleep(0.1)
    else:
        survivor.kill(), doomed.kill()
        pytest.fail("the two-node run never reached step 25")
    for pid in [doomed.pid, *children(doomed.pid)]:  # the node goes: its agent, its rank, its memory
        os.kill(pid, signal.SIGKILL)
    doomed.wait()
    killed_at = metrics.read_text().count('"loss"')
    lost = [d for d in run_snapshot_dirs(run_dir) if d.name.endswith(f"-{doomed.pid}")]
    assert len(lost) == 1
    for path in lost:
        subprocess.run(["rm", "-rf", str(path)], check=True)
    t0 = time.monotonic()
    replacement = subprocess.Popen(
        [*node, "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = survivor.communicate(timeout=300)
    r_out, r_err = replacement.communicate(timeout=60)
    assert survivor.returncode == 0, err[-3000:]
    assert replacement.returncode == 0, r_err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 60 and summary["restarts"] >= 1
    loaded = [e for e in read_events(run_dir) if e["kind"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0]["source"] == "memory", loaded
    assert loaded[0]["disk_step"] == 20 and 20 < loaded[0]["step"] <= killed_at + 1, (loaded, killed_at)
    step = loaded[0]["step"]
    assert f"restored its snapshot of step {step} from the peer copy held by rank 0" in r_err + r_out
    assert f"resuming from the in-memory snapshot of step {step}" in err
    print(
        f"killed after {killed_at} steps logged; resumed from the peer copy of step {step} (disk: 20); "
        f"replacement start to end {time.monotonic() - t0:.1f} s; loaded in {loaded[0]['seconds']:.3f} s"
    )
    clean = train_json(*[a.replace("drill-peer", "drill-peer-clean") for a in args], "--nproc", "2")
    assert losses_by_step(run_dir) == losses_by_step(clean["run_dir"])  # every step, bit for bit


# Two ranks on "two nodes" (LOCAL_WORLD_SIZE=1: each its own launch directory, as two agents have), a
# real gloo group. Rank 1 snapshots step 5, which rank 0 receives as a peer copy; rank 1's node is then
# lost (its directory removed) and both restart. RESULT per rank: the step resumed from (or None).
PAIR = r"""
import json, os, shutil, sys, time
import torch, torch.distributed as dist
from pathlib import Path
from phalanx.parallel.distributed import DistEnv
from phalanx.run.snapshots import peer_dir
from phalanx.train.memory_checkpoint import MemorySnapshots

rank, run, corrupt = int(os.environ["RANK"]), Path(sys.argv[1]), sys.argv[2] == "corrupt"
dist.init_process_group("gloo")
env = DistEnv(rank, 2, 0, torch.device("cpu"), "gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(2, 8)).sum().backward(); opt.step()
lines = []
snaps = MemorySnapshots(run, env, {"tp": 1}, 1, say=lines.append)
snaps.take(5, model, opt, {"loader": {}})
snaps.flush()
held = peer_dir(snaps.dir.parent, 1)
while rank == 0 and not (held / "step_00000005.json").exists():
    time.sleep(0.05)
dist.barrier()
snaps.close()
expected = [p.detach().clone() for p in model.parameters()]
if rank == 1:
    shutil.rmtree(snaps.dir)  # the node is lost: its own snapshot goes
elif corrupt:
    with open(held / "step_00000005.bin", "r+b") as f:
        f.seek(10); byte = f.read(1); f.seek(10); f.write(bytes([byte[0] ^ 0xFF]))
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
again = MemorySnapshots(run, env, {"tp": 1}, 1, say=lines.append)
loaded = again.resume(model, opt, 0, {})
same = all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))
again.close()
shutil.rmtree(again.dir.parent, ignore_errors=True)  # this "node"'s launch directory, peer copies included
print("RESULT " + json.dumps({"step": loaded.step if loaded else None, "same": same, "lines": lines}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("corrupt", [False, True])
def test_peer_copy_restores_a_lost_rank_and_a_corrupt_one_falls_back_to_disk(tmp_path, corrupt):
    from tests.helpers import free_port

    port, procs = free_port(), []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        env.pop("PHALANX_AGENT_PID", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PAIR, str(tmp_path / "run"), "corrupt" if corrupt else "sound"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    if not corrupt:
        assert [r["step"] for r in results] == [5, 5] and results[1]["same"]
        assert results[1]["lines"] == ["rank 1: restored its snapshot of step 5 from the peer copy held by rank 0"]
    else:
        assert [r["step"] for r in results] == [None, None]  # the trainer then resumes from disk
        refused = "warning: rank 1: the peer copy of step 5 held by rank 0 does not match its CRC-32; not used"
        assert results[1]["lines"] == [refused]
        assert results[0]["lines"] == []
