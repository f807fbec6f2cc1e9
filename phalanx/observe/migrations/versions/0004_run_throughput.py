"""The run's throughput as one definition: tokens/s, TFLOP/s and MFU averaged over its training time.

The runs row held the newest step's tokens/s and MFU, which the summary, the tiles and `phalanx runs`
did not agree with. It now holds the run's averages (phalanx/run/throughput.py): tokens_per_sec and mfu
change meaning, achieved_tflops (per device) is new, and `throughput` keeps the running sums (JSON) that
each ingested batch adds to. Runs already in the store get theirs from their stored steps and events.

Revision ID: 0004
"""

import json

import sqlalchemy as sa
from alembic import op

from phalanx.run.throughput import FIGURES, LAUNCH, RunThroughput

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("achieved_tflops", sa.Float))
        batch.add_column(sa.Column("throughput", sa.Text))
    _backfill()


def _backfill() -> None:
    conn = op.get_bind()
    runs = sa.table("runs", *(sa.column(c) for c in ("id", "throughput", "tokens_per_sec", "achieved_tflops", "mfu")))
    steps = sa.table("steps", *(sa.column(c) for c in ("id", "run_id", "time", "step_seconds", *FIGURES)))
    events = sa.table("events", sa.column("run_id"), sa.column("time"), sa.column("kind"))
    for run_id in conn.execute(sa.select(runs.c.id)).scalars().all():
        launches = conn.execute(
            sa.select(events.c.time).where(events.c.run_id == run_id, events.c.kind == LAUNCH)
        ).scalars()
        started = [{"kind": LAUNCH, "time": at} for at in launches]
        rows = conn.execute(
            sa.select(steps.c.time, steps.c.step_seconds, *(steps.c[f] for f in FIGURES))
            .where(steps.c.run_id == run_id, steps.c.step_seconds.is_not(None))
            .order_by(steps.c.time, steps.c.id)
        ).mappings()
        throughput = RunThroughput()
        throughput.add((dict(r) for r in rows), started)
        conn.execute(
            runs.update()
            .where(runs.c.id == run_id)
            .values(throughput=json.dumps(throughput.state()), **throughput.rates())
        )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("throughput")
        batch.drop_column("achieved_tflops")
