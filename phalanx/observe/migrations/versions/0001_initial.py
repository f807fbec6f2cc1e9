"""The first run store schema: runs, their nodes, steps, per-rank timings, events, goodput, preflight, ingest offsets.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False, index=True),
        sa.Column("dir", sa.String(1000), nullable=False, unique=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("model", sa.String(200)),
        sa.Column("world_size", sa.Integer),
        sa.Column("config", sa.Text),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("last_step", sa.Integer),
        sa.Column("max_steps", sa.Integer),
        sa.Column("last_loss", sa.Float),
        sa.Column("last_val_loss", sa.Float),
        sa.Column("tokens_per_sec", sa.Float),
        sa.Column("mfu", sa.Float),
        sa.Column("restarts", sa.Integer, nullable=False),
        sa.Column("ettr", sa.Float),
        sa.Column("error", sa.Text),
    )
    run_id = lambda nullable=False: sa.Column(  # noqa: E731
        "run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=nullable
    )
    op.create_table(
        "run_nodes",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("node", sa.String(200), primary_key=True),
        sa.Column("joined_at", sa.Float, nullable=False),
    )
    op.create_table(
        "steps",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        run_id(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        *(
            sa.Column(name, sa.Float)
            for name in (
                "loss",
                "val_loss",
                "lr",
                "grad_norm",
                "tokens_per_sec",
                "mfu",
                "achieved_tflops",
                "peak_mem_gib",
                "step_seconds",
                "compute_seconds",
                "eval_seconds",
            )
        ),
        sa.Column("skipped", sa.String(40)),
    )
    op.create_index("ix_steps_run_step", "steps", ["run_id", "step"])
    op.create_table(
        "rank_steps",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        run_id(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("node", sa.String(200)),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("step_seconds", sa.Float),
        sa.Column("compute_seconds", sa.Float),
        sa.Column("data_seconds", sa.Float),
    )
    op.create_index("ix_rank_steps_run_step", "rank_steps", ["run_id", "step"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        run_id(),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("node", sa.String(200)),
        sa.Column("rank", sa.Integer),
        sa.Column("kind", sa.String(60), nullable=False),
        sa.Column("details", sa.Text),
    )
    op.create_index("ix_events_run_time", "events", ["run_id", "time"])
    op.create_table(
        "goodput",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("report", sa.Text, nullable=False),
    )
    op.create_table(
        "preflight",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        run_id(nullable=True),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("passed", sa.Integer, nullable=False),
        sa.Column("results", sa.Text, nullable=False),
    )
    op.create_table(
        "ingest_offsets",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("path", sa.String(300), primary_key=True),
        sa.Column("position", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    for table in ("ingest_offsets", "preflight", "goodput", "events", "rank_steps", "steps", "run_nodes", "runs"):
        op.drop_table(table)
