"""Benchmark scores of a run's checkpoints: what `phalanx eval --tasks` saves in RUN_DIR/eval/ (by hand, or
in the background while the run trains with eval.tasks), one row per task, metric and report.

The follower reads each report file once (ingest_offsets marks it read, as it marks how far each JSON
lines file was read), so the rows land exactly once. Reports saved before this version are read on the
run's next sync or `phalanx runs import`: a migration reads no run directories.

Revision ID: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.create_table(
        "eval_scores",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("report", sa.String(300), nullable=False),
        sa.Column("task", sa.String(200), nullable=False),
        sa.Column("metric", sa.String(200), nullable=False),
        sa.Column("value", sa.Float),
        sa.Column("stderr", sa.Float),
        sa.Column("samples", sa.Integer),
        sa.Column("limit", sa.Integer),
    )
    op.create_index("ix_eval_scores_run_step", "eval_scores", ["run_id", "step"])


def downgrade() -> None:
    op.drop_index("ix_eval_scores_run_step", table_name="eval_scores")
    op.drop_table("eval_scores")
