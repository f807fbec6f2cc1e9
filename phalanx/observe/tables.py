"""The run store's tables at the newest schema version (SQLAlchemy Core).

The migrations in migrations/versions build this schema step by step; a test checks that a migrated
database matches these definitions. Free-form details (a config, an event's fields, a goodput report)
are JSON text so SQLite and PostgreSQL store them the same way.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()

# One training run (one run directory), across all its launches and restarts.
runs = Table(
    "runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(200), nullable=False, index=True),
    Column("dir", String(1000), nullable=False, unique=True),
    Column("status", String(20), nullable=False),  # running | restarting | finished | failed | stopped
    Column("model", String(200)),
    Column("world_size", Integer),
    Column("config", Text),  # the resolved config, JSON
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float),
    Column("updated_at", Float, nullable=False),
    Column("last_step", Integer),
    Column("max_steps", Integer),
    Column("last_loss", Float),
    Column("last_val_loss", Float),
    # tokens_per_sec (global), mfu and achieved_tflops (per device, below): the run's averages over its
    # training time (phalanx/run/throughput.py); `throughput` holds the running sums they come from (JSON).
    Column("tokens_per_sec", Float),
    Column("mfu", Float),
    Column("restarts", Integer, nullable=False),
    Column("ettr", Float),
    Column("error", Text),
    Column("tokens_seen", Float),  # at last_step
    Column("tags", Text),  # JSON list of short strings, set from the dashboard
    Column("note", Text),  # free text, set from the dashboard
    Column("achieved_tflops", Float),
    Column("throughput", Text),
)

# The hosts whose node agents joined a run (several agents may add themselves at the same moment).
run_nodes = Table(
    "run_nodes",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("node", String(200), primary_key=True),
    Column("joined_at", Float, nullable=False),
)

# Rank 0's record of each optimizer step (and of evaluations): the run's curves.
steps = Table(
    "steps",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("time", Float, nullable=False),
    Column("loss", Float),
    Column("val_loss", Float),
    Column("lr", Float),
    Column("grad_norm", Float),
    Column("tokens_per_sec", Float),
    Column("mfu", Float),
    Column("achieved_tflops", Float),
    Column("peak_mem_gib", Float),
    Column("step_seconds", Float),
    Column("compute_seconds", Float),
    Column("eval_seconds", Float),
    Column("skipped", String(40)),
    Column("tokens_seen", Float),
    # A mixture of experts' routing balance (null for a dense model): the busiest expert's tokens over
    # the mean expert's in the worst MoE layer, and per MoE layer (a JSON list, layer 0 first).
    Column("moe_imbalance", Float),
    Column("moe_imbalance_by_layer", Text),
    Index("ix_steps_run_step", "run_id", "step"),
    Index("ix_steps_run_time", "run_id", "time"),  # which step a run was at when an event happened
)

# Every rank's own timing of every step: the rank-by-step heatmap that shows stragglers.
rank_steps = Table(
    "rank_steps",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("node", String(200)),
    Column("time", Float, nullable=False),
    Column("step_seconds", Float),
    Column("compute_seconds", Float),
    Column("data_seconds", Float),
    Index("ix_rank_steps_run_step", "run_id", "step"),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("time", Float, nullable=False),
    Column("node", String(200)),
    Column("rank", Integer),
    Column("kind", String(60), nullable=False),
    Column("details", Text),  # JSON: the event's other fields
    Index("ix_events_run_time", "run_id", "time"),
)

# The newest goodput report of a run (restarts, faults, stragglers, buckets, ETTR), JSON.
goodput = Table(
    "goodput",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("updated_at", Float, nullable=False),
    Column("report", Text, nullable=False),
)

# Preflight results of nodes (issue 6 fills it); run_id is null for a preflight outside a run.
preflight = Table(
    "preflight",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE")),
    Column("node", String(200), nullable=False),
    Column("time", Float, nullable=False),
    Column("passed", Integer, nullable=False),
    Column("results", Text, nullable=False),
)

# How far the node agent has read each plain-file mirror into the store, so a later launch of the same
# run continues where the previous one stopped: every line lands exactly once.
ingest_offsets = Table(
    "ingest_offsets",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("path", String(300), primary_key=True),
    Column("position", BigInteger, nullable=False),
)

# The node agents' hardware samples (RUN_DIR/telemetry.jsonl): one row per node and sample for the host,
# one per node, device and sample for each accelerator. seq numbers a node's samples in the run (1, 2,
# ...; the device rows of a sample share its host row's seq), so a long run's charts read an evenly
# spaced sample through the (run_id, seq) index, as steps are read, instead of scanning every row.
host_telemetry = Table(
    "host_telemetry",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("time", Float, nullable=False),
    Column("node", String(200), nullable=False),
    Column("cpu_ratio", Float),
    Column("load1", Float),
    Column("memory_used_bytes", Float),
    Column("memory_total_bytes", Float),
    Column("disk_free_bytes", Float),
    Index("ix_host_telemetry_run_seq", "run_id", "seq"),
)

device_telemetry = Table(
    "device_telemetry",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("time", Float, nullable=False),
    Column("node", String(200), nullable=False),
    Column("device", Integer, nullable=False),
    Column("utilization_ratio", Float),
    Column("memory_used_bytes", Float),
    Column("memory_total_bytes", Float),
    Column("temperature_c", Float),
    Column("power_w", Float),
    Column("ecc_uncorrectable", Float),
    Index("ix_device_telemetry_run_seq", "run_id", "seq"),
)

# Nodes that failed a preflight check; launches on this store refuse them until `phalanx preflight --clear`.
quarantine = Table(
    "quarantine",
    metadata,
    Column("node", String(200), primary_key=True),
    Column("reason", Text, nullable=False),
    Column("since", Float, nullable=False),
    Column("run", String(200)),
)

# Benchmark scores of the run's checkpoints (RUN_DIR/eval/*.json, written by `phalanx eval --tasks`): one
# row per report, task and metric; `report` names the file (eval/step_N-TIME.json) the row came from.
eval_scores = Table(
    "eval_scores",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("time", Float, nullable=False),
    Column("report", String(300), nullable=False),
    Column("task", String(200), nullable=False),
    Column("metric", String(200), nullable=False),
    Column("value", Float),
    Column("stderr", Float),
    Column("samples", Integer),
    Column("limit", Integer),
    Index("ix_eval_scores_run_step", "run_id", "step"),
)
