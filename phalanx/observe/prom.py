"""Prometheus metrics: what a training node and the dashboard expose at /metrics.

Names follow Prometheus conventions: a `phalanx_` prefix, base units in the name (`_seconds`, `_ratio`),
`_total` for counters. Both collectors read state that exists anyway (the node agent's follower, the run
store) at scrape time, so nothing is computed when no one scrapes.

What only grows is a counter (tokens trained on, ECC errors, events): rate() and increase() over it
answer "how fast" for any window, which a precomputed tokens-per-second gauge cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Gauges of a training run: (name, help, key in the follower's latest step record).
TRAIN_GAUGES = (
    ("phalanx_train_step", "Last completed optimizer step", "step"),
    ("phalanx_train_loss", "Training loss at the last step", "loss"),
    ("phalanx_train_val_loss", "Newest validation loss", "val_loss"),
    ("phalanx_train_learning_rate", "Learning rate at the last step", "lr"),
    ("phalanx_train_grad_norm", "Gradient norm at the last step (before clipping)", "grad_norm"),
    ("phalanx_train_mfu_ratio", "Model FLOPs utilisation of one device (0-1) at the last step", "mfu"),
    ("phalanx_train_peak_memory_bytes", "Peak memory of rank 0", "peak_mem_bytes"),
    ("phalanx_train_ettr_ratio", "Effective training time ratio of this launch (productive / wall)", "ettr"),
    (
        "phalanx_train_moe_imbalance_ratio",
        "A mixture of experts at the last step: the busiest expert's tokens over the mean expert's, in its "
        "worst MoE layer (1: even)",
        "moe_imbalance",
    ),
)
# Counters of a training run: (name without _total, help, key in the follower's latest step record).
TRAIN_COUNTERS = (
    (
        "phalanx_train_tokens",
        (
            "Tokens trained on up to the last step (rate() of it: tokens per second of the "
            "whole job); it goes back with the step after a rollback"
        ),
        "tokens_seen",
    ),
)
# Counters from the event log: (name without _total, help, event kinds counted).
EVENT_COUNTERS = (
    ("phalanx_train_restarts", "Restarts of the ranks by the node agent", ("restart",)),
    ("phalanx_train_worker_failures", "Ranks that died", ("worker_failed",)),
    ("phalanx_train_hangs", "Hangs detected", ("hang_detected",)),
    ("phalanx_train_stragglers", "Straggler alerts", ("straggler",)),
    ("phalanx_train_rollbacks", "Numerics-guard rollbacks", ("rollback",)),
    ("phalanx_train_failed_saves", "Checkpoint saves that failed", ("save_failed",)),
)


class TrainingCollector(Collector):
    """The node agent's view of its run, from a function returning the follower's current state:
    {"run": name, "last": newest step record, "ranks": {rank: newest timing record}, "counts": {kind: n}}."""

    def __init__(self, state: Callable[[], dict[str, Any]]):
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        run, last = state["run"], state.get("last") or {}
        for name, help_text, key in TRAIN_GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=["run"])
            if last.get(key) is not None:
                gauge.add_metric([run], float(last[key]))
            yield gauge
        for name, help_text, key in TRAIN_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["run"])
            if last.get(key) is not None:
                counter.add_metric([run], float(last[key]))
            yield counter
        counts = state.get("counts", {})
        for name, help_text, kinds in EVENT_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["run"])
            counter.add_metric([run], float(sum(counts.get(k, 0) for k in kinds)))
            yield counter
        step_time = GaugeMetricFamily(
            "phalanx_rank_step_seconds", "Wall time of each rank's last step", labels=["run", "rank", "node"]
        )
        compute = GaugeMetricFamily(
            "phalanx_rank_compute_seconds",
            "Each rank's own work (data + forward) in its last step: stragglers show here",
            labels=["run", "rank", "node"],
        )
        for rank, record in sorted(state.get("ranks", {}).items()):
            labels = [run, str(rank), str(record.get("node") or "")]
            if record.get("step_seconds") is not None:
                step_time.add_metric(labels, float(record["step_seconds"]))
            if record.get("compute_seconds") is not None:
                compute.add_metric(labels, float(record["compute_seconds"]))
        yield step_time
        yield compute
        by_layer = GaugeMetricFamily(
            "phalanx_train_moe_layer_imbalance_ratio",
            "A mixture of experts at the last step: the busiest expert's tokens over the mean, per MoE layer",
            labels=["run", "layer"],
        )
        for layer, ratio in enumerate(last.get("moe_imbalance_by_layer") or []):  # the MoE layers, in order
            by_layer.add_metric([run, str(layer)], float(ratio))
        yield by_layer
        yield from eval_gauges(
            "phalanx_train",
            ["run"],
            [
                ([run], {"task": task, "metric": metric, "step": step, "value": value})
                for (task, metric), (step, value) in sorted(state.get("eval", {}).items())
            ],
        )


def eval_gauges(prefix: str, labels: list[str], scores: list[tuple[list[str], dict[str, Any]]]) -> Iterator[Metric]:
    """Benchmark scores (eval.tasks, `phalanx eval`) of the newest evaluated checkpoint, and its step: a
    gauge per task and metric, as the dashboard charts them. The step is a value, not a label, so that
    each score stays one series across checkpoints."""
    score = GaugeMetricFamily(
        f"{prefix}_eval_score",
        "Benchmark score (lm-evaluation-harness) of the newest evaluated checkpoint",
        labels=[*labels, "task", "metric"],
    )
    step = GaugeMetricFamily(
        f"{prefix}_eval_step", "Step of the checkpoint the eval score is of", labels=[*labels, "task", "metric"]
    )
    for values, row in scores:
        where = [*values, row["task"], row["metric"]]
        step.add_metric(where, float(row["step"]))
        if row["value"] is not None:
            score.add_metric(where, float(row["value"]))
    yield score
    yield step


# Per-run gauges the dashboard exposes for every run in the store: (name, help, key in the runs row).
RUN_GAUGES = (
    ("phalanx_run_step", "Last completed optimizer step", "last_step"),
    ("phalanx_run_loss", "Training loss at the last step", "last_loss"),
    ("phalanx_run_val_loss", "Newest validation loss", "last_val_loss"),
    (
        "phalanx_run_mfu_ratio",
        "Model FLOPs utilisation of one device (0-1), the run's average over its training steps",
        "mfu",
    ),
    ("phalanx_run_ettr_ratio", "Effective training time ratio (productive / wall)", "ettr"),
    ("phalanx_run_last_update_timestamp_seconds", "When the run last reported (Unix time)", "updated_at"),
)
# Per-run counters: (name without _total, help, key in the runs row).
RUN_COUNTERS = (
    ("phalanx_run_tokens", "Tokens trained on up to the last step (rate() of it: tokens per second)", "tokens_seen"),
)
RUN_STATUSES = ("running", "restarting", "finished", "failed", "stopped")


class StoreCollector(Collector):
    """Every run in a run store, for the dashboard's /metrics."""

    def __init__(self, store: Any):
        self._store = store

    def collect(self) -> Iterator[Metric]:
        runs = self._store.list_runs()
        for name, help_text, key in RUN_GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=["run", "id"])
            for run in runs:
                if run.get(key) is not None:
                    gauge.add_metric([run["name"], str(run["id"])], float(run[key]))
            yield gauge
        for name, help_text, key in RUN_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["run", "id"])
            for run in runs:
                if run.get(key) is not None:
                    counter.add_metric([run["name"], str(run["id"])], float(run[key]))
            yield counter
        restarts = CounterMetricFamily("phalanx_run_restarts", "Restarts of the run's ranks", labels=["run", "id"])
        status = GaugeMetricFamily(
            "phalanx_run_status", "1 for the run's current status", labels=["run", "id", "status"]
        )
        for run in runs:
            restarts.add_metric([run["name"], str(run["id"])], float(run["restarts"] or 0))
            for s in RUN_STATUSES:
                status.add_metric([run["name"], str(run["id"]), s], 1.0 if run["status"] == s else 0.0)
        yield restarts
        yield status
        names = {run["id"]: run["name"] for run in runs}
        yield from eval_gauges(
            "phalanx_run",
            ["run", "id"],
            [
                ([names[row["run_id"]], str(row["run_id"])], row)
                for row in self._store.newest_eval_scores()
                if row["run_id"] in names
            ],
        )


# Host and device readings of the node agent's telemetry sampler: (name, help, key).
HOST_GAUGES = (
    ("phalanx_host_cpu_ratio", "Host CPU utilisation (0-1)", "cpu_ratio"),
    ("phalanx_host_memory_used_bytes", "Host memory in use", "memory_used_bytes"),
    ("phalanx_host_memory_total_bytes", "Host memory", "memory_total_bytes"),
    ("phalanx_host_disk_free_bytes", "Free disk at the run directory", "disk_free_bytes"),
)
DEVICE_GAUGES = (
    ("phalanx_device_utilization_ratio", "Accelerator busy time (0-1)", "utilization_ratio"),
    ("phalanx_device_memory_used_bytes", "Accelerator memory in use", "memory_used_bytes"),
    ("phalanx_device_memory_total_bytes", "Accelerator memory", "memory_total_bytes"),
    ("phalanx_device_temperature_celsius", "Accelerator temperature", "temperature_c"),
    ("phalanx_device_power_watts", "Accelerator power draw", "power_w"),
)
# The driver's error counts only grow (until the driver reloads): counters, so increase() shows new ones.
DEVICE_COUNTERS = (
    ("phalanx_device_ecc_uncorrectable_errors", "Uncorrectable ECC errors the driver reports", "ecc_uncorrectable"),
)


class TelemetryCollector(Collector):
    """The newest telemetry sample of this node: {"node", "host": {...}, "devices": [{...}]}."""

    def __init__(self, latest: Callable[[], dict[str, Any]]):
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        sample = self._latest() or {}
        node, host = sample.get("node", ""), sample.get("host", {})
        for name, help_text, key in HOST_GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=["node"])
            if host.get(key) is not None:
                gauge.add_metric([node], float(host[key]))
            yield gauge
        for family, table in ((GaugeMetricFamily, DEVICE_GAUGES), (CounterMetricFamily, DEVICE_COUNTERS)):
            for name, help_text, key in table:
                metric = family(name, help_text, labels=["node", "device"])
                for device in sample.get("devices", []):
                    if device.get(key) is not None:
                        metric.add_metric([node, str(device["device"])], float(device[key]))
                yield metric
