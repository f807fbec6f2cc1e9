"""How long a launch takes to train, locally and on Ray, and how long Ray takes to bring back a lost node.

1. Command to first step: from starting `phalanx train` to the wall time of its first logged training
   step, for a local launch (`--nproc 2`) and a Ray launch (`--launcher ray --nnodes 2 --nproc 1`) on a
   two-node Ray cluster on loopback that is already up (its own start is reported apart). The data is
   prepared once beforehand, so tokenising is not in either figure.
2. Killed node to first step after recovery: node 1's agent actor is SIGKILLed mid-run (its rank goes
   with it); the time from the kill to the first training step logged after the group re-formed, with
   the replaced agent, from the newest checkpoint.

Usage: .venv/bin/python bench/ray_launch.py [--repeats N] [--runs DIR] [--rdzv-conf K=V,...] [--kill-only]   (prints JSON and a table)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.max_seq_len=64",
    "data.vocab_size=384",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=24",
    "train.warmup_steps=2",
    "train.eval_interval=1000",
    "checkpoint.interval=4",
    "checkpoint.keep=10",
]
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def steps(run_dir: Path) -> list[dict]:
    return [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]


def train(args: list[str], extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx", "train", *args, *extra, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"phalanx train exited {proc.returncode}:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def to_first_step(args: list[str], extra: list[str], run_dir: Path) -> float:
    started = time.time()
    finish(train(args, extra))
    return steps(run_dir)[0]["time"] - started


def ranks_of_ray_node(node: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and b"phalanx.train.worker" in (entry / "cmdline").read_bytes()
                and f"PHALANX_RAY_NODE={node}".encode() in (entry / "environ").read_bytes().split(b"\0")
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_to_first_step(args: list[str], extra: list[str], run_dir: Path, at_step: int) -> dict:
    proc = train(args, extra + ["safe.inject=[{fault: slow, rank: 0, step: 5, ms: 300}]"])
    while len(steps(run_dir)) < at_step:
        if proc.poll() is not None:
            raise SystemExit("the run ended before the kill")
        time.sleep(0.02)
    (rank,) = ranks_of_ray_node(1)
    agent = int(Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1])
    killed = time.time()
    os.kill(agent, signal.SIGKILL)
    summary = finish(proc)
    events = read_jsonl(run_dir / "events.jsonl")
    detected = next(e["time"] for e in events if e["kind"] == "worker_failed" and e["time"] > killed)
    again = next(e["time"] for e in events if e["kind"] == "training_started" and e["time"] > killed)
    first = next(m["time"] for m in steps(run_dir) if m["time"] > again)
    replaced = next(e["time"] for e in events if e["kind"] == "node_replaced")
    return {
        "to_detection": detected - killed,
        "to_replacement_agent": replaced - killed,
        "to_first_step": first - killed,
        "restarts": summary["restarts"],
        "steps": summary["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--rdzv-conf", default="", help="passed to the Ray launches, e.g. keep_alive_interval=1")
    parser.add_argument("--kill-only", action="store_true", help="only the killed-node drill")
    options = parser.parse_args()
    runs = options.runs or Path(tempfile.mkdtemp(prefix="phalanx-ray-bench-"))
    os.environ.update(RAY_ENV)
    from ray.cluster_utils import Cluster

    from phalanx.data.corpus import iter_documents, resolve_sources

    corpus = runs / "plays.txt"
    sources = [
        s
        for s in resolve_sources(["builtin:shakespeare"], Path.cwd())
        if s.path.stem in ("romeo-and-juliet", "macbeth")
    ]
    corpus.write_text("\n\n".join(iter_documents(sources)))
    base = TINY + [f"data.sources=[{corpus}]", f"run.dir={runs}"]
    subprocess.run(
        [sys.executable, "-m", "phalanx", "data", "prepare", *base, "run.name=prepare", "--json"],
        check=True,
        capture_output=True,
    )

    t0 = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node_a": 1},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, node_ip_address="127.0.0.1")
    cluster_start = time.monotonic() - t0
    ray_args = ["--launcher", "ray", "--ray-address", cluster.address, "--nnodes", "2", "--nproc", "1"]
    if options.rdzv_conf:
        ray_args += ["--rdzv-conf", options.rdzv_conf]
    local, on_ray, kills = [], [], []
    try:
        for i in range(options.repeats):  # alternated, so that the machine's drift touches both alike
            if not options.kill_only:
                local.append(to_first_step(base + [f"run.name=local-{i}"], ["--nproc", "2"], runs / f"local-{i}"))
                on_ray.append(to_first_step(base + [f"run.name=ray-{i}"], ray_args, runs / f"ray-{i}"))
            kills.append(kill_to_first_step(base + [f"run.name=kill-{i}"], ray_args, runs / f"kill-{i}", 7))
    finally:
        cluster.shutdown()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)
    result = {
        "ray_cluster_start_s": round(cluster_start, 2),
        "local_to_first_step_s": [round(x, 2) for x in local],
        "ray_to_first_step_s": [round(x, 2) for x in on_ray],
        "ray_kill": [{k: round(v, 2) if isinstance(v, float) else v for k, v in kill.items()} for kill in kills],
    }
    print(json.dumps(result, indent=1))
    med = statistics.median
    if local:
        print(f"\n| launch | command to first step (median of {options.repeats}) |\n|---|---|")
        print(f"| local, `--nproc 2` | {med(local):.1f} s |")
        print(f"| Ray, `--nnodes 2 --nproc 1` (cluster up) | {med(on_ray):.1f} s |")
    print(
        f"\nnode 1's agent killed: detection {med(k['to_detection'] for k in kills):.2f} s, replacement agent "
        f"up {med(k['to_replacement_agent'] for k in kills):.2f} s, first step after recovery "
        f"{med(k['to_first_step'] for k in kills):.1f} s (medians); Ray cluster start {cluster_start:.1f} s"
    )


if __name__ == "__main__":
    main()
