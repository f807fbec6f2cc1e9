"""The preflight's pure pieces: bus bandwidth formulas, limits and their overrides, inventory comparison,
group halving, and who gets blamed for what in a graded report."""

import pytest

from phalanx.errors import PhalanxError
from phalanx.preflight.bisection import halves
from phalanx.preflight.collectives import algbw_gbps, busbw_gbps, message_bytes
from phalanx.preflight.evaluate import evaluate
from phalanx.preflight.inventory import compare
from phalanx.preflight.thresholds import Limit, device_type, limits_for, parse_overrides
from phalanx.preflight.timing import SLOW_FACTOR_ENV, SLOW_RANK_ENV, SlowRank


# -- bus bandwidth, as nccl-tests defines it ------------------------------------------------------------
def test_busbw_follows_the_nccl_tests_formulas():
    # 1 GB in 10 ms is an algorithm bandwidth of 100 GB/s whatever the collective
    assert algbw_gbps(10**9, 0.01) == pytest.approx(100.0)
    # all-reduce moves 2(n-1)/n of the buffer per rank: 8 ranks -> 1.75x, 2 ranks -> 1x
    assert busbw_gbps("all_reduce", 10**9, 0.01, 8) == pytest.approx(175.0)
    assert busbw_gbps("all_reduce", 10**9, 0.01, 2) == pytest.approx(100.0)
    # all-gather (S = the whole gathered output) moves (n-1)/n of it: 8 ranks -> 0.875x, 2 ranks -> 0.5x
    assert busbw_gbps("all_gather", 10**9, 0.01, 8) == pytest.approx(87.5)
    assert busbw_gbps("all_gather", 10**9, 0.01, 2) == pytest.approx(50.0)
    # one rank moves nothing
    assert busbw_gbps("all_reduce", 10**9, 0.01, 1) == 0.0
    with pytest.raises(ValueError):
        busbw_gbps("broadcast", 10**9, 0.01, 8)


def test_message_sizes_are_whole_elements_and_whole_pieces_per_rank():
    assert message_bytes("all_reduce", 1001, 3) == 1000  # float32 elements
    assert message_bytes("all_gather", 1000, 3) == 996  # 3 pieces of 83 elements
    assert message_bytes("all_gather", 1, 4) == 16  # never empty


# -- limits -------------------------------------------------------------------------------------------
def test_limits_grade_both_directions():
    floor = Limit(warn=80, fail=50)
    assert [floor.status(v) for v in (100, 80, 79, 50, 49, None)] == ["pass", "pass", "warn", "warn", "fail", "skip"]
    ceiling = Limit(warn=85, fail=95, higher_is_better=False)
    assert [ceiling.status(v) for v in (60, 86, 95, 96)] == ["pass", "warn", "warn", "fail"]
    errors = Limit(warn=None, fail=0, higher_is_better=False)
    assert (errors.status(0), errors.status(1)) == ("pass", "fail")


def test_device_types_from_torch_names():
    assert device_type("NVIDIA H100 80GB HBM3", True) == "h100"
    assert device_type("NVIDIA H200", True) == "h200"
    assert device_type("AMD Instinct MI300X", True) == "mi300x"
    assert device_type("AMD Instinct MI325X", True) == "mi325x"
    assert device_type("AMD Instinct MI355X", True) == "mi355x"
    assert device_type("NVIDIA A100-SXM4-80GB", True) == "a100"
    assert device_type("NVIDIA GeForce RTX 4090", True) == "gpu"
    assert device_type("cpu (x86_64)", False) == "cpu"
    # an expected figure below the datasheet peak, with the warning floor above the failure floor
    h100 = limits_for("h100")["matmul_bf16_tflops"]
    assert h100.fail < h100.warn < h100.expected < 989.4


def test_threshold_overrides():
    overrides = parse_overrides(["matmul_fp32_tflops=1000", "gpu_temperature_c.warn=70", "slow_rank_ratio=3"])
    assert overrides == {"matmul_fp32_tflops.fail": 1000.0, "gpu_temperature_c.warn": 70.0, "slow_rank_ratio.fail": 3.0}
    cpu = limits_for("cpu", overrides)
    # a failure floor above the warning floor leaves no warning zone
    assert (cpu["matmul_fp32_tflops"].fail, cpu["matmul_fp32_tflops"].warn) == (1000.0, 1000.0)
    assert cpu["matmul_fp32_tflops"].status(0.05) == "fail"
    assert cpu["slow_rank_ratio"].fail == 3.0
    assert cpu["slow_rank_ratio"].warn == limits_for("cpu")["slow_rank_ratio"].warn
    # a check the type does not grade is added with the override alone, in the right direction
    assert cpu["gpu_temperature_c"] == Limit(warn=70.0, fail=None, higher_is_better=False, unit="C")
    assert limits_for("cpu")["matmul_fp32_tflops"].fail == 0.001  # the table itself is untouched


@pytest.mark.parametrize(
    "item, message",
    [
        ("matmul_fp32_tflop=3", "did you mean matmul_fp32_tflops"),
        ("matmul_fp32_tflops", "NAME=VALUE"),
        ("matmul_fp32_tflops=fast", "takes a number"),
        ("matmul_fp32_tflops.low=3", "suffix may be .warn or .fail"),
    ],
)
def test_bad_threshold_overrides_say_what_is_wrong(item, message):
    with pytest.raises(PhalanxError, match=message):
        parse_overrides([item])


def test_slow_rank_drill_from_the_environment(monkeypatch):
    monkeypatch.delenv(SLOW_RANK_ENV, raising=False)
    assert SlowRank.from_env() is None
    monkeypatch.setenv(SLOW_RANK_ENV, "3")
    assert SlowRank.from_env() == SlowRank(3, 4.0)
    monkeypatch.setenv(SLOW_FACTOR_ENV, "8")
    assert SlowRank.from_env() == SlowRank(3, 8.0)
    monkeypatch.setenv(SLOW_FACTOR_ENV, "1")
    with pytest.raises(PhalanxError, match="above 1"):
        SlowRank.from_env()
    monkeypatch.setenv(SLOW_RANK_ENV, "two")
    with pytest.raises(PhalanxError, match=SLOW_RANK_ENV):
        SlowRank.from_env()


# -- inventory -----------------------------------------------------------------------------------------
def inventory(**changes):
    base = {
        "python": "3.11.9",
        "torch": "2.6.0+rocm6.2",
        "cuda": None,
        "hip": "6.2.41133",
        "nccl": "2.21.5",
        "driver": "6.8.5",
        "accelerator": "8 x AMD Instinct MI300X",
        "arch": "gfx942",
        "phalanx": "0.1.0",
        "cpu_model": "AMD EPYC 9654",
        "ram_gib": 2003.0,
    }
    return {**base, **changes}


def test_equal_inventories_match_even_when_hardware_sizes_differ():
    assert compare({"a": inventory(), "b": inventory(ram_gib=1500.0, cpu_model="AMD EPYC 9534")}) == []


def test_the_odd_node_out_is_named():
    mismatches = compare({"a": inventory(), "b": inventory(torch="2.5.1+rocm6.2"), "c": inventory()})
    assert mismatches == [
        {"field": "torch", "values": {"a": "2.6.0+rocm6.2", "b": "2.5.1+rocm6.2", "c": "2.6.0+rocm6.2"}, "odd": ["b"]}
    ]


def test_two_nodes_that_differ_cannot_be_told_apart():
    mismatches = compare({"a": inventory(), "b": inventory(driver="6.10.5", hip="6.3.0")})
    assert [m["field"] for m in mismatches] == ["hip", "driver"]
    assert all(m["odd"] == [] for m in mismatches)


# -- halving and blame ---------------------------------------------------------------------------------
def test_halves_split_by_node_first():
    node_of = {r: r // 4 for r in range(12)}  # 3 nodes of 4 ranks
    assert halves(list(range(12)), node_of) == ([0, 1, 2, 3], list(range(4, 12)))
    assert halves([4, 5, 6, 7], node_of) == ([4, 5], [6, 7])
    assert halves([0, 1, 2], {r: 0 for r in range(3)}) == ([0], [1, 2])


def raw_job(nodes=("n0", "n1"), ranks_per_node=2, suspects=(), disk=None, busbw=0.5, torch_versions=None):
    """Figures as worker.py gathers them, for a CPU job (the grading under test is a pure function)."""
    raw_nodes, ranks = {}, []
    for i, node in enumerate(nodes):
        own = list(range(i * ranks_per_node, (i + 1) * ranks_per_node))
        inv = {
            "host": node,
            "runs_dir": "/runs",
            "disk_free_gib": 100.0,
            "accelerator": "none",
            "cpu_threads": 8,
            "ram_gib": 32.0,
            **inventory(
                torch=(torch_versions or {}).get(node, "2.13.0"),
                hip=None,
                nccl=None,
                driver=None,
                accelerator="none",
                arch=None,
            ),
        }
        raw_nodes[node] = {
            "host": node,
            "node_rank": i,
            "launcher": f"l{i}",
            "ranks": own,
            "inventory": inv,
            "health": {"source": None, "note": "no GPU", "driver": None, "devices": []},
            "disk_write_mbps": (disk or {}).get(node, 500.0),
        }
        ranks += [
            {
                "rank": r,
                "node": node,
                "local_rank": r - own[0],
                "device": "cpu",
                "device_name": "cpu",
                "matmul_bf16_tflops": 0.1,
                "matmul_fp32_tflops": 0.05,
                "memory_bandwidth_gbps": 10.0,
            }
            for r in own
        ]
    world = len(ranks)
    return {
        "world_size": world,
        "backend": "gloo",
        "gpu": False,
        "quick": True,
        "nodes": raw_nodes,
        "ranks": ranks,
        "collectives": [
            {"op": "all_reduce", "bytes": 2**20, "seconds": 0.001, "algbw_gbps": busbw, "busbw_gbps": busbw}
        ],
        "bisection": {"suspects": list(suspects), "ratio": 5.0 if suspects else 1.0, "levels": [], "leaf": None},
        "seconds": 1.0,
    }


def test_a_healthy_job_passes():
    report = evaluate(raw_job())
    assert report.passed and report.failed_nodes == {} and report.cluster_failures == []
    assert {c.check for c in report.checks} >= {
        "inventory_match",
        "disk_write_mbps",
        "matmul_fp32_tflops",
        "compute_straggler_ratio",
        "all_reduce_busbw_gbps",
        "slow_rank_ratio",
    }


def test_a_node_failing_its_own_check_is_blamed_alone():
    report = evaluate(raw_job(disk={"n1": 1.0}))
    assert not report.passed
    assert list(report.failed_nodes) == ["n1"] and "disk_write_mbps" in report.failed_nodes["n1"]


def test_a_slow_rank_blames_its_node_for_the_slow_collectives_too():
    report = evaluate(raw_job(suspects=[3], busbw=0.001))
    assert list(report.failed_nodes) == ["n1"]
    assert "slow_rank_ratio on rank 3" in report.failed_nodes["n1"]
    assert "all_reduce_busbw_gbps" in report.failed_nodes["n1"]
    assert report.slow_ranks["ranks"] == [3] and report.slow_ranks["nodes"] == ["n1"]


def test_slow_collectives_nobody_can_be_blamed_for_are_a_cluster_failure():
    report = evaluate(raw_job(busbw=0.001))
    assert not report.passed and report.failed_nodes == {}
    assert len(report.cluster_failures) == 1 and "all_reduce_busbw_gbps" in report.cluster_failures[0]
    # on a single node there is nobody else to blame
    single = evaluate(raw_job(nodes=("n0",), busbw=0.001))
    assert list(single.failed_nodes) == ["n0"] and single.cluster_failures == []


def test_differing_versions_fail_the_odd_node_or_the_cluster():
    three = evaluate(raw_job(nodes=("n0", "n1", "n2"), torch_versions={"n2": "2.12.0"}))
    assert list(three.failed_nodes) == ["n2"] and "torch differs" in three.failed_nodes["n2"]
    two = evaluate(raw_job(torch_versions={"n1": "2.12.0"}))
    assert two.failed_nodes == {} and "torch differs" in two.cluster_failures[0]


def test_a_gpu_without_figures_is_graded_against_its_datasheet_peak():
    from phalanx.preflight.thresholds import device_limits

    l40s = device_limits("NVIDIA L40S", True)  # in models/flops.py, not in the preflight table
    assert l40s["matmul_bf16_tflops"].expected == pytest.approx(362.05 * 0.45)
    assert "matmul_fp32_tflops" not in l40s and "gpu_temperature_c" in l40s
    assert "matmul_bf16_tflops" not in device_limits("Some Future GPU", True)
    # an override wins over the derived figure
    assert device_limits("NVIDIA L40S", True, {"matmul_bf16_tflops.fail": 10.0})["matmul_bf16_tflops"].fail == 10.0
