"""A mixture of experts' routing balance per step: the dashboard's expert-balance curve and heatmap.

Every step line of an MoE run carries `moe_imbalance` (the busiest expert's tokens over the mean
expert's, in the worst MoE layer) and `moe_imbalance_by_layer` (one such ratio per MoE layer); the
steps table now keeps both (the list as JSON text). Steps already in the store stay without them: the
store never kept them, and a migration reads no run directories.

Revision ID: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("moe_imbalance", sa.Float))
        batch.add_column(sa.Column("moe_imbalance_by_layer", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("moe_imbalance_by_layer")
        batch.drop_column("moe_imbalance")
