"""Hardware telemetry in the store, tags and a note per run, tokens seen per step.

The node agents' samples (RUN_DIR/telemetry.jsonl) were only on disk and /metrics; now the follower
copies them into host_telemetry and device_telemetry for the dashboard's system charts. Runs get tags
and a note (set from the dashboard) and tokens_seen; steps get tokens_seen (the x axis "tokens") and an
index by time (the step a run was at when an event happened). Runs already in the store get tokens_seen
from their config's train.global_batch_size x train.seq_len, as the trainer counts them.

Revision ID: 0003
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("tokens_seen", sa.Float))
        batch.add_column(sa.Column("tags", sa.Text))
        batch.add_column(sa.Column("note", sa.Text))
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("tokens_seen", sa.Float))
    op.create_index("ix_steps_run_time", "steps", ["run_id", "time"])
    run_id = lambda: sa.Column(  # noqa: E731
        "run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
    )
    op.create_table(
        "host_telemetry",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        run_id(),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        *(
            sa.Column(name, sa.Float)
            for name in ("cpu_ratio", "load1", "memory_used_bytes", "memory_total_bytes", "disk_free_bytes")
        ),
    )
    op.create_index("ix_host_telemetry_run_seq", "host_telemetry", ["run_id", "seq"])
    op.create_table(
        "device_telemetry",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        run_id(),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("device", sa.Integer, nullable=False),
        *(
            sa.Column(name, sa.Float)
            for name in (
                "utilization_ratio",
                "memory_used_bytes",
                "memory_total_bytes",
                "temperature_c",
                "power_w",
                "ecc_uncorrectable",
            )
        ),
    )
    op.create_index("ix_device_telemetry_run_seq", "device_telemetry", ["run_id", "seq"])
    _backfill_tokens()


def _backfill_tokens() -> None:
    conn = op.get_bind()
    runs = sa.table("runs", sa.column("id"), sa.column("config"), sa.column("last_step"), sa.column("tokens_seen"))
    steps = sa.table("steps", sa.column("run_id"), sa.column("step"), sa.column("loss"), sa.column("tokens_seen"))
    for run, config, last_step in conn.execute(sa.select(runs.c.id, runs.c.config, runs.c.last_step)).all():
        per_step = _tokens_per_step(config)
        if per_step is None:
            continue
        conn.execute(
            steps.update()
            .where(steps.c.run_id == run, steps.c.loss.is_not(None))
            .values(tokens_seen=steps.c.step * per_step)
        )
        if last_step is not None:
            conn.execute(runs.update().where(runs.c.id == run).values(tokens_seen=float(last_step * per_step)))


def _tokens_per_step(config: str | None) -> float | None:
    try:
        train = json.loads(config or "{}").get("train") or {}
        batch, seq_len = train.get("global_batch_size"), train.get("seq_len")
    except (ValueError, AttributeError):
        return None
    if isinstance(batch, int) and isinstance(seq_len, int) and batch > 0 and seq_len > 0:
        return float(batch * seq_len)
    return None


def downgrade() -> None:
    op.drop_table("device_telemetry")
    op.drop_table("host_telemetry")
    op.drop_index("ix_steps_run_time", "steps")
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("tokens_seen")
    with op.batch_alter_table("runs") as batch:
        for column in ("note", "tags", "tokens_seen"):
            batch.drop_column(column)
