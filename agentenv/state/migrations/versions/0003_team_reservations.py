"""Team-quota reservations: the cluster-wide admission of a team's concurrent sandboxes (sql.py).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "team_reservations",
        sa.Column("reservation_id", sa.Text, primary_key=True),
        sa.Column("team_id", sa.Text, nullable=False),
        sa.Column("node_id", sa.Text, nullable=False),
        sa.Column("sandbox_id", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("team_reservations_team", "team_reservations", ["team_id"])
    op.create_index("team_reservations_node", "team_reservations", ["node_id"])


def downgrade() -> None:
    op.drop_table("team_reservations")
