import pytest

"""`phalanx preflight` through the real launcher: gloo ranks on CPU, the run store, the slow-rank drill,
and two node agents on this machine standing in for two nodes."""

import json
import os
import socket
import subprocess
import sys

from phalanx.observe.store import RunStore
from phalanx.preflight.timing import SLOW_FACTOR_ENV, SLOW_RANK_ENV
from tests.helpers import free_port, phalanx, wait_for_port

NODE = socket.gethostname()


def preflight_json(*args: str, check: bool = True) -> tuple[int, dict, str]:
    proc = phalanx("preflight", *args, "--quick", "--json", check=check)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_two_ranks_pass_and_report_every_check(tmp_path):
    code, report, _ = preflight_json(f"run.dir={tmp_path}", "--nproc", "2")
    assert code == 0 and report["passed"] and report["failed_nodes"] == {}
    assert (report["world_size"], report["backend"], report["device_type"]) == (2, "gloo", "cpu")
    checks = {(c["check"], c["rank"]) for c in report["checks"]}
    for rank in (0, 1):
        assert {
            ("matmul_bf16_tflops", rank),
            ("matmul_fp32_tflops", rank),
            ("memory_bandwidth_gbps", rank),
            ("compute_straggler_ratio", rank),
        } <= checks
    assert {
        ("inventory_match", None),
        ("disk_write_mbps", None),
        ("all_reduce_busbw_gbps", None),
        ("all_gather_busbw_gbps", None),
        ("slow_rank_ratio", None),
    } <= checks
    health = next(c for c in report["checks"] if c["check"] == "gpu_health")
    assert health["status"] == "skip" and "no GPU" in health["message"]
    for c in report["checks"]:
        if c["status"] in ("pass", "warn") and c["check"] != "inventory_match":  # measured figures
            assert isinstance(c["value"], (int, float)) and c["value"] > 0, c
    inventory = report["nodes"][NODE]["inventory"]
    assert inventory["torch"] and inventory["cpu_threads"] >= 1 and inventory["ram_gib"] > 0
    # the result is in the run store, and a passing node is not quarantined
    store = RunStore.open(None, tmp_path)
    try:
        (row,) = store.preflights()
        assert (row["node"], row["passed"]) == (NODE, True) and store.quarantined() == []
    finally:
        store.close()


@pytest.mark.slow
def test_an_injected_slow_rank_is_named_by_bisection(tmp_path):
    # 4 ranks: the bisection compares halves [0, 1] and [2, 3], then finds the late rank within the slow half
    code, report, stderr = preflight_json(
        f"run.dir={tmp_path}",
        "observe.store=none",
        "--nproc",
        "4",
        "--inject-slow-rank",
        "2",
        "--slow-factor",
        "8",
        check=False,
    )
    assert code == 6, stderr
    assert report["slow_ranks"]["ranks"] == [2] and report["slow_ranks"]["nodes"] == [NODE]
    level = report["slow_ranks"]["levels"][0]
    assert (level["a"], level["b"], level["slow"]) == ([0, 1], [2, 3], [2, 3])
    slow = next(c for c in report["checks"] if c["check"] == "slow_rank_ratio")
    assert (slow["status"], slow["rank"], slow["node"]) == ("fail", 2, NODE)
    assert "slow_rank_ratio on rank 2" in report["failed_nodes"][NODE]
    assert "rank 2" in stderr and "preflight failed" in stderr


@pytest.mark.slow
def test_two_nodes_name_the_slow_node_and_only_it_is_quarantined(tmp_path):
    # Two node agents of 2 ranks each; the drill (set the documented way, by environment) slows rank 3,
    # on the second node. Both share one run store, as nodes sharing a runs directory would.
    # The store exists before the nodes start: two processes creating (migrating) a fresh SQLite store at the
    # same moment race in RunStore (reported to the store's owner).
    RunStore.open(None, tmp_path).close()
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SLOW_RANK_ENV: "3", SLOW_FACTOR_ENV: "8"}
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "preflight",
        f"run.dir={tmp_path}",
        "--quick",
        "--json",
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
    ]
    nodes = [
        subprocess.Popen(
            [*command, "--node-rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    ]
    wait_for_port(port)  # node 0 hosts the rendezvous store, as on a real cluster
    nodes.append(
        subprocess.Popen(
            [*command, "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    )
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(out.strip() for out, _ in outputs), [err[-3000:] for _, err in outputs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    # the job failed, so every node says so (exit 6): none should start training
    assert [node.returncode for node in nodes] == [6, 6], [err for _, err in outputs]
    names = {r["node"] for r in reports}
    assert len(names) == 2  # two agents on one host are told apart by their node rank
    slow_node = reports[0]["slow_ranks"]["nodes"]
    assert reports[0]["slow_ranks"] == reports[1]["slow_ranks"] and reports[0]["slow_ranks"]["ranks"] == [3]
    (culprit,) = slow_node
    assert list(reports[0]["failed_nodes"]) == [culprit] and culprit in names
    # the first bisection level split the job by node
    level = reports[0]["slow_ranks"]["levels"][0]
    assert (level["a"], level["b"]) == ([0, 1], [2, 3])
    store = RunStore.open(None, tmp_path)
    try:
        rows = {row["node"]: row["passed"] for row in store.preflights()}
        assert rows == {name: name != culprit for name in names}
        assert [q["node"] for q in store.quarantined()] == [culprit]
    finally:
        store.close()


@pytest.mark.slow
def test_a_failed_check_quarantines_the_node_until_cleared(tmp_path):
    proc = phalanx(
        "preflight",
        f"run.dir={tmp_path}",
        "--quick",
        "--nproc",
        "1",
        "--threshold",
        "matmul_fp32_tflops=1000",
        check=False,
    )
    assert proc.returncode == 6, proc.stderr
    assert "error: preflight failed" in proc.stderr and "matmul_fp32_tflops on rank 0" in proc.stderr
    assert "below the failure limit 1,000" in proc.stderr and "Traceback" not in proc.stderr
    assert "quarantined " + NODE in proc.stdout
    store = RunStore.open(None, tmp_path)
    try:
        (quarantined,) = store.quarantined()
        assert quarantined["node"] == NODE and "matmul_fp32_tflops" in quarantined["reason"]
        (row,) = store.preflights()
        assert row["passed"] is False
        failed = [c for c in row["results"]["checks"] if c["status"] == "fail"]
        assert [(c["check"], c["rank"]) for c in failed] == [("matmul_fp32_tflops", 0)]
    finally:
        store.close()
    cleared = phalanx("preflight", f"run.dir={tmp_path}", "--clear", NODE)
    assert f"{NODE} released from quarantine" in cleared.stdout
    again = json.loads(phalanx("preflight", f"run.dir={tmp_path}", "--clear", NODE, "--json").stdout)
    assert again == {"node": NODE, "was_quarantined": False, "reason": None}
