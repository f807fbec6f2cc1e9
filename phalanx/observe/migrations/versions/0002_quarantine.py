"""Quarantined nodes: failed a preflight; launches on the same store keep them out until cleared.

Revision ID: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.create_table(
        "quarantine",
        sa.Column("node", sa.String(200), primary_key=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("since", sa.Float, nullable=False),
        sa.Column("run", sa.String(200)),
    )


def downgrade() -> None:
    op.drop_table("quarantine")
